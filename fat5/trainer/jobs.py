"""The steps `fat5 pretrain` and `fat5 finetune` take alike: the output folder made ready (refused, resumed from its
newest complete checkpoint, or emptied of what a run wrote), the training arguments and the FAT5Trainer, training
and evaluating the final weights, and the final model saved at the top of the output folder.

Each job is a ``prepare_*()`` function that checks what the job needs and builds everything, returning a job whose
``run()`` trains, evaluates and saves: ``prepare_pretraining`` (`PretrainingJob`) and ``prepare_finetuning``
(`FinetuningJob`), with the same signature, ``(config, output_dir, *, overrides, resume, overwrite)``. The `fat5`
command runs them inside the job's ``begun_*()`` block, with that signature too: what the job checks and says before
torch and transformers are imported (its config, inputs and output folder, which it locks).

Under torchrun or `accelerate launch` the job is one job of several processes: the main one locks the output folder
(`check_output_dir`) and alone writes in it, the others wait for it where they need what it wrote. Without an
accelerator the processes train on the CPU together (``use_cpu``, which the jobs default to there): transformers would
otherwise run each as a job of its own, all writing the same folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ..errors import FAT5Error
from ..folder_contents import FINAL_MODEL_STAGING, temporary_name


def is_main_launch_process() -> bool:
    """Whether this process is its job's main one, as the launcher says before torch.distributed starts: torchrun's
    (and so accelerate's and DeepSpeed's) ``RANK``, absent for a job of one process."""
    return os.environ.get("RANK", "0") == "0"


def launched_processes() -> int:
    """How many processes the launcher started for the job (torchrun's ``WORLD_SIZE``; 1 without one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_output_dir(output_dir: Path, *, resume: bool, overwrite: bool, resume_keeps_config: bool = False) -> None:
    """Before any work, in one line naming the fix: the output folder, or the folder it will be made in, takes a new
    file, no other live job writes there (the main process locks it until the job ends: `release_output_dir`), and
    the job may start there as asked (a folder that holds a run, a model or files no run wrote needs ``resume`` or
    ``overwrite``: `fat5.output_folder.run_folder_refusal`)."""
    from ..output_folder import lock_run_folder, run_folder_refusal

    if overwrite and resume:
        raise FAT5Error("--overwrite starts the run over and --resume continues it: pass one of them")
    output_dir = Path(output_dir).expanduser().absolute()
    folder = output_dir
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise FAT5Error(f"the output folder {output_dir} cannot be made: {folder} is a file; choose another folder")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".fat5-write-test-"):
            pass
    except OSError as error:
        raise FAT5Error(f"the output folder {output_dir}: cannot write in {folder} ({error.strerror or error}); "
                        "choose a folder you can write to") from None
    if is_main_launch_process():
        lock_run_folder(output_dir)
    refusal = None if resume or overwrite else run_folder_refusal(output_dir, resume_keeps_config)
    if refusal:
        release_output_dir(output_dir)
        raise FAT5Error(refusal)


def release_output_dir(output_dir: Path) -> None:
    """Release the lock `check_output_dir` took (the main process's)."""
    from ..output_folder import unlock_run_folder

    if is_main_launch_process():
        unlock_run_folder(output_dir)


@contextlib.contextmanager
def released_on_failure(output_dir: Path) -> Iterator[None]:
    """A job's preparation after `check_output_dir`: a failure releases the output folder (and removes it when the
    lock made it and nothing was written)."""
    try:
        yield
    except BaseException:
        release_output_dir(output_dir)
        raise


@contextlib.contextmanager
def released_at_the_end(output_dir: Path) -> Iterator[None]:
    """A job's run: the output folder released when it ends, however it ends."""
    try:
        yield
    finally:
        release_output_dir(output_dir)


def trains_on_cpu(training: dict) -> bool:
    """Whether the job trains on the CPU: ``training.use_cpu`` when given, else when `accelerate launch` was told to
    (its ``use_cpu``) or this machine has no accelerator (`training_arguments` sets it so); without an accelerator,
    ``use_cpu: false`` under several processes is refused: it would make each process a job of its own."""
    import torch

    if training.get("use_cpu") is False and launched_processes() > 1 and not torch.accelerator.is_available():
        raise FAT5Error(f"training.use_cpu false: this machine has no GPU, and its {launched_processes()} processes "
                        "would each run a job of their own, all writing the same folder; set training.use_cpu: true "
                        "(or leave it out) to train them as one job on the CPU")
    launched_on_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes", "y", "on")
    return training.get("use_cpu", launched_on_cpu or not torch.accelerator.is_available())


def process_state(training: dict):
    """accelerate's state of this job's processes, on the CPU or the accelerator as `trains_on_cpu` says."""
    from accelerate import PartialState

    return PartialState(cpu=trains_on_cpu(training))


def prepare_output_folder(output_dir: Path, config, inputs: Iterable, training: dict, *, overwrite: bool,
                          resume: bool, resume_keeps_config: bool = False) -> tuple[Path, Path | None]:
    """Refuse, resume or empty the output folder as asked (`fat5.output_folder.prepare_run_folder`), never touching
    what the job reads (``inputs``, and ``config`` when it is a file); returns the folder, made, and with ``resume``
    the newest complete checkpoint to continue from (None: the run starts over). Every process calls it; the main
    one changes the folder, the others wait for it."""
    from ..checkpoints import find_resume_checkpoint
    from ..output_folder import prepare_run_folder

    state = process_state(training)
    read = [*inputs, *([config] if isinstance(config, (str, os.PathLike)) else [])]
    output_dir = prepare_run_folder(output_dir, overwrite=overwrite, resume=resume,
                                    inputs=[path for path in read if path and Path(path).exists()],
                                    main_process=state.is_main_process, resume_keeps_config=resume_keeps_config)
    state.wait_for_everyone()
    checkpoint = find_resume_checkpoint(output_dir, announce=state.is_main_process) if resume else None
    output_dir.mkdir(parents=True, exist_ok=True)
    return output_dir, checkpoint


def training_arguments(output_dir: Path, training: dict, *, defaults: dict | None = None, fixed: dict | None = None,
                       evaluates: bool = True):
    """`FAT5TrainingArguments` of a checked ``training`` section (`config_schema.training_section`) over the job's
    ``defaults``; the job's ``fixed`` fields (its seed, its compilation) over both. Without evaluation data
    (``evaluates`` false) nothing is evaluated, whatever the section's eval_strategy."""
    from .trainer import FAT5TrainingArguments

    arguments = {**(defaults or {}), **training, **(fixed or {}), "output_dir": str(output_dir),
                 "use_cpu": trains_on_cpu(training)}
    if not evaluates:
        arguments["eval_strategy"] = "no"
    try:
        return FAT5TrainingArguments(**arguments)
    except (TypeError, ValueError) as error:
        raise FAT5Error(f"training: {error}") from None


def build_trainer(arguments, model, tokenizer, data_collator, train_dataset, eval_dataset, **options):
    """The job's FAT5Trainer: ``options`` are FAT5Trainer's others (batch samplers, compute_metrics)."""
    from .trainer import FAT5Trainer

    return FAT5Trainer(model=model, args=arguments, train_dataset=train_dataset, eval_dataset=eval_dataset,
                       data_collator=data_collator, processing_class=tokenizer, **options)


def train_and_evaluate(trainer, checkpoint: Path | None):
    """Train (from ``checkpoint`` when resuming), then evaluate the final weights where there is evaluation data;
    returns the Trainer's train output and the evaluation's metrics (None without evaluation data)."""
    from .trainer import require_full_state_dict

    require_full_state_dict(trainer)
    train_output = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    metrics = trainer.evaluate_final_weights() if trainer.eval_dataset is not None else None
    return train_output, metrics


@contextlib.contextmanager
def final_writes(output_dir: Path, temporaries: Iterable[Path] = ()) -> Iterator[None]:
    """Within the block, a failure removes the half-written ``temporaries``, and a full disk becomes one line
    (`final_model_disk_full_error`: the folder, and the checkpoint from which ``--resume`` finishes the run)."""
    from ..output_folder import final_model_disk_full_error, is_disk_full

    try:
        yield
    except Exception as error:
        for temporary in temporaries:
            shutil.rmtree(temporary, ignore_errors=True)
        if not is_disk_full(error, output_dir):
            raise
        raise final_model_disk_full_error(output_dir) from None


def save_final_model(trainer, output_dir: Path, verify: Callable[[Path], object] | None = None) -> None:
    """``trainer.save_model`` (the model and its tokenizer) into a temporary folder inside ``output_dir``, checked
    by ``verify`` (a loader, given that folder) when given, then its files moved to the top of ``output_dir``.

    Every process calls it: under FSDP, ``save_model`` gathers the full state dict from all of them (and writes it
    from the main process, as it always does); the files are touched by the main process alone.
    """
    from ..output_folder import move_into

    main_process = trainer.is_world_process_zero()
    # a name of this process's (under FSDP the others name theirs, and write nothing in it)
    temporary = output_dir / temporary_name(FINAL_MODEL_STAGING)
    trainer.accelerator.wait_for_everyone()
    with final_writes(output_dir, [temporary]):
        trainer.save_model(str(temporary))
        if main_process:
            if verify is not None:
                verify(temporary)
            move_into(temporary, output_dir)
    trainer.accelerator.wait_for_everyone()
