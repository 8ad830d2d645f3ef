"""A full disk during `fat5 convert` or `fat5 pretrain`: one line that says the disk is full and where, and nothing
half-written. A 3 MiB tmpfs, filled but for a little, stands in for the full disk (mounting one needs root: the
tests are skipped, saying why, where it cannot be mounted)."""

import json
import os
import shutil
import subprocess
import sys

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


def _fat5(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fat5.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=900, cwd=cwd, check=False)


def test_convert_on_a_full_disk(small_disk, tmp_path):
    source = make_checkpoint(tmp_path / "t5", "t5")
    _fill(small_disk, leave=20_000)
    converted = _fat5("convert", source, small_disk / "fat5", cwd=tmp_path)
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
    pretrained = _fat5("pretrain", tmp_path / "config.yaml", "--output-dir", run, cwd=tmp_path)
    assert pretrained.returncode == 2, pretrained.stderr[-3000:]
    [line] = [line for line in pretrained.stderr.strip().splitlines() if line.startswith("fat5 pretrain")]
    assert "Traceback" not in pretrained.stderr
    assert line.startswith(f"fat5 pretrain: error: the disk holding {run} is full")
    assert "checkpoint-2 was not written; no complete checkpoint is kept" in line
    # nothing half-written: no checkpoint folder, no staging folder, no final model
    assert sorted(path.name for path in run.iterdir()) == ["tokenizer"]
