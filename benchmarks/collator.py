"""Throughput of the UL2 collator on one CPU core, and the padding that packing leaves.

The target: a GPU step must never wait on the data, i.e. >= 5,000 examples of 1024 tokens per second per core.
Each example here is a 1022-token source (the inputs, with mode prefix and EOS, are at most 1024 tokens), drawn
with the FAT5 UL2 mixture. Three paths are timed, single process, after a warm-up:

* ``padded``: ``UL2DataCollator(packed=False)`` on lists of token sequences (plan + realize + pad + tensors);
* ``packed``: ``UL2DataCollator(packed=True)`` packing each call's examples itself;
* ``planned``: the map-style pipeline, ``UL2PackedBatchSampler`` + ``PlannedDataset`` + the collator through a
  ``DataLoader`` with no workers (planning of the epoch included in the time).

The padding fractions of packing on the built-in Shakespeare corpus (scenes, 1024-token rows) are recorded beside
naive padding (one example per row, random batches padded to their longest example).

    python benchmarks/collator.py [--seconds 3] [--out benchmarks/results/collator.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

from fat5.trainer.collator import UL2DataCollator
from fat5.trainer.data import shakespeare_texts
from fat5.trainer.packing import PlannedDataset, UL2PackedBatchSampler, padding_stats
from fat5.trainer.tokenizer import train_tokenizer
from fat5.trainer.ul2 import UL2Objective

SOURCE_LENGTH = 1022
MAX_INPUT_LENGTH = 1024
VOCAB = 32128


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def objective(max_target_length=None) -> UL2Objective:
    return UL2Objective(
        sentinel_ids=np.arange(VOCAB - 1, VOCAB - 1 - 256, -1),
        prefix_ids={"[R]": 3, "[S]": 4, "[X]": 5},
        eos_id=1,
        max_input_length=MAX_INPUT_LENGTH,
        max_target_length=max_target_length,
    )


def examples_per_second(step, examples_per_step: int, seconds: float, windows: int = 5) -> dict:
    """Run ``step`` for ``windows`` windows of ``seconds / windows`` each; the median window is the figure (other
    processes on a shared machine slow some windows down)."""
    step()  # warm-up
    rates = []
    for _ in range(windows):
        done = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds / windows:
            step()
            done += examples_per_step
        rates.append(done / (time.perf_counter() - start))
    median = float(np.median(rates))
    return {
        "examples_per_s": median,
        "tokens_per_s": median * SOURCE_LENGTH,
        "examples_per_s_windows": [round(r, 1) for r in rates],
    }


def bench_collators(seconds: float, batch_size: int) -> dict:
    rng = np.random.default_rng(0)
    features = [{"input_ids": rng.integers(6, VOCAB - 256, size=SOURCE_LENGTH)} for _ in range(batch_size)]
    results = {}
    for name, packed in (("padded", False), ("packed", True)):
        collator = UL2DataCollator(
            objective=objective(MAX_INPUT_LENGTH if packed else None), packed=packed, pad_token_id=0
        )
        timing = examples_per_second(lambda collator=collator: collator(features), batch_size, seconds)
        results[name] = {"batch_examples": batch_size, **timing}

    sources = [rng.integers(6, VOCAB - 256, size=SOURCE_LENGTH) for _ in range(4096)]
    collator = UL2DataCollator(objective=objective(MAX_INPUT_LENGTH), packed=True, pad_token_id=0)
    epoch = [0]

    def one_epoch():
        sampler = UL2PackedBatchSampler(
            [SOURCE_LENGTH] * len(sources), collator.objective, rows_per_batch=batch_size, split_long=False
        )
        sampler.set_epoch(epoch[0])
        epoch[0] += 1
        for _ in DataLoader(PlannedDataset(sources), batch_sampler=sampler, collate_fn=collator):
            pass

    results["planned"] = {"batch_rows": batch_size, **examples_per_second(one_epoch, len(sources), seconds)}
    return results


def padding_on_shakespeare() -> dict:
    texts = list(shakespeare_texts())
    tokenizer = train_tokenizer(texts, vocab_size=4096, num_sentinels=256, model="bpe")
    sequences = [np.asarray(x) for x in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]]
    lengths = [len(s) for s in sequences]
    collator = UL2DataCollator(tokenizer, max_input_length=MAX_INPUT_LENGTH, packed=True)
    report = {
        "documents": len(sequences),
        "tokens": int(sum(lengths)),
        "length_percentiles_10_50_90": [float(x) for x in np.percentile(lengths, [10, 50, 90])],
    }
    for label, grouped in (("packed_grouped_by_length", True), ("packed_random_rows", False)):
        sampler = UL2PackedBatchSampler(
            lengths, collator.objective, tokens_per_batch=64 * 1024, group_by_length=grouped, seed=0
        )
        real = positions = 0
        for batch in DataLoader(PlannedDataset(sequences), batch_sampler=sampler, collate_fn=collator):
            stats = padding_stats(batch)
            real += stats["input_tokens"] + stats["target_tokens"]
            positions += batch["input_ids"].numel() + batch["labels"].numel()
        report[label] = {"padding_fraction": 1 - real / positions, "batches": len(sampler)}
    padded = UL2DataCollator(tokenizer, max_input_length=MAX_INPUT_LENGTH, packed=False)
    order = np.random.default_rng(0).permutation(len(sequences))
    real = positions = 0
    for start in range(0, len(order), 32):
        batch = padded([sequences[i] for i in order[start : start + 32]])
        stats = padding_stats(batch)
        real += stats["input_tokens"] + stats["target_tokens"]
        positions += batch["input_ids"].numel() + batch["labels"].numel()
    report["naive_padded_batches_of_32"] = {"padding_fraction": 1 - real / positions}
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="timing per path (5 windows)")
    parser.add_argument("--batch-size", type=int, default=64, help="examples (or packed rows) per collator call")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "collator.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    load_before = os.getloadavg()
    throughput = bench_collators(args.seconds, args.batch_size)
    load_after = os.getloadavg()
    padding = padding_on_shakespeare()
    import datasets
    import tokenizers
    import transformers

    result = {
        "benchmark": "UL2 collator throughput, one process on one CPU core",
        "target": ">= 5000 examples of 1024 tokens per second per core",
        "cpu": cpu_name(),
        "logical_cpus": os.cpu_count(),
        "load_average_1min_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        "python": platform.python_version(),
        "versions": {
            "numpy": np.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "datasets": datasets.__version__,
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "source_tokens_per_example": SOURCE_LENGTH,
        "max_input_length": MAX_INPUT_LENGTH,
        "mixture": "FAT5 default (fat5/trainer/configs/ul2_default.yaml)",
        "throughput": throughput,
        "padding_shakespeare_1024": padding,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'path':<10} {'examples/s':>12} {'tokens/s':>14}")
    for name, numbers in throughput.items():
        print(f"{name:<10} {numbers['examples_per_s']:>12,.0f} {numbers['tokens_per_s']:>14,.0f}")
    for label, numbers in padding.items():
        if isinstance(numbers, dict):
            print(f"Shakespeare, 1024-token rows, {label}: padding {numbers['padding_fraction']:.2%}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
