"""Whole-model speed: FAT5 against transformers' T5ForConditionalGeneration, same shape, weights, process and GPU.

Measures a training step (forward, backward, fused AdamW; bf16 weights), the encoder forward, greedy generation of
128 tokens, and the longest encoder input that trains with batch 1. Decoder length is a quarter of the encoder's.

    python benchmarks/model.py --shape base --out benchmarks/results/model_base.json
    python benchmarks/model.py --implementations fat5 --packed 4 --skip encoder generation longest \
        --out benchmarks/results/model_base_packed.json
    python benchmarks/model.py --shape large --batches 512:32 1024:16 2048:8 4096:2 --skip encoder generation longest \
        --implementations transformers fat5 fat5-cudagraphs --out benchmarks/results/model_large.json
"""

import argparse
import functools
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, kernel_ms_by_kind, markdown_table, write_result

SHAPES = {
    "small": {"d_model": 512, "d_ff": 1024, "num_layers": 8, "num_heads": 6, "d_kv": 64},
    "base": {"d_model": 768, "d_ff": 2048, "num_layers": 12, "num_heads": 12, "d_kv": 64},
    "large": {"d_model": 1024, "d_ff": 2816, "num_layers": 24, "num_heads": 16, "d_kv": 64},
}
COMMON = {"vocab_size": 32128, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, "dropout_rate": 0.0,
          "decoder_start_token_id": 0}
DEFAULT_BATCHES = {512: 64, 1024: 32, 2048: 16, 4096: 4, 8192: 1, 16384: 1}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


IMPLEMENTATIONS = ("fat5", "fat5-compiled", "fat5-cudagraphs", "transformers")
COMPILED = ("fat5-compiled", "fat5-cudagraphs")
# the eager fat5 model, and the one with compiled blocks, trained on packed rows (--packed)
PACKED = {"fat5": "fat5-packed", "fat5-compiled": "fat5-compiled-packed"}


def build_models(shape: str, implementations: list[str]):
    """transformers' T5 and FAT5s carrying the same weights (the names are T5's on both sides).

    ``fat5-compiled`` is FAT5 with every block compiled by ``torch.compile`` (regional compilation: blocks of one
    kind share their compiled code, so compiling costs a few blocks' worth, not the model's). ``fat5-cudagraphs``
    compiles the whole model with ``mode="reduce-overhead"``: each training step replays CUDA graphs, so the host's
    time per kernel launch no longer counts.
    """
    from transformers import T5Config, T5ForConditionalGeneration

    from fat5 import FAT5Config, FAT5ForConditionalGeneration

    torch.manual_seed(0)
    hf = T5ForConditionalGeneration(T5Config(**SHAPES[shape], **COMMON))
    hf.lm_head.weight = torch.nn.Parameter(hf.shared.weight.detach().clone())
    # transformers first: the memory that CUDA graphs keep for replays must not count against the peer
    models = {"transformers": hf} if "transformers" in implementations else {}
    for name in ("fat5", *COMPILED):
        if name in implementations:
            fat5 = FAT5ForConditionalGeneration(
                FAT5Config(**SHAPES[shape], **COMMON, scale_decoder_outputs=False, attention_backend="auto")
            )
            fat5.load_state_dict(hf.state_dict(), strict=False)
            if name == "fat5-compiled":
                # every block shares one forward, so encoder and decoder, each length, and packed rows each take one
                # of dynamo's compiled versions of it: past the default limit of 8 the blocks would run eagerly
                torch._dynamo.config.recompile_limit = 64
                for block in (*fat5.encoder.block, *fat5.decoder.block):
                    block.compile(dynamic=False)
            if name == "fat5-cudagraphs":
                fat5.compile(mode="reduce-overhead", dynamic=False, fullgraph=True)
            models[name] = fat5
    return {name: model.to("cuda", torch.bfloat16) for name, model in models.items()}


def parameter_counts(model) -> tuple[int, int, int]:
    """Parameters touched per encoder token, per decoder token (without lm_head), and lm_head's."""
    encoder = sum(p.numel() for n, p in model.named_parameters() if n.startswith("encoder.") and "embed" not in n)
    decoder = sum(p.numel() for n, p in model.named_parameters() if n.startswith("decoder.") and "embed" not in n)
    return encoder, decoder, model.lm_head.weight.numel()


def step_flops(model, config, batch: int, encoder_length: int, decoder_length: int) -> float:
    """6 x parameters touched per token, plus attention (forward 4*B*H*Lq*Lk*D, causal halved; backward 2.5x)."""
    encoder, decoder, head = parameter_counts(model)
    dense = 6 * (encoder * batch * encoder_length + (decoder + head) * batch * decoder_length)
    per_layer = 4 * batch * config.num_heads * config.d_kv
    attention_forward = config.num_layers * per_layer * encoder_length**2 + config.num_decoder_layers * per_layer * (
        decoder_length**2 / 2 + decoder_length * encoder_length
    )
    return dense + 3.5 * attention_forward


def time_ms(function, warmup: int = 2, repeats: int = 5) -> float:
    """Median wall time of ``function`` in ms, with CUDA events after warm-up."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def random_batch(batch, encoder_length, decoder_length, vocab_size, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    input_ids = torch.randint(2, vocab_size, (batch, encoder_length), device="cuda", generator=generator)
    labels = torch.randint(2, vocab_size, (batch, decoder_length), device="cuda", generator=generator)
    return input_ids, labels


def example_segments(length: int, examples: int) -> torch.Tensor:
    """Segment ids of a packed row of ``length`` tokens: ``examples`` equal examples, the last a quarter shorter, so
    that the row ends in padding (0) as the UL2 collator's packed rows do (``main`` checks that each has 4+ tokens)."""
    size = length // examples
    segment_ids = (torch.arange(length, device="cuda") // size + 1).clamp(max=examples)
    segment_ids[length - size // 4:] = 0
    return segment_ids


def packed_batch(batch, encoder_length, decoder_length, examples, vocab_size):
    """Model inputs of ``batch`` packed rows (``example_segments`` on both sides; labels -100 on padding), and each
    example's (encoder, decoder) length, for the FLOP count."""
    input_ids, labels = random_batch(batch, encoder_length, decoder_length, vocab_size)
    segment_ids = example_segments(encoder_length, examples).expand(batch, -1).contiguous()
    decoder_segment_ids = example_segments(decoder_length, examples).expand(batch, -1).contiguous()
    inputs = {
        "input_ids": input_ids.masked_fill(segment_ids == 0, 0),
        "segment_ids": segment_ids,
        "decoder_input_ids": labels.roll(1, dims=1).masked_fill(decoder_segment_ids == 0, 0),
        "decoder_segment_ids": decoder_segment_ids,
    }
    encoder_lengths = torch.bincount(segment_ids[0], minlength=examples + 1)[1:].tolist()
    decoder_lengths = torch.bincount(decoder_segment_ids[0], minlength=examples + 1)[1:].tolist()
    labels = labels.masked_fill(decoder_segment_ids == 0, -100)
    return inputs, labels, list(zip(encoder_lengths, decoder_lengths)) * batch


def release():
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def train_step_factory(model, input_ids, labels, **inputs):
    """A training step on one batch (``inputs``: further model inputs, such as packed rows' segment ids)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        # a new training step: the CUDA graphs' outputs of the previous one may be overwritten (no-op when eager)
        torch.compiler.cudagraph_mark_step_begin()
        loss = model(input_ids=input_ids, labels=labels, use_cache=False, **inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step, optimizer


def set_activation_checkpointing(model, enabled: bool) -> None:
    """Turn checkpointing of the blocks on or off: transformers >= 5.23 calls it activation checkpointing (its
    gradient_checkpointing_* names warn that they go in v6), older releases have only those."""
    prefix = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    getattr(model, f"{prefix}_checkpointing_{'enable' if enabled else 'disable'}")()


def measure_training(name, model, lengths, batches, peak_tflops, checkpointing=False, packed_examples=0):
    """Training steps at each encoder length. With ``packed_examples``, every row packs that many examples
    (``packed_batch``): tokens/s then counts the real tokens, and MFU each example's own attention."""
    rows = []
    config = model.config
    for length in lengths:
        batch = batches.get(length, 1)
        decoder_length = max(length // 4, 1)
        release()
        if checkpointing:
            set_activation_checkpointing(model, True)
        row = {"implementation": name, "encoder_length": length, "batch": batch, "checkpointing": checkpointing}
        try:
            if packed_examples:
                inputs, labels, examples = packed_batch(batch, length, decoder_length, packed_examples,
                                                        config.vocab_size)
                tokens = sum(encoder + decoder for encoder, decoder in examples)
                flops = sum(step_flops(model, config, 1, encoder, decoder) for encoder, decoder in examples)
                row.update(examples_per_row=packed_examples, padding_fraction=round(1 - tokens / (
                    batch * (length + decoder_length)), 4))
            else:
                input_ids, labels = random_batch(batch, length, decoder_length, config.vocab_size)
                inputs = {"input_ids": input_ids}
                tokens = batch * (length + decoder_length)
                flops = step_flops(model, config, batch, length, decoder_length)
            step, optimizer = train_step_factory(model.train(), labels=labels, **inputs)
            # the same weights and batch on every implementation: a wrong model shows here before its speed counts
            first_loss = step().float().item()
            milliseconds = time_ms(step, warmup=1, repeats=5)
            row.update(
                step_ms=round(milliseconds, 2),
                tokens_per_second=round(tokens / milliseconds * 1e3),
                mfu=round(flops / (milliseconds * 1e-3) / (peak_tflops * 1e12), 4) if peak_tflops else None,
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                first_step_loss=round(first_loss, 4),
            )
            del step, optimizer
        except torch.cuda.OutOfMemoryError:
            row.update(step_ms=None, tokens_per_second=None, mfu=None, peak_gib="OOM")
        finally:
            model.zero_grad(set_to_none=True)
            if checkpointing:
                set_activation_checkpointing(model, False)
        print(row, flush=True)
        rows.append(row)
    return rows


def longest_trainable(name, model, start=4096, stop=131072, checkpointing=True):
    """Double the batch-1 encoder length until a training step runs out of memory."""
    longest, length = None, start
    if checkpointing:
        set_activation_checkpointing(model, True)
    while length <= stop:
        release()
        try:
            input_ids, labels = random_batch(1, length, length // 4, model.config.vocab_size)
            step, optimizer = train_step_factory(model.train(), input_ids, labels)
            step()
            torch.cuda.synchronize()
            longest = {"implementation": name, "encoder_length": length, "checkpointing": checkpointing,
                       "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
            del step, optimizer
        except torch.cuda.OutOfMemoryError:
            break
        finally:
            model.zero_grad(set_to_none=True)
        print(longest, flush=True)
        length *= 2
    if checkpointing:
        set_activation_checkpointing(model, False)
    return longest


def profile_training(name, model, length, batch, path, steps=3):
    """Where a training step's time goes, appended to the text file ``path``: the host's time to enqueue one step
    against the device's time to run it (a host-bound step has them equal), the host synchronisations inside a
    step, and the CUDA kernels and host-side operators of ``steps`` steps by total time. Returns the row for the
    result file: those times and the GPU's milliseconds per step by kind of kernel (``KERNEL_KINDS``)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    release()
    input_ids, labels = random_batch(batch, length, max(length // 4, 1), model.config.vocab_size)
    step, optimizer = train_step_factory(model.train(), input_ids, labels)
    step()
    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    started = time.perf_counter()
    start.record()
    step()
    end.record()
    enqueued = time.perf_counter()
    torch.cuda.synchronize()
    host_ms, device_ms = (enqueued - started) * 1e3, start.elapsed_time(end)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # the first use of the debug mode also warns that it is a prototype: that notice is no synchronisation
    synchronisations = sorted({str(w.message).splitlines()[0] for w in caught
                               if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)})
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    averages = profiler.key_averages()
    by_kind = kernel_ms_by_kind(profiler, steps)
    with open(path, "a") as handle:
        handle.write(f"# {name}, encoder length {length}, batch {batch}\n"
                     f"host enqueue {host_ms:.1f} ms, device {device_ms:.1f} ms per step; "
                     f"{len(caught)} host synchronisations in a step {synchronisations}\n"
                     f"GPU ms per step by kind of kernel: {by_kind}\n\n"
                     f"## CUDA kernels of {steps} steps\n"
                     f"{averages.table(sort_by='self_cuda_time_total', row_limit=30, max_name_column_width=80)}\n"
                     f"## host operators of {steps} steps\n"
                     f"{averages.table(sort_by='self_cpu_time_total', row_limit=30, max_name_column_width=80)}\n\n")
    model.zero_grad(set_to_none=True)
    del step, optimizer
    print(f"profile of {name} at {length} -> {path}", flush=True)
    return {"implementation": name, "encoder_length": length, "batch": batch, "host_enqueue_ms": round(host_ms, 2),
            "device_ms": round(device_ms, 2), "host_synchronisations": len(caught),
            "kernel_ms": round(sum(by_kind.values()), 2), "kernel_ms_by_kind": by_kind}


@torch.no_grad()
def measure_generation(models, caches=("dynamic",), batches=(1, 32), input_length=512, new_tokens=128):
    """Greedy generation of ``new_tokens`` tokens. ``"static"`` is transformers' StaticCache, with which ``generate``
    compiles the decoding step (``torch.compile``, mode reduce-overhead: CUDA graphs); its first call compiles and is
    not timed. Every output is compared with transformers' own (dynamic cache) ids."""
    rows = []
    for batch in batches:
        input_ids, _ = random_batch(batch, input_length, 1, 32128, seed=batch)
        outputs = {}
        for name, model in models.items():
            for cache in caches:
                release()
                model.eval()
                extra = {"cache_implementation": "static"} if cache == "static" else {}
                generate = functools.partial(model.generate, input_ids=input_ids, max_new_tokens=new_tokens,
                                             min_new_tokens=new_tokens, do_sample=False, num_beams=1, **extra)

                started = time.perf_counter()
                outputs[name, cache] = generate()
                first_call_s = time.perf_counter() - started
                milliseconds = time_ms(generate, warmup=1, repeats=3)
                rows.append({"implementation": name, "cache": cache, "batch": batch, "input_length": input_length,
                             "new_tokens": new_tokens, "ms": round(milliseconds, 1),
                             "first_call_s": round(first_call_s, 1),
                             "tokens_per_second": round(batch * new_tokens / milliseconds * 1e3)})
                reference = outputs.get(("transformers", "dynamic"))
                if reference is not None and reference.shape == outputs[name, cache].shape:
                    same = (outputs[name, cache] == reference).float().mean().item()
                    rows[-1]["identical_token_fraction_bf16"] = round(same, 4)
                print(rows[-1], flush=True)
    return rows


@torch.no_grad()
def measure_encoder(models, lengths, batches):
    rows = []
    for length in lengths:
        batch = batches.get(length, 1)
        input_ids, _ = random_batch(batch, length, 1, 32128)
        for name, model in models.items():
            release()
            encoder = model.eval().get_encoder()
            try:
                milliseconds = time_ms(functools.partial(encoder, input_ids=input_ids), warmup=2, repeats=5)
                rows.append({"implementation": name, "encoder_length": length, "batch": batch,
                             "ms": round(milliseconds, 2),
                             "tokens_per_second": round(batch * length / milliseconds * 1e3),
                             "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)})
            except torch.cuda.OutOfMemoryError:
                rows.append({"implementation": name, "encoder_length": length, "batch": batch, "ms": "OOM"})
            print(rows[-1], flush=True)
    return rows


def check_agreement(models, vocab_size):
    """Loss of FAT5 and transformers on one batch, bf16: they must agree before any timing counts."""
    input_ids, labels = random_batch(2, 256, 64, vocab_size, seed=123)
    with torch.no_grad():
        losses = {
            name: model.eval()(input_ids=input_ids, labels=labels).loss.float().item() for name, model in models.items()
        }
    for name, loss in losses.items():
        if "transformers" in losses and abs(loss - losses["transformers"]) > 1e-2 * abs(losses["transformers"]):
            raise SystemExit(f"{name} and transformers disagree: losses {losses}")
    return losses


def plot(document, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for index, name in enumerate((*IMPLEMENTATIONS, *PACKED.values())):
        rows = [r for r in document["results"]["training"] if r["implementation"] == name and r["tokens_per_second"]]
        if not rows:
            continue
        style = {"marker": "o", "label": name, "color": f"C{index}"}  # one colour per model
        left.plot([r["encoder_length"] for r in rows], [r["tokens_per_second"] for r in rows], **style)
        right.plot([r["encoder_length"] for r in rows], [r["peak_gib"] for r in rows], **style)
    for axis, label in ((left, "training tokens/s"), (right, "peak GiB")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("encoder length (decoder = length / 4)")
        axis.set_ylabel(label)
        axis.legend()
    figure.suptitle(f"T5 v1.1-{document['shape']} shape, bf16, {document['environment'].get('gpu')}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="base")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--implementations", nargs="+", default=["fat5", "transformers"], choices=IMPLEMENTATIONS)
    parser.add_argument("--skip", nargs="*", default=[], choices=["training", "encoder", "generation", "longest"])
    parser.add_argument("--generation-caches", nargs="+", default=["dynamic", "static"], choices=["dynamic", "static"],
                        help="KV caches to generate with (static: generate compiles the decoding step)")
    parser.add_argument("--generation-batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--profile", type=int, nargs="*", default=[], metavar="LENGTH",
                        help="also profile training steps at these encoder lengths: GPU time by kind of kernel in the "
                             "result file, kernel and operator tables in a text file beside it")
    parser.add_argument("--batches", nargs="+", default=[], metavar="LENGTH:BATCH",
                        help=f"training/encoder batch per encoder length, over the defaults {DEFAULT_BATCHES}")
    parser.add_argument("--packed", type=int, default=0, metavar="EXAMPLES",
                        help="also train the eager fat5 model (and fat5-compiled, when measured) on rows packing this "
                             "many examples each (segment_ids, as `fat5 pretrain` does), reported as fat5-packed "
                             "(fat5-compiled-packed)")
    parser.add_argument("--out", help="result file (default: benchmarks/results/model_SHAPE.json)")
    args = parser.parse_args(argv)
    args.out = args.out or f"benchmarks/results/model_{args.shape}.json"
    batches = dict(DEFAULT_BATCHES)
    for pair in args.batches:
        length, _, batch = pair.partition(":")
        if not (length.isdigit() and batch.isdigit()):
            parser.error(f"--batches takes LENGTH:BATCH pairs such as 1024:16, got {pair!r}")
        batches[int(length)] = int(batch)
    if args.packed < 0 or (args.packed and (not set(PACKED) & set(args.implementations) or "training" in args.skip)):
        parser.error("--packed takes a positive number of examples per row and needs the fat5 or fat5-compiled "
                     "implementation and the training measurement")
    for length in args.lengths if args.packed else ():
        if max(length // 4, 1) // args.packed < 4:
            parser.error(f"--packed {args.packed}: the decoder rows of encoder length {length} ({max(length // 4, 1)} "
                         "tokens) cannot hold that many examples of 4 or more tokens")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/model.py needs a CUDA GPU")

    gpu = torch.cuda.get_device_name(0)
    peak = next((value for key, value in PEAK_BF16_TFLOPS.items() if key in gpu), None)
    models = build_models(args.shape, args.implementations)
    # compiled models are checked by their first training step's loss instead (an eval graph would compile too)
    results = {"agreement_losses": check_agreement({n: m for n, m in models.items() if n not in COMPILED},
                                                   COMMON["vocab_size"])}
    if "training" not in args.skip:
        results["training"] = [row for name, model in models.items()
                               for row in measure_training(name, model, args.lengths, batches, peak)]
        if args.packed:
            for name, packed_name in PACKED.items():
                if name in models:
                    results["training"] += measure_training(packed_name, models[name], args.lengths, batches, peak,
                                                            packed_examples=args.packed)
    if args.profile:
        results["profile"] = [
            profile_training(name, model, length, batches.get(length, 1), args.out.replace(".json", "_profile.txt"))
            for length in args.profile for name, model in models.items()
        ]
    # compiled blocks are specialised to training shapes: a decoding step of every new length would recompile
    eager = {name: model for name, model in models.items() if name not in COMPILED}
    if "encoder" not in args.skip:
        results["encoder"] = measure_encoder(eager, args.lengths, batches)
    if "generation" not in args.skip:
        # transformers first: its dynamic-cache ids are what every other output is compared with
        ordered = dict(sorted(eager.items(), key=lambda item: item[0] != "transformers"))
        results["generation"] = measure_generation(ordered, args.generation_caches, args.generation_batches)
    if "longest" not in args.skip:
        results["longest_batch1"] = [longest_trainable(name, model) for name, model in eager.items()]
    document = write_result(args.out, results, shape=args.shape, peak_bf16_tflops=peak)
    if "training" in results:
        plot(document, args.out.replace(".json", ".png"))
        print(markdown_table(results["training"], ["implementation", "encoder_length", "batch", "step_ms",
                                                   "tokens_per_second", "mfu", "peak_gib"]))
    print(environment()["gpu"], "->", args.out)


if __name__ == "__main__":
    main()
