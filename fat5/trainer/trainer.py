"""FAT5Trainer: transformers' Seq2SeqTrainer, logging what FAT5 users watch.

The model computes the fused cross-entropy + z-loss itself (exact under gradient accumulation through
``num_items_in_batch``); the trainer adds the two parts of the loss, the tokens per second and the share of padding
to every training log, and routes transformers' ``label_smoothing_factor`` into the fused loss.
"""

import enum
import inspect
import math
import os
import shutil
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
from transformers.trainer_callback import ProgressCallback

from ..checkpoints import fsync_files, newest_complete_checkpoint
from ..errors import FAT5Error
from ..folder_contents import CHECKPOINT_NAME, CHECKPOINT_PREFIX, CHECKPOINT_STAGING
from ..output_folder import disk_full_error, is_disk_full
from .metrics import numeric_progress_callback
from .training_fields import unknown_training_fields


@dataclass
class FAT5TrainingArguments(Seq2SeqTrainingArguments):
    """``Seq2SeqTrainingArguments`` plus what FAT5's jobs add.

    Args:
        torch_compile_regional: compile each encoder and decoder block on its own (accelerate's regional
            compilation: blocks of one kind share their compiled code, so compiling costs a few blocks' worth)
            instead of the whole model. Implies ``torch_compile``; ``torch_compile_mode`` applies to each block.
            Inductor then fuses the element-wise work between the kernels and the blocks' Python runs once per
            shape, which pays most where eager steps wait on the host (long inputs at small batches), without
            CUDA graphs' need for batches of one shape.
        logging_nan_inf_filter: False by default here (True in transformers). transformers' filter tests every
            step's loss for NaN and inf on the host, which waits for the GPU at every step (two synchronisations),
            so the host cannot queue the next step while the GPU runs this one (benchmarks/README.md, UL2
            pretraining, measures what it costs). Off, a NaN or inf loss reaches the logged mean, where it shows,
            instead of being replaced by the average of the earlier ones.
        ddp_find_unused_parameters: False by default here (transformers: True for a model without activation
            checkpointing). Every parameter of a FAT5 model that requires a gradient takes part in every step, so
            DDP's search for unused ones after each forward (a walk of the autograd graph) is pure cost; a model
            that does leave one unused fails at its second step with DDP's error listing the indices of the
            parameters that got no gradient (their names with ``TORCH_DISTRIBUTED_DEBUG=INFO``), never silently.
            Set it true for such a model.
        dataloader_pin_memory: as in transformers where an accelerator is present; False without one, where pinned
            host memory has nothing to speed up and torch's DataLoader warns about it for every loader.
    """

    logging_nan_inf_filter: bool = field(
        default=False,
        metadata={"help": "Replace NaN/inf step losses in the logged mean (reads every step's loss on the host)."},
    )
    ddp_find_unused_parameters: bool | None = field(
        default=False,
        metadata={"help": "Let DDP search for parameters that take no part in a step (every FAT5 parameter does)."},
    )
    torch_compile_regional: bool = field(
        default=False,
        metadata={"help": "Compile each encoder and decoder block separately (implies torch_compile)."},
    )

    def __post_init__(self):
        if self.torch_compile_regional:
            from accelerate.utils import TorchDynamoPlugin

            # the switch came with accelerate 1.7; before it the Trainer would compile the whole model instead
            if "use_regional_compilation" not in TorchDynamoPlugin.__dataclass_fields__:
                import accelerate

                raise ValueError(
                    "torch_compile_regional needs accelerate >= 1.7 (TorchDynamoPlugin.use_regional_compilation), "
                    f"this environment has accelerate {accelerate.__version__}"
                )
            self.torch_compile = True
        if self.dataloader_pin_memory and not torch.accelerator.is_available():
            self.dataloader_pin_memory = False
        super().__post_init__()


# what a scalar field of the training arguments may hold; YAML gives these types, and a value of another one reaches
# the Trainer unchecked (a learning rate written 3e-4 is the string "3e-4" in YAML 1.1, a TypeError deep in the
# optimizer)
_SCALAR_KINDS = {int: "an integer", float: "a number", bool: "true or false", type(None): "null"}


def _accepts(kind, value) -> bool:
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    return isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)


def _parses_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# the meaningful range of each numeric field: (lowest, highest, whether each bound is allowed, other allowed values);
# transformers accepts e.g. max_steps -3 and then trains epochs without a word, or a beta of 1.5 that diverges
_RANGES = {
    "max_steps": (1, None, (True, True), (-1,), "-1 (train num_train_epochs) or an integer >= 1"),
    "num_train_epochs": (0, None, (False, True), (), "> 0"),
    "learning_rate": (0, None, (True, True), (), ">= 0"),
    "warmup_steps": (0, None, (True, True), (), ">= 0 (below 1: a share of the steps)"),
    "weight_decay": (0, None, (True, True), (), ">= 0"),
    "adam_beta1": (0, 1, (True, False), (), "in [0, 1)"),
    "adam_beta2": (0, 1, (True, False), (), "in [0, 1)"),
    "adam_epsilon": (0, None, (False, True), (), "> 0"),
    "max_grad_norm": (0, None, (True, True), (), ">= 0 (0: no clipping)"),
    "label_smoothing_factor": (0, 1, (True, False), (), "in [0, 1)"),
    "neftune_noise_alpha": (0, None, (False, True), (None,), "> 0 or null"),
    "per_device_train_batch_size": (1, None, (True, True), (), ">= 1"),
    "per_device_eval_batch_size": (1, None, (True, True), (), ">= 1"),
    "gradient_accumulation_steps": (1, None, (True, True), (), ">= 1"),
    "eval_accumulation_steps": (1, None, (True, True), (None,), ">= 1 or null"),
    "torch_empty_cache_steps": (1, None, (True, True), (None,), ">= 1 or null"),
    "logging_steps": (0, None, (False, True), (), "> 0 (below 1: a share of the steps)"),
    "eval_steps": (0, None, (False, True), (None,), "> 0 (below 1: a share of the steps) or null"),
    "save_steps": (0, None, (False, True), (), "> 0 (below 1: a share of the steps)"),
    "eval_delay": (0, None, (True, True), (), ">= 0"),
    "save_total_limit": (1, None, (True, True), (None,), ">= 1 or null (keep every checkpoint)"),
    "seed": (0, 2**32 - 1, (True, True), (), "in [0, 2**32 - 1]"),
    "data_seed": (0, 2**32 - 1, (True, True), (None,), "in [0, 2**32 - 1] or null"),
    "dataloader_num_workers": (0, None, (True, True), (), ">= 0"),
    "dataloader_prefetch_factor": (1, None, (True, True), (None,), ">= 1 or null"),
    "ddp_bucket_cap_mb": (1, None, (True, True), (None,), ">= 1 or null"),
    "ddp_timeout": (1, None, (True, True), (), ">= 1 (seconds)"),
    "generation_max_length": (1, None, (True, True), (None,), ">= 1 or null"),
    "generation_num_beams": (1, None, (True, True), (None,), ">= 1 or null"),
}


def _in_range(name: str, value) -> bool:
    low, high, (low_ok, high_ok), allowed, _ = _RANGES[name]
    if value in allowed and (value is None or not isinstance(value, bool)):
        return True
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return False
    above = value >= low if low_ok else value > low
    below = high is None or (value <= high if high_ok else value < high)
    return above and below and not math.isinf(value)


def check_training_arguments(arguments: dict, where: str = "training") -> None:
    """Raise FAT5Error, naming the field, for a name that is no `FAT5TrainingArguments` field, a value of the wrong
    type in one of its scalar fields (integers, numbers, booleans; the fields that take strings are transformers'),
    a number outside the field's meaningful range (a negative ``max_steps``, a beta of 1.5, ...) or a value outside
    the field's choices (an ``eval_strategy`` of "sometimes"): what transformers would say only once the job builds
    its arguments, after its output folder is prepared."""
    fields = typing.get_type_hints(FAT5TrainingArguments)
    unknown_training_fields(arguments, fields, where)
    for name, value in arguments.items():
        kinds = _kinds(fields[name])
        if not set(kinds) <= set(_SCALAR_KINDS) or any(_accepts(kind, value) for kind in kinds):
            continue
        expected = " or ".join(_SCALAR_KINDS[kind] for kind in kinds)
        message = f"{where}.{name} must be {expected}, got {value!r}"
        if isinstance(value, str) and float in kinds and "." not in value and _parses_as_number(value):
            message += " (YAML reads a number without a dot, like 3e-4, as text: write 3.0e-4)"
        raise FAT5Error(message)
    for name, value in arguments.items():
        if name in _RANGES and not _in_range(name, value):
            raise FAT5Error(f"{where}.{name} must be {_RANGES[name][4]}, got {value!r}")
        choices = _choices(name, fields[name])
        if choices and value is not None and value not in choices:
            raise FAT5Error(f"{where}.{name} must be one of {choices}, got {value!r}")
    if arguments.get("report_to") not in (None, "none", ["none"]):
        from transformers.integrations import get_reporting_integration_callbacks

        # the Trainer looks its reporters up only when it is built, deep in the job
        try:
            get_reporting_integration_callbacks(arguments["report_to"])
        except ValueError as error:
            raise FAT5Error(f"{where}.report_to: {error}") from None


def _kinds(annotation) -> tuple:
    """The types a field's annotation allows (those of a union, else the one)."""
    is_union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
    return typing.get_args(annotation) if is_union else (annotation,)


def _choices(name: str, annotation) -> list | None:
    """The values a field takes, where it names them: its metadata's choices, or the values of the Enum it is typed
    with (IntervalStrategy, SchedulerType, OptimizerNames, ...); None for a field that takes any value of its type."""
    choices = FAT5TrainingArguments.__dataclass_fields__[name].metadata.get("choices")
    if choices:
        return list(choices)
    enums = [kind for kind in _kinds(annotation) if isinstance(kind, type) and issubclass(kind, enum.Enum)]
    return [member.value for kind in enums for member in kind] or None


def count_tokens(inputs: dict, decoder_labels: bool = True) -> tuple[torch.Tensor, int]:
    """Real tokens (encoder inputs plus, for seq2seq, labelled decoder positions) and slots of one batch."""
    input_ids = inputs["input_ids"]
    if "segment_ids" in inputs:
        encoder_tokens = (inputs["segment_ids"] > 0).sum()
    elif inputs.get("attention_mask") is not None:
        encoder_tokens = inputs["attention_mask"].sum()
    else:
        encoder_tokens = torch.tensor(input_ids.numel(), device=input_ids.device)
    slots = input_ids.numel()
    labels = inputs.get("labels") if decoder_labels else None
    if labels is not None:
        encoder_tokens = encoder_tokens + (labels != -100).sum()
        slots += labels.numel()
    return encoder_tokens, slots


def require_full_state_dict(trainer) -> None:
    """Raise FAT5Error, before any training, when FSDP or DeepSpeed ZeRO-3 would save sharded checkpoints:
    ``save_model`` then writes no usable model, and a job's final folder must be a plain model that
    ``from_pretrained`` loads."""
    if trainer.is_fsdp_enabled:
        state_dict_type = str(trainer.accelerator.state.fsdp_plugin.state_dict_type)
        if "FULL_STATE_DICT" not in state_dict_type:
            raise FAT5Error(f"FSDP state dict type {state_dict_type}: the final model would not be saved; set "
                            "fsdp_state_dict_type: FULL_STATE_DICT in the accelerate config "
                            "(examples/accelerate/fsdp.yaml)")
    if trainer.is_deepspeed_enabled:
        zero = trainer.accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        if zero.get("stage") == 3 and not zero.get("stage3_gather_16bit_weights_on_model_save"):
            raise FAT5Error("DeepSpeed ZeRO-3 without zero3_save_16bit_model: the final model would be saved "
                            "without its sharded weights; set zero3_save_16bit_model: true in the accelerate "
                            "config's deepspeed_config, or use ZeRO-2 (examples/accelerate/deepspeed_zero2.yaml)")


def _fused_loss_config(model):
    """The config whose ``label_smoothing`` the loss of ``model`` reads (FAT5's fused LM loss), or None for a model
    whose loss does not (transformers' T5, FAT5's encoder heads). ``model`` may be a PEFT model; the class is matched
    by name so that a FAT5 loaded as remote code counts too."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if any(cls.__name__ == "FAT5ForConditionalGeneration" for cls in type(base).__mro__):
        return base.config
    return None


def _yields_batches(dataset) -> bool:
    from .packing import PackedStreamDataset

    return isinstance(dataset, PackedStreamDataset)


def _takes_loss_parts(model) -> bool:
    """Whether the model under the Trainer's wrappers (DDP, torch.compile, a PEFT model) is a FAT5 seq2seq model, whose
    forward returns the loss's parts when asked (``return_loss_parts``): they are logged apart."""
    from transformers.modeling_utils import unwrap_model

    model = unwrap_model(model)
    model = getattr(model, "_orig_mod", model)
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return "return_loss_parts" in inspect.signature(model.forward).parameters


class FAT5Trainer(Seq2SeqTrainer):
    """A ``Seq2SeqTrainer`` for FAT5 models; every argument is the parent's.

    Training logs gain ``ce_loss`` and ``z_loss`` (their means since the last log), ``tokens_per_second`` (real
    tokens, encoder and labelled decoder positions, per second of wall time from the first training batch after the
    last log to this log, all processes: the evaluations, checkpoints and set-up between windows do not count) and
    ``padding_fraction`` (the share of batch slots that held padding); under several processes each is the figure
    of the whole job (losses averaged over every process's batches, tokens and slots summed). The first step of
    each new batch shape adds ``first_step_seconds`` (its wall time, compilation included) and ``batch_shapes``
    (the shapes seen so far) to ``state.log_history``, unprinted (the console would get a line per new shape).

    ``label_smoothing_factor`` smooths FAT5's fused loss, in training and evaluation, with the z-loss kept (where
    transformers' LabelSmoother, which takes the labels away from the model, would drop it); the model's saved config
    keeps its own ``label_smoothing``. A model without that loss (transformers' T5, FAT5's encoder heads) gets
    transformers' LabelSmoother, as under ``Seq2SeqTrainer``.

    Packed UL2 batches come from a batch sampler (``train_batch_sampler`` / ``eval_batch_sampler``, e.g.
    :class:`~fat5.trainer.packing.UL2PackedBatchSampler`, whose batches depend only on its seed and the epoch, so a
    resumed run sees exactly the data it would have seen) over :class:`~fat5.trainer.packing.PlannedDataset`, or
    from an ``IterableDataset`` that yields whole batches (:class:`~fat5.trainer.packing.PackedStreamDataset`).
    """

    def __init__(self, *args, train_batch_sampler=None, eval_batch_sampler=None, **kwargs):
        self._checkpoint_run_dir = None
        self.train_batch_sampler = train_batch_sampler
        self.eval_batch_sampler = eval_batch_sampler
        super().__init__(*args, **kwargs)
        # the progress bar's log lines with numbers as numbers (transformers' own writes them as strings)
        if self.pop_callback(ProgressCallback) is not None:
            self.add_callback(numeric_progress_callback())
        self._smoothed_loss_config = None
        if self.args.label_smoothing_factor > 0:
            # the fused loss smooths labels itself (see compute_loss_context_manager)
            self._smoothed_loss_config = _fused_loss_config(self.accelerator.unwrap_model(self.model))
            if self._smoothed_loss_config is not None:
                self.label_smoother = None
        self._reset_window()
        self._shapes_seen = set()
        # seconds of the first training step of each batch shape, in order (compilation included)
        self.first_step_seconds = []

    def _get_output_dir(self, trial) -> str:
        # while _save_checkpoint writes, the Trainer's checkpoint-N folder is made in the staging folder
        if self._checkpoint_run_dir is not None:
            return str(self._checkpoint_run_dir)
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, written whole or not at all: every file goes to
        ``.checkpoint-staging/checkpoint-N`` in the run folder, which is renamed to ``checkpoint-N`` once every
        process has written its part; older checkpoints beyond ``save_total_limit`` are renamed away before they are
        deleted. A kill at any moment leaves the previous complete checkpoint or the new one, and a full disk says
        so in one line and keeps the previous one."""
        run_dir = Path(self._get_output_dir(trial))
        name = f"{CHECKPOINT_PREFIX}-{self.state.global_step}"
        staging = run_dir / CHECKPOINT_STAGING
        if self.args.should_save:
            # what a killed run left half-written
            shutil.rmtree(staging, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self._checkpoint_run_dir = staging
        try:
            super()._save_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                best = self.state.best_model_checkpoint
                if best is not None and Path(best).parent == staging:
                    self.state.best_model_checkpoint = str(run_dir / Path(best).name)
                    self.state.save_to_json(str(staging / name / "trainer_state.json"))
                fsync_files(staging / name)
                if (run_dir / name).exists():
                    # a checkpoint of the same step (a run resumed from an older one): moved aside, not deleted first
                    os.replace(run_dir / name, staging / f"replaced-{name}")
                os.replace(staging / name, run_dir / name)
                self._rotate_complete_checkpoints(run_dir, staging)
                shutil.rmtree(staging, ignore_errors=True)
        except Exception as error:
            if not is_disk_full(error, staging):
                raise
            if self.args.should_save:
                shutil.rmtree(staging, ignore_errors=True)
            kept, _ = newest_complete_checkpoint(run_dir)
            raise disk_full_error(run_dir, f"{name} was not written; " + (
                f"{kept.name} is the newest complete checkpoint" if kept else "no complete checkpoint is kept"
            )) from None
        finally:
            self._checkpoint_run_dir = None
        self.accelerator.wait_for_everyone()

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # Under FSDP the state dict arrives gathered, every tied target (the stacks' embed_tokens, a tied lm_head) a
        # copy of its own that save_pretrained cannot recognise as shared: written as is, the folder would hold the
        # embedding three times, unlike the model a one-GPU job saves. The copies are dropped; loading ties them.
        if state_dict is not None:
            unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
            tied = getattr(unwrapped, "all_tied_weights_keys", None) or {}
            state_dict = {name: value for name, value in state_dict.items()
                          if not (name in tied and tied[name] in state_dict)}
        super()._save(output_dir, state_dict=state_dict)

    def _rotate_complete_checkpoints(self, run_dir: Path, staging: Path) -> None:
        """transformers' rotation (keep ``save_total_limit``, always the newest and the best), by step, each old
        checkpoint renamed into the staging folder before it is deleted, so that no half-deleted one remains."""
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        checkpoints = sorted(
            (int(match.group(1)), path) for path in run_dir.iterdir() if (match := CHECKPOINT_NAME.match(path.name))
        )
        protected = {checkpoints[-1][1]}
        if self.state.best_model_checkpoint is not None:
            protected.add(Path(self.state.best_model_checkpoint))
        remaining = len(checkpoints)
        for _, path in checkpoints:
            if remaining <= max(limit, len(protected)):
                break
            if path not in protected:
                staging.mkdir(exist_ok=True)
                doomed = staging / f"deleting-{path.name}"
                os.replace(path, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
                remaining -= 1

    def _issue_warnings_after_load(self, load_result) -> None:
        # a checkpoint stores tied weights once (shared.weight): their other names are missing by design
        model = self.accelerator.unwrap_model(self.model)
        names_of = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            names_of.setdefault(id(tensor), []).append(name)
        missing = set(load_result.missing_keys)
        tied = {name for names in names_of.values() if not set(names) <= missing for name in names}
        load_result = types.SimpleNamespace(
            missing_keys=[key for key in load_result.missing_keys if key not in tied],
            unexpected_keys=list(load_result.unexpected_keys),
        )
        super()._issue_warnings_after_load(load_result)

    def _build_accelerator_args(self, **kwargs) -> dict:
        arguments = super()._build_accelerator_args(**kwargs)
        # transformers builds the dynamo plugin from torch_compile* for every accelerate that has the switch
        # (FAT5TrainingArguments checked the version); plain Seq2SeqTrainingArguments have no such field
        if getattr(self.args, "torch_compile_regional", False):
            arguments["dynamo_plugin"].use_regional_compilation = True
        return arguments

    def _batch_loader(self, dataset, batch_sampler) -> DataLoader:
        from .packing import PlannedDataset

        workers = {"num_workers": self.args.dataloader_num_workers}
        if self.args.dataloader_num_workers > 0:
            # the batch sampler plans each epoch in this process, so workers kept across epochs still see every
            # epoch's batches; restarting them each epoch stalled the pretraining step (benchmarks/README.md)
            workers["persistent_workers"] = self.args.dataloader_persistent_workers
            if self.args.dataloader_prefetch_factor is not None:
                workers["prefetch_factor"] = self.args.dataloader_prefetch_factor
        if batch_sampler is not None:
            loader = DataLoader(
                PlannedDataset(dataset), batch_sampler=batch_sampler, collate_fn=self.data_collator,
                pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(), **workers,
            )
        else:
            # an IterableDataset of ready batches
            loader = DataLoader(dataset, batch_size=None, **workers)
        return self.accelerator.prepare(loader)

    def get_train_dataloader(self) -> DataLoader:
        if self.train_batch_sampler is not None or _yields_batches(self.train_dataset):
            return self._batch_loader(self.train_dataset, self.train_batch_sampler)
        return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if self.eval_batch_sampler is not None and not isinstance(dataset, (str, dict)):
            return self._batch_loader(dataset, self.eval_batch_sampler)
        if _yields_batches(dataset):
            return self._batch_loader(dataset, None)
        return super().get_eval_dataloader(eval_dataset)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # Resumed from a checkpoint at max_steps in the middle of an epoch, transformers' loop draws the epoch's next
        # batches and trains a step past max_steps: it checks max_steps after a step only. No batch is drawn then,
        # which the loop takes as an epoch's end, and training stops.
        if 0 < self.state.max_steps <= self.state.global_step:
            self.control.should_training_stop = True
            return [], None
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def compute_loss_context_manager(self):
        stack = super().compute_loss_context_manager()
        if self._smoothed_loss_config is not None:
            # the Trainer's forward passes (training and evaluation) run in here: the factor holds for them only, so
            # that the config saved with the model and checkpoints keeps the model's own label_smoothing
            config, own_smoothing = self._smoothed_loss_config, self._smoothed_loss_config.label_smoothing
            config.label_smoothing = self.args.label_smoothing_factor
            stack.callback(setattr, config, "label_smoothing", own_smoothing)
        return stack

    def evaluate_final_weights(self) -> dict:
        """``evaluate()``'s metrics for the weights training ended with, without evaluating them twice: the Trainer's
        own evaluation at the last step, when it made one there (the built-in pretraining job's did; a finetuning job
        that evaluates each epoch does, generation included), else a new one. Weights that training replaced at its
        end (``load_best_model_at_end``) are always evaluated anew."""
        if not self.args.load_best_model_at_end:
            evaluations = [entry for entry in self.state.log_history if "eval_loss" in entry]
            if evaluations and evaluations[-1]["step"] == self.state.global_step:
                return {key: value for key, value in evaluations[-1].items() if key != "step"}
        return self.evaluate()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        # After each generate, Seq2SeqTrainer fills every unset field of the model's generation config with
        # transformers' defaults (max_length 20, top_k 50, ...). Saved with the model, an explicit max_length 20
        # conflicts with every later generate(max_new_tokens=...), which then warns; the unset fields are unset again.
        generation_config = getattr(self.model, "generation_config", None)
        unset = [name for name, value in vars(generation_config).items() if value is None] if generation_config else []
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)
        finally:
            for name in unset:
                setattr(generation_config, name, None)

    def training_step(self, model, inputs, *args, **kwargs):
        # The first step of each batch shape compiles (Triton kernels; with torch_compile, the graph and its CUDA
        # graphs): its time is logged, as `first_step_seconds`, so that the cost of a new shape is seen. Packed
        # batches in a few fixed shapes (data.shape_buckets) pay it once per shape.
        shape = tuple((key, tuple(value.shape)) for key, value in inputs.items() if isinstance(value, torch.Tensor))
        if shape in self._shapes_seen:
            return super().training_step(model, inputs, *args, **kwargs)
        started = time.perf_counter()
        loss = super().training_step(model, inputs, *args, **kwargs)
        if loss.device.type == "cuda":
            torch.cuda.synchronize(loss.device)
        self._shapes_seen.add(shape)
        self.first_step_seconds.append(round(time.perf_counter() - started, 3))
        # into the log history (and pretrain_summary.json) without the console line a log prints: a job's report
        # gives them in one line at its end
        entry = {"first_step_seconds": self.first_step_seconds[-1], "batch_shapes": len(self._shapes_seen)}
        if self.state.epoch is not None:
            entry["epoch"] = self.state.epoch
        self.state.log_history.append({**entry, "step": self.state.global_step})
        return loss

    def _reset_window(self) -> None:
        self._window_loss_parts = None
        self._window_batches = 0
        self._window_parts_are_shares = False
        self._window_tokens = None
        self._window_slots = 0
        self._window_start = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            if self.label_names and all(inputs.get(name) is None for name in self.label_names):
                # without labels FAT5 has no decoder inputs either, and would fail on those with a puzzling message
                # (DataCollatorForSeq2Seq gives labels=None to a dataset without them)
                given = sorted(name for name, value in inputs.items() if value is not None)
                raise ValueError(
                    f"FAT5Trainer: the training batch has no {self.label_names} (it holds {given}): the dataset "
                    "needs a `labels` column (the target token ids), or the data collator must make one; the "
                    "Trainer drops columns that the model's forward does not take (remove_unused_columns)"
                )
            if self._window_start is None:
                self._window_start = time.perf_counter()
            if _takes_loss_parts(model):
                inputs = {**inputs, "return_loss_parts": True}
                if not return_outputs and self.compute_loss_func is None and self.label_smoother is None:
                    # nothing reads this step's logits, which accelerate's mixed precision would copy to fp32
                    inputs["return_logits"] = False
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training:
            # kept on the device: adding them up here costs no synchronisation, the log reads them once
            tokens, slots = count_tokens(inputs, decoder_labels=getattr(outputs, "ce_loss", None) is not None)
            if self._window_tokens is None:
                # the optimizer steps of this window are counted from here (a resumed run starts past 0)
                self._window_first_step = self.state.global_step
            self._window_tokens = tokens if self._window_tokens is None else self._window_tokens + tokens
            self._window_slots += slots
            parts = getattr(outputs, "ce_loss", None), getattr(outputs, "z_loss", None)
            if parts[0] is not None:
                parts = torch.stack([parts[0].detach().float(), parts[1].detach().float()])
                self._window_loss_parts = parts if self._window_loss_parts is None else self._window_loss_parts + parts
                self._window_batches += 1
                # divided by the token count of a whole optimizer step, a batch's parts are its share of the step
                self._window_parts_are_shares = num_items_in_batch is not None
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs and self._window_tokens is not None:
            # every process logs together (the Trainer gathers the loss there too), so one summed reduction gives
            # the figures of the whole job: packed batches differ in size from rank to rank, and so do their parts
            device = self._window_tokens.device
            parts = self._window_loss_parts if self._window_loss_parts is not None else torch.zeros(2, device=device)
            # float32, not float64, which MPS lacks; a log needs no more than its 7 digits
            counts = torch.tensor([self._window_slots, self._window_batches], dtype=torch.float32, device=device)
            window = torch.cat([self._window_tokens.detach().float().reshape(1), counts, parts.float()])
            tokens, slots, batches, ce_sum, z_sum = self.accelerator.reduce(window, reduction="sum").tolist()
            if self._window_loss_parts is not None:
                if self._window_parts_are_shares:
                    # shares add up over a step's batches, and over the ranks when the count spans them all
                    ranks = 1 if self.args.average_tokens_across_devices else self.accelerator.num_processes
                    divisor = max(self.state.global_step - self._window_first_step, 1) * ranks
                else:
                    divisor = batches
                logs["ce_loss"], logs["z_loss"] = round(ce_sum / divisor, 6), round(z_sum / divisor, 8)
            elapsed = time.perf_counter() - self._window_start
            logs["tokens_per_second"] = round(tokens / elapsed, 1)
            logs["padding_fraction"] = round(1.0 - tokens / slots, 4)
            self._reset_window()
        super().log(logs, *args, **kwargs)
