"""FAT5's graphed decoding loop (``fat5/graphed_decoding.py``) against transformers' T5 ``generate`` with the same
weights (fp32, CPU: the step runs eagerly under ``graphed_decoding="always"``), and against FAT5's own
``graphed_decoding="never"`` where transformers has no such model (ALiBi, RoPE, no position encoding); on a GPU the
captured graph against the eager step.
"""

import copy
import pickle

import pytest
import torch
from helpers import TINY, hf_and_fat5, padded_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation import GenerateBeamEncoderDecoderOutput, GenerateEncoderDecoderOutput

from fat5 import FAT5Config, FAT5ForConditionalGeneration
from fat5.graphed_decoding import cache_length_bucket, encoder_length_bucket, graphed_decoding_state


def _graphed(model):
    model.config.graphed_decoding = "always"
    return model


@pytest.fixture(scope="module")
def gated_untied():
    """T5 v1.1 (gated-GELU, untied head) and the FAT5 with its weights."""
    hf, fat5 = hf_and_fat5("t5v1.1")
    return hf, _graphed(fat5)


@pytest.fixture(scope="module")
def relu_tied():
    """T5 v1.0 (ReLU, head tied to the embedding, decoder output scaled by d_model**-0.5) and its FAT5."""
    hf, fat5 = hf_and_fat5("t5")
    return hf, _graphed(fat5)


@pytest.fixture(scope="module", params=["gated_untied", "relu_tied"])
def models(request):
    return request.getfixturevalue(request.param)


def generate_both(models, seed=5, **arguments):
    """T5's then FAT5's output, each after seeding the generator alike (for sampling); asserts that FAT5's call went
    through the graphed loop (a graph was built or replayed)."""
    hf, fat5 = models
    torch.manual_seed(seed)
    expected = hf.generate(**arguments)
    calls_before = _graph_uses(fat5)
    torch.manual_seed(seed)
    actual = fat5.generate(**arguments)
    assert _graph_uses(fat5) == calls_before + 1, "FAT5's generate did not take the graphed loop"
    return expected, actual


def _graph_uses(model) -> int:
    return graphed_decoding_state(model).graph_uses


def batch_inputs(seed=1):
    ids, mask, _ = padded_batch(seed)
    return {"input_ids": ids, "attention_mask": mask}


def eos_met_early(models, **arguments) -> int:
    """A token that T5's greedy decoding of the padded batch makes at its second step in the first row: as EOS,
    rows finish at different steps."""
    sequences = models[0].generate(**batch_inputs(), max_new_tokens=8, **arguments)
    return int(sequences[0, 2])


def test_greedy_padded_batch(models):
    expected, actual = generate_both(models, **batch_inputs(), max_new_tokens=20)
    assert torch.equal(actual, expected)


def test_eos_early_pads_finished_rows(models):
    eos = eos_met_early(models)
    expected, actual = generate_both(models, **batch_inputs(), max_new_tokens=24, eos_token_id=eos)
    assert torch.equal(actual, expected)
    # the case is the one meant: a row ended by EOS and padded after it
    ended = (actual[:, 1:] == eos).any(dim=1)
    assert ended.any()


@pytest.mark.parametrize("minimum", [{"min_new_tokens": 1}, {"min_new_tokens": 4}, {"min_length": 6}],
                         ids=lambda minimum: ",".join(f"{k}={v}" for k, v in minimum.items()))
def test_minimum_lengths_hold_eos_back(gated_untied, minimum):
    """EOS is a token that a row of T5's plain greedy decoding makes first just before, or at, the first position
    the minimum allows: held back there, or ending the row exactly there; a minimum misplaced by one position
    changes one or the other (the tiny tied model repeats its first token: it has no such rows)."""
    first_allowed = minimum.get("min_new_tokens", minimum.get("min_length", 0) - 1) + 1
    inputs = {"input_ids": torch.randint(2, TINY["vocab_size"], (8, 9), generator=torch.Generator().manual_seed(0))}
    for position in (first_allowed - 1, first_allowed):
        eos = _first_made_at(gated_untied[0], inputs, position)
        expected, actual = generate_both(gated_untied, **inputs, max_new_tokens=16, eos_token_id=eos, **minimum)
        assert torch.equal(actual, expected)
        assert not (actual[:, 1:first_allowed] == eos).any()
    assert (actual[:, first_allowed] == eos).any()


def _first_made_at(model, inputs, position: int) -> int:
    """A token that some row of the greedy decoding without EOS makes at ``position`` and not before."""
    sequences = model.generate(**inputs, max_new_tokens=position, eos_token_id=None)
    for row in sequences:
        if not (row[1:position] == row[position]).any():
            return int(row[position])
    raise AssertionError(f"every row repeats an earlier token at position {position}: choose other inputs")


def test_greedy_with_other_processors(gated_untied):
    expected, actual = generate_both(gated_untied, **batch_inputs(), max_new_tokens=12, repetition_penalty=1.3,
                                     no_repeat_ngram_size=2)
    assert torch.equal(actual, expected)


def test_static_cache_asked_for(gated_untied):
    expected, actual = generate_both(gated_untied, **batch_inputs(), max_new_tokens=10,
                                     cache_implementation="static")
    assert torch.equal(actual, expected)


def test_max_length(models):
    expected, actual = generate_both(models, **batch_inputs(), max_length=7)
    assert torch.equal(actual, expected)
    assert actual.shape == (3, 7)


@pytest.mark.parametrize(
    "settings_",
    [
        {"temperature": 0.7},
        {"top_k": 5},
        {"top_p": 0.8, "temperature": 1.3},
        {"repetition_penalty": 1.5, "top_k": 20},
        {"num_return_sequences": 2},
    ],
    ids=lambda options: ",".join(f"{k}={v}" for k, v in options.items()),
)
def test_sampling_draws_transformers_ids(gated_untied, settings_):
    eos = eos_met_early(gated_untied)
    expected, actual = generate_both(gated_untied, seed=11, **batch_inputs(), do_sample=True, max_new_tokens=12,
                                     eos_token_id=eos, **settings_)
    assert torch.equal(actual, expected)
    # the same random numbers drawn: the generators are where they are after transformers' call
    assert torch.equal(torch.rand(4), _rand_after(gated_untied[0], seed=11, **batch_inputs(), do_sample=True,
                                                  max_new_tokens=12, eos_token_id=eos, **settings_))


def test_sampling_stops_where_transformers_stops(models):
    """Every row ends at its first sampled token: transformers draws once; so must FAT5 (its host looks at the rows
    after every sampled step), and the tied model's scaled head must give transformers' distribution."""
    inputs = {"input_ids": batch_inputs()["input_ids"][:1]}
    torch.manual_seed(2)
    eos = int(models[0].generate(**inputs, do_sample=True, max_new_tokens=1)[0, 1])
    options = {"do_sample": True, "max_new_tokens": 12, "eos_token_id": eos, "temperature": 0.6}
    expected, actual = generate_both(models, seed=2, **inputs, **options)
    assert torch.equal(actual, expected)
    assert actual.shape == (1, 2)
    assert torch.equal(torch.rand(4), _rand_after(models[0], seed=2, **inputs, **options))


def _rand_after(model, seed, **arguments):
    torch.manual_seed(seed)
    model.generate(**arguments)
    return torch.rand(4)


def test_return_dict_in_generate(gated_untied):
    expected, actual = generate_both(gated_untied, **batch_inputs(), max_new_tokens=5, return_dict_in_generate=True)
    assert type(actual) is type(expected) is GenerateEncoderDecoderOutput
    assert torch.equal(actual.sequences, expected.sequences)


_BEAM_SETTINGS = [
    {"num_beams": 2},
    {"num_beams": 4},
    {"num_beams": 4, "length_penalty": 0.5, "early_stopping": True, "num_return_sequences": 2},
    {"num_beams": 3, "length_penalty": 2.0, "early_stopping": False},
    {"num_beams": 3, "length_penalty": -1.0, "early_stopping": "never", "num_return_sequences": 3},
]


@pytest.mark.parametrize("settings_", _BEAM_SETTINGS, ids=lambda options: ",".join(f"{k}={v}" for k, v in
                                                                                   options.items()))
def test_beam_search_gives_transformers_ids(models, settings_):
    """Rows of different input lengths, EOS met early by some beams (they finish while others run on)."""
    eos = eos_met_early(models)
    expected, actual = generate_both(models, **batch_inputs(), max_new_tokens=12, eos_token_id=eos, **settings_)
    assert torch.equal(actual, expected)


def test_beam_search_reaches_eos_and_max_length(gated_untied):
    """The case meant by the test above: a returned beam ended by EOS before max_length; and max_length alone."""
    eos = eos_met_early(gated_untied)
    _, actual = generate_both(gated_untied, **batch_inputs(), max_new_tokens=12, eos_token_id=eos, num_beams=4)
    assert (actual[:, 1:] == eos).any(dim=1).any()
    expected, actual = generate_both(gated_untied, **batch_inputs(), max_length=7, num_beams=3, eos_token_id=None)
    assert torch.equal(actual, expected)
    assert actual.shape == (3, 7)


def test_beam_search_minimum_length_holds_eos_back(gated_untied):
    """EOS is the token that the first row's best beam makes second: min_new_tokens holds it back to the fourth."""
    inputs, options = batch_inputs(), {"num_beams": 3, "max_new_tokens": 10}
    eos = int(gated_untied[0].generate(**inputs, **options, eos_token_id=None)[0, 2])
    expected, actual = generate_both(gated_untied, **inputs, **options, eos_token_id=eos, min_new_tokens=4)
    assert torch.equal(actual, expected)
    assert not (actual[:, 1:4] == eos).any()
    assert (gated_untied[0].generate(**inputs, **options, eos_token_id=eos)[:, 1:4] == eos).any()


def test_beam_sampling_draws_transformers_ids(gated_untied):
    options = {"num_beams": 3, "do_sample": True, "top_k": 20, "temperature": 1.2, "max_new_tokens": 10,
               "eos_token_id": eos_met_early(gated_untied)}
    expected, actual = generate_both(gated_untied, seed=13, **batch_inputs(), **options)
    assert torch.equal(actual, expected)
    assert torch.equal(torch.rand(4), _rand_after(gated_untied[0], seed=13, **batch_inputs(), **options))


@pytest.mark.parametrize("output_scores", [False, True])
def test_beam_search_return_dict_in_generate(models, output_scores):
    expected, actual = generate_both(models, **batch_inputs(), max_new_tokens=8, num_beams=2, num_return_sequences=2,
                                     eos_token_id=eos_met_early(models), length_penalty=0.8,
                                     return_dict_in_generate=True, output_scores=output_scores)
    assert type(actual) is type(expected) is GenerateBeamEncoderDecoderOutput
    assert torch.equal(actual.sequences, expected.sequences)
    assert torch.equal(actual.beam_indices, expected.beam_indices)
    if not output_scores:
        assert actual.sequences_scores is expected.sequences_scores is actual.scores is None
        return
    # the same ids from the same weights: the scores differ by the two forwards' rounding alone
    torch.testing.assert_close(actual.sequences_scores, expected.sequences_scores)
    assert len(actual.scores) == len(expected.scores)
    for actual_step, expected_step in zip(actual.scores, expected.scores, strict=True):
        torch.testing.assert_close(actual_step, expected_step)


def test_encoder_outputs_and_inputs_embeds(gated_untied):
    hf, fat5 = gated_untied
    inputs = batch_inputs()
    expected = hf.generate(**inputs, max_new_tokens=6)
    encoder_outputs = fat5.get_encoder()(**inputs)
    given_outputs = fat5.generate(encoder_outputs=encoder_outputs, attention_mask=inputs["attention_mask"],
                                  max_new_tokens=6)
    embeds = fat5.get_input_embeddings()(inputs["input_ids"])
    given_embeds = fat5.generate(inputs_embeds=embeds, attention_mask=inputs["attention_mask"], max_new_tokens=6)
    assert torch.equal(given_outputs, expected)
    assert torch.equal(given_embeds, expected)


def test_lengths_of_one_bucket_reuse_the_buffers():
    hf, fat5 = hf_and_fat5("t5v1.1", seed=7)
    _graphed(fat5)
    state = graphed_decoding_state(fat5)
    inputs = batch_inputs()
    generate_both((hf, fat5), **inputs, max_new_tokens=10)
    builds = (state.weight_builds, state.graph_builds)
    shorter = {"input_ids": inputs["input_ids"][:, :8], "attention_mask": inputs["attention_mask"][:, :8]}
    expected, actual = generate_both((hf, fat5), **shorter, max_new_tokens=12)
    assert torch.equal(actual, expected)
    assert (state.weight_builds, state.graph_builds) == builds
    # another batch size is another graph
    generate_both((hf, fat5), input_ids=inputs["input_ids"][:2], max_new_tokens=12)
    assert state.graph_builds == builds[1] + 1


def test_beam_search_calls_of_one_bucket_reuse_the_buffers():
    hf, fat5 = hf_and_fat5("t5v1.1", seed=7)
    _graphed(fat5)
    state = graphed_decoding_state(fat5)
    inputs = batch_inputs()
    generate_both((hf, fat5), **inputs, max_new_tokens=10, num_beams=2)
    builds = (state.weight_builds, state.graph_builds)
    shorter = {"input_ids": inputs["input_ids"][:, :8], "attention_mask": inputs["attention_mask"][:, :8]}
    expected, actual = generate_both((hf, fat5), **shorter, max_new_tokens=12, num_beams=2, length_penalty=0.7)
    assert torch.equal(actual, expected)
    assert (state.weight_builds, state.graph_builds) == builds


def test_changed_weights_are_derived_again():
    hf, fat5 = hf_and_fat5("t5v1.1", seed=8)
    _graphed(fat5)
    state = graphed_decoding_state(fat5)
    generate_both((hf, fat5), **batch_inputs(), max_new_tokens=8)
    builds = state.weight_builds
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for model in (hf, fat5):
            block = model.decoder.block[1]
            noise = torch.randn(block.layer[0].SelfAttention.v.weight.shape, generator=generator.manual_seed(3))
            block.layer[0].SelfAttention.v.weight.add_(noise)
            block.layer[2].DenseReluDense.wo.weight.mul_(-1.0)
    expected, actual = generate_both((hf, fat5), **batch_inputs(), max_new_tokens=8)
    assert torch.equal(actual, expected)
    assert state.weight_builds == builds + 1


@pytest.mark.parametrize("options", [{"num_beams": 3, "output_logits": True, "return_dict_in_generate": True},
                                     {"output_scores": True, "return_dict_in_generate": True},
                                     {"decoder_input_ids": torch.tensor([[0, 5]] * 3)}],
                         ids=["beam_logits", "scores", "decoder_prefix"])
def test_other_options_take_transformers_loop(gated_untied, options):
    hf, fat5 = gated_untied
    uses = _graph_uses(fat5)
    expected = hf.generate(**batch_inputs(), max_new_tokens=6, **options)
    actual = fat5.generate(**batch_inputs(), max_new_tokens=6, **options)
    sequences = getattr(actual, "sequences", actual)
    assert torch.equal(sequences, getattr(expected, "sequences", expected))
    assert _graph_uses(fat5) == uses


def test_copies_start_empty_and_clear_frees():
    hf, fat5 = hf_and_fat5("t5v1.1", seed=9)
    expected, _ = generate_both((hf, _graphed(fat5)), **batch_inputs(), max_new_tokens=4)
    copied = copy.deepcopy(fat5)
    restored = pickle.loads(pickle.dumps(fat5))
    for model in (copied, restored):
        assert graphed_decoding_state(model).graphs == {}
        assert torch.equal(model.generate(**batch_inputs(), max_new_tokens=4), expected)
    state = graphed_decoding_state(fat5)
    state.clear()
    assert (state.weights, len(state.graphs)) == (None, 0)
    assert torch.equal(fat5.generate(**batch_inputs(), max_new_tokens=4), expected)


def test_lora_adapters_keep_transformers_loop():
    """The step reads the projections' own weights: an adapter's share would be lost."""
    from peft import LoraConfig, get_peft_model

    _, fat5 = hf_and_fat5("t5v1.1")
    expected = fat5.generate(**batch_inputs(), max_new_tokens=5)
    model = get_peft_model(_graphed(fat5), LoraConfig(task_type="SEQ_2_SEQ_LM", init_lora_weights=False))
    adapted = model.generate(**batch_inputs(), max_new_tokens=5)
    assert "_graphed_decoding_state" not in fat5.__dict__
    with model.disable_adapter():
        assert torch.equal(model.generate(**batch_inputs(), max_new_tokens=5), expected)
    assert not torch.equal(adapted, expected)


def test_forward_hooks_keep_transformers_loop():
    _, fat5 = hf_and_fat5("t5v1.1")
    expected = fat5.generate(**batch_inputs(), max_new_tokens=5)
    handle = _graphed(fat5).decoder.block[0].layer[2].register_forward_hook(lambda module, args, output: -output)
    hooked = fat5.generate(**batch_inputs(), max_new_tokens=5)
    handle.remove()
    assert "_graphed_decoding_state" not in fat5.__dict__
    assert not torch.equal(hooked, expected)


def test_never_and_auto_on_cpu_keep_transformers_loop():
    _, fat5 = hf_and_fat5("t5v1.1")
    for mode in ("never", "auto"):
        fat5.config.graphed_decoding = mode
        fat5.generate(**batch_inputs(), max_new_tokens=3)
        assert "_graphed_decoding_state" not in fat5.__dict__


def test_umt5_tables_per_layer():
    hf, fat5 = hf_and_fat5("umt5")
    expected, actual = generate_both((hf, _graphed(fat5)), **batch_inputs(), max_new_tokens=12)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("position_encoding", ["alibi", "rope", "none"])
def test_position_encodings_without_a_transformers_twin(position_encoding):
    torch.manual_seed(0)
    config = FAT5Config(**TINY, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                        position_encoding=position_encoding, attention_backend="reference", attention_scale=None)
    model = FAT5ForConditionalGeneration(config).eval()
    for options in ({}, {"num_beams": 3, "num_return_sequences": 2}):
        outputs = {}
        for mode in ("never", "always"):
            model.config.graphed_decoding = mode
            outputs[mode] = model.generate(**batch_inputs(), max_new_tokens=12, **options)
        assert torch.equal(outputs["always"], outputs["never"]), options
    assert graphed_decoding_state(model).graph_uses == 2


def test_buckets():
    assert [encoder_length_bucket(n) for n in (1, 128, 129, 2048, 2049, 65536)] == [128, 128, 256, 2048, 3072, 65536]
    assert [cache_length_bucket(n) for n in (1, 64, 65, 127, 128, 129)] == [64, 64, 128, 128, 128, 256]


@settings(max_examples=6, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(1, 12), eos_step=st.integers(1, 4), seed=st.integers(0, 100))
def test_property_greedy_with_eos(batch, length, eos_step, seed):
    hf, fat5 = _property_models()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, TINY["vocab_size"], (batch, length), generator=generator)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    inputs = {"input_ids": ids * mask, "attention_mask": mask}
    # the token the first row generates at step eos_step (min_new_tokens: the config's own EOS may come earlier)
    eos = int(hf.generate(**inputs, max_new_tokens=eos_step, min_new_tokens=eos_step)[0, eos_step])
    expected, actual = generate_both((hf, fat5), **inputs, max_new_tokens=10, eos_token_id=eos)
    assert torch.equal(actual, expected)


_PROPERTY_MODELS = []


def _property_models():
    if not _PROPERTY_MODELS:
        hf, fat5 = hf_and_fat5("t5v1.1", seed=4)
        _PROPERTY_MODELS.extend((hf, _graphed(fat5)))
    return _PROPERTY_MODELS


def _use_backend(model, backend: str):
    """Every module's kernels on ``backend``: the modules keep the backend they were made with."""
    for module in model.modules():
        for name in ("backend", "activation_backend"):
            if getattr(module, name, None) is not None:
                setattr(module, name, backend)
    return model


@pytest.mark.interpreter
@pytest.mark.parametrize("causal", [True, False])
def test_decode_attention_matches_the_reference(causal):
    """The decoding kernel with T5's bias rows made beforehand, the offset read from the device and keys and values
    interleaved as in the cross-attention buffer, against the reference attention."""
    from fat5.kernels.attention import attention
    from fat5.kernels.attention_triton import decode_attention, t5_bias_rows
    from fat5.kernels.position_bias import NO_POSITION_BIAS, PositionBias

    torch.manual_seed(0)
    batch, heads, head_dim, keys = 2, 2, 16, 40
    bias = PositionBias.t5(torch.randn(8, heads), bidirectional=False, max_distance=16) if causal else NO_POSITION_BIAS
    query = torch.randn(batch, heads, 1, head_dim)
    storage = torch.randn(batch, keys, 2, heads, head_dim)
    key, value = storage[:, :, 0].transpose(1, 2), storage[:, :, 1].transpose(1, 2)
    mask = None if causal else torch.arange(keys)[None, :] < torch.tensor([[keys], [17]])
    offset = torch.tensor([23])
    actual = decode_attention(query, key, value, position_bias=bias, causal=causal, key_padding_mask=mask,
                              t5_bias_rows=t5_bias_rows(bias) if causal else None, query_offset=offset)
    expected = attention(query, key, value, position_bias=bias, causal=causal, key_padding_mask=mask,
                         query_offset=23, backend="reference")
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_triton_step_gives_transformers_ids():
    hf, fat5 = hf_and_fat5("t5v1.1")
    inputs = {"input_ids": batch_inputs()["input_ids"][1:], "attention_mask": batch_inputs()["attention_mask"][1:]}
    expected, actual = generate_both((hf, _use_backend(_graphed(fat5), "triton")), **inputs, max_new_tokens=4)
    assert torch.equal(actual, expected)


@pytest.mark.gpu
def test_cuda_graph_matches_eager_step_and_transformers_loop():
    _, fat5 = hf_and_fat5("t5v1.1")
    fat5 = _use_backend(fat5.cuda(), "auto")
    inputs = {name: tensor.cuda() for name, tensor in batch_inputs().items()}
    fat5.config.graphed_decoding = "never"  # the one graph below is the 40-token call's
    eos = int(fat5.generate(**inputs, max_new_tokens=8)[0, 2])
    outputs = {}
    for mode in ("never", "always"):
        fat5.config.graphed_decoding = mode
        outputs[mode] = fat5.generate(**inputs, max_new_tokens=40, eos_token_id=eos)
    state = graphed_decoding_state(fat5)
    (graph,) = state.graphs.values()
    assert isinstance(graph._replay.__self__, torch.cuda.CUDAGraph)
    assert torch.equal(outputs["always"], outputs["never"])
    # the same buffers, the step run eagerly instead of replayed
    graph._replay = graph._eager_step
    assert torch.equal(fat5.generate(**inputs, max_new_tokens=40, eos_token_id=eos), outputs["never"])
    # EOS masked inside the graph; sampling from the graph's logits; beams reordering the buffers between replays
    for options in ({"min_new_tokens": 10}, {"do_sample": True, "top_k": 10}, {"num_beams": 3, "length_penalty": 0.7},
                    {"num_beams": 2, "do_sample": True, "top_k": 10, "num_return_sequences": 2}):
        outputs = {}
        for mode in ("never", "always"):
            fat5.config.graphed_decoding = mode
            torch.manual_seed(0)
            outputs[mode] = fat5.generate(**inputs, max_new_tokens=20, eos_token_id=eos, **options)
        assert torch.equal(outputs["always"], outputs["never"]), options
    fat5.to(torch.bfloat16)
    bf16 = fat5.generate(**inputs, max_new_tokens=40)
    assert bf16.shape[0] == 3
    assert state.weight_builds == 2
