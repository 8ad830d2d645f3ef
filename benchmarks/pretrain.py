"""UL2 pretraining speed: `fat5 pretrain` with the minipile config, on the built-in Shakespeare corpus.

Runs :func:`fat5.trainer.pretrain.pretrain` (the code behind `fat5 pretrain`) with the model, packed lengths, batch
budget and optimiser settings of fat5/trainer/configs/pretrain_minipile.yaml, but on the local Shakespeare corpus
(about 1.1 M tokens, so a run of a few hundred steps repeats it, each epoch re-noised) with a tokenizer trained on
it, for a bounded number of steps with the warm-up and cosine schedule shrunk to that length. Reports the
steady-state tokens/s that FAT5Trainer logs (real encoder tokens plus labelled decoder positions per second; the
first logs, with compilation and autotuning, are left out), the padding fraction, the loss, and the MFU: model
FLOPs (benchmarks/model.py's ``step_flops`` applied to every packed example, so attention counts each example
against itself only, as the varlen kernel computes it) over time, over the GPU's dense bf16 peak.

    python benchmarks/pretrain.py --out benchmarks/results/pretrain_minipile.json
    python benchmarks/pretrain.py --tiny        # a CPU check of the whole path in a minute or two (no MFU)
"""

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, markdown_table, write_result
from model import PEAK_BF16_TFLOPS, check_agreement, parameter_counts, step_flops

from fat5.trainer.pretrain import CONFIG_DIR, load_config, load_corpus, pretrain

logger = logging.getLogger("benchmarks.pretrain")
MINIPILE_CONFIG = CONFIG_DIR / "pretrain_minipile.yaml"
# a model, batch and corpus small enough for a 2-core CPU: the same code path, not a measurement
TINY_MODEL = {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4}
TINY_DATA = {"max_input_length": 128, "max_target_length": 64, "tokens_per_batch": 2048, "num_proc": 1}


def benchmark_config(max_steps: int, logging_steps: int, tiny: bool) -> dict:
    """The minipile config with Shakespeare as corpus, ``max_steps`` steps and no evaluation or checkpoint."""
    config = yaml.safe_load(MINIPILE_CONFIG.read_text())
    minipile_data, minipile_training = config["data"], config["training"]
    config["data"] = {
        "corpus": "shakespeare",
        "eval_fraction": 0.0,
        **{key: minipile_data[key]
           for key in ("max_input_length", "max_target_length", "tokens_per_batch", "num_proc")},
    }
    # every scene: the corpus has 813, far fewer than the config's 200,000 documents
    config["tokenizer"] = {**config["tokenizer"], "train_on_documents": None}
    # the config's schedule (5% warm-up, cosine) over this run's length, so the loss moves as in the real run
    warmup_share = minipile_training["warmup_steps"] / minipile_training["max_steps"]
    config["training"] = {
        **minipile_training,
        "max_steps": max_steps,
        "warmup_steps": max(1, round(warmup_share * max_steps)),
        "logging_steps": logging_steps,
        "eval_strategy": "no",
        "save_strategy": "no",
    }
    for unused in ("eval_steps", "save_steps", "save_total_limit"):
        config["training"].pop(unused)
    if tiny:
        config["model"].update(TINY_MODEL)
        config["tokenizer"].update(vocab_size=2000, num_sentinels=128)
        config["data"].update(TINY_DATA)
        config["training"].update(bf16=False, optim="adamw_torch", dataloader_num_workers=0)
    return config


def agreement_models(model_settings: dict, vocab_size: int) -> dict:
    """transformers' T5 and a FAT5 of the config's shape carrying the same weights, bf16 on the GPU.

    The z-loss is FAT5's own addition, so it is off here: both losses are then the plain cross-entropy.
    """
    from transformers import T5Config, T5ForConditionalGeneration

    from fat5 import FAT5Config, FAT5ForConditionalGeneration

    shape = {key: model_settings[key] for key in ("d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers",
                                                  "num_heads", "feed_forward_proj")}
    common = {"vocab_size": vocab_size, "tie_word_embeddings": False, "dropout_rate": 0.0, "decoder_start_token_id": 0}
    torch.manual_seed(0)
    transformers_model = T5ForConditionalGeneration(T5Config(**shape, **common))
    # transformers 5's T5Config ties lm_head to the embedding whatever it is told; this config's model is untied
    transformers_model.lm_head.weight = torch.nn.Parameter(
        torch.randn_like(transformers_model.shared.weight) * shape["d_model"] ** -0.5)
    fat5_model = FAT5ForConditionalGeneration(
        FAT5Config(**shape, **common, scale_decoder_outputs=False, z_loss=0.0,
                   attention_backend=model_settings.get("attention_backend", "auto"))
    )
    fat5_model.load_state_dict(transformers_model.state_dict(), strict=False)
    return {name: model.to("cuda", torch.bfloat16) for name, model in
            (("fat5", fat5_model), ("transformers", transformers_model))}


def step_statistics(settings: dict, output_dir: Path, steps: int):
    """Real tokens and model FLOPs of each of the first ``steps`` training steps, from the run's own batch plan.

    The batches are rebuilt as the run built them (same tokenizer, corpus, collator and sampler seed; epoch after
    epoch), and each packed example's lengths come from its UL2 plan. The first batch is also collated, and its
    token count checked against FAT5Trainer's count, so the plan and the trained batches are known to agree.
    """
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from fat5.trainer.collator import UL2DataCollator
    from fat5.trainer.data import tokenize_dataset
    from fat5.trainer.packing import PlannedDataset, UL2PackedBatchSampler
    from fat5.trainer.trainer import count_tokens

    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(output_dir)
    seed, data = int(settings["seed"]), settings["data"]
    train_texts, _ = load_corpus(data, seed)
    train = tokenize_dataset(train_texts, tokenizer, text_column="text", num_proc=data.get("num_proc"))
    collator = UL2DataCollator(tokenizer, mixture=settings.get("ul2"), max_input_length=data["max_input_length"],
                               max_target_length=data.get("max_target_length"), packed=True, seed=seed)
    sampler = UL2PackedBatchSampler(train["length"], collator.objective, tokens_per_batch=data["tokens_per_batch"],
                                    seed=seed)
    objective = collator.objective
    tokens, flops, rows = [], [], []
    epoch = 0
    while len(tokens) < steps:
        for batch in sampler.batches(epoch):
            plan = {name: np.array([getattr(example, name) for example in batch])
                    for name in ("denoiser", "length", "num_noise", "num_spans", "row")}
            input_lengths = np.empty(len(batch), dtype=np.int64)
            target_lengths = np.empty(len(batch), dtype=np.int64)
            for index in np.unique(plan["denoiser"]):
                chosen = plan["denoiser"] == index
                input_lengths[chosen], target_lengths[chosen] = objective.output_lengths(
                    index, plan["length"][chosen], plan["num_noise"][chosen], plan["num_spans"][chosen])
            tokens.append(int(input_lengths.sum() + target_lengths.sum()))
            flops.append(float(np.sum(step_flops(model, model.config, 1, input_lengths, target_lengths))))
            rows.append(int(plan["row"].max()) + 1)
        epoch += 1
    first = collator([PlannedDataset(train)[example] for example in sampler.batches(0)[0]])
    counted = int(count_tokens(first)[0])
    if counted != tokens[0]:
        raise SystemExit(f"the rebuilt plan says {tokens[0]} tokens in the first batch, the collated batch {counted}")
    return np.array(tokens[:steps]), np.array(flops[:steps]), np.array(rows[:steps]), model


def summarise(log_history: list[dict], tokens: np.ndarray, flops: np.ndarray, warmup_steps: int, peak) -> dict:
    """Per logging window: tokens/s as FAT5Trainer logged it, seconds (the window's tokens at that rate), MFU."""
    windows, previous = [], 0
    for entry in log_history:
        if "tokens_per_second" not in entry:
            continue
        step = entry["step"]
        window_tokens, window_flops = tokens[previous:step].sum(), flops[previous:step].sum()
        seconds = window_tokens / entry["tokens_per_second"]
        windows.append({
            "first_step": previous + 1, "last_step": step, "loss": entry["loss"],
            "tokens_per_second": entry["tokens_per_second"],
            "padding_fraction": entry["padding_fraction"], "seconds": round(float(seconds), 3),
            "model_tflops": round(float(window_flops / seconds / 1e12), 1),
            "mfu": round(float(window_flops / seconds / (peak * 1e12)), 4) if peak else None,
        })
        previous = step
    steady = [w for w in windows if w["first_step"] > warmup_steps]
    if not steady:
        raise SystemExit(f"no logging window starts after the {warmup_steps} warm-up steps: run more steps")
    seconds = sum(w["seconds"] for w in steady)
    steady_tokens = sum(tokens[w["first_step"] - 1:w["last_step"]].sum() for w in steady)
    steady_flops = sum(flops[w["first_step"] - 1:w["last_step"]].sum() for w in steady)
    return {
        "windows": windows,
        "steady_steps": f"{steady[0]['first_step']}-{steady[-1]['last_step']}",
        "tokens_per_second": round(float(steady_tokens / seconds)),
        "seconds_per_step": round(seconds / (steady[-1]["last_step"] - steady[0]["first_step"] + 1), 4),
        "model_tflops": round(float(steady_flops / seconds / 1e12), 1),
        "mfu": round(float(steady_flops / seconds / (peak * 1e12)), 4) if peak else None,
        "padding_fraction": round(float(np.mean([w["padding_fraction"] for w in steady])), 4),
        "loss_first": windows[0]["loss"],
        "loss_last": windows[-1]["loss"],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=None, help="training steps (default 300; --tiny: 12)")
    parser.add_argument("--logging-steps", type=int, default=None,
                        help="steps per logged window (default 10; --tiny: 3)")
    parser.add_argument("--warmup-logs", type=int, default=3, help="logged windows left out of the steady state")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch: checks the path on a CPU")
    parser.add_argument("--output-dir", default=None, help="where the run writes (default: a temporary folder)")
    parser.add_argument("--out", default="benchmarks/results/pretrain_minipile.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("benchmarks/pretrain.py measures on a CUDA GPU; on a CPU run it with --tiny to check the path")
    max_steps = args.max_steps or (12 if args.tiny else 300)
    logging_steps = args.logging_steps or (3 if args.tiny else 10)
    warmup_steps = args.warmup_logs * logging_steps
    peak = None
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        peak = next((value for key, value in PEAK_BF16_TFLOPS.items() if key in gpu), None)

    config = benchmark_config(max_steps, logging_steps, args.tiny)
    settings = load_config(config)
    results = {}
    if torch.cuda.is_available():
        # any vocabulary checks the kernels; the trained tokenizer's size is only known later
        models = agreement_models(settings["model"], settings["tokenizer"]["vocab_size"])
        results["agreement_losses_bf16"] = check_agreement(models, settings["tokenizer"]["vocab_size"])
        logger.info("FAT5 and transformers agree on one batch: %s", results["agreement_losses_bf16"])
        del models
        torch.cuda.empty_cache()

    with tempfile.TemporaryDirectory(prefix="fat5-pretrain-benchmark-") as scratch:
        output_dir = Path(args.output_dir or scratch)
        logger.info("pretraining %d steps into %s", max_steps, output_dir)
        started = time.perf_counter()
        summary = pretrain(config, output_dir)
        wall_seconds = time.perf_counter() - started
        logger.info("rebuilding the batch plan to count tokens and FLOPs per step")
        tokens, flops, rows, model = step_statistics(settings, output_dir, summary["steps"])
    encoder, decoder, head = parameter_counts(model)
    results.update(
        summarise(summary["log_history"], tokens, flops, warmup_steps, peak),
        steps=summary["steps"],
        tokens_per_step=round(float(tokens.mean())),
        rows_per_step=round(float(rows.mean()), 1),
        parameters={"encoder": encoder, "decoder": decoder, "lm_head": head,
                        "total": sum(p.numel() for p in model.parameters())},
        vocab_size=model.config.vocab_size,
        wall_seconds_whole_job=round(wall_seconds, 1),
    )
    document = write_result(args.out, results, config=config, tiny=args.tiny, peak_bf16_tflops=peak,
                            warmup_steps_excluded=warmup_steps)
    print(markdown_table(results["windows"], ["first_step", "last_step", "loss", "tokens_per_second",
                                              "padding_fraction", "model_tflops", "mfu"]))
    print(markdown_table([results], ["steady_steps", "tokens_per_second", "seconds_per_step", "tokens_per_step",
                                     "model_tflops", "mfu", "padding_fraction", "loss_first", "loss_last"]))
    print(environment()["gpu"] or "CPU", "->", args.out, f"({document['results']['wall_seconds_whole_job']} s job)")


if __name__ == "__main__":
    main()
