"""benchmarks/pretrain.py's CPU paths: the ``--tiny`` job against its peers, ``--padding-plan`` (no training) and
``--profile``."""

import functools
import json

import pytest
from helpers import benchmark_module


@pytest.fixture(scope="module")
def pretrain_benchmark():
    return benchmark_module("pretrain")


@pytest.mark.slow  # the tiny job, its two peers and a restarted job in a fresh process: 1-2 min on two shared cores
def test_the_tiny_job_and_its_peers_train_on_the_same_examples(pretrain_benchmark, tmp_path):
    out = tmp_path / "tiny.json"
    pretrain_benchmark.main(["--tiny", "--restart", "--steps", "4", "--max-documents", "30", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    runs = {run["path"]: run for run in results["runs"]}
    assert sorted(runs) == ["fat5", "transformers", "transformers_compiled"]
    for run in runs.values():
        assert run["steps"] == 4 and run["tokens_per_second"] > 0 and "error" not in run
    # the peers take each step's examples from the job's own packed batch: the same real tokens, step by step
    assert runs["transformers"]["real_tokens"] == runs["fat5"]["real_tokens"]
    assert runs["transformers_compiled"]["real_tokens"] == runs["fat5"]["real_tokens"]
    # fixed shapes: the compiled peer's micro-batches take the job's batch shapes, one graph each
    shapes = {tuple(shape) for shape in runs["transformers_compiled"]["micro_batch_shapes"]}
    assert shapes == {tuple(shape) for shape in results["batch_shapes"]}
    assert {entry["shape"] for entry in runs["transformers_compiled"]["first_step_seconds_by_shape"]} <= {
        "x".join(map(str, shape)) for shape in shapes}
    # FAT5's loss holds the z-loss; its cross-entropy part is what the peers' curves are compared with
    assert all(loss > part for loss, part in zip(runs["fat5"]["loss"], runs["fat5"]["cross_entropy"]))
    (pair,) = results["loss_agreement"]["pairs"]
    for peer in ("transformers", "transformers_compiled"):
        assert pair[f"fat5_vs_{peer}"]["steps_compared"] == 4
        assert pair[f"fat5_vs_{peer}"]["max"] < 1e-3  # fp32 on a CPU, the same weights and examples
        assert results[f"fat5_over_{peer}_tokens_per_second"] > 0
    restart = results["restart"]
    assert restart["steps"] == 2 and restart["warm_prepare_seconds"] > 0 and restart["cold_prepare_seconds"] > 0
    cold = {entry["shape"] for entry in runs["fat5"]["first_step_seconds_by_shape"]}
    assert restart["first_step_seconds"] and all(
        entry["shape"] in cold and entry["cold"] > 0 and entry["warm"] > 0 for entry in restart["first_step_seconds"])
    assert out.with_suffix(".png").exists()


def test_padding_plan_counts_the_positions_of_each_bucket_count(pretrain_benchmark, tmp_path):
    out = tmp_path / "padding.json"
    pretrain_benchmark.main(["--padding-plan", "--tiny", "--max-buckets", "3", "--padding-epochs", "1",
                             "--max-documents", "30", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    plans = results["padding_plan"]["tiny"]
    assert [plan["buckets"] for plan in plans] == [1, 2, 3]
    assert [len(plan["batch_shapes"]) for plan in plans] == [1, 2, 3]
    # one bucket: rows of the config's 128 encoder tokens and one decoder width
    ((rows, encoder, decoder),) = plans[0]["batch_shapes"]
    assert encoder == 128 and rows * (encoder + decoder) <= results["tokens_per_batch"]
    # the overall padding is the two sides' weighted by their widths
    expected = (plans[0]["encoder_padding"] * encoder + plans[0]["decoder_padding"] * decoder) / (encoder + decoder)
    assert plans[0]["padding_fraction"] == pytest.approx(expected, abs=1e-3)
    within = [plan["buckets"] for plan in plans if plan["padding_fraction"] <= 0.05]
    assert results["fewest_buckets_within_target"]["tiny"] == (within[0] if within else None)
    assert out.with_suffix(".png").exists()


@pytest.mark.slow  # five training steps of the tiny model through the Trainer: 20-30 s on two shared cores
def test_profile_takes_the_last_steps_apart_and_leaves_them_out_of_the_throughput(pretrain_benchmark, tmp_path):
    out = tmp_path / "tiny.json"
    pretrain_benchmark.main(["--tiny", "--runs", "fat5", "--steps", "5", "--profile", "1", "--max-documents", "30",
                             "--out", str(out)])
    (run,) = json.loads(out.read_text())["results"]["runs"]
    profile = run["profile"]
    assert profile["profiled_steps"] == [5, 5]
    assert profile["host_enqueue_ms"] > 0 and profile["device_ms"] is None  # no device events on a CPU
    assert any("mm" in operator for operator in profile["host_operator_ms"])
    # the costliest operators outside CUDA graphs, each with the Python lines that called it
    assert all(key.startswith("aten::") and ".py(" in key for key in profile["operator_callers_ms"])
    # step 4 is timed alone from the end of step 3: the windows from there on are left out
    assert [window["profiled"] for window in run["windows"]] == [window["last_step"] >= 3 for window in run["windows"]]
    assert run["windows"][-1]["profiled"] and not run["windows"][0]["profiled"]
    assert "fat5, seed 0" in (tmp_path / "tiny_profile.txt").read_text()
    # the profiled step's FLOPs split by the docstring's formula: products and attention both count
    assert run["profiled_gflop_per_step"]["dense"] > 0 and run["profiled_gflop_per_step"]["attention"] > 0
    assert 0 < run["attention_flops_fraction"] < 0.5


def test_time_bounds_of_a_hand_made_profile(pretrain_benchmark):
    # 40 + 10 TFLOP a step on 100 ms of kernels: products 60 ms, attention 5 + 20 ms, optimizer 4 ms, the rest 11 ms
    run = {"profiled_gflop_per_step": {"dense": 40e3, "attention": 10e3},
           "profile": {"kernel_ms_by_kind": {"matrix products": 60.0, "attention forward": 5.0,
                                             "attention backward": 20.0, "optimizer": 4.0, "RMSNorm": 11.0}}}
    bounds = pretrain_benchmark.time_bounds(run, attention_tflops=500.0, peak_tflops=1000.0, target_mfu=0.45)
    assert bounds["achieved_tflops"] == {"matrix products": pytest.approx(666.7, abs=0.1), "attention": 400.0}
    assert bounds["mfu_kernels"] == 0.5
    # attention at 500 TFLOP/s takes 20 ms instead of 25: 50 TFLOP in 95 ms at a 1000 TFLOP/s peak
    assert bounds["mfu_attention_at_bound"] == pytest.approx(50 / 95, abs=1e-4)
    # products 60 + attention 20 + optimizer 4
    assert bounds["step_ms"]["products_attention_at_bound_optimizer_only"] == 84.0
    assert bounds["mfu_products_attention_at_bound_optimizer_only"] == pytest.approx(50 / 84, abs=1e-4)
    assert bounds["step_ms"]["at_target_mfu"] == pytest.approx(50 / 450 * 1e3, abs=0.01)


def test_fat5_config_overrides_name_a_field_and_a_literal(pretrain_benchmark):
    import argparse

    parser = argparse.ArgumentParser()
    assert pretrain_benchmark.parse_config_overrides(parser, ["use_fused_rms_norm=False", "z_loss=1e-4"]) == {
        "use_fused_rms_norm": False, "z_loss": 1e-4}
    for bad in ("no_such_field=1", "use_fused_rms_norm", "use_fused_rms_norm=maybe"):
        with pytest.raises(SystemExit):
            pretrain_benchmark.parse_config_overrides(parser, [bad])


def result_file(path, runs, shape="base"):
    document = {"environment": {"gpu": "test", "date": "today"}, "shape": shape, "model": {}, "data": {"rows": 1},
                "results": {"runs": runs, "batch_shapes": [[1, 8, 8]], "vocab_size": 128, "tokens_per_batch": 64}}
    path.write_text(json.dumps(document))
    return str(path)


def run(path, seed, loss, tokens_per_second):
    return {"path": path, "initialization": "t5x", "seed": seed, "steps": len(loss), "loss": loss,
            "tokens_per_second": tokens_per_second,
            "windows": [{"last_step": len(loss), "tokens_per_second": tokens_per_second}]}


def test_merged_runs_compare_speed_and_loss_curves_against_two_seeds(pretrain_benchmark, tmp_path):
    reference = [10.0 - 0.1 * step for step in range(40)]
    other_seed = [value * (1.02 if step % 2 else 0.98) for step, value in enumerate(reference)]
    # transformers' curve 0.5% off FAT5's until it turns NaN at step 31
    transformers = [value * 1.005 for value in reference[:30]] + [float("nan")] * 10
    profiled = dict(run("fat5", 0, reference, 600.0), profiled_gflop_per_step={"dense": 40e3, "attention": 10e3},
                    profile={"kernel_ms_by_kind": {"matrix products": 60.0, "attention backward": 40.0},
                             "kernel_ms": 100.0, "device_ms": 101.0, "host_enqueue_ms": 20.0,
                             "host_synchronisations": 0,
                             "time_bounds": {"attention_bound_tflops": 500.0, "peak_tflops": 1000.0,
                                             "mfu_kernels": 0.123}})
    first = result_file(tmp_path / "a.json", [profiled, run("fat5", 1, other_seed, 610.0)])
    second = result_file(tmp_path / "b.json", [run("transformers", 0, transformers, 150.0)])
    out = tmp_path / "merged.json"
    pretrain_benchmark.main(["--merge", first, second, "--smoothing", "4", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [entry["source"] for entry in results["runs"]] == [first, first, second]
    # a stale bound is recomputed from the stored profile: 50 TFLOP on 100 ms of kernels at a 1000 TFLOP/s peak
    bounds = results["runs"][0]["profile"]["time_bounds"]
    assert bounds["mfu_kernels"] == 0.5 and bounds["target_mfu"] == 0.45 and bounds["attention_bound_tflops"] == 500
    assert results["fat5_over_transformers_tokens_per_second"] == 4.0
    (pair,) = results["loss_agreement"]["pairs"]
    between, noise = pair["fat5_vs_transformers"], pair["fat5_seed_1_vs_0"]
    assert between["steps_compared"] == noise["steps_compared"] == 30
    assert between["max"] == pytest.approx(0.005 / 1.005, rel=1e-2)  # |f - 1.005 f| / (1.005 f)
    assert noise["max"] == pytest.approx(0.02, rel=1e-2)
    # the seeds' alternating +-2% nearly cancels in a 4-step mean; the 0.5% offset does not: outside the noise
    assert between["smoothed_mean"] > noise["smoothed_mean"] and pair["within_seed_noise"] is False
    assert out.with_suffix(".png").exists()


def test_merge_refuses_other_shapes_and_overwriting_its_inputs(pretrain_benchmark, tmp_path):
    base = result_file(tmp_path / "base.json", [run("fat5", 0, [1.0] * 5, 1.0)])
    small = result_file(tmp_path / "small.json", [run("fat5", 0, [1.0] * 5, 1.0)], shape="small")
    with pytest.raises(SystemExit, match="differ in their shape"):
        pretrain_benchmark.main(["--merge", base, small, "--out", str(tmp_path / "out.json")])
    with pytest.raises(SystemExit):
        pretrain_benchmark.main(["--merge", base, "--out", base])
    with pytest.raises(SystemExit, match="cannot read .*missing.json"):
        pretrain_benchmark.main(["--merge", base, str(tmp_path / "missing.json"), "--out", str(tmp_path / "out.json")])
    (tmp_path / "padding.json").write_text(json.dumps({"results": {"padding_plan": {}}}))
    with pytest.raises(SystemExit, match="not a pretraining result"):
        pretrain_benchmark.main(["--merge", base, str(tmp_path / "padding.json"), "--out", str(tmp_path / "out.json")])


def test_the_transformers_path_takes_each_epoch_as_the_trainer_takes_fat5s(pretrain_benchmark):
    """The Trainer takes from every epoch as many batches as the first epoch's loader held; the transformers path,
    whose loader has no length, takes the same: at most the first epoch's count, all of a shorter epoch."""
    import pretrain_peers  # importable once pretrain.py put benchmarks/ on the path
    import torch

    class Sampler:
        batches_by_epoch = (3, 4, 2)

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __len__(self):
            return self.batches_by_epoch[self.epoch]

        def __iter__(self):
            return iter([[self.epoch * 10 + batch] for batch in range(len(self))])

    def collator(examples):  # one packed example a batch, its token the batch's id
        token = int(examples[0]["input_ids"][0])
        return {"segment_ids": torch.tensor([[1]]), "decoder_segment_ids": torch.tensor([[1]]),
                "input_ids": torch.tensor([[token]]), "decoder_input_ids": torch.tensor([[0]]),
                "labels": torch.tensor([[token]])}

    dataset = [{"input_ids": [index]} for index in range(30)]
    split = functools.partial(pretrain_peers.chunked, chunks=1, pad_token_id=0)
    steps = pretrain_peers.UnpackedSteps(dataset, Sampler(), collator, split)
    taken = []
    for epoch in range(3):
        steps.set_epoch(epoch)
        taken.append([int(batch["input_ids"][0, 0]) for batch in steps])
    assert taken == [[0, 1, 2], [10, 11, 12], [20, 21]]
