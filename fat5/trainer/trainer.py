"""FAT5Trainer: transformers' Seq2SeqTrainer, logging what FAT5 users watch.

The model computes the fused cross-entropy + z-loss itself (exact under gradient accumulation through
``num_items_in_batch``); the trainer adds the two parts of the loss, the tokens per second and the share of padding
to every training log, and routes transformers' ``label_smoothing_factor`` into the fused loss.
"""

import time

import torch
from torch.utils.data import DataLoader
from transformers import Seq2SeqTrainer


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


def _yields_batches(dataset) -> bool:
    from .packing import PackedStreamDataset

    return isinstance(dataset, PackedStreamDataset)


class FAT5Trainer(Seq2SeqTrainer):
    """A ``Seq2SeqTrainer`` for FAT5 models; every argument is the parent's.

    Training logs gain ``ce_loss`` and ``z_loss`` (their means since the last log), ``tokens_per_second`` (real
    tokens, encoder and labelled decoder positions, per second of wall time since the last log, all processes) and
    ``padding_fraction`` (the share of batch slots that held padding).

    Packed UL2 batches come from a batch sampler (``train_batch_sampler`` / ``eval_batch_sampler``, e.g.
    :class:`~fat5.trainer.packing.UL2PackedBatchSampler`, whose batches depend only on its seed and the epoch, so a
    resumed run sees exactly the data it would have seen) over :class:`~fat5.trainer.packing.PlannedDataset`, or
    from an ``IterableDataset`` that yields whole batches (:class:`~fat5.trainer.packing.PackedStreamDataset`).
    """

    def __init__(self, *args, train_batch_sampler=None, eval_batch_sampler=None, **kwargs):
        self.train_batch_sampler = train_batch_sampler
        self.eval_batch_sampler = eval_batch_sampler
        super().__init__(*args, **kwargs)
        if self.args.label_smoothing_factor > 0:
            # the fused loss smooths labels itself; transformers' smoother would take the labels away from the model
            self.accelerator.unwrap_model(self.model).config.label_smoothing = self.args.label_smoothing_factor
            self.label_smoother = None
        self._reset_window()

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

    def _reset_window(self) -> None:
        self._window_loss_parts = None
        self._window_steps = 0
        self._window_tokens = None
        self._window_slots = 0
        self._window_start = time.perf_counter()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training:
            # kept on the device: adding them up here costs no synchronisation, the log reads them once
            tokens, slots = count_tokens(inputs, decoder_labels=getattr(outputs, "ce_loss", None) is not None)
            self._window_tokens = tokens if self._window_tokens is None else self._window_tokens + tokens
            self._window_slots += slots
            parts = getattr(outputs, "ce_loss", None), getattr(outputs, "z_loss", None)
            if parts[0] is not None:
                parts = torch.stack([parts[0].detach().float(), parts[1].detach().float()])
                self._window_loss_parts = parts if self._window_loss_parts is None else self._window_loss_parts + parts
                self._window_steps += 1
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs and self._window_tokens is not None:
            if self._window_loss_parts is not None:
                ce_loss, z_loss = (self._window_loss_parts / self._window_steps).tolist()
                logs["ce_loss"], logs["z_loss"] = round(ce_loss, 6), round(z_loss, 8)
            tokens = self.accelerator.reduce(self._window_tokens.detach().clone(), reduction="sum").item()
            slots = self._window_slots * self.accelerator.num_processes
            elapsed = time.perf_counter() - self._window_start
            logs["tokens_per_second"] = round(tokens / elapsed, 1)
            logs["padding_fraction"] = round(1.0 - tokens / slots, 4)
            self._reset_window()
        super().log(logs, *args, **kwargs)
