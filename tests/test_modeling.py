"""FAT5 against transformers' own T5 / UMT5: same weights, same logits, same loss, same generated ids."""

import pytest
import torch
from helpers import TINY, fat5_from_hf, make_hf, padded_batch, relative_error
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, EncoderDecoderCache, T5Config, T5EncoderModel

import fat5
from fat5 import FAT5Config, FAT5EncoderModel, FAT5ForConditionalGeneration, FAT5Model
from fat5.conversion.convert import _make_umt5_decoder_causal


@pytest.mark.parametrize("family", ["t5", "t5v1.1", "umt5"])
def test_logits_and_loss_match_transformers(family):
    hf = make_hf(family)
    model = fat5_from_hf(hf, family)
    input_ids, attention_mask, labels = padded_batch()
    with torch.no_grad():
        expected = hf(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        actual = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, return_loss_parts=True)
    assert relative_error(actual.logits, expected.logits) < 1e-5
    assert relative_error(actual.encoder_last_hidden_state, expected.encoder_last_hidden_state) < 1e-5
    assert abs(actual.loss.item() - expected.loss.item()) < 1e-5 * abs(expected.loss.item())
    assert actual.z_loss.item() == 0.0


def test_return_logits_false_leaves_the_logits_out_and_the_loss_as_it_is():
    hf = make_hf("t5v1.1").train()
    model = fat5_from_hf(hf, "t5v1.1").train()
    input_ids, attention_mask, labels = padded_batch()
    expected = hf(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    output = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, return_logits=False)
    assert output.logits is None and "logits" not in output
    assert abs(output.loss.item() - expected.loss.item()) < 1e-5 * abs(expected.loss.item())
    output.loss.backward()
    expected.loss.backward()
    assert relative_error(model.lm_head.weight.grad, hf.lm_head.weight.grad) < 1e-4


def test_autocast_training_matches_transformers_with_projections_fed_in_its_dtype():
    """fp32 weights under bf16 autocast, as the Trainer runs `bf16: true`: the same loss and gradients as transformers'
    T5 and the same output dtypes, while every projection inside the stacks receives bf16 activations as they are
    (transformers hands them fp32 norm outputs and fp32-widened feed-forward activations, which autocast casts
    to bf16 at each projection: the same values, more passes over memory both ways)."""
    hf = make_hf("t5v1.1").train()
    model = fat5_from_hf(hf, "t5v1.1").train()
    input_ids, attention_mask, labels = padded_batch()
    watched = {
        "q": model.encoder.block[0].layer[0].SelfAttention.q,
        "cross k": model.decoder.block[1].layer[1].EncDecAttention.k,
        "wi_0": model.decoder.block[0].layer[-1].DenseReluDense.wi_0,
        "wo": model.encoder.block[0].layer[-1].DenseReluDense.wo,
    }
    seen = {}

    def record_input_dtype(name):
        def hook(module, args):
            seen.setdefault(name, args[0].dtype)
        return hook

    hooks = [module.register_forward_pre_hook(record_input_dtype(name)) for name, module in watched.items()]
    outputs = []
    for network in (hf, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = network(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        output.loss.backward()
        outputs.append(output)
    for hook in hooks:
        hook.remove()
    assert seen == dict.fromkeys(watched, torch.bfloat16)
    expected, actual = outputs
    assert actual.encoder_last_hidden_state.dtype == expected.encoder_last_hidden_state.dtype == torch.float32
    assert actual.logits.dtype == expected.logits.dtype
    assert abs(actual.loss.item() - expected.loss.item()) < 5e-3 * abs(expected.loss.item())
    hf_parameters = dict(hf.named_parameters())
    for name, parameter in model.named_parameters():
        if parameter.grad is not None and name in hf_parameters:
            assert relative_error(parameter.grad, hf_parameters[name].grad) < 5e-2, name


def test_a_non_causal_umt5_reference_is_made_causal_before_comparing():
    """transformers 5.17 builds UMT5's decoder self-attention with is_causal=False (SDPA then lets a position see
    later ones when no decoder mask is given); the conversion check makes the reference causal again, with a note."""
    hf = make_hf("umt5")
    model = fat5_from_hf(hf, "umt5")
    input_ids, attention_mask, labels = padded_batch()
    for block in hf.decoder.block:  # as that release builds it
        block.layer[0].SelfAttention.is_causal = False
    with torch.no_grad():
        non_causal = hf(input_ids=input_ids, attention_mask=attention_mask, labels=labels).logits
        expected = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).logits
    assert relative_error(non_causal, expected) > 1e-2  # the bug shows at this shape
    notes = []
    _make_umt5_decoder_causal(hf, notes)
    with torch.no_grad():
        fixed = hf(input_ids=input_ids, attention_mask=attention_mask, labels=labels).logits
    assert relative_error(fixed, expected) < 1e-5
    assert len(notes) == 1 and "not causal" in notes[0]
    _make_umt5_decoder_causal(hf, notes)  # a causal reference is left as it is, without a note
    assert len(notes) == 1


@pytest.mark.parametrize("family", ["t5", "t5v1.1", "umt5"])
def test_generation_matches_transformers(family):
    hf = make_hf(family, seed=3)
    model = fat5_from_hf(hf, family)
    input_ids, attention_mask, _ = padded_batch(seed=4)
    settings = {"max_new_tokens": 8, "min_new_tokens": 8}
    greedy, beam = {"do_sample": False}, {"do_sample": False, "num_beams": 3}
    sampling = {"do_sample": True, "top_k": 20}
    for extra in (greedy, beam, sampling):
        torch.manual_seed(5)  # sampling draws the same numbers for both, so equal logits pick the same tokens
        expected = hf.generate(input_ids=input_ids, attention_mask=attention_mask, **settings, **extra)
        torch.manual_seed(5)
        actual = model.generate(input_ids=input_ids, attention_mask=attention_mask, **settings, **extra)
        assert torch.equal(actual, expected), extra


def test_encoder_model_matches_transformers():
    torch.manual_seed(0)
    hf = T5EncoderModel(T5Config(**TINY, feed_forward_proj="gated-gelu")).eval()
    model = FAT5EncoderModel(FAT5Config(**TINY, feed_forward_proj="gated-gelu", attention_backend="reference")).eval()
    missing, unexpected = model.load_state_dict(hf.state_dict(), strict=False)
    assert not [k for k in missing + unexpected if "embed_tokens" not in k]
    input_ids, attention_mask, _ = padded_batch()
    with torch.no_grad():
        expected = hf(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        actual = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    assert relative_error(actual, expected) < 1e-5


def test_num_items_in_batch_makes_the_loss_a_sum_over_it():
    model = FAT5ForConditionalGeneration(FAT5Config(**TINY, attention_backend="reference")).eval()
    input_ids, attention_mask, labels = padded_batch()
    with torch.no_grad():
        mean_loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        summed = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, num_items_in_batch=100).loss
    labelled = (labels != -100).sum().item()
    torch.testing.assert_close(summed, mean_loss * labelled / 100, rtol=1e-5, atol=1e-7)


def test_z_loss_is_reported_apart_and_added():
    config = FAT5Config(**TINY, attention_backend="reference", z_loss=1e-2)
    model = FAT5ForConditionalGeneration(config).eval()
    input_ids, attention_mask, labels = padded_batch()
    with torch.no_grad():
        output = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, return_loss_parts=True)
    logits = output.logits.view(-1, TINY["vocab_size"])
    kept = labels.view(-1) != -100
    expected_z = 1e-2 * torch.logsumexp(logits[kept], dim=-1).pow(2).mean()
    expected_ce = torch.nn.functional.cross_entropy(logits, labels.view(-1))
    torch.testing.assert_close(output.z_loss, expected_z, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(output.ce_loss, expected_ce, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(output.loss, expected_ce + expected_z, rtol=1e-5, atol=1e-7)


def packed_batch(rows, encoder_width, decoder_width, generator):
    """Rows of (encoder length, decoder length) examples packed back to back, then padded: the ids, segment ids and
    each example's own (input_ids, decoder_input_ids, row, decoder start)."""
    input_ids = torch.zeros(len(rows), encoder_width, dtype=torch.long)
    decoder_input_ids = torch.zeros(len(rows), decoder_width, dtype=torch.long)
    segment_ids = torch.zeros_like(input_ids)
    decoder_segment_ids = torch.zeros_like(decoder_input_ids)
    examples = []
    for row, lengths in enumerate(rows):
        encoder_at = decoder_at = 0
        for number, (encoder_length, decoder_length) in enumerate(lengths, start=1):
            encoder = torch.randint(2, 96, (encoder_length,), generator=generator)
            decoder = torch.randint(2, 96, (decoder_length,), generator=generator)
            input_ids[row, encoder_at : encoder_at + encoder_length] = encoder
            segment_ids[row, encoder_at : encoder_at + encoder_length] = number
            decoder_input_ids[row, decoder_at : decoder_at + decoder_length] = decoder
            decoder_segment_ids[row, decoder_at : decoder_at + decoder_length] = number
            examples.append((encoder, decoder, row, decoder_at))
            encoder_at += encoder_length
            decoder_at += decoder_length
    return input_ids, segment_ids, decoder_input_ids, decoder_segment_ids, examples


@pytest.mark.parametrize("position_encoding", ["t5", "alibi", "rope", "fire", "none"])
def test_packed_rows_give_each_example_its_own_logits(position_encoding):
    """Two examples packed in one row see nothing of each other: each gets the logits it gets alone."""
    torch.manual_seed(0)
    config = FAT5Config(**TINY, feed_forward_proj="gated-gelu", position_encoding=position_encoding,
                        attention_backend="reference")
    model = FAT5ForConditionalGeneration(config).eval()
    input_ids, segment_ids, decoder_input_ids, decoder_segment_ids, examples = packed_batch(
        [[(5, 3), (4, 4)]], encoder_width=11, decoder_width=8, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        packed = model(input_ids=input_ids, segment_ids=segment_ids, decoder_input_ids=decoder_input_ids,
                       decoder_segment_ids=decoder_segment_ids).logits[0]
        for encoder, decoder, _, start in examples:
            alone = model(input_ids=encoder[None], decoder_input_ids=decoder[None]).logits[0]
            assert relative_error(packed[start : start + decoder.numel()], alone) < 1e-5


row_of_examples = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 4)), min_size=0, max_size=3)


@settings(max_examples=12, deadline=None)
@given(rows=st.lists(row_of_examples, min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_packed_batches_of_any_layout_give_each_example_its_own_logits(rows, seed):
    """Rows holding different numbers of examples (none, or filling the row), padded or not: every example's
    logits are those it gets alone."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = FAT5ForConditionalGeneration(FAT5Config(**TINY, attention_backend="reference")).eval()
    encoder_width = max([sum(e for e, _ in row) for row in rows] + [1])
    decoder_width = max([sum(d for _, d in row) for row in rows] + [1])
    input_ids, segment_ids, decoder_input_ids, decoder_segment_ids, examples = packed_batch(
        rows, encoder_width, decoder_width, generator
    )
    with torch.no_grad():
        packed = model(input_ids=input_ids, segment_ids=segment_ids, decoder_input_ids=decoder_input_ids,
                       decoder_segment_ids=decoder_segment_ids).logits
        for encoder, decoder, row, start in examples:
            alone = model(input_ids=encoder[None], decoder_input_ids=decoder[None]).logits[0]
            assert relative_error(packed[row, start : start + decoder.numel()], alone) < 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("d_kv", [16, 8])  # 8: below the kernels' smallest head dim, their output is padded
def test_packed_batch_through_the_triton_kernels_matches_the_reference(d_kv):
    """Empty example slots, rows without padding, a row of padding only, and decoder padding facing no encoder
    padding: the varlen kernels (interpreter, fp32) give the reference's loss and gradients. One layer per stack:
    a second would run the same kernels on the same layout."""
    rows = [[(5, 3), (4, 2)], [(6, 5)], [], [(9, 2)]]
    input_ids, segment_ids, decoder_input_ids, decoder_segment_ids, _ = packed_batch(
        rows, 9, 5, torch.Generator().manual_seed(0)
    )
    labels = torch.where(decoder_segment_ids > 0, decoder_input_ids, -100)
    results = {}
    for backend in ("reference", "triton"):
        torch.manual_seed(0)
        config = FAT5Config(**dict(TINY, d_kv=d_kv, num_heads=2, num_layers=1, num_decoder_layers=1),
                            attention_backend=backend)
        model = FAT5ForConditionalGeneration(config).train()
        loss = model(input_ids=input_ids, segment_ids=segment_ids, decoder_input_ids=decoder_input_ids,
                     decoder_segment_ids=decoder_segment_ids, labels=labels).loss
        loss.backward()
        results[backend] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    (loss, grads), (expected_loss, expected_grads) = results["triton"], results["reference"]
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        assert relative_error(grads[name], expected_grads[name]) < 1e-4, name


def test_a_packed_forward_builds_each_rows_layout_once(monkeypatch):
    """The encoder's packed layout serves the encoder and the decoder's cross-attention: each build reads two numbers
    back to the host, so a training step builds two layouts (encoder rows, decoder rows), not three."""
    from fat5.modeling_fat5 import TokenLayout

    built = []
    packed = TokenLayout.packed.__func__

    def counting_packed(cls, segment_ids):
        built.append(tuple(segment_ids.shape))
        return packed(cls, segment_ids)

    monkeypatch.setattr(TokenLayout, "packed", classmethod(counting_packed))
    model = FAT5ForConditionalGeneration(FAT5Config(**TINY, attention_backend="reference"))
    segment_ids = torch.tensor([[1, 1, 1, 2, 2, 0], [1, 1, 2, 2, 2, 2]])
    decoder_segment_ids = torch.tensor([[1, 1, 2, 0], [1, 2, 2, 2]])
    labels = torch.randint(2, TINY["vocab_size"], (2, 4)).masked_fill(decoder_segment_ids == 0, -100)
    model(input_ids=torch.randint(2, TINY["vocab_size"], (2, 6)), segment_ids=segment_ids,
          decoder_input_ids=labels.clamp(min=0), decoder_segment_ids=decoder_segment_ids, labels=labels).loss.backward()
    assert built == [(2, 6), (2, 4)]


def test_packed_layout_cuts_rows_into_example_slots_and_a_padding_tail():
    """A hand-counted case: two rows, the second with one example of the batch's two and no padding."""
    from fat5.modeling_fat5 import TokenLayout

    layout = TokenLayout.packed(torch.tensor([[1, 1, 2, 0], [1, 1, 1, 1]]))
    assert layout.cu_seqlens.tolist() == [0, 2, 3, 4, 8, 8, 8]
    assert layout.max_seqlen == 4
    assert layout.position_ids.tolist() == [[0, 1, 0, 0], [0, 1, 2, 3]]
    assert layout.examples.tolist() == [[True, True], [True, False]]


@pytest.mark.parametrize(
    "segment_ids", [[[1, 0, 1, 0]], [[1, 1, 0, 2]], [[2, 2, 1, 0]], [[1, -1, 0, 0]]], ids=str
)
def test_packed_rows_out_of_order_are_refused_by_name(segment_ids):
    model = FAT5ForConditionalGeneration(FAT5Config(**TINY, attention_backend="reference")).eval()
    with pytest.raises(ValueError, match="increasing order.*padding \\(0\\) only after"):
        model.get_encoder()(input_ids=torch.ones(1, 4, dtype=torch.long), segment_ids=torch.tensor(segment_ids))


def test_decoder_rows_must_hold_the_encoder_rows_examples():
    model = FAT5ForConditionalGeneration(FAT5Config(**TINY, attention_backend="reference")).eval()
    input_ids = torch.ones(2, 4, dtype=torch.long)
    segment_ids = torch.tensor([[1, 1, 2, 0], [1, 1, 1, 0]])
    with pytest.raises(ValueError, match="same examples"):
        model(input_ids=input_ids, segment_ids=segment_ids, decoder_input_ids=torch.ones(2, 3, dtype=torch.long),
              decoder_segment_ids=torch.tensor([[1, 2, 0], [1, 2, 0]]))


@pytest.mark.parametrize("argument", ["cache", "past_key_values"])
def test_the_cache_is_taken_under_either_name_and_returned_under_transformers_own(argument):
    """transformers 5.24 calls the KV cache `cache` where earlier releases said `past_key_values`: a decoding step
    reads it under either name and returns it in the output field the installed transformers' models use."""
    from transformers.modeling_outputs import Seq2SeqLMOutput

    field = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"
    hf = make_hf("t5v1.1")
    model = fat5_from_hf(hf, "t5v1.1")
    input_ids, attention_mask, _ = padded_batch()
    decoder_input_ids = torch.tensor([[0, 5, 9]] * 3)
    with torch.no_grad():
        full = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
        first = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids[:, :2],
                      use_cache=True)
        cache = getattr(first, field)
        assert cache.get_seq_length() == 2
        step = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids[:, 2:],
                     use_cache=True, **{argument: cache})
    assert relative_error(step.logits[:, -1], full[:, -1]) < 1e-5
    assert getattr(step, field) is cache and cache.get_seq_length() == 3
    # named twice, the cache given as `cache` wins unless it is empty (then PEFT's prefix under the old name serves)
    other = EncoderDecoderCache(DynamicCache(), DynamicCache())
    both = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids[:, 2:],
                 use_cache=True, cache=cache, past_key_values=other)
    assert getattr(both, field) is cache and other.get_seq_length() == 0


@pytest.mark.parametrize("position_encoding", ["t5", "alibi", "rope", "fire", "none"])
def test_cached_decoding_equals_full_forward(position_encoding):
    """Step-by-step decoding with the KV cache gives the logits of one causal forward over the whole prefix."""
    torch.manual_seed(0)
    config = FAT5Config(**TINY, position_encoding=position_encoding, attention_backend="reference")
    model = FAT5ForConditionalGeneration(config).eval()
    input_ids, attention_mask, _ = padded_batch()
    decoder_input_ids = torch.randint(2, 96, (3, 6))
    with torch.no_grad():
        full = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                     use_cache=False).logits
        encoder_outputs = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
        past, steps = None, []
        for t in range(decoder_input_ids.shape[1]):
            output = model(encoder_outputs=encoder_outputs, attention_mask=attention_mask,
                           decoder_input_ids=decoder_input_ids[:, t : t + 1], past_key_values=past, use_cache=True)
            past = output.past_key_values
            steps.append(output.logits)
    assert relative_error(torch.cat(steps, dim=1), full) < 1e-5


@pytest.mark.parametrize("position_encoding", ["t5", "alibi", "rope", "fire", "none"])
def test_static_cache_generates_the_dynamic_cache_ids(position_encoding):
    """transformers' StaticCache (what ``generate`` compiles into CUDA graphs): fixed-size buffers, the cache length a
    device tensor; greedy and beam-search ids equal the default cache's, with and without a decoder mask."""
    torch.manual_seed(0)
    config = FAT5Config(**TINY, position_encoding=position_encoding, attention_backend="reference")
    model = FAT5ForConditionalGeneration(config).eval()
    input_ids, attention_mask, _ = padded_batch()
    settings = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    expected = model.generate(input_ids=input_ids, attention_mask=attention_mask, **settings)
    static = model.generate(input_ids=input_ids, attention_mask=attention_mask, cache_implementation="static",
                            **settings)
    assert torch.equal(static, expected)
    decoder_mask = {"decoder_attention_mask": torch.ones(3, 1, dtype=torch.long)}
    masked = model.generate(input_ids=input_ids, attention_mask=attention_mask, cache_implementation="static",
                            **decoder_mask, **settings)
    assert torch.equal(masked, expected)
    beams = {**settings, "num_beams": 3}  # beam search reorders the static buffers in place
    assert torch.equal(
        model.generate(input_ids=input_ids, attention_mask=attention_mask, cache_implementation="static", **beams),
        model.generate(input_ids=input_ids, attention_mask=attention_mask, **beams),
    )


def test_static_cache_matches_transformers_t5():
    hf = make_hf("t5v1.1", seed=3)
    model = fat5_from_hf(hf, "t5v1.1")
    input_ids, attention_mask, _ = padded_batch(seed=4)
    settings = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "cache_implementation": "static"}
    expected = hf.generate(input_ids=input_ids, attention_mask=attention_mask, **settings)
    assert torch.equal(model.generate(input_ids=input_ids, attention_mask=attention_mask, **settings), expected)


def test_static_cache_decoding_step_traces_as_one_graph():
    """The decoding step that ``generate`` compiles: no graph break, no recompilation as the position advances."""
    import torch._dynamo.testing
    from transformers.cache_utils import EncoderDecoderCache, StaticCache

    torch.manual_seed(0)
    config = FAT5Config(**TINY, position_encoding="t5", attention_backend="reference")
    model = FAT5ForConditionalGeneration(config).eval()
    input_ids, attention_mask, _ = padded_batch()
    expected = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6, min_new_tokens=6,
                              do_sample=False)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
        cache = EncoderDecoderCache(StaticCache(config=config, max_cache_len=8),
                                    StaticCache(config=config, max_cache_len=input_ids.shape[1]))
        tokens = [torch.zeros(3, 1, dtype=torch.long)]
        for step in range(6):
            forward = model if step == 0 else compiled  # the first step fills the cross-attention cache, eagerly
            logits = forward(encoder_outputs=encoder_outputs, attention_mask=attention_mask,
                             decoder_input_ids=tokens[-1], past_key_values=cache).logits
            tokens.append(logits[:, -1].argmax(-1, keepdim=True))
    assert torch.equal(torch.cat(tokens, dim=1), expected)
    assert counter.frame_count == 1


@pytest.mark.gpu
def test_compiled_static_cache_generation_on_gpu():
    """What ``generate(cache_implementation="static")`` does on a GPU: the Triton kernels inside the decoding step
    that transformers compiles into CUDA graphs, giving the ids of the eager dynamic cache (fp32, so that the
    compiler's fusions cannot flip a near tie; benchmarks/model.py compares bf16 ids at the base shape)."""
    torch.manual_seed(0)
    # transformers' loop: FAT5's own graphed loop (test_graphed_decoding.py) would take both calls
    config = FAT5Config(**dict(TINY, d_kv=64, num_heads=2, d_model=64), attention_backend="triton",
                        graphed_decoding="never")
    model = FAT5ForConditionalGeneration(config).cuda().eval()
    input_ids, attention_mask, _ = padded_batch()
    input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()
    settings = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False}
    expected = model.generate(input_ids=input_ids, attention_mask=attention_mask, **settings)
    for _ in range(2):  # the second call replays the captured graphs
        static = model.generate(input_ids=input_ids, attention_mask=attention_mask, cache_implementation="static",
                                **settings)
        assert torch.equal(static, expected)


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    config = FAT5Config(**TINY, feed_forward_proj="gated-gelu", attention_backend="reference")
    model = FAT5ForConditionalGeneration(config).train()
    input_ids, attention_mask, labels = padded_batch()

    def gradients():
        model.zero_grad()
        model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    model.gradient_checkpointing_enable()
    checkpointed = gradients()
    assert plain.keys() == checkpointed.keys()
    assert "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in plain
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7)


def test_auto_classes_round_trip(tmp_path):
    from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

    model = FAT5ForConditionalGeneration(FAT5Config(**TINY, tie_word_embeddings=False, attention_backend="reference"))
    model.save_pretrained(tmp_path)
    # the folder carries its code for machines without fat5; with fat5 imported, the Auto classes take the package's
    assert "AutoModelForSeq2SeqLM" in AutoConfig.from_pretrained(tmp_path).to_dict()["auto_map"]
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, FAT5ForConditionalGeneration)
    assert not torch.equal(loaded.lm_head.weight, loaded.shared.weight)
    input_ids, attention_mask, labels = padded_batch()
    with torch.no_grad():
        expected = model.eval()(input_ids=input_ids, attention_mask=attention_mask, labels=labels).logits
        actual = loaded(input_ids=input_ids, attention_mask=attention_mask, labels=labels).logits
    torch.testing.assert_close(actual, expected)
    assert isinstance(AutoModel.from_pretrained(tmp_path), FAT5Model)


def test_task_heads_through_the_auto_classes(tmp_path):
    """`import fat5` registers the heads: each auto class builds its FAT5 head on a saved seq2seq folder (with or
    without trust_remote_code), with the folder's encoder; the QA loss is the mean of the start and end losses."""
    import transformers

    model = FAT5ForConditionalGeneration(FAT5Config(**TINY, attention_backend="reference")).eval()
    model.save_pretrained(tmp_path)
    input_ids, attention_mask, _ = padded_batch()
    with torch.no_grad():
        expected = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    for task in ("SequenceClassification", "TokenClassification", "QuestionAnswering"):
        auto_class, head_class = getattr(transformers, f"AutoModelFor{task}"), getattr(fat5, f"FAT5For{task}")
        for trust_remote_code in (False, True):
            head = auto_class.from_pretrained(tmp_path, trust_remote_code=trust_remote_code).eval()
            assert type(head) is head_class and head.get_input_embeddings() is head.get_encoder().embed_tokens
            with torch.no_grad():
                states = head.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            torch.testing.assert_close(states, expected)
    start, end = torch.tensor([1, 0, 2]), torch.tensor([3, 6, 2])
    with torch.no_grad():
        output = head(input_ids=input_ids, attention_mask=attention_mask, start_positions=start, end_positions=end)
    cross_entropy = torch.nn.functional.cross_entropy
    expected_loss = (cross_entropy(output.start_logits, start) + cross_entropy(output.end_logits, end)) / 2
    torch.testing.assert_close(output.loss, expected_loss)


def test_tied_model_shares_its_head(tmp_path):
    model = FAT5ForConditionalGeneration(FAT5Config(**TINY, attention_backend="reference"))
    assert model.lm_head.weight is model.shared.weight
    model.save_pretrained(tmp_path)
    loaded = FAT5ForConditionalGeneration.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.shared.weight
    torch.testing.assert_close(loaded.shared.weight, model.shared.weight)


def test_bad_inputs_get_clear_errors():
    model = FAT5ForConditionalGeneration(FAT5Config(**TINY, attention_backend="reference")).eval()
    input_ids, attention_mask, labels = padded_batch()
    with pytest.raises(ValueError, match="attention mask covers 5 positions"):
        model(input_ids=input_ids, attention_mask=attention_mask[:, :5], labels=labels)
    with pytest.raises(ValueError, match="segment_ids"):
        model(input_ids=input_ids, segment_ids=torch.ones_like(input_ids), attention_mask=attention_mask, labels=labels)
    with pytest.raises(ValueError, match="contiguous"):
        model.get_encoder()(input_ids=input_ids[:1, :4], segment_ids=torch.tensor([[1, 2, 1, 0]]))
    with pytest.raises(ValueError, match="exactly one"):
        model.get_encoder()()


@pytest.mark.parametrize("position_encoding", ["t5", "fire"])
def test_later_blocks_take_copies_of_the_first_blocks_position_parameters_and_refuse_to_run_without(position_encoding):
    from fat5.modeling_fat5 import TokenLayout

    model = FAT5EncoderModel(FAT5Config(**TINY, position_encoding=position_encoding, attention_backend="reference"))
    first, later = model.encoder.block[0], model.encoder.block[1]
    hidden_states = torch.randn(2, 5, 32)
    layout = TokenLayout.padded(2, 5)
    _, _, _, *position_parameters = first(hidden_states, layout)
    owner = first.layer[0].SelfAttention
    owned = owner.relative_attention_bias if position_encoding == "t5" else owner.fire
    assert len(position_parameters) == len(list(owned.parameters()))
    for travelling in position_parameters:  # copies: FSDP reshards the first block once it has run
        assert not any(travelling is parameter for parameter in owned.parameters())
        assert any(torch.equal(travelling, parameter) for parameter in owned.parameters())
    later(hidden_states, layout, None, None, None, *position_parameters)
    with pytest.raises(ValueError, match="position parameters"):
        later(hidden_states, layout)
