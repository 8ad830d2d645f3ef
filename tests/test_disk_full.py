"""A full disk during `fat5 convert`, `fat5 pretrain` or `fat5 finetune`: one line that says the disk is full and where,
and nothing half-written. A 3 MiB tmpfs, filled but for a little, stands in for the full disk (mounting one needs root:
the tests are skipped, saying why, where it cannot be mounted)."""

import contextlib
import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import TINY_PRETRAIN, make_checkpoint


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True,
                             text=True, check=False)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def _fill(disk, leave: int) -> None:
    """Fill ``disk`` but for ``leave`` bytes."""
    free = shutil.disk_usage(disk).free
    (disk / "filler").write_bytes(b"\0" * max(free - leave, 0))


def _fat5(*args) -> subprocess.CompletedProcess:
    """`fat5 ARGS` through the command's entry, in this process (a process of its own would import torch again; the
    installed script is test_cli.py's): its exit status and what it printed, as `subprocess.run` gives them. An
    exception the command let through fails the test here as a traceback would there."""
    from fat5.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main([str(arg) for arg in args])
    return subprocess.CompletedProcess(args, status, stdout.getvalue(), stderr.getvalue())


def test_convert_on_a_full_disk(small_disk, tmp_path):
    source = make_checkpoint(tmp_path / "t5", "t5")
    _fill(small_disk, leave=20_000)
    converted = _fat5("convert", source, small_disk / "fat5")
    assert converted.returncode == 2, converted.stderr[-3000:]
    [line] = converted.stderr.strip().splitlines()
    assert line.startswith(f"fat5 convert: error: the disk holding {small_disk} is full")
    assert "nothing was written" in line
    assert sorted(path.name for path in small_disk.iterdir()) == ["filler"]


def test_pretrain_on_a_full_disk(small_disk, tmp_path):
    config = {
        **TINY_PRETRAIN,
        "training": {"max_steps": 2, "save_steps": 2, "eval_strategy": "no", "disable_tqdm": True,
                     "report_to": "none"},
    }
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    # room for the tokenizer the run trains, not for its checkpoint (weights, optimizer state)
    _fill(small_disk, leave=150_000)
    run = small_disk / "run"
    pretrained = _fat5("pretrain", tmp_path / "config.yaml", "--output-dir", run)
    assert pretrained.returncode == 2, pretrained.stderr[-3000:]
    [line] = [line for line in pretrained.stderr.strip().splitlines() if line.startswith("fat5 pretrain")]
    assert "Traceback" not in pretrained.stderr
    assert line.startswith(f"fat5 pretrain: error: the disk holding {run} is full")
    assert "checkpoint-2 was not written; no complete checkpoint is kept" in line
    # nothing half-written: no checkpoint folder, no staging folder, no final model; the resolved config and the
    # tokenizer were written whole before training
    assert sorted(path.name for path in run.iterdir()) == ["pretrain_config.yaml", "tokenizer"]


def test_finetune_on_a_full_disk(small_disk, tmp_path, tiny_model):
    speeches = Path(__file__).parent / "data" / "shakespeare_speeches.jsonl"
    config = {
        "task": "seq2seq", "model": str(tiny_model),
        "data": {"train_file": str(speeches), "validation_fraction": None, "text_column": "document",
                 "target_column": "summary", "max_target_length": 8},
        "training": {"max_steps": 1, "per_device_train_batch_size": 4, "save_strategy": "no", "use_cpu": True,
                     "disable_tqdm": True, "report_to": "none"},
    }
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    # room for the run's records, not for the final model's weights
    _fill(small_disk, leave=40_000)
    run = small_disk / "run"
    finetuned = _fat5("finetune", tmp_path / "config.yaml", "--output-dir", run)
    assert finetuned.returncode == 2, finetuned.stderr[-3000:]
    assert "Traceback" not in finetuned.stderr
    [line] = [line for line in finetuned.stderr.strip().splitlines() if line.startswith("fat5 finetune")]
    assert line.startswith(f"fat5 finetune: error: the disk holding {run} is full")
    assert "the final model was not written" in line
    assert not (run / ".final-model.tmp").exists()
    assert not (run / "model.safetensors").exists()
