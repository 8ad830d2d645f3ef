"""Several GPUs: does DDP / FSDP training follow the one-GPU loss curve, and how well does throughput scale?

One command starts every run as its own worker processes (plain python for one GPU, `accelerate launch` with
examples/accelerate/ddp.yaml or fsdp.yaml for two), each training FAT5 through FAT5Trainer for the T5 v1.1-base
shape (d_model 768, 12 + 12 layers, 12 heads, d_kv 64, d_ff 2048 gated-gelu, vocab 32128), bf16, on a synthetic
seq2seq stream: encoder 1024 tokens, decoder 256, the target a copy of the input's first 256 tokens, so the loss
falls. Batches come in order (no shuffling), so a step of 2 GPUs x b rows sees the rows of a 1-GPU step of 2b.

- curves: 1 GPU batch 2b against DDP and FSDP with b per GPU, same seed and data; "within noise" means the largest
  relative difference of the loss curves is no larger than that between two 1-GPU runs of different seeds.
- scaling: tokens/s of DDP (b per GPU) / (2 x tokens/s of 1 GPU at batch b), steps after the warm-up.

    python benchmarks/distributed.py --out benchmarks/results/distributed.json
    python benchmarks/distributed.py --tiny      # CPU check: tiny model, few steps, 2 processes over gloo
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# NVLink multicast (NVLS, symmetric memory) must stay off on the lent machines; children inherit these
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

BASE = {"d_model": 768, "num_layers": 12, "num_heads": 12, "d_kv": 64, "d_ff": 2048, "vocab_size": 32128}
TINY = {"d_model": 32, "num_layers": 2, "num_heads": 4, "d_kv": 8, "d_ff": 64, "vocab_size": 512}


# ----------------------------------------------------------------------------------------------- worker


def copy_task(rows: int, encoder_length: int, decoder_length: int, vocab_size: int, seed: int):
    """Random encoder rows; each target is the row's first ``decoder_length`` tokens (the model must copy)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(3, min(vocab_size, 8192), (rows, encoder_length), generator=generator)
    return [{"input_ids": row, "labels": row[:decoder_length].clone()} for row in inputs]


def worker(args) -> None:
    import torch
    from transformers import Seq2SeqTrainingArguments, set_seed

    from fat5 import FAT5Config, FAT5ForConditionalGeneration
    from fat5.trainer.trainer import FAT5Trainer

    shape = TINY if args.tiny else BASE
    set_seed(args.seed)
    config = FAT5Config(**shape, feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
                        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = FAT5ForConditionalGeneration(config)
    rows = args.steps * args.global_batch
    data = copy_task(rows, args.encoder_length, args.decoder_length, shape["vocab_size"], seed=1234)
    training = Seq2SeqTrainingArguments(
        output_dir=args.run_dir, per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=1e-4,
        warmup_steps=10, lr_scheduler_type="constant_with_warmup", optim=args.optim, weight_decay=0.0,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=args.seed,
        bf16=not args.tiny, use_cpu=args.tiny, train_sampling_strategy="sequential", dataloader_num_workers=0,
        ddp_find_unused_parameters=False, remove_unused_columns=False,
    )
    trainer = FAT5Trainer(model=model, args=training, train_dataset=data,
                          data_collator=lambda rows: {key: torch.stack([r[key] for r in rows]) for key in rows[0]})
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    if args.save_model:
        trainer.save_model(os.path.join(args.run_dir, "model"))
    if trainer.is_world_process_zero():
        result = {
            "processes": trainer.accelerator.num_processes,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "losses": [entry["loss"] for entry in logs],
            "tokens_per_second": [entry["tokens_per_second"] for entry in logs],
            "train_seconds": wall,
        }
        if args.save_model:
            from transformers import AutoModelForSeq2SeqLM

            loaded = AutoModelForSeq2SeqLM.from_pretrained(os.path.join(args.run_dir, "model"))
            result["saved_model_loads"] = isinstance(loaded, FAT5ForConditionalGeneration)
        Path(args.result).write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------------- driver


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(name: str, args, *, processes: int, strategy: str, batch: int, seed: int, work: Path) -> dict:
    """Run one training job in fresh worker processes; its result, or {"error": ...}."""
    import yaml

    run_dir = work / name
    run_dir.mkdir(parents=True, exist_ok=True)
    result_file = run_dir / "result.json"
    worker_args = [str(Path(__file__).resolve()), "--worker", "--run-dir", str(run_dir), "--result", str(result_file),
                   "--steps", str(args.steps), "--batch", str(batch), "--global-batch", str(batch * processes),
                   "--seed", str(seed), "--encoder-length", str(args.encoder_length),
                   "--decoder-length", str(args.decoder_length), "--optim", args.optim]
    if args.tiny:
        worker_args.append("--tiny")
    if strategy != "single":
        worker_args.append("--save-model")
    if strategy == "single":
        command = [sys.executable] + worker_args
    else:
        accelerate_config = yaml.safe_load((REPO / "examples" / "accelerate" / f"{strategy}.yaml").read_text())
        accelerate_config.update(num_processes=processes, main_process_port=_free_port())
        if args.tiny:
            # a MULTI_GPU config with use_cpu starts the processes through torchrun; they meet over gloo
            accelerate_config.update(use_cpu=True, mixed_precision="no")
            accelerate_config.pop("gpu_ids", None)
        config_file = run_dir / "accelerate.yaml"
        config_file.write_text(yaml.safe_dump(accelerate_config))
        accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
        command = [accelerate, "launch", "--config_file", str(config_file)] + worker_args
    environment = dict(os.environ)
    if strategy == "single" and not args.tiny:
        environment["CUDA_VISIBLE_DEVICES"] = environment.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    if args.tiny:
        environment["OMP_NUM_THREADS"] = "1"
    print(f"[{name}] {processes} process(es), {strategy}, batch {batch} per process, seed {seed}", flush=True)
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=REPO, check=False,
                               timeout=args.run_timeout)
    elapsed = time.perf_counter() - started
    if completed.returncode != 0 or not result_file.is_file():
        tail = (completed.stderr or completed.stdout)[-3000:]
        print(f"[{name}] failed (exit {completed.returncode}) after {elapsed:.0f} s:\n{tail}", flush=True)
        return {"error": tail, "exit_status": completed.returncode}
    result = json.loads(result_file.read_text())
    result["wall_seconds"] = round(elapsed, 1)
    print(f"[{name}] done in {elapsed:.0f} s", flush=True)
    return result


def curve_difference(reference: list[float], other: list[float]) -> dict:
    steps = min(len(reference), len(other))
    relative = [abs(other[i] - reference[i]) / abs(reference[i]) for i in range(steps)]
    return {"max_relative": max(relative), "mean_relative": sum(relative) / steps}


def steady_tokens_per_second(result: dict, warmup: int) -> float:
    values = result["tokens_per_second"][warmup:] or result["tokens_per_second"]
    return sum(values) / len(values)


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for label, losses in curves.items():
        axis.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1.2)
    axis.set_xlabel("step")
    axis.set_ylabel("training loss")
    axis.set_title("FAT5 T5 v1.1-base shape: one GPU against two (same global batch)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "distributed.json"))
    parser.add_argument("--tiny", action="store_true", help="CPU check: tiny model, few steps, gloo")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 100; 8 with --tiny)")
    parser.add_argument("--batch", type=int, default=None, help="rows per GPU b (default 64; 2 with --tiny)")
    parser.add_argument("--optim", default=None,
                        help="the Trainer's optimizer (default adamw_torch_fused, one kernel per step for every "
                             "parameter, also FSDP2's DTensors; adamw_torch with --tiny)")
    parser.add_argument("--encoder-length", type=int, default=None)
    parser.add_argument("--decoder-length", type=int, default=None)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--warmup-steps", type=int, default=10, help="steps left out of the tokens/s means")
    parser.add_argument("--run-timeout", type=int, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--global-batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--save-model", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps or (8 if args.tiny else 100)
    args.batch = args.batch or (2 if args.tiny else 64)
    args.optim = args.optim or ("adamw_torch" if args.tiny else "adamw_torch_fused")
    args.encoder_length = args.encoder_length or (64 if args.tiny else 1024)
    args.decoder_length = args.decoder_length or (16 if args.tiny else 256)
    if args.worker:
        worker(args)
        return 0
    if args.decoder_length > args.encoder_length:
        parser.error("--decoder-length must not exceed --encoder-length (the target copies the input)")

    import torch

    if not args.tiny and torch.cuda.device_count() < args.processes:
        parser.error(f"{args.processes} GPUs needed, {torch.cuda.device_count()} visible (or use --tiny on a CPU)")
    n, b = args.processes, args.batch
    with tempfile.TemporaryDirectory(prefix="fat5-distributed-") as scratch:
        work = Path(scratch)
        runs = {
            "1gpu_batch2b_seed0": launch("1gpu_batch2b_seed0", args, processes=1, strategy="single", batch=n * b,
                                         seed=0, work=work),
            "1gpu_batch2b_seed1": launch("1gpu_batch2b_seed1", args, processes=1, strategy="single", batch=n * b,
                                         seed=1, work=work),
            "ddp": launch("ddp", args, processes=n, strategy="ddp", batch=b, seed=0, work=work),
            "1gpu_batchb": launch("1gpu_batchb", args, processes=1, strategy="single", batch=b, seed=0, work=work),
        }
        if args.tiny:
            runs["fsdp"] = {"error": "skipped: accelerate runs FSDP on accelerators only"}
        else:
            runs["fsdp"] = launch("fsdp", args, processes=n, strategy="fsdp", batch=b, seed=0, work=work)

    reference = runs["1gpu_batch2b_seed0"]
    summary = {"per_device_batch": b, "processes": n, "steps": args.steps,
               "encoder_length": args.encoder_length, "decoder_length": args.decoder_length,
               "model": "tiny" if args.tiny else "t5-v1.1-base shape", "optim": args.optim}
    if "error" not in reference and "error" not in runs["1gpu_batch2b_seed1"]:
        noise = curve_difference(reference["losses"], runs["1gpu_batch2b_seed1"]["losses"])
        summary["seed_noise"] = noise
        for name in ("ddp", "fsdp"):
            if "error" in runs[name]:
                summary[name] = {"error": runs[name]["error"][-500:]}
                continue
            difference = curve_difference(reference["losses"], runs[name]["losses"])
            difference["within_noise"] = difference["max_relative"] <= noise["max_relative"]
            difference["saved_model_loads"] = runs[name].get("saved_model_loads")
            summary[name] = difference
    if "error" not in runs["ddp"] and "error" not in runs["1gpu_batchb"]:
        single = steady_tokens_per_second(runs["1gpu_batchb"], args.warmup_steps)
        for name in ("ddp", "fsdp"):
            if "error" not in runs[name]:
                multi = steady_tokens_per_second(runs[name], args.warmup_steps)
                summary.setdefault(name, {})["tokens_per_second"] = round(multi, 1)
                summary[name]["scaling_efficiency"] = round(multi / (n * single), 4)
        summary["1gpu_batchb_tokens_per_second"] = round(single, 1)

    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import markdown_table, write_result

    out = Path(args.out)
    write_result(str(out), {"summary": summary, "runs": runs})
    curves = {name: run["losses"] for name, run in runs.items() if "losses" in run and name != "1gpu_batchb"}
    if curves:
        plot(curves, out.with_suffix(".png"))

    rows = []
    for name in ("ddp", "fsdp"):
        entry = summary.get(name, {})
        rows.append({
            "run": f"{name}, {n} x batch {b}",
            "max rel. diff": f"{entry['max_relative']:.2e}" if "max_relative" in entry else "-",
            "mean rel. diff": f"{entry['mean_relative']:.2e}" if "mean_relative" in entry else "-",
            "within noise": entry.get("within_noise", "-"),
            "tokens/s": entry.get("tokens_per_second", "-"),
            "scaling": f"{entry['scaling_efficiency']:.1%}" if "scaling_efficiency" in entry else "-",
            "error": "yes" if "error" in runs[name] else "",
        })
    print()
    if "seed_noise" in summary:
        print(f"seed noise (1 GPU, seeds 0 and 1): max rel. diff {summary['seed_noise']['max_relative']:.2e}, "
              f"mean {summary['seed_noise']['mean_relative']:.2e}")
    if "1gpu_batchb_tokens_per_second" in summary:
        print(f"1 GPU, batch {b}: {summary['1gpu_batchb_tokens_per_second']} tokens/s")
    print(markdown_table(rows, ["run", "max rel. diff", "mean rel. diff", "within noise", "tokens/s", "scaling",
                                "error"]))
    print(f"written: {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
