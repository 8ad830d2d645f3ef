"""SIGKILL while `fat5 pretrain` writes its checkpoints: nothing is lost.

A tiny CPU run (6 steps, a checkpoint every 2, `save_total_limit: 2`, so the third write also deletes the first
checkpoint) forks a copy of itself at each checkpoint write and kills the copy with SIGKILL at moments spread over
the write, from before its first file to after its rename (the write's length is measured first, in a copy that
is left to finish). After each kill the folder must hold only complete checkpoints, the previous newest or the new
one must be there, and the one `--resume` picks must load. Then the run writes the checkpoint itself and trains on.
Two of the killed states are kept and resumed by the `fat5 pretrain --resume` command (its entry, in the test's
process): one killed during the first write (nothing complete: it starts over and says so) and one killed during the
last (it continues from the previous checkpoint); each finishes with a model that loads.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY_PRETRAIN, run_in_a_fork

CONFIG = {
    **TINY_PRETRAIN,
    "training": {"max_steps": 6, "logging_steps": 1, "save_steps": 2, "save_total_limit": 2, "eval_strategy": "no",
                 "warmup_steps": 0, "learning_rate": 1.0e-3, "disable_tqdm": True, "report_to": "none"},
}
KILLS_PER_CHECKPOINT = 8
CHECKPOINT_STEPS = (2, 4, 6)


def _check_after_kill(run_dir: Path, before: set[str], new: str) -> dict:
    """The folder a kill left: only complete checkpoints, the previous newest or the new one among them, and the
    one a resume picks loads."""
    from safetensors.torch import load_file

    from fat5.checkpoints import checkpoint_problem, newest_complete_checkpoint
    from fat5.folder_contents import CHECKPOINT_STAGING

    present = {path.name for path in run_dir.glob("checkpoint-*")}
    problems = {name: checkpoint_problem(run_dir / name) for name in present}
    assert not any(problems.values()), problems
    assert present <= before | {new}, (present, before, new)
    newest_before = max(before, key=lambda name: int(name.split("-")[1]), default=None)
    chosen, skipped = newest_complete_checkpoint(run_dir)
    assert not skipped
    assert (chosen.name if chosen else None) in {newest_before, new}, (chosen, newest_before, new)
    if chosen is not None:
        state = json.loads((chosen / "trainer_state.json").read_text())
        assert f"checkpoint-{state['global_step']}" == chosen.name
        assert load_file(chosen / "model.safetensors")
    staging = run_dir / CHECKPOINT_STAGING
    return {"new_complete": new in present, "left_partial": staging.is_dir() and any(staging.iterdir())}


def _drive(run_dir: Path, keep: Path) -> None:
    """Run the job with killed copies at every checkpoint write (see the module doc); writes keep/report.json."""
    import tqdm

    from fat5.trainer import trainer as trainer_module
    from fat5.trainer.pretraining import pretrain

    # tqdm's monitor thread takes tqdm's lock now and then: a copy forked at that moment would wait on it forever
    tqdm.tqdm.monitor_interval = 0
    write = trainer_module.FAT5Trainer._save_checkpoint
    report = {"kills": [], "duration": None}

    def write_in_a_copy(trainer, model, trial, kill_after=None) -> float:
        def write_or_say_where_it_hangs():
            import faulthandler

            # a copy that hangs says where, then ends
            faulthandler.dump_traceback_later(60, exit=True)
            write(trainer, model, trial)

        return run_in_a_fork(write_or_say_where_it_hangs, kill_after)

    def killed_writes(trainer, model, trial):
        new = f"checkpoint-{trainer.state.global_step}"
        if report["duration"] is None:
            report["duration"] = write_in_a_copy(trainer, model, trial)
            shutil.rmtree(run_dir / new)
        for index in range(KILLS_PER_CHECKPOINT):
            before = {path.name for path in run_dir.glob("checkpoint-*")}
            kill_after = report["duration"] * 1.2 * index / (KILLS_PER_CHECKPOINT - 1)
            write_in_a_copy(trainer, model, trial, kill_after)
            outcome = _check_after_kill(run_dir, before, new)
            report["kills"].append({"checkpoint": new, "after_s": kill_after, **outcome})
            first_partial = outcome["left_partial"] and not any(
                kill["left_partial"] for kill in report["kills"][:-1] if kill["checkpoint"] == new)
            if first_partial and new in ("checkpoint-2", "checkpoint-6"):
                shutil.copytree(run_dir, keep / new, symlinks=True)
        write(trainer, model, trial)

    trainer_module.FAT5Trainer._save_checkpoint = killed_writes
    pretrain(CONFIG, run_dir)
    (keep / "report.json").write_text(json.dumps(report))


def _resume(config: Path, run_dir: Path, capfd) -> tuple[int, str]:
    """`fat5 pretrain CONFIG --output-dir RUN_DIR --resume` through the command's entry, in this process (a process
    of its own would import torch again): its exit status and what it printed."""
    from fat5_command import main

    capfd.readouterr()
    status = main(["pretrain", str(config), "--output-dir", str(run_dir), "--resume"])
    return status, capfd.readouterr().out


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the killed copies are forked")
def test_sigkill_during_checkpoint_writes_loses_nothing(tmp_path, capfd):
    from transformers import AutoModelForSeq2SeqLM

    import fat5  # noqa: F401  (registers FAT5 with the Auto classes)

    run_dir, keep = tmp_path / "run", tmp_path / "kept"
    keep.mkdir()
    environment = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                   "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}
    driven = subprocess.run([sys.executable, __file__, str(run_dir), str(keep)], capture_output=True, text=True,
                            timeout=900, env=environment, check=False)
    assert driven.returncode == 0, driven.stderr[-4000:]
    report = json.loads((keep / "report.json").read_text())
    kills = report["kills"]
    assert len(kills) == KILLS_PER_CHECKPOINT * len(CHECKPOINT_STEPS) >= 20
    # the moments spread over the write: some kills left it half-done, some came after the rename
    assert sum(kill["left_partial"] for kill in kills) >= len(CHECKPOINT_STEPS), kills
    assert any(kill["new_complete"] for kill in kills), kills
    AutoModelForSeq2SeqLM.from_pretrained(run_dir)

    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(CONFIG))
    status, printed = _resume(config, keep / "checkpoint-2", capfd)
    assert status == 0
    assert "no complete checkpoint" in printed and "starting from step 0" in printed
    status, printed = _resume(config, keep / "checkpoint-6", capfd)
    assert status == 0
    assert f"continuing from {keep / 'checkpoint-6' / 'checkpoint-4'}" in printed
    for resumed in (keep / "checkpoint-2", keep / "checkpoint-6"):
        summary = json.loads((resumed / "pretrain_summary.json").read_text())
        assert summary["steps"] == CONFIG["training"]["max_steps"]
        AutoModelForSeq2SeqLM.from_pretrained(resumed)


if __name__ == "__main__":
    _drive(Path(sys.argv[1]), Path(sys.argv[2]))


def test_checkpoint_folders_are_named_as_transformers_names_them():
    """fat5.folder_contents spells transformers' checkpoint prefix out (its module costs seconds to import): a
    release that renamed it would leave every checkpoint unseen by --resume and --overwrite."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    from fat5.folder_contents import CHECKPOINT_NAME, CHECKPOINT_PREFIX, is_run_file

    assert CHECKPOINT_PREFIX == PREFIX_CHECKPOINT_DIR
    assert CHECKPOINT_NAME.match(f"{PREFIX_CHECKPOINT_DIR}-12")[1] == "12" and is_run_file(f"{PREFIX_CHECKPOINT_DIR}-3")
