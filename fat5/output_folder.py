"""Where FAT5's commands write: the rules for ``--overwrite``, folders that appear whole or not at all, a full disk
said in one line, and a training job's output folder made ready (refused, resumed or emptied of what a run wrote).

The rule, for `fat5 convert`, `export-hf`, `bundle`, `pretrain` and `finetune` alike: ``--overwrite`` touches nothing
outside the output folder, never a folder that holds the input (or the current directory), and never the user's own
files. `convert`, `export-hf` and `bundle` replace the folder whole, so they replace only a folder of files FAT5
writes (`is_model_folder_file`): one holding anything else is refused, ``--overwrite`` or not. A training job's folder
may hold the user's files beside the run's: without ``--overwrite`` such a folder is refused, and with it only what a
run writes there (`is_run_file`) is removed. What the files are named is `fat5.folder_contents`; which checkpoints are
complete, `fat5.checkpoints`.

One job writes in a training job's output folder at a time: its main process holds a lock on the folder
(`lock_run_folder`) from its first check to its end, and a job started on a folder that a live job holds is refused in
one line. The lock is the kernel's (``flock``), which ends with the process that holds it: a killed job leaves no
stale lock. Every temporary file or folder a process writes has a name of its own (`temporary_name`).
"""

import contextlib
import errno
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .checkpoints import checkpoint_steps, newest_complete_checkpoint, reached_max_steps
from .errors import FAT5Error
from .folder_contents import (
    MODEL_FILES,
    RUN_LOCK,
    is_model_folder_file,
    is_run_file,
    is_temporary,
    temporary_name,
    user_files,
)

# below this much free space, a write that failed without an errno (torch's zip writer says only "unexpected pos")
# is taken for a full disk
_NEARLY_FULL_BYTES = 64 * 2**20


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
    return out.parent / temporary_name(out.name, kind)


def write_atomically(path: Path, content: bytes) -> None:
    """``path`` holds ``content`` whole or keeps what it held: written under a name of this process's, then renamed."""
    temporary = path.with_name(temporary_name(path.name))
    try:
        temporary.write_bytes(content)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


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
    others = user_files(out, is_model_folder_file) if out.is_dir() else []
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
    others = user_files(out)
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
    if not out.is_dir():
        return out
    if main_process:
        _remove_leftover_temporaries(out)
    if resume:
        return out
    if overwrite:
        if main_process and any(is_run_file(path.name) for path in out.iterdir()):
            kept = user_files(out)
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


@dataclass
class _HeldLock:
    """A lock this process holds on a run folder: its open lock file, how many times it was taken, and the highest
    folder that taking it made (removed with the lock when it holds nothing else)."""

    handle: object
    made: Path | None
    count: int = 1


_HELD: dict[Path, _HeldLock] = {}


def lock_run_folder(out) -> Path:
    """Lock the training job's output folder ``out`` for this process, making it when it is missing; returns it
    absolute. A folder that a live job holds is refused in one line naming that job. A process that holds the lock
    may take it again (`unlock_run_folder` then releases it as many times)."""
    try:
        import fcntl
    except ModuleNotFoundError:  # Windows has no flock: its jobs run unlocked
        fcntl = None
    out = Path(out).expanduser().absolute()
    if out in _HELD:
        _HELD[out].count += 1
        return out
    made = next((folder for folder in reversed([out, *out.parents]) if not folder.exists()), None)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RUN_LOCK
    while fcntl is not None:
        handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115  (the lock lasts as long as the file is open)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(handle)
            handle.close()
            raise FAT5Error(f"{out} is being written by another job ({holder}): wait for it to end, or choose "
                            "another output folder") from None
        # a job that released the lock between this open and this flock removed the file this handle holds
        if path.exists() and os.path.samestat(os.fstat(handle.fileno()), path.stat()):
            break
        handle.close()
    else:
        _HELD[out] = _HeldLock(None, made)
        return out
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                 f"{' '.join(sys.argv)}")
    handle.flush()
    _HELD[out] = _HeldLock(handle, made)
    return out


def _lock_holder(handle) -> str:
    """Who holds the lock file ``handle`` is open on, as its holder wrote it just after taking the lock."""
    for _ in range(20):
        handle.seek(0)
        holder = handle.read().strip()
        if holder:
            return holder
        time.sleep(0.05)
    return "a process that has not said which"


def unlock_run_folder(out) -> None:
    """Release a lock `lock_run_folder` took; the last release removes the lock file, and the folders that taking it
    made when they hold nothing else (a job refused before its first write leaves no folder behind)."""
    out = Path(out).expanduser().absolute()
    held = _HELD.get(out)
    if held is None:
        return
    held.count -= 1
    if held.count:
        return
    del _HELD[out]
    # removed while still held: a job waiting on this file finds it gone, and locks a new one
    if held.handle is not None:
        (out / RUN_LOCK).unlink(missing_ok=True)
        held.handle.close()
    if held.made is not None:
        for folder in [out, *out.parents]:
            with contextlib.suppress(OSError):
                folder.rmdir()
            if folder == held.made:
                break


def _remove_leftover_temporaries(out: Path) -> None:
    """What a killed run left half-written at the top of ``out`` (its temporary files and folders), removed by the
    job that holds the folder's lock: no other process writes them."""
    for path in out.iterdir():
        if is_temporary(path.name) and is_run_file(path.name) and path.is_dir():
            shutil.rmtree(path)
        elif is_temporary(path.name) and is_run_file(path.name):
            path.unlink()


def move_into(temporary: Path, out: Path) -> None:
    """Move the files of the finished folder ``temporary`` to the top of ``out`` (same disk), replacing a model
    already there, so that a kill at any moment leaves a model that loads: each file replaces its namesake in one
    rename, config.json last, and the previous model's weight files that the new one lacks (other shards) are
    removed just before it. A kill between leaves the previous model or, for the instants of those renames, the new
    weights under the previous config.json: the same model's, since only ``--resume`` saves over a model."""
    names = sorted((path.name for path in temporary.iterdir()), key=lambda name: name == "config.json")
    weights = [out / name for name in MODEL_FILES if name != "config.json"] + list(out.glob("model-*.safetensors"))
    stale = [path for path in weights if path.is_file() and path.name not in names]
    *first, last = names
    for name in first:
        _replace(temporary / name, out / name)
    for path in stale:
        path.unlink()
    _replace(temporary / last, out / last)
    temporary.rmdir()


def _replace(source: Path, target: Path) -> None:
    if target.is_dir():
        shutil.rmtree(target)
    os.replace(source, target)


def final_model_disk_full_error(run_dir: Path) -> FAT5Error:
    """What a job says when the disk fills while its final model is written: the folder, and the checkpoint from
    which ``--resume`` finishes the run, if one is complete."""
    kept, _ = newest_complete_checkpoint(run_dir)
    return disk_full_error(run_dir, "the final model was not written" + (
        f"; {kept.name} is complete: free some space and --resume finishes the run" if kept else ""))


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
