"""`fat5 pretrain`'s config and path: the path chosen and said first, the resolved config saved and reused on resume,
bad input refused before any work, and batches of one shape per step on every process."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import SMALL_PRETRAIN

from fat5.errors import FAT5Error
from fat5.trainer import pretraining as pretrain_module
from fat5.trainer.pretrain_config import COMPILED_STEP_MIN_STEPS, choose_path, load_pretrain_config
from fat5.trainer.pretraining import pretrain

CONFIGS = Path(pretrain_module.__file__).parent / "configs"


def small(**sections) -> dict:
    config = json.loads(json.dumps(SMALL_PRETRAIN))
    for name, change in sections.items():
        config[name] = {**config.get(name, {}), **change}
    return config


def test_auto_runs_eager_on_a_cpu_and_compiled_in_cuda_graphs_on_a_gpu_for_a_long_job():
    config = load_pretrain_config(small(training={"max_steps": COMPILED_STEP_MIN_STEPS}))
    on_cpu, on_gpu = choose_path(config, cuda=False), choose_path(config, cuda=True)
    assert (on_cpu.compile_mode, on_cpu.shape_buckets, on_cpu.training_arguments()) == ("none", None, {})
    assert on_cpu.describe() == ("pretraining path: eager step, batch shapes follow each batch "
                                 "(compile.mode auto: no CUDA device)")
    assert (on_gpu.compile_mode, on_gpu.shape_buckets) == ("cuda-graphs", 5)
    assert on_gpu.training_arguments() == {"torch_compile": True, "torch_compile_mode": "reduce-overhead"}
    assert on_gpu.describe().startswith("pretraining path: compiled step in CUDA graphs, 5 batch shapes")
    # shapes that follow each batch would capture a graph at nearly every step: auto keeps such a job eager
    unbucketed = load_pretrain_config(small(data={"shape_buckets": None}))
    assert choose_path(unbucketed, cuda=True).compile_mode == "none"
    # a shorter job would spend longer compiling than the compiled step saves: eager, in few shapes (each new shape
    # compiles FAT5's Triton kernels)
    short = choose_path(load_pretrain_config(SMALL_PRETRAIN), cuda=True)
    assert (short.compile_mode, short.shape_buckets) == ("none", 5)
    assert short.describe() == (
        "pretraining path: eager step, 5 batch shapes (compile.mode auto: CUDA device, but 8 steps would not repay "
        f"the compilation; auto compiles from {COMPILED_STEP_MIN_STEPS})")
    regional = load_pretrain_config(small(compile={"mode": "regional"}, data={"shape_buckets": 3}))
    assert choose_path(regional, cuda=False).training_arguments() == {"torch_compile_regional": True}
    assert choose_path(regional, cuda=False).shape_buckets == 3


def test_the_base_config_is_the_t5_v1_1_base_shape_on_the_fast_path():
    config = load_pretrain_config(CONFIGS / "pretrain_base.yaml")
    model = config.model_config(32000, pad_token_id=0, eos_token_id=1)
    assert (model.d_model, model.d_kv, model.d_ff, model.num_layers, model.num_decoder_layers, model.num_heads) == (
        768, 64, 2048, 12, 12, 12)
    assert model.is_gated_act and not model.tie_word_embeddings and model.dropout_rate == 0.0
    assert config.data.corpus == "shakespeare" and config.tokenizer.vocab_size == 32000
    assert (config.data.max_input_length, config.data.max_target_length, config.data.tokens_per_batch) == (
        1024, 1024, 32768)
    training = config.training
    assert training["bf16"] and training["optim"] == "adamw_torch_fused" and training["max_grad_norm"] == 1.0
    assert training["dataloader_num_workers"] == 4 and training["dataloader_persistent_workers"]
    assert training["accelerator_config"] == {"non_blocking": True}
    assert choose_path(config, cuda=True).describe() == (
        "pretraining path: compiled step in CUDA graphs, 5 batch shapes (compile.mode auto: CUDA device)")
    minipile = load_pretrain_config(CONFIGS / "pretrain_minipile.yaml")
    assert choose_path(minipile, cuda=True).compile_mode == "cuda-graphs"


@pytest.mark.parametrize("change, message", [
    ({"training": {"output_dir": "elsewhere"}}, r"training.output_dir is not set here: the output folder is --output"),
    ({"data": {"max_input_lenght": 64}}, r"data: unknown key\(s\) \['max_input_lenght'\]"),
    ({"compile": {"mode": "fast"}}, r"compile.mode must be one of"),
    ({"compile": {"cache": "/tmp"}}, r"compile: unknown key\(s\) \['cache'\]"),
    ({"training": {"torch_compile": True}}, r"training.torch_compile is not set here: the compile section sets it"),
    # rows hold up to max_target_length (32) decoder tokens
    ({"data": {"shape_buckets": [8, 16]}}, r"data.shape_buckets \[8, 16\] cannot hold the longest UL2 target.*32"),
    ({"data": {"shape_buckets": "many"}}, r"data.shape_buckets must be auto, null"),
    ({"compile": {"mode": "cuda-graphs"}}, r"compile.mode cuda-graphs needs a CUDA device"),
])
def test_bad_input_is_named_before_any_work(tmp_path, monkeypatch, change, message):
    """Refused before the corpus is read or a tokenizer trained, with the output folder left unmade."""
    def no_work(*args, **kwargs):
        raise AssertionError("the job started working on an invalid config")

    monkeypatch.setattr(pretrain_module, "load_corpus", no_work)
    monkeypatch.setattr(pretrain_module, "_trains_on_cuda", lambda settings: False)
    with pytest.raises(FAT5Error, match=message):
        pretrain(small(**change), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_unwritable_compile_cache_is_named_before_any_work(tmp_path, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the job started working with an unwritable cache")

    monkeypatch.setattr(pretrain_module, "load_corpus", no_work)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    config = small(compile={"mode": "default", "cache_dir": str(blocker / "cache")})
    with pytest.raises(FAT5Error, match=r"compile.cache_dir .*a-file/cache is not writable"):
        pretrain(config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_bad_input_is_one_line_and_a_failing_exit(tmp_path, capsys):
    """The command's entry, in this process (test_cli.py runs the installed script): an exception it let through
    would fail the test here as a traceback would there."""
    from fat5.cli import main

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(small(training={"output_dir": "x"})))
    assert main(["pretrain", str(config), "--output-dir", str(tmp_path / "out")]) != 0
    [line] = capsys.readouterr().err.splitlines()
    assert "training.output_dir is not set here" in line
    assert not (tmp_path / "out").exists()


def test_the_resolved_config_is_saved_said_first_and_reused_on_resume(tmp_path, capfd):
    config = small(training={"max_steps": 2, "save_steps": 2})
    output = tmp_path / "run"
    pretrain(config, output)
    first_line = capfd.readouterr().out.splitlines()[0]
    assert first_line == ("pretraining path: eager step, batch shapes follow each batch "
                          "(compile.mode auto: no CUDA device)")
    saved = yaml.safe_load((output / "pretrain_config.yaml").read_text())
    assert saved["resolved"]["compile_mode"] == "none" and saved["resolved"]["shape_buckets"] is None
    assert saved["data"]["max_input_length"] == 64 and saved["compile"]["mode"] == "auto"
    # defaults filled in: keys the config did not give
    assert saved["data"]["split"] == "train" and saved["training"]["lr_scheduler_type"] == "cosine"
    assert not list(output.glob(".*.tmp"))

    # resumed without a config: the saved one (the built-in default would build a d_model-128 model for 300 steps)
    summary = pretrain(None, output, resume=True)
    assert summary["steps"] < 300 and json.loads((output / "config.json").read_text())["d_model"] == 32
    with pytest.raises(FAT5Error, match=r"--resume: training.learning_rate differ\(s\) from the run's config"):
        pretrain(small(training={"max_steps": 2, "save_steps": 2, "learning_rate": 5e-3}), output, resume=True)


def _batches(shape_group: int):
    from fat5.trainer.packing import UL2PackedBatchSampler
    from fat5.trainer.ul2 import UL2Objective

    objective = UL2Objective(sentinel_ids=list(range(100, 164)), prefix_ids={"[R]": 3, "[S]": 4, "[X]": 5}, eos_id=1,
                             max_input_length=128, max_target_length=64)
    lengths = np.random.default_rng(0).integers(20, 600, size=400)
    return UL2PackedBatchSampler(lengths, objective, tokens_per_batch=1024, shape_buckets=4, pool_size=100,
                                 shape_group=shape_group)


def test_every_process_trains_one_shape_at_each_step():
    """Under two processes (accelerate takes batches r, r + 2, ... for process r) both train a batch of one shape at
    every step; ungrouped, consecutive batches differ in shape."""
    from accelerate.data_loader import BatchSamplerShard

    def shape(batch):
        return batch[0].batch_rows, batch[0].target_width

    ungrouped = _batches(1)
    assert len({shape(batch) for batch in ungrouped}) == 4
    assert any(shape(a) != shape(b) for a, b in zip(ungrouped.batches()[::2], ungrouped.batches()[1::2]))
    sampler = _batches(2)
    ranks = [list(BatchSamplerShard(sampler, num_processes=2, process_index=rank)) for rank in range(2)]
    assert len(ranks[0]) == len(ranks[1]) > 10
    assert all(shape(a) == shape(b) for a, b in zip(*ranks))
    # every batch is the ungrouped sampler's, each used once; at most one batch of each shape left out
    planned = {tuple(example.rng_key) for batch in ungrouped.batches() for example in batch}
    grouped = [batch[0].rng_key for batch in sampler.batches()]
    assert len(set(grouped)) == len(grouped) and set(grouped) <= planned
    assert len(ungrouped) - len(sampler) <= 4
    four = _batches(4).batches()
    assert all(len({shape(batch) for batch in four[start : start + 4]}) == 1 for start in range(0, len(four), 4))
