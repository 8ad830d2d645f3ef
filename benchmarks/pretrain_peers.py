"""pretrain.py's peers: the paths a user without FAT5 takes, on the job's own examples.

* ``transformers``: ``T5ForConditionalGeneration`` + a plain ``Seq2SeqTrainer`` of the job's training arguments,
  eager, each step's examples one per row in ``--transformers-chunks`` micro-batches padded to their longest.
* ``transformers_compiled``: nanoT5's recipe, ``torch.compile(dynamic=False)`` on micro-batches in the job's few
  fixed batch shapes, the job's precision, fused AdamW, learning-rate schedule and clipping, in a loop of its own.

Both take each step's examples from the job's packed batch taken apart (:class:`UnpackedSteps`): the job's tokenized
data, sampler and collator, so the very UL2 corruption FAT5 trains on."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time

import numpy as np
import torch
from common import parameter_counts
from pretrain_steps import StepRecorder, by_shape, measured, record_steps
from torch.nn.attention import SDPBackend, sdpa_kernel

# torch 2.11's cuDNN attention backward gives NaN in dq under an attention mask when the keys' width is 64 past a
# multiple of 128 and a row's log-sum-exp is very negative (pytorch/pytorch#196678): padded T5 batches are such,
# and the run turned NaN (at step 135 of one run, 162 of another: found with torch.autograd.detect_anomaly). The
# transformers paths take SDPA's other kernels (the memory-efficient one serves a mask), as a user would.
SDPA_BACKENDS_OF_TRANSFORMERS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


class UnpackedSteps(torch.utils.data.IterableDataset):
    """The examples of each packed batch, one per row: the packed collator's own batch taken apart (so the UL2
    corruption is the very one FAT5 trains on), sorted by encoder length, made into padded micro-batches by
    ``split`` (examples -> micro-batches); yielded one by one, or, with ``whole_steps``, as one list a step. Epoch
    ``e`` gives the packed sampler's epoch ``e``."""

    def __init__(self, dataset, sampler, collator, split, whole_steps: bool = False):
        self.dataset, self.sampler, self.collator, self.split = dataset, sampler, collator, split
        self.whole_steps = whole_steps
        # The Trainer counts an epoch's batches once, from the loader's length before the first epoch, and takes that
        # many from every epoch: FAT5's path sees at most the first epoch's count of each later epoch's batches.
        # The peers, whose loaders have no length, take the same ones.
        sampler.set_epoch(0)
        self.batches_per_epoch = len(sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        from fat5.trainer.packing import PlannedDataset

        planned = PlannedDataset(self.dataset)
        for batch in itertools.islice(self.sampler, self.batches_per_epoch):
            examples = sorted(unpacked_examples(self.collator([planned[example] for example in batch])),
                              key=lambda example: len(example[0]))
            micro_batches = self.split(examples)
            if self.whole_steps:
                yield micro_batches
            else:
                yield from micro_batches


def unpacked_examples(batch: dict) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``(input_ids, decoder_input_ids, labels)`` of every example of a packed batch."""
    segments, decoder_segments = batch["segment_ids"].numpy(), batch["decoder_segment_ids"].numpy()
    input_ids, decoder_input_ids = batch["input_ids"].numpy(), batch["decoder_input_ids"].numpy()
    labels = batch["labels"].numpy()
    examples = []
    for row in range(segments.shape[0]):
        for segment in range(1, int(segments[row].max(initial=0)) + 1):
            encoder, decoder = segments[row] == segment, decoder_segments[row] == segment
            examples.append((input_ids[row][encoder], decoder_input_ids[row][decoder], labels[row][decoder]))
    return examples


def padded_batch(examples, pad_token_id: int, multiple: int = 8, widths: tuple[int, int] | None = None,
                 rows: int | None = None) -> dict:
    """T5's padded batch (attention masks, labels -100 on padding) of ``examples``: ``rows`` rows (empty ones after
    the examples) of ``widths`` (encoder, decoder), by default one row an example at the longest, rounded up to
    ``multiple``."""
    encoder_width, decoder_width = widths or (-(-max(len(example[index]) for example in examples) // multiple)
                                              * multiple for index in (0, 1))
    rows = rows or len(examples)
    batch = {
        "input_ids": np.full((rows, encoder_width), pad_token_id),
        "attention_mask": np.zeros((rows, encoder_width), dtype=np.int64),
        "decoder_input_ids": np.full((rows, decoder_width), pad_token_id),
        "decoder_attention_mask": np.zeros((rows, decoder_width), dtype=np.int64),
        "labels": np.full((rows, decoder_width), -100),
    }
    for row, (inputs, decoder_inputs, labels) in enumerate(examples):
        batch["input_ids"][row, : len(inputs)] = inputs
        batch["attention_mask"][row, : len(inputs)] = 1
        batch["decoder_input_ids"][row, : len(decoder_inputs)] = decoder_inputs
        batch["decoder_attention_mask"][row, : len(decoder_inputs)] = 1
        batch["labels"][row, : len(labels)] = labels
    return {key: torch.from_numpy(value.astype(np.int64)) for key, value in batch.items()}


def chunked(examples, chunks: int, pad_token_id: int) -> list[dict]:
    """``examples`` (sorted by length) cut into ``chunks`` micro-batches, each padded to its longest."""
    return [padded_batch([examples[i] for i in chunk.tolist()], pad_token_id)
            for chunk in np.array_split(np.arange(len(examples)), chunks)]


def in_fixed_shapes(examples, shapes, pad_token_id: int) -> list[dict]:
    """``examples`` one per row in micro-batches of ``shapes`` ``(rows, encoder width, decoder width)``, decoder
    widths ascending: each example in the first shape that holds it, a shape's last micro-batch filled with empty
    rows."""
    groups = {shape: [] for shape in shapes}
    for example in examples:
        shape = next((shape for shape in shapes if len(example[0]) <= shape[1] and len(example[1]) <= shape[2]), None)
        if shape is None:
            raise ValueError(f"an example of {len(example[0])} + {len(example[1])} tokens fits none of {shapes}")
        groups[shape].append(example)
    return [padded_batch(group[first:first + rows], pad_token_id, widths=(encoder, decoder), rows=rows)
            for (rows, encoder, decoder), group in groups.items() for first in range(0, len(group), rows)]


def fixed_shapes(job) -> list[tuple[int, int, int]]:
    """The compiled peer's micro-batch shapes: the job's batch shapes; for a job whose batches follow their content
    (no shape buckets), its rows at its longest encoder and decoder."""
    sampler, data = job.batches.train_sampler, job.settings.data
    if sampler.buckets is not None:
        return [tuple(shape) for shape in sampler.buckets.shapes()]
    width = data.max_input_length
    return [(max(1, data.tokens_per_batch // width), width, data.max_target_length or width)]


def token_mean_loss(outputs, labels, num_items_in_batch=None):
    """The cross-entropy summed over the micro-batch's labelled tokens, over those of the whole step: the step's
    mean, as FAT5's loss is. (T5's forward takes ``**kwargs``, so the Trainer passes it the step's token count and
    leaves its loss unscaled, but T5 ignores the count: each micro-batch's mean would add up, not average.)"""
    logits = outputs.logits.float()
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1).to(logits.device),
                                             ignore_index=-100, reduction="sum")
    return loss / num_items_in_batch


def run_transformers(job, t5, args, label: str, scratch: str) -> dict:
    """transformers' T5 through a plain Seq2SeqTrainer of the job's training arguments, eager, on the job's
    examples of each step in ``--transformers-chunks`` padded micro-batches."""
    from torch.utils.data import DataLoader
    from transformers import Seq2SeqTrainer

    split = functools.partial(chunked, chunks=args.transformers_chunks, pad_token_id=t5.config.pad_token_id)
    steps = UnpackedSteps(job.batches.train, job.batches.train_sampler, job.collator, split)

    class PlainTrainer(Seq2SeqTrainer):
        """Seq2SeqTrainer fed ready padded batches (one worker keeps each step's micro-batches together)."""

        def get_train_dataloader(self):
            loader = DataLoader(steps, batch_size=None, num_workers=min(self.args.dataloader_num_workers, 1),
                                pin_memory=self.args.dataloader_pin_memory)
            return self.accelerator.prepare(loader)

    # the job's compile mode cleared too: TrainingArguments turns torch_compile back on when a mode is set
    arguments = dataclasses.replace(job.trainer.args, output_dir=scratch, torch_compile=False, torch_compile_mode=None,
                                    torch_compile_backend=None, torch_compile_regional=False,
                                    gradient_accumulation_steps=args.transformers_chunks)
    if arguments.torch_compile:
        raise RuntimeError("the eager peer's training arguments still compile")
    trainer = PlainTrainer(model=t5, args=arguments, train_dataset=steps, compute_loss_func=token_mean_loss)
    recorder = StepRecorder(parameter_counts(t5), t5.config, args.window, compiled=False)
    record_steps(trainer, recorder, cross_entropy=False)
    with sdpa_kernel(list(SDPA_BACKENDS_OF_TRANSFORMERS)):
        result = measured(lambda hooks: trainer.train(), recorder, args, label, trainer)
    return dict(result, sdpa_backends=[backend.name for backend in SDPA_BACKENDS_OF_TRANSFORMERS])


def peer_optimizer(trainer, model, steps: int, fused: bool):
    """The job's optimizer and schedule for ``model``: AdamW of the job's hyper-parameters (weight decay on the
    parameters its Trainer decays), the job's learning-rate schedule over ``steps``."""
    from transformers import get_scheduler

    settings = trainer.args
    decayed = set(trainer.get_decay_parameter_names(model))
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n in decayed], "weight_decay": settings.weight_decay},
              {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=settings.learning_rate, betas=(settings.adam_beta1, settings.adam_beta2),
                                  eps=settings.adam_epsilon, fused=fused)
    schedule = get_scheduler(settings.lr_scheduler_type, optimizer, num_warmup_steps=settings.get_warmup_steps(steps),
                             num_training_steps=steps, scheduler_specific_kwargs=settings.lr_scheduler_kwargs)
    return optimizer, schedule


def loader_steps(steps: UnpackedSteps, workers: int, pin_memory: bool):
    """Each step's micro-batches, epoch after epoch, from a loader of at most one worker."""
    from torch.utils.data import DataLoader

    loader = DataLoader(steps, batch_size=None, num_workers=min(workers, 1), pin_memory=pin_memory)
    for epoch in itertools.count():
        steps.set_epoch(epoch)
        yield from loader


def compiled_micro_batches(model, micro_batches, step: int, recorder: StepRecorder, first_steps: list,
                           bf16: bool) -> None:
    """Forward and backward of one step's micro-batches, each micro-batch's mean cross-entropy (T5's own loss,
    in the compiled graph) weighted by its share of the step's labelled tokens; a new shape's first micro-batch
    timed (its compilation)."""
    device = next(model.parameters()).device
    labelled = [int((batch["labels"] != -100).sum()) for batch in micro_batches]  # host tensors: no wait
    for batch, count in zip(micro_batches, labelled):
        batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        known = len(recorder.shapes)
        recorder.measure(step, batch)
        started = time.perf_counter() if len(recorder.shapes) > known else None
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            # no decoder cache: training reads none (nanoT5's models are built without one)
            loss = model(**batch, use_cache=False).loss * (count / sum(labelled))
        loss.backward()
        recorder.add_loss(step, loss)
        if started is not None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_steps.append(round(time.perf_counter() - started, 3))


def run_transformers_compiled(job, t5, args, label: str) -> dict:
    """transformers' T5 as nanoT5 trains it: ``torch.compile(dynamic=False)`` on micro-batches in the job's few
    fixed batch shapes, the job's precision, fused AdamW, learning-rate schedule and gradient clipping, a loop of its
    own (the Trainer takes a fixed number of micro-batches a step)."""
    device, settings = torch.device(args.device), job.trainer.args
    t5.to(device).train()
    # inductor on a GPU; on a CPU dynamo traces the same graphs without generating code (--tiny checks the path)
    backend = "inductor" if device.type == "cuda" else "eager"
    model = torch.compile(t5, dynamic=False, backend=backend)
    optimizer, schedule = peer_optimizer(job.trainer, t5, args.steps, fused=device.type == "cuda")
    shapes = fixed_shapes(job)
    split = functools.partial(in_fixed_shapes, shapes=shapes, pad_token_id=t5.config.pad_token_id)
    steps = UnpackedSteps(job.batches.train, job.batches.train_sampler, job.collator, split, whole_steps=True)
    recorder, first_steps = StepRecorder(parameter_counts(t5), t5.config, args.window), []

    def train(hooks):
        recorder.tick(0, device)
        batches = loader_steps(steps, settings.dataloader_num_workers, device.type == "cuda")
        for step, micro_batches in zip(range(1, args.steps + 1), batches):
            compiled_micro_batches(model, micro_batches, step, recorder, first_steps, settings.bf16)
            if settings.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(t5.parameters(), settings.max_grad_norm)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            for hook in hooks:
                hook(step)

    with sdpa_kernel(list(SDPA_BACKENDS_OF_TRANSFORMERS)):
        result = measured(train, recorder, args, label)
    return dict(result, compile_backend=backend, micro_batch_shapes=[list(shape) for shape in shapes],
                first_step_seconds=first_steps, first_step_seconds_by_shape=by_shape(recorder.new_shapes, first_steps),
                sdpa_backends=[backend.name for backend in SDPA_BACKENDS_OF_TRANSFORMERS])
