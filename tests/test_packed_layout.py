"""Packed rows whose layout the collator builds: the same layout as the model's own derivation, the same model
outputs, no read back to the host (no graph break, no synchronisation), and batches in a few fixed shapes."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fat5 import FAT5Config, FAT5ForConditionalGeneration
from fat5.kernels.attention import attention_varlen
from fat5.kernels.position_bias import PositionBias
from fat5.modeling_fat5 import TokenLayout
from fat5.trainer.collator import UL2DataCollator
from fat5.trainer.packing import (
    PlannedDataset,
    ShapeBuckets,
    UL2PackedBatchSampler,
    bucket_batches,
    choose_target_widths,
)
from fat5.trainer.ul2 import UL2Objective

VOCAB = 512
SENTINELS = np.arange(VOCAB - 1, VOCAB - 1 - 64, -1)
LAYOUT_KEYS = ("cu_seqlens", "segment_position_ids", "decoder_cu_seqlens", "decoder_segment_position_ids")


def make_collator(max_input_length=64, max_target_length=None, seed=0):
    objective = UL2Objective(
        sentinel_ids=SENTINELS,
        prefix_ids={"[R]": 3, "[S]": 4, "[X]": 5},
        eos_id=1,
        max_input_length=max_input_length,
        max_target_length=max_target_length or max_input_length,
    )
    return UL2DataCollator(objective=objective, packed=True, pad_token_id=0, seed=seed)


def documents(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(6, VOCAB - 64, size=n)} for n in lengths]


def bucketed_batches(lengths, max_input_length=64, buckets=2, tokens_per_batch=400, drop_last=False):
    """Fixed-shape batches of the sampler + collator pipeline, and the sampler."""
    collator = make_collator(max_input_length)
    dataset = PlannedDataset(documents(lengths))
    sampler = UL2PackedBatchSampler(lengths, collator.objective, tokens_per_batch=tokens_per_batch,
                                    shape_buckets=buckets, drop_last=drop_last)
    return [collator([dataset[example] for example in batch]) for batch in sampler], sampler


def segment_pairs(encoder_cu_seqlens, decoder_cu_seqlens):
    """The (encoder range, decoder range) of each segment, those empty on both sides left out."""
    encoder, decoder = encoder_cu_seqlens.tolist(), decoder_cu_seqlens.tolist()
    pairs = zip(itertools.pairwise(encoder), itertools.pairwise(decoder))
    return [(e, d) for e, d in pairs if e[0] != e[1] or d[0] != d[1]]


def assert_layout_is_the_models(batch):
    """The collator's layout against TokenLayout.packed, the model's own derivation from the segment ids."""
    encoder = TokenLayout.packed(batch["segment_ids"])
    decoder = TokenLayout.packed(batch["decoder_segment_ids"])
    assert segment_pairs(batch["cu_seqlens"], batch["decoder_cu_seqlens"]) == segment_pairs(
        encoder.cu_seqlens, decoder.cu_seqlens
    )
    torch.testing.assert_close(batch["segment_position_ids"], encoder.position_ids, rtol=0, atol=0)
    torch.testing.assert_close(batch["decoder_segment_position_ids"], decoder.position_ids, rtol=0, atol=0)
    for stack in ("", "decoder_"):
        cu_seqlens = batch[f"{stack}cu_seqlens"]
        assert cu_seqlens.dtype == torch.int32 and cu_seqlens[0] == 0
        assert cu_seqlens[-1] == batch[f"{stack}segment_ids"].numel()
        assert (cu_seqlens[1:] >= cu_seqlens[:-1]).all()
    # the varlen kernels are told the row length as max_seqlen: no segment may be longer
    assert (batch["cu_seqlens"].diff() <= batch["input_ids"].shape[1]).all()
    assert (batch["decoder_cu_seqlens"].diff() <= batch["labels"].shape[1]).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 200), min_size=1, max_size=14),
    max_input_length=st.sampled_from([16, 48, 64]),
    seed=st.integers(0, 3),
)
def test_collator_layout_is_the_models_derivation(lengths, max_input_length, seed):
    collator = make_collator(max_input_length, seed=seed)
    batch = collator(documents(lengths, seed))
    assert set(LAYOUT_KEYS) <= set(batch)
    assert_layout_is_the_models(batch)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=30),
    buckets=st.integers(1, 3),
    tokens_per_batch=st.sampled_from([200, 600]),
)
def test_fixed_shape_batches_keep_the_models_layout(lengths, buckets, tokens_per_batch):
    """Batches padded to their bucket (empty rows, empty segments up to the capacity) still describe the rows as
    the model derives them, and come in the sampler's shapes only."""
    batches, sampler = bucketed_batches(lengths, buckets=buckets, tokens_per_batch=tokens_per_batch)
    shapes = {(rows, width) for rows, _, width in sampler.buckets.shapes()}
    for batch in batches:
        assert_layout_is_the_models(batch)
        rows, input_width = batch["input_ids"].shape
        assert input_width == 64 and (rows, batch["labels"].shape[1]) in shapes
        capacity = batch["cu_seqlens"].numel() - 1
        assert capacity % rows == 0 and capacity // rows >= 4
        assert batch["decoder_cu_seqlens"].shape == batch["cu_seqlens"].shape


def test_collator_can_leave_the_layout_out():
    collator = make_collator()
    collator.return_layout = False
    assert not set(LAYOUT_KEYS) & set(collator(documents([30, 50, 10])))


def brute_force_padding(fill, count, max_width, multiple, rows_at_width=None, batchings=1):
    widest = -(-max_width // 8) * 8
    candidates = [*range(multiple, widest, multiple), widest]
    best = None
    for size in range(1, count + 1):
        for widths in itertools.combinations(candidates, size):
            if widths[-1] != candidates[-1]:
                continue
            padding = expected_padding(fill, widths, rows_at_width, batchings)
            best = padding if best is None else min(best, padding)
    return best


def expected_padding(fill, widths, rows_at_width=None, batchings=1):
    padding = sum(min(w for w in widths if w >= f) - f for f in fill)
    if rows_at_width is not None:
        padding += sum(batchings * (rows_at_width(narrow) - 1) / 2 * (wide - narrow)
                       for narrow, wide in itertools.pairwise(widths))
    return padding


@settings(max_examples=40, deadline=None)
@given(fill=st.lists(st.integers(1, 90), min_size=1, max_size=40), count=st.integers(1, 3))
def test_chosen_widths_leave_the_least_padding(fill, count):
    widths = choose_target_widths(np.array(fill), count, 90, multiple=16)
    assert len(widths) <= count and widths[-1] == 96 and all(w % 16 == 0 for w in widths[:-1])
    assert expected_padding(fill, widths) == brute_force_padding(fill, count, 90, 16)


@settings(max_examples=40, deadline=None)
@given(fill=st.lists(st.integers(1, 90), min_size=1, max_size=60), count=st.integers(1, 4),
       budget=st.integers(100, 2000), batchings=st.integers(1, 3))
def test_chosen_widths_count_the_rows_batch_cuts_move_up(fill, count, budget, batchings):
    def rows_at_width(width):
        return max(1, budget // (32 + width))

    widths = choose_target_widths(np.array(fill), count, 90, 16, rows_at_width, batchings)
    assert len(widths) <= count and widths[-1] == 96
    expected = expected_padding(fill, widths, rows_at_width, batchings)
    assert expected == pytest.approx(brute_force_padding(fill, count, 90, 16, rows_at_width, batchings))


def test_a_width_whose_last_batch_would_move_up_more_than_it_saves_is_left_out():
    # one row of 16 and three of 32: a width of 16 saves that row 16 positions, but the cut of its batches of
    # 9 rows leaves on average 4 rows to the width of 32, which pay 16 more each
    fill = np.array([16, 32, 32, 32])
    assert choose_target_widths(fill, 2, 32, 16) == [16, 32]
    assert choose_target_widths(fill, 2, 32, 16, rows_at_width=lambda width: 9) == [32]


@settings(max_examples=40, deadline=None)
@given(fill=st.lists(st.integers(1, 128), min_size=1, max_size=60), drop_last=st.booleans())
def test_bucket_batches_cut_rows_into_the_shapes(fill, drop_last):
    fill = np.array(fill)
    buckets = ShapeBuckets.for_budget(64, [32, 64, 128], tokens_per_batch=640)
    assert buckets.rows == (6, 5, 3)
    batches = bucket_batches(fill, buckets, drop_last=drop_last, rng=np.random.default_rng(0))
    taken = np.concatenate([rows for rows, _ in batches]) if batches else np.array([], dtype=np.int64)
    assert len(set(taken.tolist())) == len(taken)
    short = [len(rows) < buckets.rows[index] for rows, index in batches]
    assert sum(short) <= (0 if drop_last else 1)
    if not drop_last:
        assert sorted(taken.tolist()) == list(range(len(fill)))
    for rows, index in batches:
        assert len(rows) <= buckets.rows[index] and fill[rows].max() <= buckets.target_widths[index]
    with pytest.raises(ValueError, match="widest bucket"):
        bucket_batches(np.array([129]), buckets)


def test_shape_buckets_hold_the_longest_target():
    collator = make_collator(64)
    with pytest.raises(ValueError, match="must hold max_target_length"):
        UL2PackedBatchSampler([100, 200], collator.objective, tokens_per_batch=400, shape_buckets=[16, 32])


def tiny_model(position_encoding="t5", backend="triton", num_layers=2):
    torch.manual_seed(0)
    config = FAT5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=num_layers, num_heads=2,
                        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                        position_encoding=position_encoding, attention_backend=backend)
    return FAT5ForConditionalGeneration(config)


def loss_and_gradients(model, batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("position_encoding", "backend"), [("t5", "triton"), ("rope", "reference")])
def test_model_with_the_collators_layout_equals_its_own(position_encoding, backend):
    """Loss and gradients with the collator's layout (row length as max_seqlen, empty rows and segments) against
    the model's own derivation from the segment ids (Triton kernels on the CPU through the interpreter)."""
    # four rows of 32 tokens: three with segments (one with two), one empty, and empty segment slots after them;
    # every slot of the capacity is a program of the varlen kernels, which the interpreter runs one by one
    batches, _ = bucketed_batches([40, 12, 30, 7], max_input_length=32, buckets=1, tokens_per_batch=256)
    batch = batches[0]
    assert (batch["segment_ids"] == 0).all(dim=1).any(), "the bucket's empty rows are part of the test"
    model = tiny_model(position_encoding, backend, num_layers=1)
    given_loss, given_gradients = loss_and_gradients(model, batch)
    derived_loss, derived_gradients = loss_and_gradients(
        model, {key: value for key, value in batch.items() if key not in LAYOUT_KEYS}
    )
    torch.testing.assert_close(given_loss, derived_loss, rtol=1e-5, atol=1e-6)
    assert given_gradients.keys() == derived_gradients.keys()
    for name, gradient in given_gradients.items():
        torch.testing.assert_close(gradient, derived_gradients[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_kernels_take_a_larger_max_seqlen(causal):
    """max_seqlen above the longest segment, and empty segments after the last: the same output and gradients."""
    torch.manual_seed(3)
    lengths = [5, 17, 0, 9]
    heads, head_dim = 2, 16
    exact = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    padded = torch.cat([exact, exact[-1:].repeat(3)])
    inputs = [torch.randn(sum(lengths), heads, head_dim, requires_grad=True) for _ in range(3)]
    table = torch.randn(8, heads, requires_grad=True)

    def run(cu_seqlens, max_seqlen):
        for tensor in (*inputs, table):
            tensor.grad = None
        output = attention_varlen(*inputs, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=causal,
                                  position_bias=PositionBias.t5(table, bidirectional=not causal, max_distance=7),
                                  backend="triton")
        output.backward(torch.linspace(-1, 1, output.numel()).view_as(output))
        return output.detach(), [tensor.grad.clone() for tensor in (*inputs, table)]

    output, gradients = run(exact, max(lengths))
    wide_output, wide_gradients = run(padded, 64)
    torch.testing.assert_close(wide_output, output, rtol=1e-5, atol=1e-6)
    for wide, narrow in zip(wide_gradients, gradients):
        torch.testing.assert_close(wide, narrow, rtol=1e-5, atol=1e-6)


def test_the_step_with_the_collators_layout_has_no_graph_break():
    """With the layout given, dynamo traces the whole forward in one graph (nothing is read back to the host); from
    the segment ids alone, the derivation's reads break it."""
    batches, _ = bucketed_batches([40, 12, 30, 7], max_input_length=32, buckets=1, tokens_per_batch=256)
    batch = batches[0]
    model = tiny_model(num_layers=1)
    torch._dynamo.reset()
    given = torch._dynamo.explain(model)(**batch)
    assert given.graph_break_count == 0, given.break_reasons
    torch._dynamo.reset()
    derived = torch._dynamo.explain(model)(**{key: value for key, value in batch.items() if key not in LAYOUT_KEYS})
    assert derived.graph_break_count > 0
    torch._dynamo.reset()


def test_given_layout_is_checked_by_name():
    batches, _ = bucketed_batches([150, 40, 12], buckets=1, tokens_per_batch=1000)
    batch = batches[0]
    model = tiny_model(backend="reference")
    with pytest.raises(ValueError, match="decoder_cu_seqlens describes packed rows"):
        model(**{**batch, "decoder_segment_ids": None})
    with pytest.raises(ValueError, match="segment_position_ids"):
        model(**{**batch, "segment_position_ids": batch["segment_position_ids"][:, :-1]})
    with pytest.raises(ValueError, match="give cu_seqlens and decoder_cu_seqlens together"):
        model(**{**batch, "decoder_cu_seqlens": None, "decoder_segment_position_ids": None})
    with pytest.raises(ValueError, match="decoder_segment_position_ids comes with decoder_cu_seqlens"):
        model(**{**batch, "decoder_cu_seqlens": None})
    with pytest.raises(ValueError, match="segments"):
        model(**{**batch, "decoder_cu_seqlens": batch["decoder_cu_seqlens"][:-1]})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_training_step_never_synchronises():
    """Forward, backward and a fused AdamW step on a packed batch with the collator's layout, bf16 autocast, under
    torch.cuda.set_sync_debug_mode("error"): any read back to the host (.item(), .tolist(), nonzero, a shape from
    data) raises."""
    batches, _ = bucketed_batches([150, 40, 12, 90, 33, 7, 61, 300, 5], buckets=1, tokens_per_batch=1000)
    model = tiny_model(backend="auto").cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    device_batches = [{key: value.pin_memory().cuda(non_blocking=True) for key, value in batch.items()}
                      for batch in batches]

    def step(batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    step(device_batches[0])  # compiles the kernels (autotuning reads timings back)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [step(batch) for batch in device_batches]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(torch.stack(losses)).all()


def test_packed_step_equals_transformers_t5_on_the_examples_one_per_row():
    """The independent truth: transformers' T5 with the same weights, each example of the fixed-shape packed batch
    in its own padded row, gives the same loss (mean over the labelled tokens) and gradients."""
    from transformers import T5Config, T5ForConditionalGeneration

    batches, _ = bucketed_batches([50, 12, 30, 7, 21, 9], max_input_length=32, buckets=1, tokens_per_batch=400)
    batch = batches[0]
    model = tiny_model(backend="reference")
    config = model.config
    t5 = T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, dropout_rate=0.0,
        feed_forward_proj=config.feed_forward_proj, tie_word_embeddings=config.tie_word_embeddings,
        decoder_start_token_id=0, pad_token_id=0,
    ))
    if not config.tie_word_embeddings and t5.lm_head.weight is t5.shared.weight:
        t5.lm_head.weight = torch.nn.Parameter(t5.shared.weight.detach().clone())
    t5.load_state_dict(model.state_dict(), strict=False)
    examples = []
    for row in range(batch["input_ids"].shape[0]):
        for segment in range(1, int(batch["segment_ids"][row].max()) + 1):
            encoder, decoder = batch["segment_ids"][row] == segment, batch["decoder_segment_ids"][row] == segment
            examples.append((batch["input_ids"][row][encoder], batch["decoder_input_ids"][row][decoder],
                             batch["labels"][row][decoder]))
    padded = {name: torch.nn.utils.rnn.pad_sequence([example[i] for example in examples], batch_first=True,
                                                    padding_value=pad)
              for i, (name, pad) in enumerate((("input_ids", 0), ("decoder_input_ids", 0), ("labels", -100)))}
    padded["attention_mask"] = torch.nn.utils.rnn.pad_sequence(
        [torch.ones(len(example[0]), dtype=torch.long) for example in examples], batch_first=True)
    padded["decoder_attention_mask"] = (padded["labels"] != -100).long()
    assert len(examples) > batch["input_ids"].shape[0] - 2, "several examples share rows"

    fat5_loss, fat5_gradients = loss_and_gradients(model, batch)
    t5_loss, t5_gradients = loss_and_gradients(t5, padded)
    torch.testing.assert_close(fat5_loss, t5_loss, rtol=1e-5, atol=1e-5)
    for name in ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                 "decoder.block.1.layer.1.EncDecAttention.q.weight", "shared.weight"):
        torch.testing.assert_close(fat5_gradients[name], t5_gradients[name], rtol=1e-4, atol=1e-6, msg=name)
