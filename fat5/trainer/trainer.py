"""FAT5Trainer: transformers' Seq2SeqTrainer, logging what FAT5 users watch.

The model computes the fused cross-entropy + z-loss itself (exact under gradient accumulation through
``num_items_in_batch``); the trainer adds the two parts of the loss, the tokens per second and the share of padding
to every training log, and routes transformers' ``label_smoothing_factor`` into the fused loss.
"""

import time
import types
import typing
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
from transformers.trainer_callback import ProgressCallback

from .metrics import numeric_progress_callback


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
    """

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
        super().__post_init__()


# what a scalar field of the training arguments may hold; YAML gives these types, and a value of another one reaches
# the Trainer unchecked (a learning rate written 3e-4 is the string "3e-4" in YAML 1.1, a TypeError deep in the optimizer)
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


def check_training_arguments(arguments: dict, where: str = "training") -> None:
    """Raise FAT5Error, naming the field, for a name that is no `FAT5TrainingArguments` field or a value of the wrong
    type in one of its scalar fields (integers, numbers, booleans); the fields that take strings are transformers'."""
    from ..errors import FAT5Error

    fields = typing.get_type_hints(FAT5TrainingArguments)
    unknown = sorted(set(arguments) - set(fields))
    if unknown:
        hint = (" (transformers 5 writes it train_sampling_strategy: group_by_length)"
                if "group_by_length" in unknown else "")
        raise FAT5Error(f"{where}: {unknown} not FAT5TrainingArguments field(s){hint}")
    for name, value in arguments.items():
        annotation = fields[name]
        is_union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
        kinds = typing.get_args(annotation) if is_union else (annotation,)
        if not set(kinds) <= set(_SCALAR_KINDS) or any(_accepts(kind, value) for kind in kinds):
            continue
        expected = " or ".join(_SCALAR_KINDS[kind] for kind in kinds)
        message = f"{where}.{name} must be {expected}, got {value!r}"
        if isinstance(value, str) and float in kinds and "." not in value and _parses_as_number(value):
            message += " (YAML reads a number without a dot, like 3e-4, as text: write 3.0e-4)"
        raise FAT5Error(message)
    if arguments.get("report_to") not in (None, "none", ["none"]):
        from transformers.integrations import get_reporting_integration_callbacks

        # the Trainer looks its reporters up only when it is built, deep in the job
        try:
            get_reporting_integration_callbacks(arguments["report_to"])
        except ValueError as error:
            raise FAT5Error(f"{where}.report_to: {error}") from None


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
    from ..errors import FAT5Error

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


class FAT5Trainer(Seq2SeqTrainer):
    """A ``Seq2SeqTrainer`` for FAT5 models; every argument is the parent's.

    Training logs gain ``ce_loss`` and ``z_loss`` (their means since the last log), ``tokens_per_second`` (real
    tokens, encoder and labelled decoder positions, per second of wall time from the first training batch after the
    last log to this log, all processes: the evaluations, checkpoints and set-up between windows do not count) and
    ``padding_fraction`` (the share of batch slots that held padding); under several processes each is the figure
    of the whole job (losses averaged over every process's batches, tokens and slots summed).

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

    def _build_accelerator_args(self, **kwargs) -> dict:
        arguments = super()._build_accelerator_args(**kwargs)
        # transformers builds the dynamo plugin from torch_compile* for every accelerate that has the switch
        # (FAT5TrainingArguments checked the version); plain Seq2SeqTrainingArguments have no such field
        if getattr(self.args, "torch_compile_regional", False):
            arguments["dynamo_plugin"].use_regional_compilation = True
        return arguments

    def _batch_loader(self, dataset, batch_sampler) -> DataLoader:
        from .packing import PlannedDataset

        options = dict(
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(),
        )
        if batch_sampler is not None:
            loader = DataLoader(PlannedDataset(dataset), batch_sampler=batch_sampler, **options)
        else:
            # an IterableDataset of ready batches
            loader = DataLoader(dataset, batch_size=None, num_workers=self.args.dataloader_num_workers)
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

    def compute_loss_context_manager(self):
        stack = super().compute_loss_context_manager()
        if self._smoothed_loss_config is not None:
            # the Trainer's forward passes (training and evaluation) run in here: the factor holds for them only, so
            # that the config saved with the model and checkpoints keeps the model's own label_smoothing
            config, own_smoothing = self._smoothed_loss_config, self._smoothed_loss_config.label_smoothing
            config.label_smoothing = self.args.label_smoothing_factor
            stack.callback(setattr, config, "label_smoothing", own_smoothing)
        return stack

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
