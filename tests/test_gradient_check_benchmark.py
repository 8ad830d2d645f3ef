"""benchmarks/gradient_check.py: FAT5's gradients inside a pretraining run against transformers' T5 with its weights."""

import json

import pytest
import torch
from helpers import benchmark_module


@pytest.fixture(scope="module")
def gradient_check():
    return benchmark_module("gradient_check")


def test_the_tiny_run_matches_t5_gradients_to_rounding(gradient_check, tmp_path):
    out = tmp_path / "tiny.json"
    gradient_check.main(["--tiny", "--steps", "8", "--check-from", "2", "--check-to", "3", "--max-documents", "30",
                         "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    steps = results["steps"]
    assert [row["step"] for row in steps] == [2, 3]
    assert results["stopped_after_step"] == 3  # the run ends with the last compared step, not at --steps
    for row in steps:
        # fp32 on both sides (the CPU run): the same network, the same examples, so the same loss and gradient
        assert row["loss"] == pytest.approx(row["t5_fp32_loss"], rel=1e-5)
        assert row["relative_error"]["fat5"] < 1e-5
        assert row["relative_error"]["t5_bf16"] is None and row["t5_bf16_loss"] is None
        errors = [parameter["fat5"] for parameter in row["worst_parameters"]]
        assert errors == sorted(errors, reverse=True)
    assert out.with_suffix(".png").exists()


def test_a_wrong_gradient_stands_out(gradient_check, tmp_path):
    """compare() on a packed batch of the tiny job: exact as computed, then one parameter's gradient spoilt is named
    first."""
    import argparse

    from fat5.trainer.packing import PlannedDataset

    pretrain = gradient_check.pretrain
    args = argparse.Namespace(config=None, tiny=True, shape="base", fat5_config={}, steps=4,
                              corpus_file=pretrain.write_corpus(12, tmp_path))
    job, _ = pretrain.prepare_job(args, 0, None, tmp_path / "job", extra={"model": {"z_loss": 0.0}})
    model, planned = job.model, PlannedDataset(job.batches.train)
    batches = (job.collator([planned[example] for example in plan]) for plan in job.batches.train_sampler.batches(0))
    batch = next(batch for batch in batches if int(batch["segment_ids"].max()) >= 2)  # a row holds several examples
    model(**batch).loss.backward()
    exact = gradient_check.compare(model, batch, torch.device("cpu"), bf16=False)
    assert exact["relative_error"]["fat5"] < 1e-5
    spoilt = "decoder.block.1.layer.0.SelfAttention.k.weight"
    gradient = model.get_parameter(spoilt).grad
    gradient.add_(gradient.norm() * torch.randn_like(gradient) / gradient.numel() ** 0.5)
    wrong = gradient_check.compare(model, batch, torch.device("cpu"), bf16=False)
    assert wrong["worst_parameters"][0]["name"] == spoilt
    assert wrong["worst_parameters"][0]["fat5"] == pytest.approx(1.0, rel=0.3)
    assert wrong["relative_error"]["fat5"] > 100 * exact["relative_error"]["fat5"]


def test_compared_steps_outside_the_run_are_refused(gradient_check, capsys):
    with pytest.raises(SystemExit):
        gradient_check.main(["--tiny", "--steps", "10", "--check-from", "8", "--check-to", "12"])
    assert "--check-to (12) <= --steps (10)" in capsys.readouterr().err
