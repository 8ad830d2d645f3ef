"""Where FAT5's commands write: the rules for ``--overwrite``, folders that appear whole or not at all, a full disk
said in one line, and the training jobs' checkpoints: which are complete, which one ``--resume`` continues from.

The rule, for `fat5 convert`, `export-hf`, `bundle`, `pretrain` and `finetune` alike: ``--overwrite`` touches nothing
outside the output folder, never a folder that holds the input (or the current directory), and never the user's own
files. `convert`, `export-hf` and `bundle` replace the folder whole, so they replace only a folder of files FAT5
writes (`is_model_folder_file`): one holding anything else is refused, ``--overwrite`` or not. A training job's folder
may hold the user's files beside the run's: without ``--overwrite`` such a folder is refused, and with it only what a
run writes there (`is_run_file`) is removed.
"""

import contextlib
import errno
import functools
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .errors import FAT5Error

# below this much free space, a write that failed without an errno (torch's zip writer says only "unexpected pos")
# is taken for a full disk
_NEARLY_FULL_BYTES = 64 * 2**20
# a checkpoint is written in here, inside the run folder (same disk), and renamed to checkpoint-N once complete
CHECKPOINT_STAGING = ".checkpoint-staging"
CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def _holds(folder: Path, path: Path) -> bool:
    return folder == path or folder in path.parents


def check_output_folder(out, *, overwrite: bool = False, inputs: Iterable = (), inside_inputs_ok: bool = False,
                        non_empty_ok: bool = False) -> Path:
    """Raise FAT5Error unless ``out`` may become (or be replaced as) an output folder; return it absolute.

    ``out`` must not be a file, nor lie inside any of ``inputs`` (the paths the job reads), unless
    ``inside_inputs_ok``; a non-empty ``out`` needs ``overwrite`` (or ``non_empty_ok``, for a job that decides itself
    what it may add to a folder), and with ``overwrite`` it must not hold an input or the current directory, nor be
    the home folder or the file system's root.
    """
    out = Path(out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise FAT5Error(f"{out} exists and is not a folder")
    real = out.resolve()
    for given in inputs:
        if given is None:
            continue
        source = Path(given).expanduser().resolve()
        if overwrite and _holds(real, source):
            raise FAT5Error(f"the output folder {out} holds the input {source}: choose a folder beside it")
        if _holds(source, real) and not inside_inputs_ok:
            raise FAT5Error(f"the output folder {out} lies inside the input {source}: choose a folder outside it")
    if overwrite and (real == Path(real.anchor) or real == Path.home().resolve()):
        raise FAT5Error(f"{out} is {'the root folder' if real == Path(real.anchor) else 'the home folder'}: "
                        "write to a folder of its own")
    if overwrite and _holds(real, Path.cwd().resolve()) and out.is_dir() and any(out.iterdir()):
        raise FAT5Error(f"the output folder {out} holds the current directory: write to a folder of its own")
    if out.is_dir() and any(out.iterdir()) and not (overwrite or non_empty_ok):
        raise FAT5Error(f"{out} already exists and is not empty (pass --overwrite to replace its content)")
    return out


def _sibling(out: Path, kind: str) -> Path:
    return out.parent / f".{out.name}.{kind}-{uuid.uuid4().hex[:8]}"


def is_disk_full(error: BaseException, folder) -> bool:
    """Whether ``error``, raised while writing into ``folder``, comes from a full disk (or quota)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    if "No space left on device" in text or "Disk quota exceeded" in text:
        return True
    # torch.save's zip writer reports a short write without its errno
    if isinstance(error, RuntimeError) and ("unexpected pos" in text or "PytorchStreamWriter" in text):
        return free_bytes(folder) < _NEARLY_FULL_BYTES
    return False


def free_bytes(folder) -> int:
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def disk_full_error(folder, what: str) -> FAT5Error:
    """The one line a full disk gets: where, how much is free, and what was (not) kept."""
    path = Path(folder).absolute()
    return FAT5Error(f"the disk holding {path} is full ({free_bytes(path) / 2**20:.1f} MiB free): {what}")


@contextlib.contextmanager
def atomic_directory(out, *, overwrite: bool = False, inputs: Iterable = (), inside_inputs_ok: bool = False
                     ) -> Iterator[Path]:
    """Yield a temporary folder beside ``out`` that becomes ``out`` only if the block completes.

    On any exception the temporary folder is removed and ``out`` is left as it was (absent, or untouched when it
    existed); a full disk becomes one FAT5Error line. ``out`` is checked first by `check_output_folder`, and an
    ``out`` to be replaced must hold only what FAT5 writes in a model folder (`is_model_folder_file`).
    """
    out = check_output_folder(out, overwrite=overwrite, inputs=inputs, inside_inputs_ok=inside_inputs_ok)
    others = _other_files(out, is_model_folder_file) if out.is_dir() else []
    if others:
        raise FAT5Error(f"{out} holds files that FAT5 did not write ({_named(others)}): --overwrite replaces a model "
                        "folder, never other files; choose a new or empty output folder")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise FAT5Error(f"cannot create the parent folder of {out}: {error}") from None
    temporary = _sibling(out, "tmp")
    try:
        temporary.mkdir()
    except OSError as error:  # a read-only or special file system: the user's choice of OUT, not a bug
        raise FAT5Error(f"cannot create a folder beside {out}: {error}") from None
    try:
        try:
            yield temporary
        except Exception as error:
            if is_disk_full(error, temporary):
                kept = f"{out} was left as it was" if out.exists() else f"nothing was written to {out}"
                raise disk_full_error(out.parent, kept) from None
            raise
        if out.exists():
            previous = _sibling(out, "old")
            out.rename(previous)
            temporary.rename(out)
            shutil.rmtree(previous, ignore_errors=True)
        else:
            temporary.rename(out)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)


# what makes a folder hold a model (or a PEFT adapter) that a training job would overwrite
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "adapter_config.json")
# what a training job (`fat5 pretrain`, `fat5 finetune`) writes at the top of its output folder, besides
# checkpoint-N, the shards of a large model and the remote code a saved model carries (`remote_code_file_names`):
# the final model and its tokenizer, the jobs' records and their temporary folders. `--overwrite` removes these only.
RUN_FILES = frozenset({
    *MODEL_FILES, "adapter_model.safetensors", "generation_config.json", "training_args.bin",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "spiece.model",
    "chat_template.jinja", CHECKPOINT_STAGING, ".final-model.tmp", "runs",
    # fat5 pretrain
    "tokenizer", "pretrain_config.yaml", "pretrain_summary.json", "loss_curve.png", "compile_cache_artifacts.bin",
    # fat5 finetune
    "adapter", "bundle", "metrics.json", "finetune_config.yaml", ".merged-model.tmp",
})
_SHARD = re.compile(r"^(model|adapter_model)-\d+-of-\d+\.safetensors$")
# the conversion's record of what it converted and how closely the result matched (`fat5 convert`, kept by `bundle`)
REPORT_FILE = "fat5_conversion.json"
# the sha256 of every file that decides what a bundle computes (code, weights, config), as `bundle` wrote them
MANIFEST_FILE = "fat5_manifest.json"
# what `fat5 convert`, `export-hf` and `bundle` write beside a training job's files: the model card, the conversion
# report and the bundle's manifest, a pytorch checkpoint's index, the Hub's attributes
MODEL_FOLDER_FILES = frozenset({"README.md", REPORT_FILE, MANIFEST_FILE, "pytorch_model.bin.index.json",
                                ".gitattributes"})
# the files a tokenizer may consist of: whichever are present travel with a converted model
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "spiece.model", "sentencepiece.bpe.model", "vocab.json", "merges.txt", "chat_template.jinja")
_PYTORCH_SHARD = re.compile(r"^pytorch_model-\d+-of-\d+\.bin$")
# a file or folder being written (`.NAME.tmp`) or replaced (`_sibling`'s `.NAME.tmp-HEX`, `.NAME.old-HEX`)
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(tmp|tmp-[0-9a-f]{8}|old-[0-9a-f]{8})$")
# what file managers leave in any folder they show: neither the user's work nor a run's
_FILE_MANAGER_FILES = frozenset({".DS_Store", "Thumbs.db", "desktop.ini"})


@functools.cache
def _remote_code_names() -> frozenset[str]:
    from .remote_code import remote_code_file_names

    return frozenset(remote_code_file_names())


def is_run_file(name: str) -> bool:
    """Whether a training job writes an entry of this name at the top of its output folder."""
    if name in RUN_FILES or name in _remote_code_names() or CHECKPOINT_NAME.match(name) or _SHARD.match(name):
        return True
    temporary = _TEMPORARY.match(name)
    return bool(temporary) and is_run_file(temporary["name"])


def is_model_folder_file(name: str) -> bool:
    """Whether FAT5 writes an entry of this name at the top of a model folder: what a training job writes there, and
    what `fat5 convert`, `export-hf` and `bundle` add (the model card, their records, other tokenizers' files, the
    shards of a pytorch checkpoint)."""
    return (name in MODEL_FOLDER_FILES or name in TOKENIZER_FILES or _PYTORCH_SHARD.match(name) is not None
            or is_run_file(name))


def _other_files(out: Path, written_by_fat5=is_run_file) -> list[str]:
    """The entries of ``out`` that FAT5 does not write (by default: that no training job writes): the user's, never
    to be removed."""
    return sorted(path.name for path in out.iterdir() if not written_by_fat5(path.name)
                  and path.name not in _FILE_MANAGER_FILES)


def _named(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def run_folder_refusal(out: Path, resume_keeps_config: bool = False) -> str | None:
    """Why a training job started afresh (neither ``--resume`` nor ``--overwrite``) refuses the folder ``out``, as
    one line naming the fix; None when it may start there. ``resume_keeps_config``: the job's ``--resume`` runs the
    config the run saved (`fat5 pretrain`), so a newest checkpoint at max_steps ends the run, where `fat5 finetune`'s
    may raise max_steps and train on."""
    if not out.is_dir():
        return None
    if any(path.is_dir() for path in out.glob("checkpoint-*")):
        newest, _ = newest_complete_checkpoint(out)
        if resume_keeps_config and newest is not None and reached_max_steps(newest):
            _, max_steps = checkpoint_steps(newest)
            if any((out / name).is_file() for name in MODEL_FILES):
                return (f"{out} holds a finished run: {newest.name} reached its max_steps ({max_steps}) and the model "
                        "is saved; pass --overwrite to start over, or choose another output folder")
            return (f"{out} holds a run that reached its max_steps ({max_steps}, {newest.name}) but did not save its "
                    "model: pass --resume to save it (no step is trained), or --overwrite to start over")
        continues = f"continue from {newest.name}" if newest else "continue (no complete checkpoint: it starts over)"
        return (f"{out} holds the checkpoints of an earlier run: pass --resume to {continues}, or --overwrite to "
                "start over")
    if any((out / name).is_file() for name in MODEL_FILES):
        return f"{out} already holds a model: pass --overwrite to replace it, or choose another output folder"
    others = _other_files(out)
    if others:
        return (f"{out} holds files that no run wrote ({_named(others)}): choose a new or empty output folder, or pass "
                "--overwrite to write beside them (it removes only what a run writes)")
    return None


def remove_run_files(out: Path) -> list[str]:
    """Remove what a training job wrote in ``out`` (`is_run_file`), nothing else; returns the names removed. They
    are renamed into a folder beside ``out`` first, which is then deleted: a kill meanwhile leaves no half-removed
    checkpoint inside ``out``."""
    names = sorted(path.name for path in out.iterdir() if is_run_file(path.name))
    if not names:
        return names
    removed = _sibling(out, "old")
    removed.mkdir()
    for name in names:
        os.replace(out / name, removed / name)
    shutil.rmtree(removed, ignore_errors=True)
    return names


def prepare_run_folder(out, *, overwrite: bool = False, resume: bool = False, inputs: Iterable = (),
                       main_process: bool = True, resume_keeps_config: bool = False) -> Path:
    """Check the output folder of a training job (`fat5 pretrain`, `fat5 finetune`) and return it absolute.

    The job writes its final model at the folder's top and its checkpoints in ``checkpoint-*`` beside it. Without
    ``overwrite`` or ``resume``, a folder that holds checkpoints, a model or files no run wrote is refused
    (`run_folder_refusal`), naming the flag that continues or replaces it; what an earlier run wrote before its
    first checkpoint is removed, the job saying it starts over. With ``overwrite``, what a run writes is removed (by
    the main process) before anything runs, and the user's other files are kept.
    """
    if overwrite and resume:
        raise FAT5Error("--overwrite starts the run over and --resume continues it: pass one of them")
    out = check_output_folder(out, overwrite=overwrite, inputs=inputs, inside_inputs_ok=True, non_empty_ok=True)
    if resume or not out.is_dir():
        return out
    if overwrite:
        if main_process and any(is_run_file(path.name) for path in out.iterdir()):
            kept = _other_files(out)
            print(f"--overwrite: removing what a run wrote in {out}"
                  + (f" (keeping the {len(kept)} other files)" if kept else ""), flush=True)
            remove_run_files(out)
        return out
    refusal = run_folder_refusal(out, resume_keeps_config)
    if refusal:
        raise FAT5Error(refusal)
    if main_process and any(is_run_file(path.name) for path in out.iterdir()):
        names = remove_run_files(out)
        print(f"{out} holds what an earlier run wrote before its first checkpoint ({', '.join(names)}): starting "
              "over", flush=True)
    return out


def move_into(temporary: Path, out: Path) -> None:
    """Move the files of the finished folder ``temporary`` to the top of ``out`` (same disk), replacing a model
    already there: its files go first and config.json comes last, so a kill between leaves a folder without
    config.json (no model, and the checkpoints still there), never one with a config and the wrong weights."""
    for name in MODEL_FILES:
        if (out / name).is_file():
            (out / name).unlink()
    for path in out.glob("model-*.safetensors"):
        path.unlink()
    names = sorted((path.name for path in temporary.iterdir()), key=lambda name: name == "config.json")
    for name in names:
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(temporary / name, target)
    temporary.rmdir()


# ----------------------------------------------------------------------------------------------- checkpoints


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


def final_model_disk_full_error(run_dir: Path) -> FAT5Error:
    """What a job says when the disk fills while its final model is written: the folder, and the checkpoint from
    which ``--resume`` finishes the run, if one is complete."""
    kept, _ = newest_complete_checkpoint(run_dir)
    return disk_full_error(run_dir, "the final model was not written" + (
        f"; {kept.name} is complete: free some space and --resume finishes the run" if kept else ""))


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


def resume_hint(command: str, output_dir) -> str:
    """What to run to continue an interrupted job whose output folder is ``output_dir``: ``--resume`` from its
    newest complete checkpoint, else the command again (with ``--overwrite`` only where the folder needs it)."""
    output_dir = Path(output_dir)
    checkpoint, _ = newest_complete_checkpoint(output_dir)
    if checkpoint is not None and reached_max_steps(checkpoint):
        return f"`{command} --resume` saves the model of {checkpoint}, which reached max_steps (no step is trained)"
    if checkpoint is not None:
        return f"`{command} --resume` continues from {checkpoint}"
    again = f"{command} --overwrite" if run_folder_refusal(output_dir) else command
    return f"no checkpoint was written yet; `{again}` starts over"


def fsync_files(folder: Path) -> None:
    """Flush the files of ``folder`` to disk, so that after a power cut the renamed checkpoint holds its data."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
