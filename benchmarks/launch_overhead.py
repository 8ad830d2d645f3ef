"""What ``launch.CachedLauncher`` buys a whole model: FAT5 with Triton's own launch path against the cached one.

One T5 v1.1-base-shaped FAT5 (bf16), one process; the two launch paths alternate (``launch.set_plain_launch``)
for ``--rounds`` rounds, so that a drift of the host or the GPU hits both alike. Measured: training steps (forward,
backward, fused AdamW; CUDA events, median of 5) at the batch shapes where the eager step is host-bound, and greedy
decoding of 64 tokens after a 512-token input.

    python benchmarks/launch_overhead.py --out benchmarks/results/launch_overhead.json
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, write_result
from model import build_models, random_batch, time_ms, train_step_factory

TRAINING_SHAPES = ((16, 1024), (32, 1024), (1, 8192))  # (batch, encoder length); decoder a quarter
GENERATION_BATCHES = (1, 32)
PATHS = ("plain", "cached")


def use_path(path: str) -> None:
    from fat5.kernels.launch import set_plain_launch

    set_plain_launch(path == "plain")


def training_rates(model, batch, length, rounds) -> dict:
    input_ids, labels = random_batch(batch, length, length // 4, 32128)
    step, _ = train_step_factory(model, input_ids, labels)
    tokens = batch * (length + length // 4)
    rates = {path: [] for path in PATHS}
    for _ in range(rounds):
        for path in PATHS:
            use_path(path)
            rates[path].append(tokens / time_ms(step) * 1e3)
    return rates


def generation_rates(model, batch, rounds, new_tokens=64) -> dict:
    input_ids, _ = random_batch(batch, 512, 1, 32128, seed=batch)

    def generate(count):
        return model.generate(input_ids=input_ids, max_new_tokens=count, min_new_tokens=count, do_sample=False)

    rates = {path: [] for path in PATHS}
    with torch.no_grad():
        for _ in range(rounds):
            for path in PATHS:
                use_path(path)
                generate(8)
                torch.cuda.synchronize()
                started = time.perf_counter()
                generate(new_tokens)
                torch.cuda.synchronize()
                rates[path].append(batch * new_tokens / (time.perf_counter() - started))
    return rates


def row(kind, shape, rates) -> dict:
    plain, cached = (statistics.median(rates[path]) for path in PATHS)
    return {"measure": kind, "shape": shape, "plain_tokens_per_second": round(plain),
            "cached_tokens_per_second": round(cached), "speedup": round(cached / plain, 3),
            "rounds": {path: [round(rate) for rate in rates[path]] for path in PATHS}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/launch_overhead.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/launch_overhead.py needs a CUDA GPU")
    model = build_models("base", ["fat5"])["fat5"]
    rows = []
    for batch, length in TRAINING_SHAPES:
        rows.append(row("training", f"batch {batch}, encoder {length}",
                        training_rates(model, batch, length, args.rounds)))
        print(rows[-1], flush=True)
    model.eval()
    for batch in GENERATION_BATCHES:
        rows.append(row("greedy generation", f"batch {batch}, 512 -> 64", generation_rates(model, batch, args.rounds)))
        print(rows[-1], flush=True)
    use_path("cached")
    write_result(args.out, rows)
    print(markdown_table(rows, ["measure", "shape", "plain_tokens_per_second", "cached_tokens_per_second", "speedup"]))


if __name__ == "__main__":
    main()
