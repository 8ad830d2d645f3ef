"""benchmarks/pretrain.py's CPU paths: ``--padding-plan`` (no training) and ``--profile`` on the ``--tiny`` job."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pretrain_benchmark():
    specification = importlib.util.spec_from_file_location("pretrain_benchmark", REPO / "benchmarks" / "pretrain.py")
    module = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(module)
    return module


def test_padding_plan_counts_the_positions_of_each_bucket_count(pretrain_benchmark, tmp_path):
    out = tmp_path / "padding.json"
    pretrain_benchmark.main(["--padding-plan", "--padding-shapes", "tiny", "--max-buckets", "3", "--padding-epochs",
                             "1", "--max-documents", "40", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    plans = results["padding_plan"]["tiny"]
    assert [plan["buckets"] for plan in plans] == [1, 2, 3]
    # one bucket: the widest decoder, 128 like the encoder rows, so 2048 positions a batch hold 8 rows
    assert plans[0]["batch_shapes"] == [[8, 128, 128]]
    # equal encoder and decoder widths: the overall padding is the mean of the two sides'
    expected = (plans[0]["encoder_padding"] + plans[0]["decoder_padding"]) / 2
    assert plans[0]["padding_fraction"] == pytest.approx(expected, abs=1e-4)
    within = [plan["buckets"] for plan in plans if plan["padding_fraction"] <= 0.05]
    assert results["fewest_buckets_within_target"]["tiny"] == (within[0] if within else None)
    assert out.with_suffix(".png").exists()


@pytest.mark.slow  # five training steps of the tiny model through the Trainer: 20-30 s on two shared cores
def test_profile_takes_the_last_steps_apart_and_leaves_them_out_of_the_throughput(pretrain_benchmark, tmp_path):
    out = tmp_path / "tiny.json"
    pretrain_benchmark.main(["--tiny", "--runs", "fat5", "--steps", "5", "--profile", "1", "--max-documents", "40",
                             "--out", str(out)])
    (run,) = json.loads(out.read_text())["results"]["runs"]
    profile = run["profile"]
    assert profile["profiled_steps"] == [5, 5]
    assert profile["host_enqueue_ms"] > 0 and profile["device_ms"] is None  # no device events on a CPU
    assert any("mm" in operator for operator in profile["host_operator_ms"])
    # step 4 is timed alone from the end of step 3: the windows from there on are left out
    assert [window["profiled"] for window in run["windows"]] == [window["last_step"] >= 3 for window in run["windows"]]
    assert run["windows"][-1]["profiled"] and not run["windows"][0]["profiled"]
    assert "fat5, seed 0" in (tmp_path / "tiny_profile.txt").read_text()
