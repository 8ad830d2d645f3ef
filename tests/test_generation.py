"""``generate``'s edge cases on FAT5 against transformers' own T5 with the same weights (fp32, CPU unless said).

The static cache (batch 1 and a padded batch, beams, sampling, several sequences, a decoder prefix, long outputs,
caches sized too small, calls of changing shapes), encoder outputs given rather than computed, embeddings instead of
ids, bf16, generation without a cache, and bad inputs: each gives T5's ids and scores, or a clear error where T5 gives
a deep one or none.
"""

import pytest
import torch
from helpers import TINY, hf_and_fat5, padded_batch, relative_error
from transformers import DynamicCache, EncoderDecoderCache, StaticCache

STATIC = {"cache_implementation": "static"}
SCORED = {"output_scores": True, "return_dict_in_generate": True}


@pytest.fixture(scope="module")
def models():
    """T5 v1.1 (gated, untied head) and the FAT5 with its weights; generate never changes a model's weights."""
    return hf_and_fat5("t5v1.1")


def generate_both(models, seed=5, **arguments):
    """T5's then FAT5's output for the same arguments, each drawing the same random numbers (for sampling)."""
    outputs = []
    for model in models:
        torch.manual_seed(seed)
        outputs.append(model.generate(**arguments))
    return outputs


def assert_same_generation(actual, expected):
    """Same ids; with ``return_dict_in_generate``, the same tokens masked and every score within fp32 tolerance."""
    if not hasattr(expected, "sequences"):
        assert torch.equal(actual, expected)
        return
    assert torch.equal(actual.sequences, expected.sequences)
    assert len(actual.scores) == len(expected.scores)
    for got, want in zip(actual.scores, expected.scores, strict=True):
        assert torch.equal(got.isinf(), want.isinf())
        finite = want.isfinite()
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-5)


# 1. the static cache


@pytest.mark.parametrize(
    "settings",
    [
        {"num_beams": 3},
        {"do_sample": True, "top_k": 20},
        {"num_beams": 3, "num_return_sequences": 2},
        {"do_sample": True, "num_return_sequences": 2},
    ],
    ids=lambda settings: ",".join(f"{k}={v}" for k, v in settings.items()),
)
def test_static_cache_decoding_strategies_match_transformers(models, settings):
    input_ids, attention_mask, _ = padded_batch(seed=4)
    expected, actual = generate_both(models, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8,
                                     min_new_tokens=8, **settings, **STATIC, **SCORED)
    assert_same_generation(actual, expected)
    assert actual.sequences.shape[0] == input_ids.shape[0] * settings.get("num_return_sequences", 1)


def test_static_cache_greedy_matches_transformers_at_batch_1_and_padded_batch_3(models):
    """The padded batch's rows have 11, 7 and 3 real tokens; with a static cache the decoder's keys are the whole
    buffer, the slots not yet written hidden."""
    input_ids, attention_mask, _ = padded_batch(seed=4)
    assert not attention_mask.all()
    for arguments in ({"input_ids": input_ids[1:2, :7]}, {"input_ids": input_ids, "attention_mask": attention_mask}):
        expected, actual = generate_both(models, **arguments, max_new_tokens=8, min_new_tokens=8, **STATIC, **SCORED)
        assert_same_generation(actual, expected)
        dynamic = models[1].generate(**arguments, max_new_tokens=8, min_new_tokens=8)
        assert torch.equal(actual.sequences, dynamic)


@pytest.mark.parametrize("masked", [False, True], ids=["no-decoder-mask", "decoder-mask"])
def test_static_cache_with_a_decoder_prefix_matches_transformers(models, masked):
    """A prefix of several decoder tokens fills the cache in one step, then decoding goes on from its length. With a
    decoder mask (one prefix token hidden), generate grows the mask by a column a step, while a static cache's keys
    are its whole buffer: the mask must reach the attention padded to it."""
    input_ids, attention_mask, _ = padded_batch(seed=4)
    prefix = torch.tensor([[0, 5, 9, 17], [0, 40, 3, 3], [0, 80, 81, 7]])
    decoder_attention_mask = torch.ones_like(prefix)
    decoder_attention_mask[1, 2] = 0
    decoder_mask = {"decoder_attention_mask": decoder_attention_mask} if masked else {}
    for cache in ({}, STATIC):
        expected, actual = generate_both(models, input_ids=input_ids, attention_mask=attention_mask,
                                         decoder_input_ids=prefix, max_new_tokens=6, min_new_tokens=6, **decoder_mask,
                                         **cache, **SCORED)
        assert_same_generation(actual, expected)
        assert torch.equal(actual.sequences[:, : prefix.shape[1]], prefix)


def test_static_cache_sizes_itself_for_long_outputs_as_transformers_does(models):
    """Outputs far longer than anything before, and a max_cache_len (the cache size the caller asks for) too small
    for them: generate sizes the cache to max_length regardless, in T5 and in FAT5."""
    input_ids, attention_mask, _ = padded_batch(seed=4)
    for extra in ({}, {"max_cache_len": 3}):
        expected, actual = generate_both(models, input_ids=input_ids, attention_mask=attention_mask,
                                         max_new_tokens=40, min_new_tokens=40, **extra, **STATIC, **SCORED)
        assert actual.sequences.shape[1] == 41
        assert_same_generation(actual, expected)


def test_a_static_cache_too_small_for_max_length_is_refused_by_name(models):
    """A StaticCache built by the caller must hold max_length - 1 decoder positions. T5 fails in the middle of
    decoding, in the cache's index_copy_ (on a GPU a device-side assert); FAT5 refuses before decoding."""
    hf, model = models
    input_ids, attention_mask, _ = padded_batch(seed=4)

    def cache(owner, length):
        return EncoderDecoderCache(StaticCache(config=owner.config, max_cache_len=length), DynamicCache())

    arguments = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 8}
    with pytest.raises(IndexError):
        hf.generate(**arguments, past_key_values=cache(hf, 4))
    with pytest.raises(ValueError, match="a static cache of 4 positions, but generate writes up to 8"):
        model.generate(**arguments, past_key_values=cache(model, 4))
    # large enough, a cache of the caller's works as in T5
    assert torch.equal(model.generate(**arguments, past_key_values=cache(model, 8)),
                       hf.generate(**arguments, past_key_values=cache(hf, 8)))


def test_static_cache_calls_of_changing_batch_and_length_match_transformers(models):
    """Each call builds its cache again (at least as long as the longest before); batch and lengths change."""
    input_ids, attention_mask, _ = padded_batch(seed=4)
    for batch, length, new_tokens, settings in [(3, 11, 8, {}), (1, 5, 3, {}), (2, 9, 12, {"num_beams": 3}),
                                                (3, 11, 20, {}), (1, 3, 4, {})]:
        expected, actual = generate_both(models, input_ids=input_ids[:batch, :length],
                                         attention_mask=attention_mask[:batch, :length], max_new_tokens=new_tokens,
                                         min_new_tokens=new_tokens, **settings, **STATIC, **SCORED)
        assert actual.sequences.shape == (batch, new_tokens + 1)
        assert_same_generation(actual, expected)


# 2. encoder outputs, embeddings, bf16


def test_encoder_outputs_are_used_as_given_and_left_unchanged(models):
    """The encoder runs once; generate takes its outputs without running it again, with any strategy. transformers
    repeats them for beams in place, so T5 returns them expanded and its next call with them fails; FAT5 leaves the
    caller's outputs as they were, so that they serve again."""
    hf, model = models
    input_ids, attention_mask, _ = padded_batch(seed=4)
    with torch.no_grad():
        encoded = {m: m.get_encoder()(input_ids=input_ids, attention_mask=attention_mask) for m in models}
    calls = []
    hook = model.encoder.register_forward_hook(lambda *_: calls.append(1))
    try:
        for settings in ({}, {"num_beams": 3}, {"num_beams": 3, "num_return_sequences": 2}, STATIC):
            arguments = {"attention_mask": attention_mask, "max_new_tokens": 8, "min_new_tokens": 8, **settings}
            expected = hf.generate(input_ids=input_ids, **arguments)
            actual = model.generate(encoder_outputs=encoded[model], **arguments)
            assert torch.equal(actual, expected), settings
            assert encoded[model].last_hidden_state.shape[0] == input_ids.shape[0]
    finally:
        hook.remove()
    assert not calls
    hf.generate(encoder_outputs=encoded[hf], attention_mask=attention_mask, max_new_tokens=2, num_beams=3)
    assert encoded[hf].last_hidden_state.shape[0] == 3 * input_ids.shape[0]  # what T5 does to them


@pytest.mark.parametrize("settings", [{}, {"num_beams": 3}, STATIC], ids=["greedy", "beams", "static"])
def test_generate_from_inputs_embeds_matches_transformers(models, settings):
    input_ids, attention_mask, _ = padded_batch(seed=4)
    with torch.no_grad():
        inputs_embeds = models[0].shared(input_ids) * 0.9  # not what the ids give, so the embeddings must be used
    expected, actual = generate_both(models, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                     max_new_tokens=8, min_new_tokens=8, **settings, **SCORED)
    assert_same_generation(actual, expected)


@pytest.mark.parametrize("family", ["t5", "t5v1.1", "umt5"])
@pytest.mark.parametrize("settings", [{}, STATIC], ids=["dynamic", "static"])
def test_bfloat16_generation_is_t5s_up_to_rounding(family, settings):
    """After ``model.to(torch.bfloat16)`` greedy ids mostly equal T5's bf16 ids, but not always: the two round
    differently (FAT5's reference attention takes its scores, softmax and weighted sum in fp32, T5's in bf16), and
    where two tokens' logits lie within a bf16 step of each other either may win (t5v1.1 here: at one step of one
    row T5's best two are one bf16 step apart and FAT5 picks the other; umt5 at seed 3 ties exactly in T5's logits).
    So the truth is T5 in bf16 teacher-forced on FAT5's own output: FAT5's scores must be its logits within bf16
    tolerance, and each token FAT5 picks must be T5's best or within two bf16 steps of it."""
    hf, model = hf_and_fat5(family, seed=4)
    hf.to(torch.bfloat16)
    model.to(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    input_ids, attention_mask, _ = padded_batch(seed=4)
    actual = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8, min_new_tokens=8,
                            **settings, **SCORED)
    with torch.no_grad():
        logits = hf(input_ids=input_ids, attention_mask=attention_mask,
                    decoder_input_ids=actual.sequences[:, :-1]).logits.float()
    scores = torch.stack(actual.scores, dim=1)
    eos = model.generation_config.eos_token_id
    assert scores[..., eos].isinf().all() and scores.isinf().sum(dim=-1).eq(1).all()  # min_new_tokens masks eos only
    finite = scores.isfinite()
    assert relative_error(scores[finite], logits[finite]) < 2e-2
    logits[~finite] = -float("inf")
    best = logits.max(dim=-1).values
    chosen = logits.gather(-1, actual.sequences[:, 1:, None]).squeeze(-1)
    assert (best - chosen <= 2 * torch.finfo(torch.bfloat16).eps * best.abs()).all()
    expected = hf.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8, min_new_tokens=8,
                           **settings)
    assert expected.shape == actual.sequences.shape


# 3. without a cache


@pytest.mark.parametrize("settings", [{}, {"num_beams": 3}, {"do_sample": True, "top_k": 20}],
                         ids=["greedy", "beams", "sampling"])
def test_generation_without_a_cache_matches_cached_and_transformers(models, settings):
    input_ids, attention_mask, _ = padded_batch(seed=4)
    arguments = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 8, "min_new_tokens": 8,
                 **settings, **SCORED}
    expected, actual = generate_both(models, **arguments, use_cache=False)
    assert_same_generation(actual, expected)
    for cache in ({}, STATIC):
        _, cached = generate_both(models, **arguments, **cache)
        assert_same_generation(cached, actual)


# 5. bad inputs


def test_decoder_input_ids_longer_than_max_length_are_refused_as_in_transformers(models):
    input_ids, attention_mask, _ = padded_batch(seed=4)
    prefix = torch.zeros(3, 4, dtype=torch.long)
    for model in models:
        for cache in ({}, STATIC):
            with pytest.raises(ValueError,
                               match="Input length of decoder_input_ids is 4, but `max_length` is set to 3"):
                model.generate(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=prefix,
                               max_length=3, **cache)


def test_long_encoder_inputs_have_no_length_limit(models):
    """T5's relative buckets take any length (the far ones share a bucket); FAT5 has no maximum either."""
    input_ids = torch.randint(2, TINY["vocab_size"], (2, 600), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 450:] = 0
    expected, actual = generate_both(models, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=5,
                                     min_new_tokens=5, **SCORED)
    assert_same_generation(actual, expected)


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (lambda mask: mask[:, :8], "attention_mask: the attention mask covers 8 positions but there are 11 tokens"),
        (lambda mask: torch.ones(3, 14, dtype=mask.dtype), "attention mask covers 14 positions but there are 11"),
        (lambda mask: mask[:2], r"attention_mask must be \(batch, length\) or a custom .* with batch 3; got \(2, 11\)"),
    ],
    ids=["short", "long", "batch"],
)
@pytest.mark.parametrize("settings", [{}, STATIC], ids=["dynamic", "static"])
def test_an_encoder_mask_of_the_wrong_shape_is_refused_by_name(models, mask, message, settings):
    """T5 fails deep inside its attention (short, batch) or quietly reads part of the mask (long); FAT5 names the
    mask before any layer runs."""
    hf, model = models
    input_ids, attention_mask, _ = padded_batch(seed=4)
    arguments = {"input_ids": input_ids, "attention_mask": mask(attention_mask), "max_new_tokens": 4, **settings}
    with pytest.raises(ValueError, match=message):
        model.generate(**arguments)
    if mask(attention_mask).shape[1] > input_ids.shape[1]:
        assert hf.generate(**arguments).shape[0] == input_ids.shape[0]  # T5 quietly reads part of it
    else:
        with pytest.raises((RuntimeError, IndexError)):
            hf.generate(**arguments)


def test_decoder_and_encoder_output_masks_of_the_wrong_length_are_refused_by_name(models):
    hf, model = models
    input_ids, attention_mask, _ = padded_batch(seed=4)
    prefix = torch.zeros(3, 2, dtype=torch.long)
    arguments = {"input_ids": input_ids, "attention_mask": attention_mask, "decoder_input_ids": prefix,
                 "decoder_attention_mask": torch.ones(3, 5, dtype=torch.long), "max_new_tokens": 4}
    assert hf.generate(**arguments).shape == (3, 6)  # T5 quietly reads part of the mask
    with pytest.raises(ValueError,
                       match="decoder_attention_mask: the attention mask covers 5 positions but there are 2"):
        model.generate(**arguments)
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
    with pytest.raises(ValueError,
                       match="the encoder's attention_mask: the attention mask covers 8 positions but there"):
        model.generate(encoder_outputs=encoded, attention_mask=attention_mask[:, :8], max_new_tokens=4)


# encoder and decoder of different depths (T5-Efficient's "DL" / "EL" models)


@pytest.mark.parametrize(("encoder_layers", "decoder_layers"), [(1, 3), (3, 1)])
@pytest.mark.parametrize("settings", [{}, {"num_beams": 2}, STATIC], ids=["greedy", "beam", "static"])
def test_generate_with_a_decoder_deeper_or_shallower_than_the_encoder(encoder_layers, decoder_layers, settings):
    """transformers 5.24 sizes generate's caches from the config's layer count, the encoder's for T5: a deeper decoder
    fails there with an IndexError (in T5 too). FAT5's decoder config counts the decoder's blocks; the cached ids are
    those of decoding without a cache, and where T5 runs (a shallower decoder), T5's."""
    from transformers import T5Config, T5ForConditionalGeneration

    from fat5 import FAT5Config, FAT5ForConditionalGeneration

    depths = {"num_layers": encoder_layers, "num_decoder_layers": decoder_layers}
    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(T5Config(**{**TINY, **depths}, feed_forward_proj="gated-gelu")).eval()
    model = FAT5ForConditionalGeneration(FAT5Config(
        **{**TINY, **depths}, feed_forward_proj="gated-gelu", attention_backend="reference"
    )).eval()
    model.load_state_dict(t5.state_dict(), strict=False)
    input_ids, attention_mask, _ = padded_batch()
    arguments = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 5, "min_new_tokens": 5,
                 "do_sample": False, **settings}
    generated = model.generate(**arguments)
    uncached = {name: value for name, value in arguments.items() if name != "cache_implementation"}
    assert torch.equal(generated, model.generate(**uncached, use_cache=False))
    if decoder_layers <= encoder_layers:
        assert torch.equal(generated, t5.generate(**arguments))
