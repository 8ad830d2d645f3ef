"""One writer per output folder (issue 50): a job locks its folder and another live job is refused there in one line
(a killed job leaves no stale lock, a refused one leaves nothing behind); two `fat5 finetune` runs started together
on one folder leave one complete model and one refusal; a killed save leaves a model that loads, the previous one or
the new one. Two processes of one job (torchrun) are tested in test_distributed.py.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO, run_in_a_fork, seq2seq_config

from fat5.errors import FAT5Error
from fat5.folder_contents import RUN_LOCK
from fat5.output_folder import lock_run_folder, unlock_run_folder

FAT5_SCRIPT = Path(sys.executable).parent / "fat5"
# a process that locks a folder as a job's main process does (without importing torch), says so, and waits
HOLD_THE_LOCK = """
import importlib.util, sys, time
sys.modules["fat5"] = importlib.util.module_from_spec(importlib.util.find_spec("fat5"))
from fat5.output_folder import lock_run_folder
lock_run_folder(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def test_a_folder_a_live_job_holds_is_refused_and_a_killed_job_leaves_no_lock(tmp_path):
    folder = tmp_path / "runs" / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(folder)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(FAT5Error, match=rf"^{folder} is being written by another job \(pid {holder.pid} on .+"
                                            r"\): wait for it to end, or choose another output folder$"):
            lock_run_folder(folder)
    finally:
        holder.kill()
        holder.wait()
    # the kernel released the killed holder's lock with its process; its file stays, named as neither the user's
    # nor a run's
    assert (folder / RUN_LOCK).is_file()
    assert lock_run_folder(folder) == folder
    assert lock_run_folder(folder) == folder  # a process may take its own lock again
    unlock_run_folder(folder)
    assert (folder / RUN_LOCK).is_file()
    unlock_run_folder(folder)
    assert not (folder / RUN_LOCK).exists() and folder.is_dir()  # the holder made the folder: it stays

    # a lock that made its folder (and its parent) removes them when nothing was written there
    fresh = tmp_path / "new" / "run"
    lock_run_folder(fresh)
    unlock_run_folder(fresh)
    assert not (tmp_path / "new").exists()
    lock_run_folder(fresh)
    (fresh / "written.txt").write_text("a run's")
    unlock_run_folder(fresh)
    assert sorted(path.name for path in fresh.iterdir()) == ["written.txt"]


def _finetune_config(model: Path, tmp_path: Path) -> Path:
    config = seq2seq_config(model, tmp_path / "run", validation=False, max_steps=8)
    # the config's use_cpu left out: the job's default on a machine without an accelerator
    del config["training"]["use_cpu"]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_two_finetune_runs_started_together_leave_one_model_and_one_refusal(tiny_model, tmp_path):
    config = _finetune_config(tiny_model, tmp_path)
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen([str(FAT5_SCRIPT), "finetune", str(config)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=environment, cwd=tmp_path) for _ in range(2)]
    finished = [(run.returncode, out, errors) for run in runs for out, errors in [run.communicate(timeout=600)]]
    assert sorted(status for status, _, _ in finished) == [0, 2], finished
    (_, out, errors), (_, _, refusal) = sorted(finished, key=lambda run: run[0])
    assert "Traceback" not in out + errors + refusal
    [line] = refusal.splitlines()
    assert re.fullmatch(rf"fat5 finetune: error: {re.escape(str(tmp_path / 'run'))} is being written by another job "
                        r"\(pid \d+ on .+\): wait for it to end, or choose another output folder", line), line
    assert f"model: {tmp_path / 'run'}" in out.splitlines()
    assert not (tmp_path / "run" / RUN_LOCK).exists()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model_type"] == "fat5"
    assert (tmp_path / "run" / "model.safetensors").is_file() and (tmp_path / "run" / "tokenizer.json").is_file()


KILLS = 8


def _top_model(folder: Path) -> dict | None:
    """The model at the top of ``folder``, loaded as a user loads it, as its tensors; None when none loads."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    try:
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.float32)
    except Exception:  # noqa: BLE001  (whatever a half-written folder makes transformers raise: no model loads)
        return None
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _same(first: dict | None, second: dict | None) -> bool:
    import torch

    return (first is not None and second is not None and first.keys() == second.keys()
            and all(torch.equal(first[name], second[name]) for name in first))


def _drive(model: Path, work: Path) -> None:
    """A finetuning run saves a model and a checkpoint; its --resume with more steps saves a new model over it, in
    copies of the process killed at moments spread over the save, each kill's folder checked (`report.json`)."""
    import tqdm

    import fat5  # noqa: F401  (registers FAT5 with the Auto classes)
    from fat5.trainer import finetuning, jobs

    # tqdm's monitor thread takes tqdm's lock now and then: a copy forked at that moment would wait on it forever
    tqdm.tqdm.monitor_interval = 0
    config = seq2seq_config(model, work / "run", validation=False, max_steps=2, save_strategy="steps", save_steps=2)
    finetuning.finetune(config)
    previous = _top_model(work / "run")
    save = jobs.save_final_model
    report, saved = {"kills": []}, {}

    def save_in_a_copy(trainer, output_dir, kill_after=None) -> float:
        return run_in_a_fork(lambda: save(trainer, output_dir), kill_after)

    def killed_saves(trainer, output_dir, verify=None):
        kept = work / "before-the-save"
        shutil.copytree(output_dir, kept, symlinks=True)
        duration = save_in_a_copy(trainer, output_dir)
        new = saved["new"] = _top_model(output_dir)
        assert new is not None and not _same(new, previous), "the resumed run's weights must differ from the first's"
        for index in range(KILLS):
            shutil.rmtree(output_dir)
            shutil.copytree(kept, output_dir, symlinks=True)
            # up to twice the measured save: another process on the cores may slow a copy down
            kill_after = duration * 2 * index / (KILLS - 1)
            save_in_a_copy(trainer, output_dir, kill_after)
            left = _top_model(output_dir)
            report["kills"].append({"after_s": kill_after, "previous": _same(left, previous), "new": _same(left, new)})
        shutil.rmtree(output_dir)
        os.replace(kept, output_dir)
        save(trainer, output_dir, verify)

    jobs.save_final_model = killed_saves
    finetuning.finetune(dict(config, training={**config["training"], "max_steps": 4}), resume=True)
    report["saved_new"] = _same(_top_model(work / "run"), saved["new"])
    (work / "report.json").write_text(json.dumps(report))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the killed copies are forked")
def test_killing_the_writer_mid_save_leaves_a_model_that_loads(tiny_model, tmp_path):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    driven = subprocess.run([sys.executable, __file__, str(tiny_model), str(tmp_path)], capture_output=True,
                            text=True, timeout=900, env=environment, check=False)
    assert driven.returncode == 0, driven.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["saved_new"]  # the save left alone wrote what the copies wrote
    kills = report["kills"]
    assert len(kills) == KILLS
    # every kill left the previous model or the new one at the top of the folder, never neither
    assert all(kill["previous"] != kill["new"] for kill in kills), kills
    # the moments spread over the save: some kills came before the new model was in place, some after
    assert kills[0]["previous"] and any(kill["new"] for kill in kills), kills


if __name__ == "__main__":
    _drive(Path(sys.argv[1]), Path(sys.argv[2]))
