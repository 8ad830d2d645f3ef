"""Finetuning: FAT5 against transformers' T5 from the same weights on the same data — speed, and the same learning.

A T5 v1.1-base-shaped ``T5ForConditionalGeneration`` (d_model 768, 12+12 layers, 12 heads, d_ff 2048 gated-gelu,
vocab 32128, untied), randomly initialised, is saved and converted with ``fat5.conversion.convert`` (verified
against transformers). Both then finetune on one seq2seq task built from the built-in Shakespeare corpus: the input
is a passage of a scene (``--source-length`` tokens), the target the lines that follow it (``--target-length``
tokens); every example fills both lengths, so there is no padding and every step holds the same number of tokens.

- FAT5 runs through `fat5 finetune`'s own ``prepare_finetuning`` (FAT5Trainer); transformers' model runs with a plain
  ``Seq2SeqTrainer`` given the very same ``TrainingArguments``, tokenized dataset and collator, so with the same seed
  both see the same batches in the same order. Weights are float32 with bf16 autocast (``bf16: true``, what a user
  of either would set on a GPU), dropout 0, fused AdamW, the loss logged every step.
- Speed: real tokens (encoder + target) per second between the end of step ``--warmup-steps`` and the last step
  (the GPU synchronised at both ends), and the peak memory.
- Same learning: the per-step relative difference of the two loss curves, against a reference for the noise of
  transformers' own run: a second transformers run that differs only in its seed (hence in the order of the
  batches). Both are also compared after a moving average over ``--smoothing`` steps, which removes most of the
  batch-to-batch variation, so what remains of the reference spread is how far a rerun moves the curve. The verdict
  is "same learning" when FAT5's mean and largest smoothed differences from transformers are no larger than the
  reference's; the step-1 difference (same weights, same batch: numerics only) is reported beside them.
- LoRA (PEFT r 16 on q, k, v, o, wi_0, wi_1, wo; identical adapter initialisation) in a second, shorter comparison.

    python benchmarks/finetune.py --out benchmarks/results/finetune.json      # writes finetune.png beside it
    python benchmarks/finetune.py --tiny                                        # a CPU check of the whole path
"""

import argparse
import copy
import gc
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import TrainerCallback, set_seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import curve_differences, environment, markdown_table, write_result

from fat5.conversion import convert
from fat5.testing import TINY_MODEL_FIELDS
from fat5.trainer.data import shakespeare_texts
from fat5.trainer.finetune_model import apply_lora
from fat5.trainer.finetuning import prepare_finetuning
from fat5.trainer.tokenizer import train_tokenizer

logger = logging.getLogger("benchmarks.finetune")
BASE_SHAPE = {"d_model": 768, "d_kv": 64, "d_ff": 2048, "num_layers": 12, "num_decoder_layers": 12, "num_heads": 12}
T5_V1_1 = {"vocab_size": 32128, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, "dropout_rate": 0.0,
           "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["q", "k", "v", "o", "wi_0", "wi_1", "wo"],
        "merge": False}
# characters per token is about 4-5 for this corpus: these many characters fill the token lengths with room to spare
CHARACTERS_PER_TOKEN_BOUND = 7


def make_checkpoints(work: Path, shape: dict, tokenizer_vocab: int) -> tuple[Path, Path, dict]:
    """A random T5 v1.1-shaped checkpoint with a tokenizer trained on the corpus, and its FAT5 conversion."""
    from transformers import T5Config, T5ForConditionalGeneration

    started = time.perf_counter()
    tokenizer = train_tokenizer(shakespeare_texts(), vocab_size=tokenizer_vocab, num_sentinels=100, model="bpe")
    logger.info("tokenizer of %d tokens trained in %.1f s", len(tokenizer), time.perf_counter() - started)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(**{**shape, **T5_V1_1}))
    # transformers 5's T5Config forces tied embeddings; a v1.1 checkpoint says untied and holds its own lm_head,
    # which the loader then keeps apart. Its draw has std d_model**-0.5 (T5's own init for an untied head, std 1,
    # starts the loss near 100 instead of about ln(vocab), far from what a finetuning run looks like).
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight) * shape["d_model"] ** -0.5)
    transformers_dir, fat5_dir = work / "t5", work / "fat5"
    model.save_pretrained(transformers_dir)
    tokenizer.save_pretrained(transformers_dir)
    started = time.perf_counter()
    result = convert(transformers_dir, fat5_dir, overwrite=True)
    tokenizer.save_pretrained(fat5_dir)
    logger.info("converted in %.1f s, verification %s", time.perf_counter() - started, result.verification)
    return transformers_dir, fat5_dir, result.verification


def write_task(path: Path, examples: int, source_length: int, target_length: int) -> None:
    """``examples`` (passage, continuation) pairs from Shakespeare's scenes as JSON lines, in a fixed random order.

    A passage is the lines of a scene from some line on, enough characters to fill ``source_length`` tokens; its
    target the lines after it, enough for ``target_length``. Passages start every few lines, as densely as the
    wanted number of examples needs.
    """
    source_chars = source_length * CHARACTERS_PER_TOKEN_BOUND
    target_chars = target_length * CHARACTERS_PER_TOKEN_BOUND
    scenes = [[line for line in text.splitlines() if line.strip()] for text in shakespeare_texts()]
    total_lines = sum(len(lines) for lines in scenes)
    # passages near a scene's end have no room for their target: tighten the stride until enough remain
    stride = max(1, total_lines // (2 * examples))
    while True:
        pairs = _passage_pairs(scenes, stride, source_chars, target_chars)
        if len(pairs) >= examples or stride == 1:
            break
        stride = max(1, stride // 2)
    if len(pairs) < examples:
        raise SystemExit(f"the corpus gives {len(pairs)} examples, fewer than the {examples} wanted")
    order = np.random.default_rng(0).permutation(len(pairs))[:examples]
    with open(path, "w") as handle:
        handle.writelines(json.dumps(pairs[index]) + "\n" for index in order)


def _passage_pairs(scenes: list[list[str]], stride: int, source_chars: int, target_chars: int) -> list[dict]:
    """(passage, continuation) pairs starting every ``stride`` lines of each scene, while the scene has room."""
    pairs = []
    for lines in scenes:
        ends = np.cumsum([len(line) + 1 for line in lines])
        for start in range(0, len(lines), stride):
            before = ends[start - 1] if start else 0
            source_end = int(np.searchsorted(ends, before + source_chars)) + 1
            target_end = int(np.searchsorted(ends, ends[min(source_end, len(lines)) - 1] + target_chars)) + 1
            if target_end > len(lines):
                break
            pairs.append({"text": "\n".join(lines[start:source_end]),
                          "summary": "\n".join(lines[source_end:target_end])})
    return pairs


class StepTimer(TrainerCallback):
    """Wall time from the end of step ``start`` to the end of the last step, the GPU synchronised at both."""

    def __init__(self, start: int):
        self.start = start
        self.times = {}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (self.start, state.max_steps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times[state.global_step] = time.perf_counter()

    def seconds(self) -> float:
        return self.times[max(self.times)] - self.times[self.start]


def tokens_per_example(dataset, source_length: int, target_length: int) -> int:
    """Every example must fill both lengths (so every step holds the same tokens); their sum."""
    source_lengths = {len(ids) for ids in dataset["input_ids"]}
    target_lengths = {len(ids) for ids in dataset["labels"]}
    if source_lengths != {source_length} or target_lengths != {target_length}:
        raise SystemExit(f"examples of {sorted(source_lengths)} / {sorted(target_lengths)} tokens, expected "
                         f"{source_length} / {target_length} only")
    return source_length + target_length


def loss_agreement(models: dict, vocab_size: int, source_length: int, target_length: int, tolerance: float) -> dict:
    """Losses of the models on one fresh random batch, in the training precision; they must agree."""
    seed = int.from_bytes(os.urandom(4), "little")
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, vocab_size, (4, source_length), generator=generator)
    labels = torch.randint(2, vocab_size, (4, target_length), generator=generator)
    losses = {}
    for name, model in models.items():
        device = next(model.parameters()).device
        with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = model.eval()(input_ids=input_ids.to(device), labels=labels.to(device)).loss
        losses[name] = loss.float().item()
    relative = abs(losses["fat5"] - losses["transformers"]) / abs(losses["transformers"])
    if relative > tolerance:
        raise SystemExit(f"FAT5 and transformers disagree on a random batch (seed {seed}): losses {losses}")
    return {"losses": losses, "relative_difference": relative, "tolerance": tolerance, "seed": seed}


def train(name: str, trainer, warmup_steps: int, tokens_per_step: int) -> dict:
    """Train, then: steady tokens/s, peak memory, the per-step losses."""
    timer = StepTimer(warmup_steps)
    trainer.add_callback(timer)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    logger.info("training %s for %d steps", name, trainer.args.max_steps)
    # the sampler draws the batch order when training starts: from the same state on both sides
    set_seed(trainer.args.seed)
    trainer.train()
    seconds = timer.seconds()
    steps = trainer.state.global_step - warmup_steps
    history = trainer.state.log_history
    row = {
        "run": name,
        "steps": trainer.state.global_step,
        "tokens_per_second": round(steps * tokens_per_step / seconds),
        "seconds_per_step": round(seconds / steps, 4),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        "losses": [entry["loss"] for entry in history if "loss" in entry],
    }
    logged = [entry["tokens_per_second"] for entry in history if "tokens_per_second" in entry
              and entry["step"] > warmup_steps]
    if logged:
        # FAT5Trainer's own count, a cross-check of the figure above (host time between logs)
        row["fat5_trainer_logged_tokens_per_second"] = round(float(np.median(logged)))
    if len(row["losses"]) != row["steps"]:
        raise SystemExit(f"{name}: {len(row['losses'])} losses logged for {row['steps']} steps")
    logger.info("%s: %s tokens/s, loss %.4f -> %.4f", name, row["tokens_per_second"], row["losses"][0],
                row["losses"][-1])
    return row


def release() -> None:
    """Give back the memory of models and optimisers whose last reference was just dropped."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare(work: Path, transformers_dir: Path, fat5_dir: Path, options: dict, lora: dict | None,
            seed_reference: bool, tolerance: float) -> dict:
    """One comparison (full finetuning, or LoRA when ``lora`` is given): FAT5, transformers, and optionally
    transformers again with another seed. One model at a time is on the GPU while it trains."""
    from transformers import Seq2SeqTrainer, T5ForConditionalGeneration

    source_length, target_length = options["source_length"], options["target_length"]
    job = prepare_finetuning({
        "task": "seq2seq",
        "model": str(fat5_dir),
        "data": {"train_file": str(work / "train.jsonl"), "max_source_length": source_length,
                 "max_target_length": target_length, "max_train_samples": options["steps"] * options["batch"],
                 "preprocessing_num_workers": options["workers"]},
        "lora": lora,
        "training": options["training"],
    }, work / ("lora" if lora else "full"), overwrite=True)
    dataset, collator, tokenizer = job.train_dataset, job.trainer.data_collator, job.tokenizer
    tokens_per_step = options["batch"] * tokens_per_example(dataset, source_length, target_length)
    # the adapters start as FAT5's do (A random, B zero): the same weights, not just the same seed
    adapters = {key: value.detach().cpu().clone() for key, value in job.model.state_dict().items() if "lora_" in key}

    job_arguments, job_lora = job.trainer.args, job.settings.lora

    def transformers_trainer(seed: int):
        # the job's own arguments, the seed aside (the seed changes nothing that TrainingArguments derives)
        arguments = copy.deepcopy(job_arguments)
        arguments.seed = seed
        set_seed(seed)
        model = T5ForConditionalGeneration.from_pretrained(transformers_dir, dtype=torch.float32)
        if model.lm_head.weight.data_ptr() == model.shared.weight.data_ptr():
            raise SystemExit("transformers loaded the untied checkpoint with tied embeddings")
        if lora:
            model = apply_lora(model, "seq2seq", job_lora)
            missing = set(adapters) - set(model.state_dict())
            if missing:
                raise SystemExit(f"the transformers model lacks FAT5's adapter weights {sorted(missing)[:3]} ...")
            model.load_state_dict(adapters, strict=False)
        return Seq2SeqTrainer(model=model, args=arguments, train_dataset=dataset, data_collator=collator,
                              processing_class=tokenizer)

    reference_trainer = transformers_trainer(job_arguments.seed)
    agreement = loss_agreement({"fat5": job.model, "transformers": reference_trainer.model},
                               T5_V1_1["vocab_size"], min(source_length, 256), min(target_length, 64), tolerance)
    logger.info("agreement before training: %s", agreement)
    reference_trainer.model.to("cpu")
    release()
    runs = [train("fat5", job.trainer, options["warmup_steps"], tokens_per_step)]
    del job
    release()
    reference_trainer.model.to(reference_trainer.args.device)
    runs.append(train("transformers", reference_trainer, options["warmup_steps"], tokens_per_step))
    del reference_trainer
    release()
    if seed_reference:
        other_seed = job_arguments.seed + 1
        runs.append(train(f"transformers_seed_{other_seed}", transformers_trainer(other_seed),
                          options["warmup_steps"], tokens_per_step))
        release()
    fat5_run, transformers_run = runs[0], runs[1]
    result = {
        "agreement_before_training": agreement,
        "tokens_per_step": tokens_per_step,
        "runs": runs,
        "speedup": round(fat5_run["tokens_per_second"] / transformers_run["tokens_per_second"], 3),
        "fat5_vs_transformers": curve_differences(fat5_run["losses"], transformers_run["losses"],
                                                  options["smoothing"]),
    }
    if seed_reference:
        reference = curve_differences(runs[2]["losses"], transformers_run["losses"], options["smoothing"])
        result["transformers_seed_vs_transformers"] = reference
        difference = result["fat5_vs_transformers"]
        result["same_learning"] = bool(difference["smoothed_mean"] <= reference["smoothed_mean"]
                                       and difference["smoothed_max"] <= reference["smoothed_max"])
    return result


def plot(results: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comparisons = [name for name in ("full", "lora") if name in results]
    figure, axes = plt.subplots(1, len(comparisons), figsize=(6 * len(comparisons), 4), squeeze=False)
    for axis, name in zip(axes[0], comparisons):
        for run in results[name]["runs"]:
            axis.plot(range(1, len(run["losses"]) + 1), run["losses"], label=run["run"], linewidth=1)
        axis.set_xlabel("step")
        axis.set_ylabel("training loss")
        axis.set_title(f"{name} finetuning, FAT5 {results[name]['speedup']}x transformers' tokens/s")
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="full finetuning steps (default 200; --tiny: 12)")
    parser.add_argument("--lora-steps", type=int, default=None, help="LoRA steps, 0: none (default 100; --tiny: 8)")
    parser.add_argument("--batch", type=int, default=None, help="examples per step (default 32; --tiny: 4)")
    parser.add_argument("--source-length", type=int, default=None, help="input tokens (default 1024; --tiny: 128)")
    parser.add_argument("--target-length", type=int, default=None, help="target tokens (default 128; --tiny: 32)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="steps left out of the timing (default 20)")
    parser.add_argument("--smoothing", type=int, default=None, help="moving-average window (default 20; --tiny: 4)")
    parser.add_argument("--no-seed-reference", action="store_true",
                        help="skip the second transformers run (no same-learning verdict)")
    parser.add_argument("--torch-compile", choices=["default", "reduce-overhead", "regional"], default=None,
                        help="both trainers compile their model (TrainingArguments torch_compile, with this mode; "
                             "reduce-overhead replays CUDA graphs; regional compiles each block, FAT5 through "
                             "torch_compile_regional, transformers through accelerate's own switch for it)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch: checks the path on a CPU")
    parser.add_argument("--work-dir", default=None, help="checkpoints, data and runs (default: a temporary folder)")
    parser.add_argument("--out", default="benchmarks/results/finetune.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("benchmarks/finetune.py measures on a CUDA GPU; on a CPU run it with --tiny to check the path")
    tiny = args.tiny
    options = {
        "shape": TINY_MODEL_FIELDS if tiny else BASE_SHAPE,
        "steps": args.steps or (12 if tiny else 200),
        "batch": args.batch or (4 if tiny else 32),
        "source_length": args.source_length or (128 if tiny else 1024),
        "target_length": args.target_length or (32 if tiny else 128),
        "warmup_steps": args.warmup_steps or (3 if tiny else 20),
        "smoothing": args.smoothing or (4 if tiny else 20),
        "workers": 1 if tiny else 8,
    }
    lora_steps = args.lora_steps if args.lora_steps is not None else (8 if tiny else 100)
    common_training = {
        "per_device_train_batch_size": options["batch"],
        "lr_scheduler_type": "linear",
        "weight_decay": 0.0,
        "optim": "adamw_torch_fused" if torch.cuda.is_available() else "adamw_torch",
        "bf16": torch.cuda.is_available(),
        "logging_steps": 1,
        # every example has the same length: grouping by length (`fat5 finetune`'s default) has nothing to group
        "train_sampling_strategy": "random",
        "save_strategy": "no",
        "seed": 0,
        "report_to": "none",
    }
    if args.torch_compile == "regional":
        common_training.update(torch_compile_regional=True)
        # the plain Seq2SeqTrainer that trains transformers' model reads accelerate's environment switch
        os.environ["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] = "1"
    elif args.torch_compile:
        common_training.update(torch_compile=True, torch_compile_mode=args.torch_compile)
    # fp32 weights on both sides; on the GPU bf16 autocast, whose rounding differs between the implementations
    tolerance = 1e-2 if torch.cuda.is_available() else 1e-4

    with tempfile.TemporaryDirectory(prefix="fat5-finetune-benchmark-") as scratch:
        work = Path(args.work_dir or scratch)
        work.mkdir(parents=True, exist_ok=True)
        transformers_dir, fat5_dir, verification = make_checkpoints(work, options["shape"], 1000 if tiny else 16000)
        write_task(work / "train.jsonl", options["steps"] * options["batch"], options["source_length"],
                   options["target_length"])
        full_options = {**options, "training": {**common_training, "max_steps": options["steps"],
                                                "learning_rate": 5e-4, "warmup_steps": 20}}
        results = {"conversion_verification": verification,
                   "full": compare(work, transformers_dir, fat5_dir, full_options, None,
                                   not args.no_seed_reference, tolerance)}
        if lora_steps:
            lora_options = {**options, "steps": lora_steps,
                            "warmup_steps": min(options["warmup_steps"], lora_steps // 2),
                            "training": {**common_training, "max_steps": lora_steps, "learning_rate": 1e-3,
                                         "warmup_steps": 10}}
            results["lora"] = compare(work, transformers_dir, fat5_dir, lora_options, LORA, False, tolerance)

    settings = {key: value for key, value in options.items() if key != "shape"}
    document = write_result(args.out, results, shape=options["shape"], model=T5_V1_1, settings=settings,
                            lora=LORA if lora_steps else None, tiny=tiny,
                            precision="float32 weights, bf16 autocast" if torch.cuda.is_available() else "float32")
    plot(results, args.out.replace(".json", ".png"),
         f"T5 v1.1-{'tiny' if tiny else 'base'} shape, {document['environment'].get('gpu') or 'CPU'}")
    rows = []
    for name in ("full", "lora"):
        if name not in results:
            continue
        comparison = results[name]
        for run in comparison["runs"]:
            rows.append({"comparison": name, **{k: v for k, v in run.items() if k != "losses"},
                         "loss_first": run["losses"][0], "loss_last": run["losses"][-1]})
        print(f"{name}: FAT5 {comparison['speedup']}x transformers' tokens/s; loss curves (relative difference) "
              f"FAT5 vs transformers {comparison['fat5_vs_transformers']}"
              + (f"; transformers seed vs transformers {comparison['transformers_seed_vs_transformers']}; "
                 f"same learning: {comparison['same_learning']}" if "same_learning" in comparison else ""))
    print(markdown_table(rows, ["comparison", "run", "steps", "tokens_per_second", "seconds_per_step", "peak_gib",
                                "loss_first", "loss_last"]))
    print(environment()["gpu"] or "CPU", "->", args.out)


if __name__ == "__main__":
    main()
