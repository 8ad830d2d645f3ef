"""Which checkpoints of a training run are complete, and which one ``--resume`` continues from. FAT5Trainer renames a
checkpoint into place only once it is written (fat5.folder_contents.CHECKPOINT_STAGING), but a kill or a full disk
under another trainer, or damage since, can leave a ``checkpoint-N`` half-written: a resume skips it, saying why.
"""

import json
import os
from pathlib import Path

from .folder_contents import CHECKPOINT_NAME


def checkpoint_problem(folder) -> str | None:
    """Why ``folder`` is no complete Trainer checkpoint (a kill or a full disk left it half-written, or a file was
    damaged since), or None when it is complete: a readable trainer_state.json, weights whose safetensors headers
    match their files' sizes (every shard an index names), and whole zip archives for the torch.save'd states."""
    import zipfile

    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    try:
        json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))["global_step"]
    except FileNotFoundError:
        return "no trainer_state.json"
    except (OSError, ValueError, KeyError, TypeError):
        return "trainer_state.json is damaged"
    weights = []
    for index_name in ("model.safetensors.index.json", "adapter_model.safetensors.index.json"):
        if (folder / index_name).is_file():
            try:
                shards = set(json.loads((folder / index_name).read_text(encoding="utf-8"))["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return f"{index_name} is damaged"
            weights += [folder / shard for shard in sorted(shards)]
    weights += [folder / name for name in ("model.safetensors", "adapter_model.safetensors")
                if (folder / name).is_file()]
    if not weights and not (folder / "pytorch_model.bin").is_file():
        return "no model weights"
    for path in weights:
        try:
            with safe_open(path, framework="pt"):
                pass
        except FileNotFoundError:
            return f"{path.name} is missing"
        except (SafetensorError, OSError) as error:
            return f"{path.name} is damaged ({error})"
    for path in sorted(folder.glob("*.pt")) + sorted(folder.glob("*.pth")) + sorted(folder.glob("*.bin")):
        if not zipfile.is_zipfile(path):
            return f"{path.name} is damaged (not a whole torch.save archive)"
    return None


def newest_complete_checkpoint(run_dir) -> tuple[Path | None, list[str]]:
    """The highest-numbered complete ``checkpoint-N`` of ``run_dir`` (None when there is none), and one line for
    each newer one skipped, saying why."""
    run_dir = Path(run_dir)
    found = []
    if run_dir.is_dir():
        for path in run_dir.iterdir():
            match = CHECKPOINT_NAME.match(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
    skipped = []
    for _, path in sorted(found, reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path.name}: {problem}")
    return None, skipped


def checkpoint_steps(checkpoint) -> tuple[int, int]:
    """(global_step, max_steps) that a complete checkpoint's trainer_state.json records: the steps trained, of the
    run's total (0 where the Trainer recorded none)."""
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text(encoding="utf-8"))
    return state["global_step"], state.get("max_steps") or 0


def reached_max_steps(checkpoint) -> bool:
    """Whether a complete checkpoint ends its run: a resume from it has no step left to train."""
    global_step, max_steps = checkpoint_steps(checkpoint)
    return 0 < max_steps <= global_step


def find_resume_checkpoint(output_dir: Path, announce: bool = True) -> Path | None:
    """The newest complete checkpoint of ``output_dir``, saying (with ``announce``: the main process) which and why
    newer ones are skipped; None (a run that starts over) when there is none."""
    checkpoint, skipped = newest_complete_checkpoint(output_dir)
    if not announce:
        return checkpoint
    for reason in skipped:
        print(f"--resume: skipping the incomplete {reason}", flush=True)
    if checkpoint is None:
        print(f"--resume: no complete checkpoint in {output_dir}: starting from step 0", flush=True)
    else:
        print(f"--resume: continuing from {checkpoint}", flush=True)
    return checkpoint


def fsync_files(folder: Path) -> None:
    """Flush the files of ``folder`` to disk, so that after a power cut the renamed checkpoint holds its data."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
