"""The decoder stack called on its own, as transformers' `test_decoder_model_past` calls T5's: `use_cache` left to the
config gives what passing the config's value gives, field for field, as T5's stack does with the same weights."""

import pytest
import torch
from helpers import hf_and_fat5


@pytest.mark.parametrize("config_use_cache", [True, False])
def test_bare_decoder_reads_use_cache_from_the_config_as_t5(config_use_cache):
    hf, fat5 = hf_and_fat5("t5")
    hf.get_decoder().config.use_cache = fat5.config.use_cache = config_use_cache  # T5's stack has its own copy
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 96, (2, 5), generator=generator)
    encoder_states = torch.randn(2, 7, 32, generator=generator)
    with torch.no_grad():
        for use_cache in (None, True, False):
            expected = hf.get_decoder()(input_ids=ids, encoder_hidden_states=encoder_states, use_cache=use_cache)
            actual = fat5.get_decoder()(input_ids=ids, encoder_hidden_states=encoder_states, use_cache=use_cache)
            assert list(actual.keys()) == list(expected.keys()), use_cache
            assert len(actual.to_tuple()) == len(expected.to_tuple())
            torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, rtol=1e-5, atol=1e-5)
        # the cache the config asked for continues the sequence as T5's does
        if config_use_cache:
            step = torch.randint(2, 96, (2, 1), generator=generator)
            first = fat5.get_decoder()(input_ids=ids, encoder_hidden_states=encoder_states)
            hf_first = hf.get_decoder()(input_ids=ids, encoder_hidden_states=encoder_states)
            actual = fat5.get_decoder()(input_ids=step, encoder_hidden_states=encoder_states, cache=first.cache)
            expected = hf.get_decoder()(input_ids=step, encoder_hidden_states=encoder_states, cache=hf_first.cache)
            torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, rtol=1e-5, atol=1e-5)


def test_the_models_still_make_no_cache_while_training():
    _, fat5 = hf_and_fat5("t5")
    fat5.train()
    ids = torch.randint(2, 96, (2, 5))
    output = fat5(input_ids=ids, decoder_input_ids=ids)
    assert "cache" not in output and "past_key_values" not in output  # a ModelOutput lists only the fields it holds
