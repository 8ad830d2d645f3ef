r"""transformers' own T5 on FAT5's kernels, the comparison a T5 user makes: the same padded batches, the same weights
(T5 v1.1-base shape, random, bf16), in one process on one GPU.

Implementations:
  ``sdpa``           ``T5ForConditionalGeneration`` as it comes (``attn_implementation="sdpa"``, transformers' default)
  ``fat5-attention`` the same model with ``attn_implementation="fat5"`` (``import fat5``: T5's bias inside the kernels)
  ``fat5-patched``   that, plus ``fat5.apply_fat5_kernels_to_t5(model)`` (FAT5's RMSNorm and fused cross-entropy)
  ``fat5-packed``    the converted model, ``FAT5ForConditionalGeneration``, training on the same examples packed
                     several to a row (``segment_ids``); it generates from the padded inputs, named ``fat5``

Batches: at each encoder length L, examples whose encoder lengths are drawn uniformly in [L/4, L] and decoder lengths
in [L/16, L/4] (one example of each batch at L and L/4, so the batch is padded to them), padded as
``DataCollatorForSeq2Seq`` pads them (``attention_mask``, labels -100), ``--batches`` examples a batch. tokens/s count
the examples' tokens (encoder + decoder), not padding: the same count for every implementation. The packed model's
rows hold the same examples, first fit by decreasing length into rows of L and L/4 tokens.

Training: a step (forward, backward, fused AdamW) timed with CUDA events after a warm-up (the first step's loss is
recorded: every implementation must give the padded loss of the same examples); peak GiB is
``torch.cuda.max_memory_allocated()`` with only the measured model on the GPU. Generation: greedy, ``--new-tokens``
tokens from the first ``--generation-batch`` examples' padded inputs, transformers' dynamic cache (``--generation-caches
static`` adds the static cache, whose decoding step generate compiles); ids compared with sdpa's. ``criteria`` in the
result checks issue 49's targets when the run (base shape) measured their lengths.

    python benchmarks/transformers_t5.py --out benchmarks/results/transformers_t5.json     # H100/H200, a few minutes
    python benchmarks/transformers_t5.py --tiny --out /tmp/transformers_t5.json             # every path on a CPU
"""

import argparse
import copy
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import draw_beside, markdown_table, parse_or_plot, save_png, t5_carrying_weights_of, write_result
from model import COMMON, DEFAULT_BATCHES, SHAPES, set_activation_checkpointing, time_ms, train_step_factory

from fat5.testing import TINY_MODEL_FIELDS, TINY_VOCAB_SIZE

IMPLEMENTATIONS = ("sdpa", "fat5-attention", "fat5-patched", "fat5-packed")
BASE = {**SHAPES["base"], **COMMON}
TINY = {**TINY_MODEL_FIELDS, "vocab_size": TINY_VOCAB_SIZE, "decoder_start_token_id": 0}
TINY_SETTINGS = {"lengths": [16, 32], "batches": {16: 6, 32: 4}, "new_tokens": 4, "generation_batch": 2}
COLUMNS = ["implementation", "encoder_length", "examples", "rows", "padding_fraction", "step_ms",
           "tokens_per_second", "peak_gib", "first_step_loss"]
GENERATION_COLUMNS = ["implementation", "cache", "input_length", "batch", "new_tokens", "ms", "tokens_per_second",
                      "peak_gib", "identical_token_fraction"]


# ---------------------------------------------------------------------------------------------------------- models


def with_attention(model, name):
    """``model`` on attention ``name``, set on every transformers model it holds: transformers 5.17's
    set_attn_implementation stops at T5's top model (its encoder and decoder stacks keep theirs)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.set_attn_implementation(name)
    return model


def build_models(fields: dict, dtype: torch.dtype) -> dict:
    """The four implementations on the CPU, one set of random weights (FAT5's, copied into transformers' T5)."""
    import fat5
    from fat5 import FAT5Config, FAT5ForConditionalGeneration

    torch.manual_seed(0)
    converted = FAT5ForConditionalGeneration(FAT5Config(**fields, scale_decoder_outputs=False, z_loss=0.0))
    sdpa = with_attention(t5_carrying_weights_of(converted, **fields), "sdpa")
    attention = with_attention(copy.deepcopy(sdpa), "fat5")
    patched = copy.deepcopy(attention)
    fat5.apply_fat5_kernels_to_t5(patched)
    models = {"sdpa": sdpa, "fat5-attention": attention, "fat5-patched": patched, "fat5-packed": converted}
    return {name: model.to(dtype) for name, model in models.items()}


class OnDevice:
    """The model on the device while measured, back on the CPU after: the peak counts one model's memory."""

    def __init__(self, model, device):
        self.model, self.device = model, device

    def __enter__(self):
        release(self.device)
        return self.model.to(self.device)

    def __exit__(self, *exception):
        self.model.to("cpu").zero_grad(set_to_none=True)
        release(self.device)


def release(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None


def wall_ms(function, device: str, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``function``: CUDA events on a GPU (model.py's ``time_ms``), the host's clock here."""
    if device == "cuda":
        return time_ms(function, warmup=warmup, repeats=repeats)
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


# --------------------------------------------------------------------------------------------------------- batches


def draw_examples(count: int, length: int, vocab_size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(encoder ids, labels) of ``count`` examples: encoder lengths in [L/4, L], decoder in [L/16, L/4], the first
    example at both maxima."""
    generator = torch.Generator().manual_seed(seed)
    decoder_length = max(length // 4, 1)
    examples = []
    for index in range(count):
        source = length if index == 0 else int(torch.randint(max(length // 4, 1), length + 1, (), generator=generator))
        target = decoder_length if index == 0 else int(
            torch.randint(max(length // 16, 1), decoder_length + 1, (), generator=generator))
        examples.append((torch.randint(2, vocab_size, (source,), generator=generator),
                         torch.randint(2, vocab_size, (target,), generator=generator)))
    return examples


def padded_batch(examples) -> dict:
    """transformers' inputs: right-padded ids, attention_mask, labels -100 on padding."""
    sources = torch.nn.utils.rnn.pad_sequence([source for source, _ in examples], batch_first=True)
    labels = torch.nn.utils.rnn.pad_sequence([target for _, target in examples], batch_first=True, padding_value=-100)
    attention_mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(source) for source, _ in examples],
                                                     batch_first=True)
    return {"input_ids": sources, "attention_mask": attention_mask, "labels": labels}


def packed_batch(examples, length: int) -> dict:
    """FAT5's packed inputs: the examples first fit by decreasing encoder length into rows of ``length`` encoder and
    ``length // 4`` decoder tokens; segment ids from 1 in each row (0: padding), decoder inputs shifted per example."""
    decoder_length = max(length // 4, 1)
    rows = []  # each: [encoder tokens used, decoder tokens used, examples]
    for source, target in sorted(examples, key=lambda example: -len(example[0])):
        row = next((row for row in rows if row[0] + len(source) <= length and row[1] + len(target) <= decoder_length),
                   None)
        if row is None:
            row = [0, 0, []]
            rows.append(row)
        row[0], row[1] = row[0] + len(source), row[1] + len(target)
        row[2].append((source, target))
    batch = {name: torch.zeros(len(rows), size, dtype=torch.long) for name, size in (
        ("input_ids", length), ("segment_ids", length), ("decoder_input_ids", decoder_length),
        ("decoder_segment_ids", decoder_length))}
    batch["labels"] = torch.full((len(rows), decoder_length), -100, dtype=torch.long)
    for index, (_, _, members) in enumerate(rows):
        encoder_at = decoder_at = 0
        for segment, (source, target) in enumerate(members, start=1):
            batch["input_ids"][index, encoder_at:encoder_at + len(source)] = source
            batch["segment_ids"][index, encoder_at:encoder_at + len(source)] = segment
            span = slice(decoder_at, decoder_at + len(target))
            batch["decoder_input_ids"][index, span] = torch.cat([target.new_zeros(1), target[:-1]])
            batch["decoder_segment_ids"][index, span] = segment
            batch["labels"][index, span] = target
            encoder_at, decoder_at = encoder_at + len(source), decoder_at + len(target)
    return batch


# ----------------------------------------------------------------------------------------------------- measurement


def measure_training(models: dict, length: int, examples: list, device: str, checkpointing: bool) -> list[dict]:
    """One row per implementation: a training step on the examples, padded (transformers) or packed (FAT5)."""
    real_tokens = sum(len(source) + len(target) for source, target in examples)
    rows = []
    for name, model in models.items():
        batch = packed_batch(examples, length) if name == "fat5-packed" else padded_batch(examples)
        row = {"implementation": name, "encoder_length": length, "examples": len(examples),
               "rows": len(batch["input_ids"]), "checkpointing": checkpointing,
               "padding_fraction": round(1 - real_tokens / (batch["input_ids"].numel() + batch["labels"].numel()), 4)}
        with OnDevice(model, device) as on_device:
            inputs = {key: value.to(device) for key, value in batch.items()}
            set_activation_checkpointing(on_device, checkpointing)
            try:
                step, _ = train_step_factory(on_device.train(), **inputs)
                row["first_step_loss"] = round(step().float().item(), 4)
                milliseconds = wall_ms(step, device, warmup=1, repeats=5 if device == "cuda" else 2)
                row.update(step_ms=round(milliseconds, 2), tokens_per_second=round(real_tokens / milliseconds * 1e3),
                           peak_gib=peak_gib(device))
                del step
            except torch.cuda.OutOfMemoryError:
                row.update(step_ms=None, tokens_per_second=None, peak_gib="OOM")
            finally:
                set_activation_checkpointing(on_device, False)
        print(row, flush=True)
        rows.append(row)
    return rows


@torch.no_grad()
def measure_generation(models: dict, length: int, examples: list, device: str, caches: list[str], new_tokens: int,
                       batch_size: int) -> list[dict]:
    """Greedy generation from the padded inputs of the first examples, every row making ``new_tokens`` tokens."""
    inputs = padded_batch(examples[:batch_size])
    options = {"input_ids": inputs["input_ids"].to(device), "attention_mask": inputs["attention_mask"].to(device),
               "max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "num_beams": 1}
    rows, reference = [], None
    for name, model in models.items():
        for cache in caches:
            row = {"implementation": "fat5" if name == "fat5-packed" else name, "cache": cache,
                   "input_length": length, "batch": batch_size, "new_tokens": new_tokens}
            extra = {"cache_implementation": "static"} if cache == "static" else {}
            with OnDevice(model, device) as on_device:
                generate = functools.partial(on_device.eval().generate, **options, **extra)
                try:
                    started = time.perf_counter()
                    ids = generate()
                    row["first_call_s"] = round(time.perf_counter() - started, 2)
                    milliseconds = wall_ms(generate, device, warmup=0, repeats=3 if device == "cuda" else 1)
                    row.update(ms=round(milliseconds, 1),
                               tokens_per_second=round(batch_size * new_tokens / milliseconds * 1e3),
                               peak_gib=peak_gib(device))
                except torch.cuda.OutOfMemoryError:
                    row.update(ms=None, tokens_per_second=None, peak_gib="OOM")
                    ids = None
            if reference is None:
                reference = ids  # sdpa's, dynamic cache: what the others are compared with
            if ids is not None and reference is not None and ids.shape == reference.shape:
                row["identical_token_fraction"] = round((ids == reference).float().mean().item(), 4)
            print(row, flush=True)
            rows.append(row)
    return rows


def check_agreement(rows: list[dict], tolerance: float) -> None:
    """Every implementation's first-step loss at a length is sdpa's (the same examples): speed counts only then."""
    for row in rows:
        reference = next(r for r in rows if r["implementation"] == "sdpa" and r["encoder_length"] == row[
            "encoder_length"])
        if "first_step_loss" in row and "first_step_loss" in reference and abs(
                row["first_step_loss"] - reference["first_step_loss"]) > tolerance * abs(reference["first_step_loss"]):
            raise SystemExit(f"{row['implementation']} disagrees with sdpa at L {row['encoder_length']}: first-step "
                             f"loss {row['first_step_loss']} against {reference['first_step_loss']}")


def ratios(training: list[dict], generation: list[dict]) -> list[dict]:
    """Each implementation against sdpa at each length: speed (tokens/s) and peak memory."""
    found = []
    for row in training + generation:
        key = "encoder_length" if "encoder_length" in row else "input_length"
        peer = next((r for r in (training if row in training else generation) if r["implementation"] == "sdpa"
                     and r[key] == row[key] and r.get("cache") == row.get("cache")), None)
        if row["implementation"] == "sdpa" or not peer or not row.get("tokens_per_second"):
            continue
        entry = {"measure": "training" if row in training else f"generation ({row['cache']} cache)",
                 "implementation": row["implementation"], "length": row[key], "speed_vs_sdpa": None,
                 "memory_vs_sdpa": None}
        if peer.get("tokens_per_second"):
            entry["speed_vs_sdpa"] = round(row["tokens_per_second"] / peer["tokens_per_second"], 2)
        if isinstance(row.get("peak_gib"), float) and isinstance(peer.get("peak_gib"), float):
            entry["memory_vs_sdpa"] = round(row["peak_gib"] / peer["peak_gib"], 3)
        found.append(entry)
    return found


def criteria(found: list[dict], training: list[dict]) -> dict:
    """Issue 49's targets for transformers' T5 with the fat5 attention and the patch, where the run measured them:
    at L 1024 a training step >= 2.5x sdpa's speed in <= 0.5x its memory; at L 4096 sdpa out of memory or >= 4x;
    greedy generation no slower than sdpa."""
    def ratio(length, measure="training"):
        return next((entry for entry in found if entry["implementation"] == "fat5-patched"
                     and entry["length"] == length and entry["measure"] == measure), None)

    checks = {}
    at_1024 = ratio(1024)
    if at_1024 and at_1024["speed_vs_sdpa"] and at_1024["memory_vs_sdpa"]:
        checks["train_1024_speed_2.5x_memory_0.5x"] = (at_1024["speed_vs_sdpa"] >= 2.5
                                                        and at_1024["memory_vs_sdpa"] <= 0.5)
    sdpa_4096 = next((row for row in training if row["implementation"] == "sdpa" and row["encoder_length"] == 4096),
                     None)
    if sdpa_4096:
        at_4096 = ratio(4096)
        checks["train_4096_sdpa_oom_or_4x"] = sdpa_4096["peak_gib"] == "OOM" or bool(
            at_4096 and at_4096["speed_vs_sdpa"] and at_4096["speed_vs_sdpa"] >= 4)
    generation = [entry for entry in found if entry["implementation"] == "fat5-patched"
                  and entry["measure"].startswith("generation") and entry["speed_vs_sdpa"]]
    if generation:
        checks["generation_no_slower"] = min(entry["speed_vs_sdpa"] for entry in generation) >= 1.0
    return checks


def plot(document, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4))
    for index, name in enumerate(IMPLEMENTATIONS):
        rows = [r for r in document["results"]["training"] if r["implementation"] == name and r["tokens_per_second"]]
        style = {"marker": "o", "label": name, "color": f"C{index}"}
        speed.plot([r["encoder_length"] for r in rows], [r["tokens_per_second"] for r in rows], **style)
        if rows and rows[0]["peak_gib"] is not None:
            memory.plot([r["encoder_length"] for r in rows], [r["peak_gib"] for r in rows], **style)
    for axis, label in ((speed, "training tokens/s (examples' tokens)"), (memory, "peak GiB")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("encoder length (decoder = length / 4)")
        axis.set_ylabel(label)
        if axis.get_lines():  # no memory on a CPU
            axis.legend()
    save_png(figure, path, document, title=f"transformers' T5 on FAT5's kernels, {document['shape']} shape")


def parse_arguments(argv=None) -> argparse.Namespace | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--batches", nargs="+", default=[], metavar="LENGTH:EXAMPLES",
                        help=f"examples per training batch at each length, over the defaults {DEFAULT_BATCHES}")
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--skip", nargs="*", default=[], choices=["training", "generation"])
    parser.add_argument("--checkpointing", action="store_true", help="train with activation checkpointing")
    parser.add_argument("--generation-caches", nargs="+", default=["dynamic"], choices=["dynamic", "static"])
    parser.add_argument("--generation-batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 models on the CPU: checks every path")
    parser.add_argument("--out", default="benchmarks/results/transformers_t5.json")
    args = parse_or_plot(parser, plot, argv)
    if args is None:
        return None
    batches = dict(DEFAULT_BATCHES)
    for pair in args.batches:
        length, _, count = pair.partition(":")
        if not (length.isdigit() and count.isdigit() and int(count) > 0):
            parser.error(f"--batches takes LENGTH:EXAMPLES pairs such as 1024:16, got {pair!r}")
        batches[int(length)] = int(count)
    args.batches = batches
    if args.tiny:
        args.lengths, args.batches = TINY_SETTINGS["lengths"], TINY_SETTINGS["batches"]
        args.new_tokens, args.generation_batch = TINY_SETTINGS["new_tokens"], TINY_SETTINGS["generation_batch"]
    if "sdpa" not in args.implementations:
        parser.error("--implementations must include sdpa: every other row is compared with it")
    if min(args.lengths) < 4 or min(args.new_tokens, args.generation_batch) < 1:
        parser.error("--lengths take 4 tokens or more; --new-tokens and --generation-batch positive numbers")
    return args


def main(argv=None) -> None:
    args = parse_arguments(argv)
    if args is None:
        return
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny to check the path on a CPU")
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    models = build_models(TINY if args.tiny else BASE, dtype)
    models = {name: models[name] for name in IMPLEMENTATIONS if name in args.implementations}
    vocab_size = (TINY if args.tiny else BASE)["vocab_size"]
    results = {"training": [], "generation": []}
    for length in args.lengths:
        examples = draw_examples(max(args.batches.get(length, 1), args.generation_batch), length, vocab_size, length)
        if "training" not in args.skip:
            results["training"] += measure_training(models, length, examples[:args.batches.get(length, 1)], device,
                                                    args.checkpointing)
            check_agreement(results["training"], 1e-5 if args.tiny else 2e-2)
        if "generation" not in args.skip:
            results["generation"] += measure_generation(models, length, examples, device, args.generation_caches,
                                                        args.new_tokens, args.generation_batch)
    results["ratios"] = ratios(results["training"], results["generation"])
    # a tiny model on a CPU says nothing of the GPU's speed
    results["criteria"] = {} if args.tiny else criteria(results["ratios"], results["training"])
    settings = {key: value for key, value in vars(args).items() if key != "plot_only"}
    document = write_result(args.out, results, shape="tiny" if args.tiny else "base", settings=settings)
    if results["training"]:
        draw_beside(plot, document, args.out)
        print(markdown_table(results["training"], COLUMNS))
    if results["generation"]:
        print("\n" + markdown_table(results["generation"], GENERATION_COLUMNS))
    print("\n" + markdown_table(results["ratios"], ["measure", "implementation", "length", "speed_vs_sdpa",
                                                    "memory_vs_sdpa"]))
    print("\ncriteria:", results["criteria"], "->", args.out)


if __name__ == "__main__":
    main()
