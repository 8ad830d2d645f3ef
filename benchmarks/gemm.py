"""The matrix products of a pretraining step, each timed alone: how fast cuBLAS runs them outside the step.

For every batch shape (rows, encoder width, decoder width) of a ``pretrain.py`` result, the products of one training
step of the T5 v1.1 shape: per linear layer the forward ``x W^T`` and the backward's two (``dy W``, ``dy^T x``);
encoder layers on the encoder positions, decoder layers on the decoder positions, the cross-attention's keys and
values on the encoder's, the output layer on the decoder's (whole here; FAT5's fused loss walks it in vocabulary
slices). bf16 inputs, fp32 accumulation, ``triton.testing.do_bench`` medians. Reported per batch shape: the products'
milliseconds and TFLOP/s, to set beside the matrix products' share of a profiled step (``pretrain.py --profile``,
``time_bounds.achieved_tflops``): what the step's products would take at cuBLAS's isolated speed.

    python benchmarks/gemm.py --shapes-from benchmarks/results/pretrain_base.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, write_result


def step_products(model: dict, vocab_size: int, rows: int, encoder_width: int, decoder_width: int) -> Counter:
    """(M, K, N) -> how many times a training step multiplies an (M, K) by a (K, N) matrix, forward and backward."""
    d_model, d_ff, inner = model["d_model"], model["d_ff"], model["num_heads"] * model["d_kv"]
    encoder, decoder = rows * encoder_width, rows * decoder_width
    linears = Counter()  # (positions, in, out) -> count
    for _ in range(model["num_layers"]):
        linears[encoder, d_model, inner] += 3  # q, k, v
        linears[encoder, inner, d_model] += 1  # o
        linears[encoder, d_model, d_ff] += 2  # gated: wi_0, wi_1
        linears[encoder, d_ff, d_model] += 1  # wo
    for _ in range(model["num_decoder_layers"]):
        linears[decoder, d_model, inner] += 4  # self q, k, v; cross q
        linears[encoder, d_model, inner] += 2  # cross k, v over the encoder's output
        linears[decoder, inner, d_model] += 2  # self o, cross o
        linears[decoder, d_model, d_ff] += 2
        linears[decoder, d_ff, d_model] += 1
    linears[decoder, d_model, vocab_size] += 1
    products = Counter()
    for (positions, fan_in, fan_out), count in linears.items():
        products[positions, fan_in, fan_out] += count  # forward: x W^T
        products[positions, fan_out, fan_in] += count  # input gradient: dy W
        products[fan_out, positions, fan_in] += count  # weight gradient: dy^T x
    return products


def time_product(m: int, k: int, n: int) -> float:
    """Median milliseconds of one bf16 (m, k) x (k, n) product."""
    from triton.testing import do_bench

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return do_bench(lambda: torch.mm(a, b), warmup=25, rep=100, return_mode="median")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes-from", default="benchmarks/results/pretrain_base.json",
                        help="a pretrain.py result: its model shape, vocabulary and batch shapes")
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/gemm_SHAPE.json)")
    args = parser.parse_args(argv)
    try:
        with open(args.shapes_from) as handle:
            source = json.load(handle)
        model, results = source["model"], source["results"]
        batch_shapes, vocab_size = results["batch_shapes"], results["vocab_size"]
    except (OSError, KeyError, json.JSONDecodeError) as error:
        raise SystemExit(f"--shapes-from {args.shapes_from}: not a pretrain.py result ({error})") from None
    if not torch.cuda.is_available():
        raise SystemExit("gemm.py times cuBLAS products: it needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    timed = {}
    rows = []
    for shape in batch_shapes:
        products = step_products(model, vocab_size, *shape)
        milliseconds = flops = 0.0
        for (m, k, n), count in products.items():
            if (m, k, n) not in timed:
                timed[m, k, n] = time_product(m, k, n)
            milliseconds += count * timed[m, k, n]
            flops += count * 2 * m * k * n
        rows.append({"batch_shape": shape, "products": sum(products.values()), "ms": round(milliseconds, 2),
                     "tflops": round(flops / milliseconds / 1e9, 1)})
    out = args.out or f"benchmarks/results/gemm_{source.get('shape', 'model')}.json"
    write_result(out, {"batch_shapes": rows, "mean_tflops": round(sum(r["tflops"] for r in rows) / len(rows), 1),
                       "products_ms": {f"{m}x{k}x{n}": round(ms, 4) for (m, k, n), ms in timed.items()}},
                 source=args.shapes_from, model=model, vocab_size=vocab_size)
    print(markdown_table(rows, ["batch_shape", "products", "ms", "tflops"]))
    print("->", out)


if __name__ == "__main__":
    main()
