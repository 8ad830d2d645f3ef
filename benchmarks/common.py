"""What every benchmark shares: the machine and versions it ran on, and how results are written."""

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import sys

import numpy as np
import torch


def environment() -> dict:
    """GPU (or CPU), library versions, date and the exact command, for a result file."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(part) for part in [os.path.basename(sys.executable)] + sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    for package in ("triton", "transformers", "liger_kernel"):
        try:  # the installed distribution's version: liger_kernel's module has no __version__
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        info["gpu"] = properties.name
        info["gpu_memory_gib"] = round(properties.total_memory / 2**30, 1)
        info["gpu_count"] = torch.cuda.device_count()
    else:
        info["gpu"] = None
    return info


def write_result(path: str, results, **extra) -> dict:
    """Write ``{"environment": ..., "results": ...}`` as JSON (to a temporary name, then renamed)."""
    document = {"environment": environment(), **extra, "results": results}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = f"{path}.tmp"
    with open(temporary, "w") as handle:
        json.dump(document, handle, indent=2)
    os.replace(temporary, path)
    return document


def draw_beside(plot, document: dict, result_path: str) -> None:
    """``plot(document, png_path)`` to the PNG beside the result file; without matplotlib, say how to draw it later."""
    try:
        plot(document, result_path.replace(".json", ".png"))
    except ImportError as error:
        print(f"no plot ({error}); draw it later with --plot-only {result_path}")


def redraw(plot, result_path: str) -> None:
    """``--plot-only``: the PNG again from an existing result file (no GPU needed)."""
    with open(result_path) as handle:
        plot(json.load(handle), result_path.replace(".json", ".png"))


def parse_or_plot(parser: argparse.ArgumentParser, plot, argv=None) -> argparse.Namespace | None:
    """The script's arguments, ``--plot-only JSON`` added; None once that option has redrawn the result's PNG."""
    parser.add_argument("--plot-only", metavar="JSON", help="redraw the PNG from an existing result file")
    args = parser.parse_args(argv)
    if args.plot_only:
        redraw(plot, args.plot_only)
        return None
    return args


def kernel_benchmark(description: str, out: str, run, plot, table, sweep_help: str, profile_help: str) -> None:
    """The command line of a fused op's benchmark (cross_entropy.py, rms_norm.py): ``--out`` (default ``out``),
    ``--sweep`` over launch configurations, ``--profile``, ``--plot-only``; ``run(args)`` measures and returns the
    result document, whose table (``table(document)``: its rows and columns) is printed and plot drawn beside it."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=out)
    parser.add_argument("--sweep", action="store_true", help=sweep_help)
    parser.add_argument("--profile", action="store_true", help=profile_help)
    args = parse_or_plot(parser, plot)
    if args is None:
        return
    document = run(args)
    print(markdown_table(*table(document)))
    draw_beside(plot, document, args.out)


def save_png(figure, path: str, document: dict, title: str = "", dpi: int = 120) -> None:
    """The figure to `path`, titled `title` and the GPU, torch and triton of the result."""
    environment = document["environment"]
    versions = f"{environment.get('gpu')} - torch {environment.get('torch')}, triton {environment.get('triton')}"
    figure.suptitle(f"{title} - {versions}" if title else versions)
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy rate (bytes read + written), the ceiling the bandwidth floors are computed with."""
    import triton.testing

    source = torch.randn(2**28, device="cuda", dtype=torch.bfloat16)
    target = torch.empty_like(source)
    ms = triton.testing.do_bench(lambda: target.copy_(source), return_mode="median")
    return 2 * source.numel() * 2 / ms / 1e6


def cold_graph_ms(function, leaves, repeats=100) -> float:
    """Median device time of ``function`` replayed from a CUDA graph, L2 flushed before each replay as do_bench does.

    Kernels of tens to hundreds of µs behind a ``backward()`` call are timed by the host eagerly: the hand-off to
    the autograd engine's device thread takes it 0.2-0.6 ms, and that wait, not the kernels, sets the eager figure
    (an RMSNorm forward+backward measured 0.23-0.63 ms at d 512-1024 over four runs on one H100). The replay keeps
    only what the GPU does. ``leaves`` have their gradients reset around warm-up, capture and replays.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture (autograd allocates its buffers here)
        for _ in range(3):
            for leaf in leaves:
                leaf.grad = None
            function()
    torch.cuda.current_stream().wait_stream(side)
    for leaf in leaves:
        leaf.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        function()
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    for leaf in leaves:
        leaf.grad = None
    return sorted(start.elapsed_time(end) for start, end in events)[repeats // 2]


def kill_with_descendants(pid: int) -> None:
    """End a job that ran past its time: the process and every process under it. Its process group is not enough:
    torch's elastic agent starts each rank in a session of its own, and a process left alive runs on beside the next
    job (and holds the job's output pipes open, so reading them would wait for it)."""
    import psutil

    job = psutil.Process(pid)
    processes = [job, *job.children(recursive=True)]
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(processes, timeout=30)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(column, "")) for column in columns) + " |")
    return "\n".join(lines)


def curve_differences(candidate: list[float], reference: list[float], smoothing: int) -> dict:
    """Relative differences |candidate - reference| / reference per step, and of the moving averages over
    ``smoothing`` steps, over the steps before either curve first turns NaN or infinite (``steps_compared``)."""
    candidate, reference = np.array(candidate, dtype=np.float64), np.array(reference, dtype=np.float64)
    length = min(len(candidate), len(reference))
    finite = np.isfinite(candidate[:length]) & np.isfinite(reference[:length])
    length = int(np.argmin(finite)) if not finite.all() else length
    if length < smoothing:
        raise ValueError(f"only {length} finite steps to compare: fewer than the smoothing window ({smoothing})")
    candidate, reference = candidate[:length], reference[:length]
    per_step = np.abs(candidate - reference) / reference
    window = np.ones(smoothing) / smoothing
    smooth_candidate = np.convolve(candidate, window, mode="valid")
    smooth_reference = np.convolve(reference, window, mode="valid")
    smoothed = np.abs(smooth_candidate - smooth_reference) / smooth_reference
    return {
        "steps_compared": length,
        "step_1": float(f"{per_step[0]:.3g}"),
        "mean": float(f"{per_step.mean():.3g}"),
        "max": float(f"{per_step.max():.3g}"),
        "smoothed_mean": float(f"{smoothed.mean():.3g}"),
        "smoothed_max": float(f"{smoothed.max():.3g}"),
    }


def t5_carrying_weights_of(fat5, **config_fields):
    """transformers' ``T5ForConditionalGeneration`` of ``config_fields`` holding a copy of ``fat5``'s weights (the
    names are T5's on both sides), its output layer untied as T5 v1.1's; checked parameter by parameter."""
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(**config_fields))
    if t5.lm_head.weight is t5.shared.weight:
        # some transformers 5 releases tie T5's output layer whatever the config says; v1.1's is its own
        t5.lm_head.weight = torch.nn.Parameter(t5.shared.weight.detach().clone())
    missing, unexpected = t5.load_state_dict(fat5.state_dict(), strict=False)
    missing = [name for name in missing if not name.endswith("embed_tokens.weight")]
    if missing or unexpected:
        raise SystemExit(f"FAT5's weights do not map onto T5's: missing {missing}, unexpected {unexpected}")
    for name, parameter in t5.named_parameters():
        if not torch.equal(parameter, fat5.get_parameter(name)):
            raise SystemExit(f"{name} differs between the two models after the copy")
    return t5


# (kind, substrings of its CUDA kernels' names); the first kind that matches a kernel takes it. Inductor names its
# kernels triton_* after the ops they fuse (triton_poi_fused_add_rms_norm_backward_...): they come first
KERNEL_KINDS = (
    ("fused by Inductor", ("triton_",)),
    # FAT5's Triton kernels, flash-attn-4's (FlashAttention*), FAT5's Hopper T5 kernels built on them (T5Bias*) and
    # their table gradient's band pass; before "matrix products", which CUTLASS's names would match
    ("attention backward", ("_attention_backward", "_backward_preprocess", "FlashAttentionBackward",
                            "T5BiasBackward", "_t5_band_")),
    ("attention forward", ("_attention_forward", "_split_combine", "FlashAttentionForward", "T5BiasForward")),
    ("T5 bias table", ("_t5_",)),
    ("matrix products", ("gemm", "nvjet", "xmma", "cutlass", "splitKreduce")),
    ("RMSNorm", ("_rms_norm",)),
    ("activation", ("_activation",)),
    ("cross-entropy", ("_cross_entropy",)),
    ("optimizer", ("FusedOptimizer", "multi_tensor_apply")),
)


def kernel_kind(name: str) -> str:
    return next((kind for kind, parts in KERNEL_KINDS if any(part in name for part in parts)),
                "other (copies, fills, reductions)")


def kernel_ms_by_kind(profiler, steps: int) -> dict[str, float]:
    """GPU milliseconds per step of a finished ``torch.profiler.profile`` of ``steps`` steps, by kind of kernel,
    most first. Kernels replayed from CUDA graphs count one by one: CUPTI records each kernel of a graph launch.
    The GPU-side ranges of annotations (``record_function``, Inductor's graph calls), which ``record_shapes``
    brings onto the device's timeline over the kernels they hold, are not kernels."""
    by_kind = {}
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
            kind = kernel_kind(event.name)
            by_kind[kind] = by_kind.get(kind, 0.0) + event.device_time / 1e3 / steps
    return {kind: round(ms, 3) for kind, ms in sorted(by_kind.items(), key=lambda item: -item[1])}


# dense bf16 peak of the GPUs the MFU figures are given for (H100 SXM; the H200 has the H100's compute)
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_tflops(gpu_name: str | None) -> float | None:
    """The dense bf16 peak of a GPU by its name, None for a CPU or an unknown GPU."""
    return next((value for key, value in PEAK_BF16_TFLOPS.items() if gpu_name and key in gpu_name), None)


def parameter_counts(model) -> dict[str, int]:
    """Parameters a token touches: ``encoder`` (per encoder token), ``decoder`` (per decoder token, without the
    output layer) and ``lm_head`` (per decoder token); the embeddings are lookups and count for nothing."""
    named = dict(model.named_parameters())
    counts = {side: sum(p.numel() for n, p in named.items() if n.startswith(f"{side}.") and "embed" not in n)
              for side in ("encoder", "decoder")}
    counts["lm_head"] = model.lm_head.weight.numel()
    return counts


def model_flops(encoder_lengths, decoder_lengths, counts: dict[str, int], config) -> tuple:
    """Model FLOPs of a training step (forward + backward) on examples of these encoder and decoder lengths (numpy
    arrays or tensors, one entry per example, each attending to itself only): ``(dense, attention)``.

    dense     = 6 x (encoder parameters x encoder tokens + (decoder + lm_head parameters) x decoder tokens)
    attention = 3.5 x 4·H·D·(encoder layers x Σ Le² + decoder layers x Σ (Ld²/2 + Ld·Le))

    (forward + backward attention is 3.5 x the forward; the decoder's causal self-attention is halved).
    ``counts``: :func:`parameter_counts`; ``config``: num_heads, d_kv, num_layers, num_decoder_layers."""
    dense = 6 * (counts["encoder"] * encoder_lengths.sum()
                 + (counts["decoder"] + counts["lm_head"]) * decoder_lengths.sum())
    forward = 4 * config.num_heads * config.d_kv * (
        config.num_layers * (encoder_lengths**2).sum()
        + config.num_decoder_layers * (decoder_lengths**2 / 2 + decoder_lengths * encoder_lengths).sum()
    )
    return dense, 3.5 * forward
