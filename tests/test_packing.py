"""Packing and the UL2 collator: batch format, packed == padded content, padding on a realistic corpus."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from transformers.models.bart.modeling_bart import shift_tokens_right

from fat5.trainer.collator import UL2DataCollator
from fat5.trainer.data import shakespeare_texts
from fat5.trainer.packing import (
    PackedStreamDataset,
    PlannedDataset,
    UL2PackedBatchSampler,
    batch_rows,
    pack_rows,
    packed_stream,
    padding_stats,
)
from fat5.trainer.tokenizer import train_tokenizer
from fat5.trainer.ul2 import UL2Objective

SENTINELS = np.arange(4095, 4095 - 256, -1)
PREFIXES = {"[R]": 3, "[S]": 4, "[X]": 5}


def make_collator(packed, max_input_length=256, **kwargs):
    objective = UL2Objective(
        sentinel_ids=SENTINELS,
        prefix_ids=PREFIXES,
        eos_id=1,
        max_input_length=max_input_length,
        max_target_length=max_input_length if packed else None,
    )
    return UL2DataCollator(objective=objective, packed=packed, pad_token_id=0, **kwargs)


@pytest.fixture(scope="module")
def shakespeare_scenes():
    """Scenes of the built-in corpus tokenized with a small BPE: a few dozen to several thousand tokens."""
    texts = list(shakespeare_texts())
    tokenizer = train_tokenizer(texts[::8], vocab_size=1024, num_sentinels=8, model="bpe")
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return [np.asarray(x, dtype=np.int64) + 0 for x in ids]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(3, 64), st.integers(1, 64)), min_size=1, max_size=80))
def test_pack_rows_respects_both_budgets(lengths):
    inputs, targets = (np.array(x) for x in zip(*lengths))
    rows, num_rows = pack_rows(inputs, targets, 64, 64)
    assert rows.min() == 0 and rows.max() == num_rows - 1
    assert np.bincount(rows, weights=inputs).max() <= 64
    assert np.bincount(rows, weights=targets).max() <= 64
    assert num_rows >= np.ceil(max(inputs.sum(), targets.sum()) / 64)
    with pytest.raises(ValueError, match="exceeds the row budget"):
        pack_rows(np.array([65]), np.array([1]), 64, 64)


def test_batch_rows_token_budget():
    fill = np.array([10, 200, 30, 190, 20, 180, 60])
    batches = batch_rows(fill, tokens_per_batch=2 * (64 + 200), input_width=64, pad_to_multiple_of=8)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(fill)))
    for rows in batches:
        width = -(-fill[rows].max() // 8) * 8
        assert len(rows) == 1 or len(rows) * (64 + width) <= 2 * (64 + 200)
        assert fill[rows].max() - fill[rows].min() <= 60  # grouped by length
    with pytest.raises(ValueError, match="exactly one"):
        batch_rows(fill)


def test_padded_batch_format():
    collator = make_collator(packed=False, seed=3)
    rng = np.random.default_rng(0)
    features = [{"input_ids": rng.integers(6, 3000, size=n).tolist()} for n in (5, 40, 254, 300, 1)]
    batch = collator(features)
    assert set(batch) == {"input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "labels"}
    assert all(v.dtype == torch.long for v in batch.values())
    assert batch["input_ids"].shape[1] <= 256 and batch["input_ids"].shape[1] % 8 == 0
    assert ((batch["input_ids"] != 0) == batch["attention_mask"].bool()).all()
    assert ((batch["labels"] != -100) == batch["decoder_attention_mask"].bool()).all()
    expected = shift_tokens_right(batch["labels"], pad_token_id=0, decoder_start_token_id=0)
    assert torch.equal(batch["decoder_input_ids"], expected)
    lengths = batch["attention_mask"].sum(1)
    assert (batch["input_ids"][torch.arange(5), lengths - 1] == 1).all()  # EOS closes every input
    first = batch["input_ids"][:, 0].tolist()
    assert set(first) <= set(PREFIXES.values())


def test_packed_rows_hold_the_same_examples_as_padded_rows():
    padded = make_collator(packed=False, return_tensors="np")
    packed = make_collator(packed=True, return_tensors="np")
    rng = np.random.default_rng(1)
    sequences = [rng.integers(6, 3000, size=n) for n in rng.integers(1, 240, size=40)]
    plan = padded.objective.plan(np.array([len(s) for s in sequences]), rng)
    rows, num_rows = pack_rows(plan.input_length, plan.target_length, 256, 256)
    one = padded.collate_plan(sequences, plan, None, np.random.default_rng(9))
    many = packed.collate_plan(sequences, plan, rows, np.random.default_rng(9))
    assert set(many) == {"input_ids", "segment_ids", "decoder_input_ids", "decoder_segment_ids", "labels",
                         "cu_seqlens", "segment_position_ids", "decoder_cu_seqlens", "decoder_segment_position_ids"}
    assert many["segment_ids"].dtype == np.int32 and many["decoder_segment_ids"].dtype == np.int32
    assert many["input_ids"].shape[0] == num_rows < len(sequences)
    for row in range(num_rows):
        members = np.flatnonzero(rows == row)
        segments = many["segment_ids"][row]
        decoder_segments = many["decoder_segment_ids"][row]
        # Segments are 1..n, contiguous, left-aligned, then padding 0; the decoder has the same n.
        n = len(members)
        for seg_ids in (segments, decoder_segments):
            used = seg_ids[seg_ids > 0]
            assert (np.diff(used) >= 0).all() and set(used.tolist()) == set(range(1, n + 1))
            assert (seg_ids[len(used) :] == 0).all()
        for s, example in enumerate(members, start=1):
            real = one["attention_mask"][example].astype(bool)
            assert np.array_equal(many["input_ids"][row][segments == s], one["input_ids"][example][real])
            labels = one["labels"][example][one["labels"][example] != -100]
            assert np.array_equal(many["labels"][row][decoder_segments == s], labels)
            decoder_inputs = many["decoder_input_ids"][row][decoder_segments == s]
            assert decoder_inputs[0] == 0 and np.array_equal(decoder_inputs[1:], labels[:-1])
        assert (many["labels"][row][decoder_segments == 0] == -100).all()
        assert (many["input_ids"][row][segments == 0] == 0).all()


def test_naive_collator_is_deterministic_under_its_seed():
    rng = np.random.default_rng(2)
    features = [{"input_ids": rng.integers(6, 3000, size=n)} for n in (50, 120, 200)]
    first = make_collator(packed=True, seed=5)(features)
    again = make_collator(packed=True, seed=5)(features)
    other = make_collator(packed=True, seed=6)(features)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(first[k].shape == other[k].shape and torch.equal(first[k], other[k]) for k in first)
    with pytest.raises(ValueError, match="empty"):
        make_collator(packed=True)([])


def naive_padding(sequences, max_input_length, batch_size, seed=0):
    """Padding of one example per row, random batches padded to their longest example (sources truncated)."""
    collator = make_collator(packed=False, max_input_length=max_input_length, seed=seed)
    order = np.random.default_rng(seed).permutation(len(sequences))
    real = positions = 0
    for start in range(0, len(order), batch_size):
        stats = padding_stats(collator([sequences[i] for i in order[start : start + batch_size]]))
        real += stats["input_tokens"] + stats["target_tokens"]
        positions += (stats["input_tokens"] + stats["target_tokens"]) / (1 - stats["padding_fraction"])
    return 1 - real / positions


def total_padding(batches):
    stats = [padding_stats(b) for b in batches]
    real = sum(s["input_tokens"] + s["target_tokens"] for s in stats)
    positions = sum((s["input_tokens"] + s["target_tokens"]) / (1 - s["padding_fraction"]) for s in stats)
    return 1 - real / positions, real


def test_packing_cuts_padding_on_shakespeare(shakespeare_scenes):
    sequences = shakespeare_scenes
    collator = make_collator(packed=True, max_input_length=512)
    sampler = UL2PackedBatchSampler(
        [len(s) for s in sequences], collator.objective, tokens_per_batch=16 * 1024, pool_size=1000, seed=0
    )
    loader = DataLoader(PlannedDataset(sequences), batch_sampler=sampler, collate_fn=collator)
    batches = list(loader)
    padding, _ = total_padding(batches)
    naive = naive_padding(sequences, 512, batch_size=16)
    print(f"Shakespeare scenes, 512-token rows: packed padding {padding:.2%}, naive padding {naive:.2%}")
    assert padding <= 0.05
    assert naive > 2 * padding
    for batch in batches:
        assert batch["input_ids"].shape[1] <= 512 and batch["labels"].shape[1] <= 512
        assert batch["input_ids"].numel() + batch["labels"].numel() <= 16 * 1024 or batch["input_ids"].shape[0] == 1
    # Every source token is used once: pieces tile the sources (tails shorter than min_length dropped).
    pieces = [p for b in sampler.batches() for p in b]
    used = np.zeros(len(sequences), dtype=np.int64)
    np.add.at(used, [p.source for p in pieces], [p.length for p in pieces])
    assert (np.array([len(s) for s in sequences]) - used < collator.objective.min_length).all()


def test_packing_on_a_lognormal_corpus():
    rng = np.random.default_rng(4)
    lengths = np.clip(rng.lognormal(mean=5.5, sigma=1.2, size=3000).astype(int), 1, 20_000)
    sequences = [rng.integers(6, 3000, size=n) for n in lengths]
    collator = make_collator(packed=True, max_input_length=1024)
    stream = packed_stream(sequences, collator, tokens_per_batch=32 * 1024, pool_size=1500, seed=1)
    padding, _ = total_padding(stream)
    naive = naive_padding(sequences, 1024, batch_size=16)
    print(
        f"log-normal lengths (median {np.median(lengths):.0f}), 1024-token rows: packed {padding:.2%}, "
        f"naive {naive:.2%}"
    )
    assert padding <= 0.05 < naive


def test_sampler_is_deterministic_and_reproducible_across_workers(shakespeare_scenes):
    sequences = shakespeare_scenes[:120]
    collator = make_collator(packed=True, max_input_length=256)
    lengths = [len(s) for s in sequences]

    def batches(num_workers, epoch):
        sampler = UL2PackedBatchSampler(lengths, collator.objective, rows_per_batch=4, pool_size=64, seed=3)
        sampler.set_epoch(epoch)
        loader = DataLoader(
            PlannedDataset(sequences), batch_sampler=sampler, collate_fn=collator, num_workers=num_workers
        )
        return list(loader)

    first, again, parallel, next_epoch = batches(0, 0), batches(0, 0), batches(2, 0), batches(0, 1)
    assert len(first) == len(again) == len(parallel)
    for a, b, c in zip(first, again, parallel):
        assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    assert not all(
        a["input_ids"].shape == b["input_ids"].shape and torch.equal(a["input_ids"], b["input_ids"])
        for a, b in zip(first, next_epoch)
    )
    assert all(b["input_ids"].shape[0] <= 4 for b in first)


def test_mixed_planned_and_plain_features_are_refused(shakespeare_scenes):
    collator = make_collator(packed=True)
    sampler = UL2PackedBatchSampler([len(s) for s in shakespeare_scenes[:10]], collator.objective, rows_per_batch=2)
    planned = PlannedDataset(shakespeare_scenes[:10])
    features = [planned[p] for p in next(iter(sampler))]
    with pytest.raises(ValueError, match="every feature or none"):
        collator([*features, {"input_ids": [7, 8, 9]}])


def test_stream_dataset_in_a_dataloader_with_workers():
    rng = np.random.default_rng(8)
    sequences = [rng.integers(6, 3000, size=n) for n in rng.integers(1, 700, size=300)]
    collator = make_collator(packed=True, max_input_length=256)
    dataset = PackedStreamDataset(sequences, collator, rows_per_batch=4, pool_size=100, seed=2)
    total = sum(len(s) for s in sequences)
    for workers in (0, 2):
        batches = list(DataLoader(dataset, batch_size=None, num_workers=workers))
        assert all(b["input_ids"].shape[0] <= 4 and "segment_ids" in b for b in batches)
        # Every source token is used once: inputs + targets = source + 2 per sentinel + prefix and two EOS; only
        # tails shorter than min_length (2) are dropped, at most one token per source.
        inputs = sum(int((b["segment_ids"] > 0).sum()) for b in batches)
        targets = sum(int((b["labels"] != -100).sum()) for b in batches)
        examples = sum(int(b["segment_ids"].max(dim=1).values.sum()) for b in batches)
        sentinels = sum(int(np.isin(b["input_ids"].numpy(), SENTINELS).sum()) for b in batches)
        dropped = total + 2 * sentinels + 3 * examples - (inputs + targets)
        assert 0 <= dropped <= len(sequences)
    again = list(DataLoader(dataset, batch_size=None, num_workers=0))
    first = list(DataLoader(dataset, batch_size=None, num_workers=0))
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(first, again))


def test_collator_reads_the_mixture_and_options_from_yaml(tmp_path):
    from fat5.trainer.tokenizer import train_tokenizer as train

    tokenizer = train((t for t, _ in zip(shakespeare_texts(), range(20))), vocab_size=300, num_sentinels=16)
    config = tmp_path / "ul2.yaml"
    config.write_text(
        "ul2:\n  denoisers:\n    - {prefix: '[X]', r: 0.5, mu: 2.0}\n  proportions: [1.0]\n"
        "  placement: t5\n  span_count_rounding: nearest\n"
    )
    collator = UL2DataCollator(tokenizer, mixture=str(config), max_input_length=64)
    assert collator.objective.placement == "t5" and collator.objective.span_count_rounding == "nearest"
    assert UL2DataCollator(tokenizer, mixture=str(config), placement="uniform").objective.placement == "uniform"
    batch = collator([list(range(10, 40))])
    assert batch["input_ids"][0, 0] == tokenizer.convert_tokens_to_ids("[X]")
    # T5 placement: the last source token is always noise, so the input ends <extra_id_k> </s>.
    length = int(batch["attention_mask"][0].sum())
    assert int(batch["input_ids"][0, length - 2]) in sentinel_ids_of(tokenizer)


def sentinel_ids_of(tokenizer):
    from fat5.trainer.tokenizer import sentinel_token_ids

    return set(sentinel_token_ids(tokenizer).tolist())
