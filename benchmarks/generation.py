r"""Greedy decoding, FAT5 against transformers' T5ForConditionalGeneration: T5 v1.1-base shape in bf16, the same
random weights on both sides, every row of a batch decoding ``--new-tokens`` tokens (min_new_tokens =
max_new_tokens), inputs of ``--input-lengths`` random tokens.

Implementations: ``fat5`` (FAT5's ``generate`` as a user calls it), ``transformers-static``
(``cache_implementation="static"``, with which ``generate`` compiles the decoding step: torch.compile,
reduce-overhead, CUDA graphs), ``transformers-dynamic`` (its default cache, eager), and on request ``fat5-static``
(FAT5 with transformers' static cache, compiled by ``generate`` the same way).

Per implementation, batch and input length, after ``torch._dynamo.reset()`` (each shape's first call is a fresh
process's; ``--keep-compiled`` leaves compiled code between shapes): the first call's seconds (compilation, graph
capture), then one timed call: tokens/s (batch x new tokens / its wall time), ms a step (wall / new tokens) and a
decoding step without the encoder ((wall - time to first token) / (new tokens - 1)), the peak of
``torch.cuda.max_memory_allocated()`` during it (both models' weights, 1 GiB, included) and of the memory reserved over
both calls (CUDA graphs' pools); then the time to first token (the median of three calls with max_new_tokens=1). An
out-of-memory error, or any other, is recorded in the row and the run goes on. Every implementation's ids are compared
with transformers' (static cache if measured): the fraction of equal tokens and the first step where a row differs. In
bf16 random weights give nearly flat logits, where one rounding flips a greedy choice, so the exact check runs in fp32:
both models in fp32, batch 4, input 512, 32 new tokens, their ids must be equal (``--no-exactness`` skips it).
Each row also says how near the step is to its floor: ``step_mb``, the bytes a decoding step must read at the least
(:func:`decode_step_bytes`: the decoder's and output layer's weights, every layer's cached cross-attention keys and
values and the self-attention cache so far), ``floor_ms``, the time those bytes take at the device's memory bandwidth
(given with ``--bandwidth-tb-s``, else that of a device-to-device copy measured at the start of the run, kept as
``copy_bandwidth_tb_s`` in the run's environment), and ``floor_fraction``, ``floor_ms`` over ``decode_ms_per_step``
(1.0: the step runs at the memory's pace; 0.4: it takes 2.5 times the floor).
``--count-kernels`` adds ``kernels_per_step`` to each row: the profiler's count of GPU kernels in a call of
``--new-tokens`` less that of the time-to-first-token call, over the steps between (kernels replayed from a CUDA
graph count one by one).

GPU time is scarce. The default grid (3 implementations x 4 batches x 2 input lengths) should take about 7
minutes on an H100 (an estimate: transformers compiles every shape for 25-40 s, the rest is seconds a shape), so
it runs in calls of a few minutes each, each with its own result file (rewritten after every shape: a call stopped
by a time limit keeps what it measured), merged afterwards on any machine:

    python benchmarks/generation.py --input-lengths 512 --out runs/generation_512.json            # ~4 min
    python benchmarks/generation.py --input-lengths 4096 --no-exactness --out runs/generation_4096.json
    python benchmarks/generation.py --long --no-exactness --out runs/generation_long.json        # ~1 min
    python benchmarks/generation.py --merge runs/generation_512.json runs/generation_4096.json \
        runs/generation_long.json --out benchmarks/results/generation.json
    python benchmarks/generation.py --tiny --out /tmp/generation.json    # every path on a CPU, in seconds

``--batches``, ``--input-lengths`` and ``--implementations`` pick smaller subsets. ``--long`` measures, instead of
the grid, FAT5 alone at batch 1 on a ``--long-length`` (65,536) token input (transformers' T5 materialises (batch,
heads, L, L) scores and cannot encode it: ``--long-transformers`` tries it and records the error). The result file
holds the rows, FAT5 / transformers tokens/s ratios of each (batch, input) whose two rows come from one run, the
environment of each run (``runs``; each row names its own); a PNG beside it (tokens/s by batch, one panel per input
length, log scales) and markdown tables printed.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import draw_beside, environment, markdown_table, parse_or_plot, save_png, write_result
from generation_profile import BASE, TINY, build_models, timed_generate

# implementation -> (model built by build_models, generate's extra options)
IMPLEMENTATIONS = {
    "fat5": ("fat5", {}),
    "fat5-static": ("fat5", {"cache_implementation": "static"}),
    "transformers-static": ("transformers", {"cache_implementation": "static"}),
    "transformers-dynamic": ("transformers", {}),
}
DEFAULT_IMPLEMENTATIONS = ["fat5", "transformers-static", "transformers-dynamic"]
# the ids every other implementation is compared with: the first of these that was measured
REFERENCES = ("transformers-static", "transformers-dynamic")
TINY_SETTINGS = {"batches": [1, 2], "input_lengths": [16, 24], "new_tokens": 4, "long_length": 64,
                 "exactness": (2, 16, 4)}
EXACTNESS = (4, 512, 32)  # batch, input length, new tokens of the fp32 check
GRID_COLUMNS = ["implementation", "batch", "input_length", "tokens_per_second", "ms_per_step", "decode_ms_per_step",
                "floor_ms", "floor_fraction", "time_to_first_token_ms", "first_call_s", "peak_gib",
                "equal_token_fraction", "first_divergent_step", "error"]
COPIED_BYTES = 2**30  # per copy of the bandwidth measurement: far beyond any GPU's L2 cache


class Progress:
    """Lines prefixed with the seconds since the start, flushed at once: GPU time is counted, the log says where."""

    def __init__(self):
        self.started = time.perf_counter()

    def __call__(self, message) -> None:
        print(f"[{time.perf_counter() - self.started:6.1f} s] {message}", flush=True)


def release(device: str, keep_compiled: bool = False) -> None:
    """A fresh process's state for the next shape: compiled code and CUDA graphs dropped (unless ``keep_compiled``),
    the allocator emptied."""
    if not keep_compiled:
        torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def gib(count: int) -> float:
    return round(count / 2**30, 2)


def time_generation(model, ids, options: dict, device: str) -> tuple[dict, torch.Tensor]:
    """First call, timed call and time to first token of one implementation at one shape (``measure_shape``'s row)."""
    batch, new_tokens = ids.shape[0], options["max_new_tokens"]
    _, first = timed_generate(model, ids, device, **options)
    reserved = torch.cuda.max_memory_reserved() if device == "cuda" else None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sequences, wall = timed_generate(model, ids, device, **options)
    if device == "cuda":
        peak, reserved = gib(torch.cuda.max_memory_allocated()), gib(max(reserved, torch.cuda.max_memory_reserved()))
    else:
        peak = None
    one_token = dict(options, max_new_tokens=1, min_new_tokens=1)
    first_token = statistics.median(timed_generate(model, ids, device, **one_token)[1] for _ in range(3))
    row = {"tokens_per_second": round(batch * new_tokens / wall, 1), "ms_per_step": round(1e3 * wall / new_tokens, 3),
           "decode_ms_per_step": round(1e3 * (wall - first_token) / (new_tokens - 1), 3) if new_tokens > 1 else None,
           "time_to_first_token_ms": round(1e3 * first_token, 2), "first_call_s": round(first, 3),
           "peak_gib": peak, "peak_reserved_gib": reserved}
    return row, sequences[:, -new_tokens:].cpu()


def decode_step_bytes(config, batch: int, input_length: int, new_tokens: int, element_bytes: int) -> int:
    """The bytes a decoding step of T5 ``config``'s decoder must read at the least, averaged over the steps that
    ``decode_ms_per_step`` times (all but the first): the decoder's weights (cross-attention's key and value
    projections left out: every implementation measured projects the encoder's output with them once, before the
    steps), the output layer's and the tokens' embedding rows; per sequence, every layer's cached cross-attention keys
    and values and its self-attention cache filled so far (step t, counted from 0, reads t + 1 positions, so the steps
    1 .. new_tokens - 1 read (new_tokens + 2) / 2 on average). Logits and cache writes are a few kilobytes: left out."""
    d_model, inner, layers = config.d_model, config.num_heads * config.d_kv, config.num_decoder_layers
    feed_forward_inputs = 2 if config.is_gated_act else 1
    attention = 3 * d_model * inner + inner * d_model + d_model * inner + inner * d_model  # qkv, o; cross q, o
    per_layer = attention + (feed_forward_inputs + 1) * d_model * config.d_ff + 3 * d_model  # + three norms
    bias_table = config.relative_attention_num_buckets * config.num_heads
    weights = layers * per_layer + d_model + bias_table + config.vocab_size * d_model + batch * d_model
    cached_positions = input_length + (new_tokens + 2) / 2
    caches = batch * layers * 2 * inner * cached_positions
    return round((weights + caches) * element_bytes)


def copy_bandwidth_tb_s(device: str) -> float | None:
    """The device memory's pace in TB/s: a device-to-device copy of ``COPIED_BYTES`` (read once, written once), the
    best of 10 after a warm-up. The floor is taken at this pace, which no decoding kernel beats by much; None off
    the GPU."""
    if device != "cuda":
        return None
    source = torch.empty(COPIED_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    seconds = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    del source, target
    torch.cuda.empty_cache()
    return round(2 * COPIED_BYTES / min(seconds) / 1e12, 3)


def bandwidth_floor(model, batch: int, input_length: int, new_tokens: int, bandwidth_tb_s: float | None,
                    decode_ms: float | None) -> dict:
    """A row's ``step_mb``, ``floor_ms`` and ``floor_fraction`` (see the module's docstring); the last two None
    without a bandwidth, the fraction None without a positive step time."""
    step_bytes = decode_step_bytes(model.config, batch, input_length, new_tokens, model.dtype.itemsize)
    floor_ms = None if bandwidth_tb_s is None else float(f"{step_bytes / (bandwidth_tb_s * 1e12) * 1e3:.4g}")
    fraction = float(f"{floor_ms / decode_ms:.3g}") if floor_ms is not None and decode_ms and decode_ms > 0 else None
    return {"step_mb": round(step_bytes / 1e6, 3), "floor_ms": floor_ms, "floor_fraction": fraction}


def kernels_per_step(model, ids, options: dict, device: str) -> float | None:
    """GPU kernels launched by one decoding step: a call of ``options``' new tokens less a call of one new token (the
    encoder, the first step and the set-up cancel), over the steps between; both calls already warm (compiled,
    captured) from ``time_generation``. None off the GPU."""
    new_tokens = options["max_new_tokens"]
    if device != "cuda" or new_tokens < 2:
        return None
    counts = []
    for steps in (1, new_tokens):
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profiler:
            timed_generate(model, ids, device, **dict(options, max_new_tokens=steps, min_new_tokens=steps))
        counts.append(sum(event.count for event in profiler.key_averages()
                          if event.device_type == torch.autograd.DeviceType.CUDA))
    return round((counts[1] - counts[0]) / (new_tokens - 1), 1)


def error_summary(error: Exception) -> str:
    """"OOM" for an out-of-memory error (compiled code and CUDA graphs raise it as a RuntimeError too), else the
    error's type and first line, its traceback printed for the log."""
    message = str(error).splitlines()[0] if str(error) else ""
    if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in message.lower():
        return "OOM"
    traceback.print_exc()
    return f"{type(error).__name__}: {message}"[:300]


def measure_shape(models: dict, implementations: list[str], batch: int, input_length: int, args, device: str,
                  progress: Progress, bandwidth_tb_s: float | None = None) -> list[dict]:
    """One row per implementation at (batch, input length), errors recorded in the row, the floor taken at
    ``bandwidth_tb_s``; ids compared at the end (``args``: the script's, for --new-tokens and --keep-compiled)."""
    generator = torch.Generator().manual_seed(1000 * batch + input_length)
    vocab_size = models["fat5"].config.vocab_size
    ids = torch.randint(2, vocab_size - 1, (batch, input_length), generator=generator).to(device)
    rows, sequences, new_tokens = [], {}, args.new_tokens
    for name in implementations:
        model_name, extra = IMPLEMENTATIONS[name]
        options = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "num_beams": 1,
                   **extra}
        row = {"implementation": name, "batch": batch, "input_length": input_length, "new_tokens": new_tokens}
        release(device, args.keep_compiled)
        progress(f"{name}, batch {batch}, input {input_length}: first call, timed call, time to first token")
        try:
            measured, sequences[name] = time_generation(models[model_name], ids, options, device)
            row.update(measured)
            row.update(bandwidth_floor(models[model_name], batch, input_length, new_tokens, bandwidth_tb_s,
                                       measured["decode_ms_per_step"]))
            if args.count_kernels:
                row["kernels_per_step"] = kernels_per_step(models[model_name], ids, options, device)
        except Exception as error:  # noqa: BLE001 - recorded: one failing shape must not cost the others
            row["error"] = error_summary(error)
        release(device, args.keep_compiled)
        progress({key: value for key, value in row.items() if key not in ("batch", "input_length", "new_tokens")})
        rows.append(row)
    compare_ids(rows, sequences)
    return rows


def divergence(ids: torch.Tensor, reference: torch.Tensor) -> tuple[float, int | None]:
    """The fraction of equal tokens, and the first step at which any row differs (None: all equal)."""
    equal = ids == reference
    differing_steps = (~equal).any(dim=0).nonzero()
    return round(float(equal.float().mean()), 4), int(differing_steps[0]) if len(differing_steps) else None


def compare_ids(rows: list[dict], sequences: dict) -> None:
    """Each row's ids against the first measured of REFERENCES (that row itself left without a comparison)."""
    reference = next((name for name in REFERENCES if name in sequences), None)
    for row in rows:
        name = row["implementation"]
        if reference is None or name == reference or name not in sequences:
            continue
        fraction, step = divergence(sequences[name], sequences[reference])
        row.update(ids_compared_with=reference, equal_token_fraction=fraction, first_divergent_step=step)


def exactness_fp32(shape: dict, device: str, batch: int, input_length: int, new_tokens: int) -> dict:
    """FAT5's ``generate`` against transformers' (default cache), both models in fp32 with the same weights: the ids
    must be equal. Also the largest logit difference over the steps up to the first divergent one (all if none)."""
    models = build_models(shape, device, torch.float32)
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(2, shape["vocab_size"] - 1, (batch, input_length), generator=generator).to(device)
    options = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "num_beams": 1,
               "return_dict_in_generate": True, "output_logits": True}
    with torch.no_grad():
        outputs = {name: model.generate(ids, **options) for name, model in models.items()}
    check = {"dtype": "float32", "batch": batch, "input_length": input_length, "new_tokens": new_tokens,
             **ids_agreement(outputs["fat5"], outputs["transformers"], new_tokens),
             "compared_with": "transformers-dynamic"}
    del models, outputs
    release(device)
    return check


def ids_agreement(output, reference, new_tokens: int) -> dict:
    """Whether ``output``'s new ids equal ``reference``'s, and the largest logit difference over the steps up to the
    first divergent one (all if none)."""
    fraction, step = divergence(output.sequences[:, -new_tokens:], reference.sequences[:, -new_tokens:])
    compared = new_tokens if step is None else step + 1
    difference = max(float((a.float() - b.float()).abs().max()) for a, b in
                     zip(output.logits[:compared], reference.logits[:compared]))
    return {"ids_equal": step is None, "equal_token_fraction": fraction, "first_divergent_step": step,
            "max_logit_difference": difference}


def tokens_per_second_ratios(rows: list[dict]) -> list[dict]:
    """Each FAT5 implementation's tokens/s over each transformers implementation's, one entry per (batch, input
    length), from rows measured in one run."""
    measured = {(row["implementation"], row["batch"], row["input_length"]): row for row in rows
                if row.get("tokens_per_second")}
    entries = {}
    for (name, batch, length), row in sorted(measured.items(), key=lambda item: item[0][1:]):
        if not name.startswith("fat5"):
            continue
        entry = entries.setdefault((batch, length), {"batch": batch, "input_length": length})
        for peer in REFERENCES:
            other = measured.get((peer, batch, length))
            if other is not None and other.get("run") == row.get("run"):
                entry[f"{name} / {peer}"] = round(row["tokens_per_second"] / other["tokens_per_second"], 3)
    return [entry for entry in entries.values() if len(entry) > 2]


def row_key(row: dict) -> tuple:
    return row["implementation"], row["batch"], row["input_length"]


def merged(documents: list[dict]) -> tuple[dict, list[dict]]:
    """The results and runs of result files in order: a later row of the same (implementation, batch, input
    length), or a later exactness check, replaces an earlier one; each row's ``run`` indexes the merged runs."""
    results, runs = {"grid": [], "long": [], "fp32_exactness": None}, []
    for document in documents:
        offset = len(runs)
        runs = runs + document["runs"]
        for part in ("grid", "long"):
            rows = [dict(row, run=row["run"] + offset) for row in document["results"][part]]
            keys = {row_key(row) for row in rows}
            results[part] = [row for row in results[part] if row_key(row) not in keys] + rows
        results["fp32_exactness"] = document["results"]["fp32_exactness"] or results["fp32_exactness"]
    results["ratios"] = tokens_per_second_ratios(results["grid"])
    return results, runs


def merge_files(paths: list[str], out: str) -> None:
    """``--merge``: result files of several calls (a grid split by input length, the long input) as one, its PNG
    and tables; no GPU needed."""
    documents = []
    for path in paths:
        with open(path) as handle:
            documents.append(json.load(handle))
    shapes = {document["shape"] for document in documents}
    if len(shapes) != 1:
        raise SystemExit(f"--merge: the files hold different model shapes {sorted(shapes)}; merge one shape's files")
    results, runs = merged(documents)
    document = write_result(out, results, shape=shapes.pop(), runs=runs, settings={"merged": paths})
    draw_beside(plot, document, out)
    print_tables(results)
    print(f"{len(paths)} files -> {out}")


def plot(document: dict, path: str) -> None:
    """Tokens/s by batch (log scales), one panel per input length; an implementation that failed at a batch says
    so in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = document["results"]["grid"]
    lengths = sorted({row["input_length"] for row in rows})
    if not lengths:
        return
    figure, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.5), squeeze=False)
    for axis, length in zip(axes[0], lengths):
        for index, name in enumerate(IMPLEMENTATIONS):
            mine = sorted((row for row in rows if row["implementation"] == name and row["input_length"] == length),
                          key=lambda row: row["batch"])
            if not mine:
                continue
            failed = [str(row["batch"]) for row in mine if row.get("error")]
            label = name + (f" (failed at batch {', '.join(failed)})" if failed else "")
            measured = [row for row in mine if not row.get("error")]
            axis.plot([row["batch"] for row in measured], [row["tokens_per_second"] for row in measured],
                      marker="o", color=f"C{index}", label=label)
        axis.set_xscale("log", base=2)
        batches = sorted({row["batch"] for row in rows if row["input_length"] == length})
        axis.set_xticks(batches, [str(batch) for batch in batches])
        axis.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
        axis.set_yscale("log")
        axis.set_xlabel("batch")
        axis.set_ylabel("new tokens / s")
        axis.set_title(f"input {length} tokens, {rows[0]['new_tokens']} new, greedy")
        axis.legend(fontsize=8)
    # a merged file's rows may come from several machines: the title names every run's GPU
    gpus = " + ".join(sorted({str(run.get("gpu")) for run in document["runs"]}))
    save_png(figure, path, {"environment": dict(document["runs"][-1], gpu=gpus)},
             title=f"Decoding, T5 v1.1-{document['shape']} shape")
    plt.close(figure)


def blank_nones(rows: list[dict]) -> list[dict]:
    return [{key: "" if value is None else value for key, value in row.items()} for row in rows]


def print_tables(results: dict) -> None:
    counted = any("kernels_per_step" in row for row in results["grid"] + results["long"])
    columns = GRID_COLUMNS + (["kernels_per_step"] if counted else [])
    print(markdown_table(blank_nones(results["grid"]), columns))
    if results["ratios"]:
        ratios = list(dict.fromkeys(key for entry in results["ratios"] for key in entry if "/" in key))
        print("\n" + markdown_table(results["ratios"], ["batch", "input_length", *ratios]))
    if results["long"]:
        print("\n" + markdown_table(blank_nones(results["long"]), columns))
    if results["fp32_exactness"]:
        print("\nfp32 exactness:", results["fp32_exactness"])


def parse_arguments(argv=None) -> argparse.Namespace | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--input-lengths", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--implementations", nargs="+", default=DEFAULT_IMPLEMENTATIONS, choices=IMPLEMENTATIONS)
    parser.add_argument("--keep-compiled", action="store_true",
                        help="no torch._dynamo.reset() between shapes: first_call_s then says whether a new shape "
                             "recompiles in a process that already decoded others (CUDA graphs' pools stay too)")
    parser.add_argument("--no-exactness", action="store_true", help="skip the fp32 ids check (in all calls but one)")
    parser.add_argument("--count-kernels", action="store_true",
                        help="add kernels_per_step to each row (GPU only: profiles two more calls a row)")
    parser.add_argument("--bandwidth-tb-s", type=float,
                        help="the memory bandwidth (TB/s) the rows' floor is taken at (default: measured on the GPU "
                             "at the start of the run; on a CPU no floor unless given)")
    parser.add_argument("--long", action="store_true",
                        help="instead of the grid: FAT5 at batch 1 on a --long-length input")
    parser.add_argument("--long-length", type=int, default=65536)
    parser.add_argument("--long-transformers", action="store_true",
                        help="with --long, also transformers' T5 (default cache), its out-of-memory error recorded")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="no measurement: merge these result files (later rows replace earlier ones of the same "
                             "implementation and shape) into --out, with its PNG and tables")
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU: checks every path, no figures")
    parser.add_argument("--out", default="benchmarks/results/generation.json")
    args = parse_or_plot(parser, plot, argv)
    if args is None:
        return None
    if args.tiny:
        args.batches, args.input_lengths = TINY_SETTINGS["batches"], TINY_SETTINGS["input_lengths"]
        args.new_tokens, args.long_length = TINY_SETTINGS["new_tokens"], TINY_SETTINGS["long_length"]
    if min(args.batches + args.input_lengths + [args.new_tokens, args.long_length]) < 1:
        parser.error("--batches, --input-lengths, --new-tokens and --long-length take positive numbers")
    if args.bandwidth_tb_s is not None and args.bandwidth_tb_s <= 0:
        parser.error(f"--bandwidth-tb-s takes a positive number of TB/s, not {args.bandwidth_tb_s}")
    if args.merge and args.out in args.merge:
        parser.error("--merge writes a new file: give an --out that is not one of the merged files")
    if args.long_transformers and not args.long:
        parser.error("--long-transformers goes with --long")
    return args


def save(args, results: dict, run: dict) -> dict:
    """This run's result file as it stands (written after every shape: a run stopped by a time limit keeps what it
    measured)."""
    for row in results["grid"] + results["long"]:
        row["run"] = 0
    results["ratios"] = tokens_per_second_ratios(results["grid"])
    settings = {key: value for key, value in vars(args).items() if key not in ("plot_only", "merge")}
    return write_result(args.out, results, shape="tiny" if args.tiny else "base", runs=[run], settings=settings)


def main(argv=None) -> None:
    args = parse_arguments(argv)
    if args is None:
        return
    if args.merge:
        return merge_files(args.merge, args.out)
    device = "cpu" if args.tiny else "cuda"
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny to check the path on a CPU")
    progress, shape, run = Progress(), TINY if args.tiny else BASE, environment()
    run["copy_bandwidth_tb_s"] = copy_bandwidth_tb_s(device)
    bandwidth = args.bandwidth_tb_s or run["copy_bandwidth_tb_s"]
    progress(f"device-to-device copy: {run['copy_bandwidth_tb_s']} TB/s; floors taken at {bandwidth} TB/s")
    results = {"grid": [], "long": [], "fp32_exactness": None}
    if not args.no_exactness:  # correctness first, and a run cut short by a time limit still has it
        exactness = TINY_SETTINGS["exactness"] if args.tiny else EXACTNESS
        try:
            results["fp32_exactness"] = exactness_fp32(shape, device, *exactness)
        except Exception as error:  # noqa: BLE001 - recorded: the speed grid is worth its GPU time all the same
            results["fp32_exactness"] = {"error": error_summary(error)}
            release(device)
        progress(f"fp32 exactness: {results['fp32_exactness']}")
    models = build_models(shape, device, torch.float32 if args.tiny else torch.bfloat16)
    progress(f"models built ({'tiny, fp32, CPU' if args.tiny else 'base, bf16'})")
    if args.long:
        names = ["fat5"] + (["transformers-dynamic"] if args.long_transformers else [])
        results["long"] = measure_shape(models, names, 1, args.long_length, args, device, progress, bandwidth)
    for input_length in [] if args.long else args.input_lengths:
        for batch in args.batches:
            results["grid"] += measure_shape(models, args.implementations, batch, input_length, args, device,
                                             progress, bandwidth)
            save(args, results, run)
    document = save(args, results, run)
    draw_beside(plot, document, args.out)
    print_tables(results)
    progress(f"-> {args.out}")


if __name__ == "__main__":
    main()
