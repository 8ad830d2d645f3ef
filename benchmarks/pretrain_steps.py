"""How pretrain.py measures a training run, whatever trains: each optimizer step's real tokens, positions, model
FLOPs (``common.model_flops``) and loss kept on the device (:class:`StepRecorder`), the wall clock every few steps,
a Trainer's steps recorded by wrapping its own ``training_step`` (``record_steps``), and ``--profile``'s last steps
taken apart (:class:`StepProfiler`, ``time_bounds``)."""

from __future__ import annotations

import functools
import logging
import os
import time
import warnings

import numpy as np
import torch
from common import kernel_ms_by_kind, model_flops

logger = logging.getLogger("benchmarks.pretrain")
TARGET_MFU = {"base": 0.45, "small": 0.35}  # issue 31


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


def step_flops(inputs: dict, counts: dict, config) -> torch.Tensor:
    """Model FLOPs of one batch by the docstring's formula: (dense, attention), a device tensor."""
    encoder_lengths, decoder_lengths = (lengths.double() for lengths in example_lengths(inputs))
    return torch.stack(model_flops(encoder_lengths, decoder_lengths, counts, config))


def shape_name(inputs: dict) -> str:
    """``rows x encoder width x decoder width`` of a batch."""
    return "x".join(str(size) for size in (*inputs["input_ids"].shape, inputs["labels"].shape[1]))


class StepRecorder:
    """What each optimizer step did, kept on the device until the run ends (reading it every step would make the
    host wait for the GPU): loss, FAT5's cross-entropy part, real tokens, positions, FLOPs; plus the wall clock
    every ``window`` steps, taken after a synchronisation, the batch shapes in the order met, and, when
    ``compiled``, the steps that met a new batch shape (they compile; an eager model's do not)."""

    def __init__(self, counts, config, window: int, compiled: bool = True):
        self.counts, self.config, self.window, self.compiled = counts, config, window, compiled
        self.losses, self.cross_entropy, self.tokens, self.positions, self.flops = {}, {}, {}, {}, {}
        self.shapes, self.new_shapes, self.new_shape_steps, self.clock = set(), [], set(), []

    def measure(self, step: int, inputs: dict) -> None:
        """Count a micro-batch of ``step`` (before the Trainer's forward, which may take the labels out)."""
        real = (inputs["segment_ids"] > 0).sum() if "segment_ids" in inputs else inputs["attention_mask"].sum()
        real = real + (inputs["labels"] != -100).sum()
        shape = tuple(tuple(value.shape) for value in inputs.values() if isinstance(value, torch.Tensor))
        if shape not in self.shapes:
            self.shapes.add(shape)
            self.new_shapes.append(shape_name(inputs))
            if self.compiled:
                self.new_shape_steps.add(step)
        self._add(self.tokens, step, real)
        self._add(self.flops, step, step_flops(inputs, self.counts, self.config))
        self.positions[step] = self.positions.get(step, 0) + inputs["input_ids"].numel() + inputs["labels"].numel()

    def add_loss(self, step: int, loss: torch.Tensor, store: str = "losses") -> None:
        """A micro-batch's loss (or cross-entropy part: ``store="cross_entropy"``): its share of the step's mean."""
        # a copy: under CUDA graphs the loss lives in the graph's output buffer, which the next replay overwrites
        self._add(getattr(self, store), step, loss.detach().float().clone())

    @staticmethod
    def _add(store: dict, step: int, value) -> None:
        store[step] = store[step] + value if step in store else value

    def tick(self, step: int, device: torch.device) -> None:
        if step % self.window == 0 or not self.clock:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.clock.append((step, time.perf_counter()))

    def windows(self, tokens: np.ndarray, flops: np.ndarray, profiled_from: int | None) -> list[dict]:
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
        return windows

    def summary(self, warmup_steps: int, peak: float | None, profiled_from: int | None = None) -> dict:
        steps = sorted(self.losses)
        tokens = torch.stack([self.tokens[s] for s in steps]).double().cpu().numpy()
        flops_split = torch.stack([self.flops[s] for s in steps]).double().cpu().numpy()
        flops = flops_split.sum(axis=1)
        positions = np.array([self.positions[s] for s in steps], dtype=np.float64)
        windows = self.windows(tokens, flops, profiled_from)
        steady = [w for w in windows if w["first_step"] > warmup_steps and not w["compiles"] and not w["profiled"]]
        result = {"steps": len(steps), "loss": [round(x, 5) for x in torch.stack([self.losses[s] for s in steps])
                                                .tolist()], "windows": windows,
                  "real_tokens": tokens.astype(np.int64).tolist(),
                  "padding_fraction": round(float(1 - tokens.sum() / positions.sum()), 4),
                  "real_tokens_per_step": round(float(tokens.mean()), 1), "batch_shapes": len(self.shapes),
                  "attention_flops_fraction": round(float(flops_split[:, 1].sum() / flops.sum()), 4)}
        if self.cross_entropy:
            result["cross_entropy"] = [round(x, 5) for x in torch.stack([self.cross_entropy[s] for s in steps])
                                       .tolist()]
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
            mfu=round(float(flops[chosen].sum() / seconds / (peak * 1e12)), 4) if peak else None,
        )
        return result


def record_steps(trainer, recorder: StepRecorder, cross_entropy: bool) -> None:
    """``trainer``'s training steps feed ``recorder`` (wrapped on this trainer alone: callbacks see no batch): each
    micro-batch counted before its step, its loss after; with ``cross_entropy``, the loss's cross-entropy part too
    (FAT5 returns it beside the z-loss; asked for without the logits, which the job's own steps do not read)."""
    training_step, compute_loss = trainer.training_step, trainer.compute_loss

    def recorded_step(model, inputs, *args, **kwargs):
        step = trainer.state.global_step + 1  # the step being made is the one after those done
        recorder.measure(step, inputs)
        loss = training_step(model, inputs, *args, **kwargs)
        recorder.add_loss(step, loss)
        return loss

    def loss_and_parts(model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            return compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss, outputs = compute_loss(model, {**inputs, "return_logits": False}, True, num_items_in_batch)
        recorder.add_loss(trainer.state.global_step + 1, outputs.ce_loss, store="cross_entropy")
        return (loss, outputs) if return_outputs else loss

    trainer.training_step = recorded_step
    if cross_entropy:
        trainer.compute_loss = loss_and_parts


def hooks_callback(hooks, recorder: StepRecorder, device: torch.device):
    """A TrainerCallback calling ``hooks`` at the end of every optimizer step, the clock started before the first."""
    from transformers import TrainerCallback

    class StepHooks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                recorder.tick(0, device)

        def on_step_end(self, args, state, control, **kwargs):
            for hook in hooks:
                hook(state.global_step)

    return StepHooks()


def measured(train, recorder: StepRecorder, args, label: str, trainer=None) -> dict:
    """``train(hooks)`` timed by ``recorder``'s clock (``hooks``: what to call at the end of each step, given to
    ``trainer`` as a callback when there is one), under ``--profile``'s profiler; the run's summary."""
    device = torch.device(args.device)
    profiler = None
    hooks = [functools.partial(recorder.tick, device=device)]
    if args.profile:
        profiler = StepProfiler(args.profile, args.steps, device, args.out.replace(".json", "_profile.txt"), label)
        # before the clock, whose window ends synchronise: the timed step's end comes first
        hooks.insert(0, profiler.step_ended)
    if trainer is not None:
        trainer.add_callback(hooks_callback(hooks, recorder, device))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    train(hooks)
    # the timing starts at the end of the step before the timed one, with a synchronisation
    result = recorder.summary(args.warmup_steps, args.peak_tflops, profiler and profiler.timed_step - 1)
    if profiler is not None:
        result["profile"] = profiler.result
        if "profiled_gflop_per_step" in result and args.peak_tflops:
            result["profile"]["time_bounds"] = time_bounds(result, args.attention_bound_tflops, args.peak_tflops,
                                                           TARGET_MFU.get(args.shape, TARGET_MFU["base"]))
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    if device.type == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return result


def by_shape(shapes: list[str], seconds: list[float]) -> list[dict]:
    """The first step's seconds of each batch shape, in the order met."""
    return [{"shape": shape, "seconds": value} for shape, value in zip(shapes, seconds)]


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
