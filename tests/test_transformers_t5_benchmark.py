"""benchmarks/transformers_t5.py's tiny mode, run as a user runs it (`fat5 bench transformers-t5 --tiny`): every
implementation trains on the same examples (padded, or packed for FAT5) with the same loss, and generates sdpa's
ids; the GPU run's targets are checked only on a GPU."""

import json

import pytest
import torch
from helpers import benchmark_module

from fat5.cli import main

IMPLEMENTATIONS = ["sdpa", "fat5-attention", "fat5-patched", "fat5-packed"]


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("transformers_t5") / "tiny.json"
    assert main(["bench", "transformers-t5", "--tiny", "--out", str(out)]) == 0
    return out, json.loads(out.read_text())


def test_every_implementation_trains_on_the_same_examples_to_the_same_loss(tiny_result):
    out, document = tiny_result
    training = document["results"]["training"]
    lengths = sorted({row["encoder_length"] for row in training})
    assert len(lengths) == 2
    assert sorted((row["implementation"], row["encoder_length"]) for row in training) == sorted(
        (name, length) for name in IMPLEMENTATIONS for length in lengths)
    for length in lengths:
        rows = {row["implementation"]: row for row in training if row["encoder_length"] == length}
        sdpa = rows["sdpa"]
        for name, row in rows.items():
            assert row["step_ms"] > 0 and row["tokens_per_second"] > 0 and row["peak_gib"] is None, row
            assert row["examples"] == sdpa["examples"]
            # the packed rows' loss is the padded batch's: the same examples' tokens, the same weights
            assert row["first_step_loss"] == pytest.approx(sdpa["first_step_loss"], rel=1e-5), (name, length)
        assert rows["fat5-packed"]["rows"] <= sdpa["rows"]
        assert rows["fat5-packed"]["padding_fraction"] <= sdpa["padding_fraction"]
    assert document["environment"]["command"] and document["shape"] == "tiny"
    assert out.with_suffix(".png").exists()


def test_every_implementation_generates_sdpas_ids(tiny_result):
    _, document = tiny_result
    generation = document["results"]["generation"]
    names = {row["implementation"] for row in generation}
    assert names == {"sdpa", "fat5-attention", "fat5-patched", "fat5"}
    for row in generation:
        assert row["identical_token_fraction"] == 1.0 and row["tokens_per_second"] > 0, row
    ratios = document["results"]["ratios"]
    assert {(entry["measure"], entry["implementation"]) for entry in ratios} == {
        *(("training", name) for name in IMPLEMENTATIONS[1:]),
        *(("generation (dynamic cache)", name) for name in names - {"sdpa"})}
    assert document["results"]["criteria"] == {}  # a CPU's tiny model says nothing of the GPU's targets


def test_the_targets_are_read_from_the_ratios():
    """The base-shape run's checks of issue 49's targets, on made-up rows."""
    benchmark = benchmark_module("transformers_t5")
    training = [
        {"implementation": "sdpa", "encoder_length": 1024, "tokens_per_second": 100, "peak_gib": 40.0},
        {"implementation": "fat5-patched", "encoder_length": 1024, "tokens_per_second": 260, "peak_gib": 16.0},
        {"implementation": "sdpa", "encoder_length": 4096, "tokens_per_second": None, "peak_gib": "OOM"},
        {"implementation": "fat5-patched", "encoder_length": 4096, "tokens_per_second": 90, "peak_gib": 9.0},
    ]
    generation = [
        {"implementation": "sdpa", "cache": "dynamic", "input_length": 1024, "tokens_per_second": 50},
        {"implementation": "fat5-patched", "cache": "dynamic", "input_length": 1024, "tokens_per_second": 45},
    ]
    ratios = benchmark.ratios(training, generation)
    assert benchmark.criteria(ratios, training) == {"train_1024_speed_2.5x_memory_0.5x": True,
                                                    "train_4096_sdpa_oom_or_4x": True, "generation_no_slower": False}
    training[1]["peak_gib"] = 21.0
    assert not benchmark.criteria(benchmark.ratios(training, generation), training)[
        "train_1024_speed_2.5x_memory_0.5x"]


def test_packed_rows_hold_every_example_once_with_its_shifted_decoder_inputs():
    benchmark = benchmark_module("transformers_t5")
    examples = benchmark.draw_examples(7, 32, 96, seed=3)
    batch = benchmark.packed_batch(examples, 32)
    assert batch["input_ids"].shape[1] == 32 and batch["labels"].shape[1] == 8
    found = []
    for row in range(len(batch["input_ids"])):
        for segment in batch["segment_ids"][row].unique().tolist():
            if segment:
                source = batch["input_ids"][row][batch["segment_ids"][row] == segment]
                on_decoder = batch["decoder_segment_ids"][row] == segment
                target = batch["labels"][row][on_decoder]
                assert torch.equal(batch["decoder_input_ids"][row][on_decoder], torch.cat([torch.zeros(1).long(),
                                                                                          target[:-1]]))
                found.append((source.tolist(), target.tolist()))
    assert sorted(found) == sorted((source.tolist(), target.tolist()) for source, target in examples)
