"""Where a greedy decoding step's time goes: FAT5's ``generate`` (on a GPU its graphed decoding path), FAT5's
modules under transformers' loop (``graphed_decoding="never"``) and transformers' T5, the last two with the static
cache that ``generate`` compiles (CUDA graphs); T5 v1.1-base shape, bf16, random weights shared by all,
``--input-length`` input tokens, ``--new-tokens`` generated (EOS suppressed, so every row makes them all).

Per implementation and batch: tokens/s and wall milliseconds a step (the third call, after two that compile and
warm up), the first call's seconds (compilation), then one profiled call of ``--profiled-tokens`` steps: the
device's kernel milliseconds a step (the sum of every kernel's duration), kernels a step, host API calls
(synchronisations, copies, launches) and the kernels that take the most time. Wall time well above kernel time
means the step waits for the host (Python, ``generate``'s bookkeeping, launches), not for the GPU.

    python benchmarks/generation_profile.py --out benchmarks/results/generation_profile.json
    python benchmarks/generation_profile.py --tiny      # the path on a CPU (no kernels to count)
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import draw_beside, markdown_table, parse_or_plot, save_png, t5_carrying_weights_of, write_result

from fat5.testing import TINY_MODEL_FIELDS, TINY_VOCAB_SIZE

BASE = {"d_model": 768, "d_kv": 64, "d_ff": 2048, "num_layers": 12, "num_decoder_layers": 12, "num_heads": 12,
        "vocab_size": 32128}
TINY = {**TINY_MODEL_FIELDS, "vocab_size": TINY_VOCAB_SIZE}
HOST_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaGraphLaunch",
              "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "aten::item")


def build_models(shape: dict, device: str, dtype: torch.dtype) -> dict:
    """FAT5 and transformers' T5 with the same random weights (T5 v1.1 layout: gated-GELU, untied head)."""
    from fat5 import FAT5Config, FAT5ForConditionalGeneration

    common = {**shape, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, "dropout_rate": 0.0,
              "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}
    torch.manual_seed(0)
    fat5 = FAT5ForConditionalGeneration(FAT5Config(**common))
    t5 = t5_carrying_weights_of(fat5, **common)
    return {"fat5": fat5.to(device, dtype).eval(), "transformers": t5.to(device, dtype).eval()}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_generate(model, ids, device: str, **options) -> tuple[torch.Tensor, float]:
    started = time.perf_counter()
    with torch.no_grad():
        sequences = model.generate(ids, **options)
    synchronize(device)
    return sequences, time.perf_counter() - started


def profile_generate(model, ids, device: str, **options) -> dict:
    """Kernel time, kernel count and host calls of one call of ``generate``, per decoding step."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        _, wall = timed_generate(model, ids, device, **options)
    events = profiler.key_averages()
    kernels = [event for event in events if event.device_type == torch.autograd.DeviceType.CUDA]
    steps = options["max_new_tokens"]
    top = sorted(kernels, key=lambda event: -event.device_time_total)[:15]
    return {
        "profiled_ms_per_step": round(1e3 * wall / steps, 3),
        "kernel_ms_per_step": round(sum(event.device_time_total for event in kernels) / 1e3 / steps, 3),
        "kernels_per_step": round(sum(event.count for event in kernels) / steps, 1),
        "host_calls": {event.key: event.count for event in events if event.key in HOST_CALLS},
        "top_kernels": [[event.key[:90], event.count, round(event.device_time_total / 1e3, 3)] for event in top],
    }


def measure(models: dict, batch: int, args, device: str) -> list[dict]:
    ids = torch.randint(2, models["fat5"].config.vocab_size - 1, (batch, args.input_length), device=device)
    options = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": False,
               "cache_implementation": "static"}
    rows, sequences = [], {}
    fat5 = models["fat5"]
    # FAT5 as `generate` runs it (the graphed decoding path), and its modules under transformers' loop and cache
    runs = [("fat5", fat5, "auto"), ("fat5-modules", fat5, "never"), ("transformers", models["transformers"], None)]
    for name, model, graphed_decoding in runs:
        if graphed_decoding is not None:
            fat5.config.graphed_decoding = graphed_decoding
        _, first = timed_generate(model, ids, device, **options)
        timed_generate(model, ids, device, **options)
        sequences[name], wall = timed_generate(model, ids, device, **options)
        short = dict(options, max_new_tokens=args.profiled_tokens, min_new_tokens=args.profiled_tokens)
        rows.append({"implementation": name, "batch": batch, "input_length": args.input_length,
                     "new_tokens": args.new_tokens, "tokens_per_second": round(batch * args.new_tokens / wall, 1),
                     "ms_per_step": round(1e3 * wall / args.new_tokens, 3), "first_call_s": round(first, 1),
                     **profile_generate(model, ids, device, **short)})
        print({key: value for key, value in rows[-1].items() if key != "top_kernels"}, flush=True)
    # random weights give nearly flat logits: bf16 rounding alone can flip a greedy choice, so this is a record
    for row in rows:
        row["same_greedy_ids"] = bool(torch.equal(sequences["fat5"], sequences["transformers"]))
    return rows


def plot(document: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in document["results"] if "implementation" in row]
    labels = [f"{row['implementation']}\nbatch {row['batch']}" for row in rows]
    positions = range(len(rows))
    figure, axis = plt.subplots(figsize=(10, 4.5))
    axis.bar([p - 0.2 for p in positions], [row["ms_per_step"] for row in rows], width=0.4, label="wall ms / step")
    axis.bar([p + 0.2 for p in positions], [row.get("kernel_ms_per_step", 0.0) for row in rows], width=0.4,
             label="kernel ms / step (device busy)")
    axis.set_xticks(list(positions), labels)
    axis.set_ylabel("milliseconds per decoding step")
    axis.legend()
    save_png(figure, path, document, title="Greedy decoding step, base shape")
    plt.close(figure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-length", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--profiled-tokens", type=int, default=32, help="steps of the profiled call")
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU: checks the path, no figures")
    parser.add_argument("--out", default="benchmarks/results/generation_profile.json")
    args = parse_or_plot(parser, plot, argv)
    if args is None:
        return
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.tiny:
        raise SystemExit("no CUDA device: run with --tiny to check the path on a CPU")
    if args.tiny:
        args.batches, args.input_length, args.new_tokens, args.profiled_tokens = [1, 2], 16, 8, 4
    models = build_models(TINY if args.tiny else BASE, device, torch.float32 if args.tiny else torch.bfloat16)
    rows = []
    for batch in args.batches:
        rows.extend(measure(models, batch, args, device))
    document = write_result(args.out, rows, shape="tiny" if args.tiny else "base",
                            settings={key: value for key, value in vars(args).items() if key != "plot_only"})
    draw_beside(plot, document, args.out)
    print(markdown_table(rows, ["implementation", "batch", "tokens_per_second", "ms_per_step", "kernel_ms_per_step",
                                "kernels_per_step", "first_call_s"]))


if __name__ == "__main__":
    main()
