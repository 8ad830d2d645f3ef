"""Output layer + cross-entropy + z-loss, forward+backward, at mT5's vocabulary: the logits materialised (what the
model does by default) against FAT5's chunked ``linear_cross_entropy`` and Liger-Kernel's fused linear
cross-entropy, in one process on one GPU.

bf16 hidden states (8192 decoder tokens x d_model 768, mT5-base) and output weight (250112 x 768), z-loss 1e-4.
Each variant's loss and gradients are checked against the materialised one; then it is timed with
``triton.testing.do_bench`` (median) and its peak memory beyond the inputs is read.

    python benchmarks/linear_cross_entropy.py --out benchmarks/results/linear_cross_entropy.json
    python benchmarks/linear_cross_entropy.py --plot-only benchmarks/results/linear_cross_entropy.json
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import draw_beside, markdown_table, parse_or_plot, save_png, write_result

Z_LOSS = 1e-4


def variants(chunk_rows_options):
    from fat5.kernels.cross_entropy import cross_entropy
    from fat5.kernels.linear_cross_entropy import linear_cross_entropy

    def materialised(hidden, weight, labels):
        return sum(cross_entropy(hidden @ weight.T, labels, z_loss=Z_LOSS))

    table = {"logits materialised (fat5 cross_entropy)": materialised}
    for chunk_rows in chunk_rows_options:
        label = "default" if chunk_rows is None else chunk_rows
        table[f"fat5 chunked ({label} rows)"] = lambda hidden, weight, labels, chunk_rows=chunk_rows: sum(
            linear_cross_entropy(hidden, weight, labels, z_loss=Z_LOSS, chunk_rows=chunk_rows)
        )
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(lse_square_scale=Z_LOSS)
        table["liger fused linear CE"] = lambda hidden, weight, labels: liger(weight, hidden, labels)
    except ImportError as error:
        print(f"liger-kernel unavailable ({error}); measuring without it")
    return table


def measure(fn, hidden, weight, labels, reference) -> dict:
    import triton.testing

    from fat5.conversion.verify import relative_error

    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    loss = fn(*leaves, labels)
    loss.backward()
    result = {
        "loss_rel_error": abs(loss.item() - reference[0]) / abs(reference[0]),
        "grad_hidden_rel_error": relative_error(leaves[0].grad, reference[1]),
        "grad_weight_rel_error": relative_error(leaves[1].grad, reference[2]),
    }
    for leaf in leaves:
        leaf.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*leaves, labels).backward()
    torch.cuda.synchronize()
    result["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    result["ms"] = triton.testing.do_bench(lambda: fn(*leaves, labels).backward(), grad_to_none=leaves,
                                           return_mode="median")
    return result


def run(args) -> dict:
    torch.manual_seed(0)
    hidden = (torch.randn(args.tokens, args.d_model, device="cuda") * 0.5).bfloat16()
    weight = (torch.randn(args.vocab_size, args.d_model, device="cuda") * 0.05).bfloat16()
    labels = torch.randint(0, args.vocab_size, (args.tokens,), device="cuda")
    table = variants([None, 2048])
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    loss = table["logits materialised (fat5 cross_entropy)"](*leaves, labels)
    loss.backward()
    reference = (loss.item(), leaves[0].grad.clone(), leaves[1].grad.clone())
    del leaves, loss
    torch.cuda.empty_cache()
    rows = []
    for name, fn in table.items():
        measured = measure(fn, hidden, weight, labels, reference)
        torch.cuda.empty_cache()
        print(f"{name}: {measured}")
        rows.append({"variant": name, **measured})
    return write_result(
        args.out, rows, tokens=args.tokens, d_model=args.d_model, vocab_size=args.vocab_size, z_loss=Z_LOSS,
        dtype="bfloat16",
    )


def plot(document: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = document["results"]
    names = [row["variant"] for row in rows]
    colors = ["#1f77b4" if "fat5" in name else "#999999" for name in names]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4))
    for axis, key, label in ((axes[0], "ms", "forward+backward ms"), (axes[1], "peak_extra_mib", "peak extra MiB")):
        bars = axis.bar(names, [row[key] for row in rows], color=colors)
        for bar in bars:
            axis.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{bar.get_height():.0f}"
                      if key == "peak_extra_mib" else f"{bar.get_height():.1f}", ha="center", va="bottom", fontsize=8)
        axis.set_ylabel(label)
        axis.tick_params(axis="x", labelrotation=15, labelsize=7)
    shape = f"{document['tokens']} x {document['d_model']} -> {document['vocab_size']}"
    save_png(figure, path, document, f"output layer + CE + z-loss, bf16, {shape}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/linear_cross_entropy.json")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--vocab-size", type=int, default=250112)
    args = parse_or_plot(parser, plot)
    if args is None:
        return
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    document = run(args)
    print(markdown_table(
        [{"variant": row["variant"], "ms": f"{row['ms']:.2f}", "peak MiB": f"{row['peak_extra_mib']:.0f}",
          "grad err (hidden / weight)": f"{row['grad_hidden_rel_error']:.1e} / {row['grad_weight_rel_error']:.1e}"}
         for row in document["results"]],
        ["variant", "ms", "peak MiB", "grad err (hidden / weight)"],
    ))
    draw_beside(plot, document, args.out)


if __name__ == "__main__":
    main()
