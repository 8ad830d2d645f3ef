"""UL2 pretraining speed: the package's own pretraining job against the paths a user without FAT5 takes, on the
same examples from the same first weights, in one process, on one device.

* ``fat5``: the job ``fat5 pretrain CONFIG`` runs (``--config``, default the shipped ``pretrain_base.yaml``: T5
  v1.1-base shape, packed UL2 on the built-in Shakespeare corpus, batches in the config's fixed shapes, its
  compilation, precision, optimizer and workers), built by ``fat5.trainer.pretraining.prepare_pretraining`` with only
  what a benchmark must change (``--steps``, the seed; no checkpoints, evaluation, reports or progress bar, one log
  at the end: a log reads the GPU). This script adds its step clock (and ``--profile``) to the job's trainer as
  callbacks, counts each batch by wrapping that trainer's ``training_step`` (callbacks see no batch), and calls
  ``job.trainer.train()``: ``job.run()`` would also evaluate and write and reload the final model, tens of seconds
  at the base shape that measure no training. (How steps are measured: ``pretrain_steps.py``; the peers:
  ``pretrain_peers.py``.)
* ``transformers``: ``T5ForConditionalGeneration`` + a plain ``Seq2SeqTrainer`` with the job's training arguments,
  eager; each step's examples (the job's packed batch taken apart: the job's tokenized data, sampler and collator,
  so the very UL2 corruption FAT5 trains on) one per row, sorted by length, cut into ``--transformers-chunks``
  micro-batches each padded to its longest, gradients accumulated over them.
* ``transformers_compiled``: the best a user without FAT5 does, nanoT5's recipe, in a loop of its own (nanoT5's is
  its own too; the Trainer takes a fixed number of micro-batches a step): ``torch.compile(model, dynamic=False)``
  on micro-batches in a few fixed shapes, the job's batch shapes ``(rows, encoder width, decoder width)``, each
  example in the narrowest that holds it, one per row, empty rows filling a shape's last micro-batch, so each
  shape compiles once; the job's precision (bf16 autocast), fused AdamW (``torch.optim.AdamW(fused=True)``, the
  Trainer's ``adamw_torch_fused``), learning-rate schedule, weight decay and gradient clipping. On a CPU it traces
  with dynamo's ``eager`` backend (no code generation): ``--tiny`` checks the path, not the compiler.

Both peers get transformers' T5 carrying a copy of the job's FAT5 weights before it trains. Losses: the job's model
adds a z-loss (1e-4 in the shipped configs); FAT5's cross-entropy part (the loss part FAT5 returns beside it) is
compared with the peers' plain cross-entropy: ``loss_agreement`` holds the relative differences of the curves, per
step and of their moving averages over ``--smoothing`` steps, beside those between two seeds of FAT5 (``--seeds``);
``within_seed_noise`` when FAT5's mean and largest smoothed differences to every peer are no larger than the seeds'.

Measured, per run, over the steps after ``--warmup-steps`` (less any window holding the first step of a new batch
shape, which compiles): real tokens per second (encoder tokens and labelled decoder positions, padding excluded,
``real_tokens`` per step beside), the padding fraction of the positions processed, peak memory, the first step's
seconds for each batch shape (compilation and CUDA-graph capture), the loss at every step, and MFU::

    model FLOPs per step = 6 x (encoder parameters x real encoder tokens
                                + (decoder parameters + lm_head parameters) x real decoder tokens)
                           + 3.5 x attention forward FLOPs
    attention forward    = 4 x H x D x (encoder layers  x sum over examples of Le^2
                                        + decoder layers x sum over examples of (Ld^2 / 2 + Ld x Le))
    MFU                  = model FLOPs per step / step time / peak (H100 SXM dense bf16: 989 TFLOP/s)

Parameters exclude the token embeddings (a lookup); each example attends to itself only (Le, Ld its encoder and
decoder lengths), so padding and the other examples of a packed row count for nothing: every path is credited the
same FLOPs for the same examples, whatever it spends (``common.model_flops``, shared with ``distributed.py``).

Restart cost (``--restart``, always on a GPU): the compile caches (``TORCHINDUCTOR_CACHE_DIR``,
``TRITON_CACHE_DIR``) point at one empty folder made for this invocation, so the first FAT5 run starts cold; after
it the same job runs ``--restart-steps`` steps in a fresh process of this script with the same folder: warm.
``restart`` holds the first step's seconds of each batch shape cold and warm, and each process's set-up seconds.

Writes a JSON result (device, versions, date, command, settings, every run) and a PNG of tokens/s and loss over the
steps beside it.

    python benchmarks/pretrain.py --out benchmarks/results/pretrain_base.json      # pretrain_base.yaml, all paths
    python benchmarks/pretrain.py --shape small --runs fat5 --steps 300
    python benchmarks/pretrain.py --tiny --restart   # the whole path on a CPU in a minute or two (no MFU)
    python benchmarks/pretrain.py --runs fat5 --profile 5        # the last 5 steps taken apart
    python benchmarks/pretrain.py --padding-plan     # no training: padding by number of buckets, on the CPU
    python benchmarks/pretrain.py --merge a.json b.json --out pretrain_base.json   # runs of several calls as one
"""

from __future__ import annotations

import argparse
import ast
import functools
import gc
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    PEAK_BF16_TFLOPS,
    curve_differences,
    draw_beside,
    markdown_table,
    parameter_counts,
    parse_or_plot,
    peak_tflops,
    t5_carrying_weights_of,
    write_result,
)
from pretrain_peers import fixed_shapes, run_transformers, run_transformers_compiled
from pretrain_steps import TARGET_MFU, StepRecorder, by_shape, measured, record_steps, time_bounds

logger = logging.getLogger("benchmarks.pretrain")
PATHS = ("fat5", "transformers", "transformers_compiled")
PEERS = PATHS[1:]
# --shape small: T5 v1.1-small's shape over the config's model section (512, 8+8 layers, 6 heads, d_ff 1024)
SMALL_MODEL = {"d_model": 512, "d_kv": 64, "d_ff": 1024, "num_layers": 8, "num_decoder_layers": 8, "num_heads": 6}
# --tiny: the built-in default config (its tiny model, eager on a CPU) with batches in two fixed shapes, as a GPU
# config's, so that the compiled peer has its fixed shapes too
TINY_DATA = {"shape_buckets": 2}
PADDING_TARGET = 0.05  # of the positions processed (issue 31)
ATTENTION_ROUTES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention_routes.json")


# ----------------------------------------------------------------------------------------------- the job


def shipped_config() -> Path:
    """The shipped ``pretrain_base.yaml``, from the installed package."""
    from fat5.trainer import pretraining as job_module

    return Path(job_module.CONFIG_DIR) / "pretrain_base.yaml"


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that choose the job (shared with gradient_check.py)."""
    parser.add_argument("--config", default=None,
                        help="the job's YAML config (default the shipped pretrain_base.yaml; --tiny: the built-in "
                             "default)")
    parser.add_argument("--shape", choices=["base", "small"], default="base",
                        help="small: T5 v1.1-small's shape over the config's model section")
    parser.add_argument("--fat5-config", nargs="+", default=[], metavar="FIELD=VALUE",
                        help="FAT5Config fields over the config's model section, as Python literals")
    parser.add_argument("--max-documents", type=int, default=None,
                        help="train on the first N Shakespeare scenes only (the job's data.path, a JSON-lines file)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")


def resolve_job_arguments(parser, args, scratch: str) -> None:
    """The config path (None under --tiny: the built-in default), the FAT5Config overrides parsed, the shorter
    corpus written to ``scratch``."""
    if args.tiny:
        args.config, args.device = None, "cpu"
    else:
        args.config = str(args.config or shipped_config())
        if not Path(args.config).is_file():
            parser.error(f"no pretraining config at {args.config}: give --config PATH (or --tiny)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny to check the path on a CPU")
    args.fat5_config = parse_config_overrides(parser, args.fat5_config)
    args.corpus_file = write_corpus(args.max_documents, scratch) if args.max_documents else None


def write_corpus(documents: int, folder) -> str:
    """The first ``documents`` Shakespeare scenes as a JSON-lines corpus (the job's ``data.path``)."""
    from fat5.trainer.data import shakespeare_texts

    path = Path(folder) / "scenes.jsonl"
    with open(path, "w") as handle:
        texts = itertools.islice(shakespeare_texts(), documents)
        handle.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    return str(path)


def job_overrides(args, seed: int, initialization: str | None, steps: int, tokenizer=None) -> dict:
    """What the benchmark changes in the job's config: the seed, ``--steps``, no checkpoints, evaluation, reports or
    progress bar, one log at the end (a log reads the GPU); ``--shape``/``--fat5-config``/``--initialization`` model
    fields; under --tiny two batch shapes; ``--max-documents``' corpus; the tokenizer of the first job, if any."""
    model = {**(SMALL_MODEL if args.shape == "small" else {}), **args.fat5_config}
    if initialization:
        model["initialization"] = initialization
    data = dict(TINY_DATA) if args.tiny else {}
    if args.corpus_file:
        data["path"] = args.corpus_file
    training = {"max_steps": steps, "logging_steps": steps, "save_strategy": "no", "eval_strategy": "no",
                "report_to": "none", "disable_tqdm": True}
    # compile.cache_dir null: the job keeps the compile caches this invocation set (use_fresh_compile_caches); the
    # path the config's own length takes (compile.mode auto runs a job as short as a benchmark's eagerly)
    compile_section = {"cache_dir": None, "mode": job_compile_mode(args)}
    overrides = {"seed": seed, "model": model, "data": data, "training": training, "compile": compile_section}
    if tokenizer is not None:
        overrides["tokenizer"] = {"path": str(tokenizer)}
    return overrides


def job_compile_mode(args) -> str:
    """The compile mode the job of ``--config`` takes on this benchmark's device, at the config's own length."""
    from fat5.trainer.pretrain_config import choose_path, load_pretrain_config

    # gradient_check.py's arguments name no device: it trains where the job would
    device = getattr(args, "device", "cuda" if torch.cuda.is_available() else "cpu")
    return choose_path(load_pretrain_config(args.config), cuda=device == "cuda").compile_mode


def prepare_job(args, seed: int, initialization: str | None, output_dir, steps: int | None = None, tokenizer=None,
                extra: dict | None = None):
    """The package's pretraining job of ``args`` (``extra``: more overrides, by section): ``(job, seconds)``."""
    from fat5.trainer.pretraining import prepare_pretraining

    overrides = job_overrides(args, seed, initialization, steps or args.steps, tokenizer)
    for section, values in (extra or {}).items():
        overrides[section] = {**overrides.get(section, {}), **values}
    started = time.perf_counter()
    job = prepare_pretraining(args.config, output_dir, overwrite=True, overrides=overrides)
    return job, round(time.perf_counter() - started, 2)


def job_tokenizer(job) -> Path:
    """Where the job's tokenizer is: the config's, or the one the job trained (later jobs load it)."""
    return Path(job.settings.tokenizer.path or job.output_dir / "tokenizer")


def t5_fields(config) -> dict:
    """The T5Config fields of a FAT5 model's config (those FAT5 shares with T5, and the output layer's tie)."""
    from fat5.conversion.convert import CONFIG_FIELDS

    fields = (*CONFIG_FIELDS, "tie_word_embeddings")
    return {field: getattr(config, field) for field in fields if hasattr(config, field)}


def parse_config_overrides(parser, pairs: list[str]) -> dict:
    """``--fat5-config`` FIELD=VALUE pairs as a dict, each field checked against FAT5Config."""
    from fat5 import FAT5Config

    known = set(FAT5Config().to_dict())
    overrides = {}
    for pair in pairs:
        field, _, text = pair.partition("=")
        if not text or field not in known:
            parser.error(f"--fat5-config {pair!r}: give FIELD=VALUE with a FAT5Config field")
        try:
            overrides[field] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            parser.error(f"--fat5-config {pair!r}: {text!r} is not a Python literal (True, 0.1, 'gelu')")
    return overrides


# ----------------------------------------------------------------------------------------------- FAT5, restarts


def run_fat5(job, args, label: str) -> dict:
    """The job's own trainer, this script's clock (and profiler) added as callbacks."""
    trainer = job.trainer
    recorder = StepRecorder(parameter_counts(job.model), job.model.config, args.window)
    record_steps(trainer, recorder, cross_entropy=True)
    result = measured(lambda hooks: trainer.train(), recorder, args, label, trainer)
    return dict(result, first_step_seconds=trainer.first_step_seconds,
                first_step_seconds_by_shape=by_shape(recorder.new_shapes, trainer.first_step_seconds))


JOB_FIELDS = ("config", "tiny", "shape", "fat5_config", "corpus_file", "steps")


def restart_cost(args, first: dict, tokenizer: Path, seed: int, initialization, scratch: str) -> dict:
    """The job again, ``--restart-steps`` steps, in a fresh process of this script (``--restart-child``) on the
    compile caches the first run (``first``, cold) filled: the first step of each batch shape cold and warm."""
    folder = Path(scratch)
    spec = {"job": {field: getattr(args, field) for field in JOB_FIELDS}, "seed": seed,
            "initialization": initialization, "tokenizer": str(tokenizer), "out": str(folder / "restart.json")}
    spec["job"]["steps"] = min(args.restart_steps, args.steps)
    (folder / "restart-spec.json").write_text(json.dumps(spec))
    started = time.perf_counter()
    completed = subprocess.run([sys.executable, os.path.abspath(__file__), "--restart-child",
                                str(folder / "restart-spec.json")], capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        return {"error": (completed.stderr or completed.stdout)[-3000:]}
    warm = json.loads(Path(spec["out"]).read_text())
    cold = {entry["shape"]: entry["seconds"] for entry in first.get("first_step_seconds_by_shape", [])}
    return {"steps": spec["job"]["steps"], "caches": "TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR: one folder, "
            "empty before the first run", "cold_prepare_seconds": first.get("prepare_seconds"),
            "warm_prepare_seconds": warm["prepare_seconds"],
            "warm_process_seconds": round(time.perf_counter() - started, 1),
            "first_step_seconds": [{"shape": entry["shape"], "cold": cold.get(entry["shape"]),
                                    "warm": entry["seconds"]} for entry in warm["first_step_seconds_by_shape"]]}


def restart_child(spec_path: str) -> None:
    """``--restart-child``: the job of the spec written by :func:`restart_cost`, trained in this fresh process;
    its set-up seconds and the first step's seconds of each batch shape written to the spec's ``out``."""
    spec = json.loads(Path(spec_path).read_text())
    args = argparse.Namespace(**spec["job"])
    with tempfile.TemporaryDirectory(prefix="fat5-pretrain-restart-") as scratch:
        job, prepare_seconds = prepare_job(args, spec["seed"], spec["initialization"], Path(scratch) / "job",
                                           tokenizer=spec["tokenizer"])
        recorder = StepRecorder(parameter_counts(job.model), job.model.config, window=args.steps)
        record_steps(job.trainer, recorder, cross_entropy=False)
        job.trainer.train()
    Path(spec["out"]).write_text(json.dumps({
        "prepare_seconds": prepare_seconds,
        "first_step_seconds_by_shape": by_shape(recorder.new_shapes, job.trainer.first_step_seconds)}))


def use_fresh_compile_caches(scratch: str) -> None:
    """Inductor's and Triton's caches in one empty folder of this invocation (its child processes inherit it)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(scratch, "compile-cache", "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(scratch, "compile-cache", "triton")


def guarded(path: str, run: dict, train) -> dict:
    """``run`` updated with what ``train()`` measured, or with the error that stopped it (the other paths still
    run, and the result keeps what they measured)."""
    try:
        run.update(train())
    except torch.cuda.OutOfMemoryError as error:
        logger.warning("%s path ran out of memory: %s", path, str(error).splitlines()[0])
        run["error"] = "out of memory: " + str(error).splitlines()[0]
    except Exception as error:
        logger.exception("%s path failed", path)
        run["error"] = f"{type(error).__name__}: {str(error)[:2000]}"
    release()
    logger.info("%s", {key: value for key, value in run.items() if key not in ("loss", "cross_entropy", "windows",
                                                                              "real_tokens")})
    return run


def run_path(path: str, job, weights, args, label: str, scratch: str) -> dict:
    """One path's run; a peer on its own copy of the job's first weights (``weights``: T5 carrying them)."""
    if path == "fat5":
        return run_fat5(job, args, label)
    t5 = t5_carrying_weights_of(weights, **t5_fields(job.model.config))
    try:
        if path == "transformers":
            return run_transformers(job, t5, args, label, scratch)
        return run_transformers_compiled(job, t5, args, label)
    finally:
        t5.to("cpu")


def run_seed(args, paths, seed: int, initialization, scratch: str, tokenizer, restart: bool) -> tuple:
    """Every path of one seed and initialisation from the job's first weights; the restart cost after FAT5's run
    when ``restart``. ``(runs, restart cost or None, job)``."""
    job, prepare_seconds = prepare_job(args, seed, initialization, Path(scratch) / f"job-{initialization}-{seed}",
                                       tokenizer=tokenizer)
    weights = None
    if set(paths) & set(PEERS):  # taken before FAT5 trains, where the job's trainer put its model
        with torch.device(job.model.device):
            weights = t5_carrying_weights_of(job.model, **t5_fields(job.model.config)).cpu()
    shapes = [list(shape) for shape in fixed_shapes(job)]
    logger.info("batch shapes (rows, encoder, decoder): %s", shapes)
    runs, cost = [], None
    for path in paths:
        run = {"path": path, "initialization": initialization or "config", "seed": seed, "bucket_shapes": shapes}
        if path == "fat5":
            run["prepare_seconds"] = prepare_seconds
        logger.info("%s path, initialization %s, seed %d: %d steps", path, run["initialization"], seed, args.steps)
        job.batches.train_sampler.set_epoch(0)  # every path starts at the sampler's first epoch
        runs.append(guarded(path, run, functools.partial(run_path, path, job, weights, args, f"{path}, seed {seed}",
                                                         scratch)))
        if path == "fat5":
            # its optimizer, compiled model and graphs' memory freed for the restarted job and the peers
            job.trainer.accelerator.free_memory()
            job.trainer.optimizer, job.trainer.lr_scheduler, job.trainer.model_wrapped = None, None, job.model
            job.model.to("cpu")
            release()
            if restart:
                cost = restart_cost(args, runs[-1], job_tokenizer(job), seed, initialization, scratch)
    return runs, cost, job


def release() -> None:
    """Free a finished run's optimizer and compiled graphs before the next run starts."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cross_entropy(run: dict) -> list[float]:
    """A run's cross-entropy curve: FAT5's loss part, a peer's loss."""
    return run.get("cross_entropy") or run["loss"]


def comparisons(runs: list[dict], smoothing: int) -> dict:
    """FAT5 over each peer in real tokens/s, and the cross-entropy curves against the noise of two FAT5 seeds.

    Paths are compared at the same initialisation and seed (the same first weights and examples); the noise is the
    difference between the first two seeds of FAT5 (other weights, other batch order), over the same steps."""
    finished = {(run["path"], run["initialization"], run["seed"]): run for run in runs if "loss" in run}
    results, agreement = {}, []
    for peer in PEERS:
        pairs = [(run, finished[(peer, *key[1:])]) for key, run in finished.items()
                 if key[0] == "fat5" and (peer, *key[1:]) in finished]
        ratios = [fat5["tokens_per_second"] / other["tokens_per_second"] for fat5, other in pairs
                  if fat5.get("tokens_per_second") and other.get("tokens_per_second")]
        if ratios:
            results[f"fat5_over_{peer}_tokens_per_second"] = round(float(np.mean(ratios)), 2)
    for (path, initialization, seed), fat5 in finished.items():
        peers = {peer: finished[peer, initialization, seed] for peer in PEERS
                 if path == "fat5" and (peer, initialization, seed) in finished}
        if not peers:
            continue
        entry = {"initialization": initialization, "seed": seed}
        for peer, run in peers.items():
            entry[f"fat5_vs_{peer}"] = curve_differences(cross_entropy(fat5), cross_entropy(run), smoothing)
        seeds = sorted(key[2] for key in finished if key[:2] == ("fat5", initialization))
        if len(seeds) >= 2:
            steps = min(entry[f"fat5_vs_{peer}"]["steps_compared"] for peer in peers)
            first, second = (cross_entropy(finished["fat5", initialization, other])[:steps] for other in seeds[:2])
            noise = entry[f"fat5_seed_{seeds[1]}_vs_{seeds[0]}"] = curve_differences(second, first, smoothing)
            entry["within_seed_noise"] = all(entry[f"fat5_vs_{peer}"][key] <= noise[key] for peer in peers
                                             for key in ("smoothed_mean", "smoothed_max"))
        agreement.append(entry)
    if agreement:
        results["loss_agreement"] = {"smoothing": smoothing, "compared": "FAT5's cross-entropy part (its loss less "
                                     "the z-loss) against the peers' cross-entropy", "pairs": agreement}
    return results


def merge_files(paths: list[str], out: str, smoothing: int) -> None:
    """``--merge``: the runs of several result files of one shape (a device call's time limit fits only so many
    runs) as one result, compared as if one invocation had made them."""
    documents = []
    for path in paths:
        try:
            with open(path) as handle:
                documents.append(json.load(handle))
        except (OSError, json.JSONDecodeError) as error:
            raise SystemExit(f"--merge: cannot read {path} as a result file: {error}") from None
        if not isinstance(documents[-1], dict) or "runs" not in documents[-1].get("results", {}):
            raise SystemExit(f"--merge: {path} is not a pretraining result (no results.runs)")
    for field in ("shape", "data"):
        if len({json.dumps(document[field], sort_keys=True) for document in documents}) > 1:
            raise SystemExit(f"--merge: the files differ in their {field}; merge the runs of one shape and data")
    first = documents[0]
    runs = [dict(run, source=path) for path, document in zip(paths, documents) for run in document["results"]["runs"]]
    for run in runs:  # derived figures: recomputed by this script's formula from the stored profile
        bounds = run.get("profile", {}).get("time_bounds")
        if bounds and "profiled_gflop_per_step" in run:
            run["profile"] = dict(run["profile"], time_bounds=time_bounds(
                run, bounds["attention_bound_tflops"], bounds.get("peak_tflops", PEAK_BF16_TFLOPS["H100"]),
                TARGET_MFU.get(first["shape"], TARGET_MFU["base"])))
    shared = ("batch_shapes", "vocab_size", "tokens_per_batch")
    results = {**{key: first["results"][key] for key in shared}, "runs": runs, **comparisons(runs, smoothing)}
    restarts = [document["results"]["restart"] for document in documents if "restart" in document["results"]]
    if restarts:  # FAT5's restart cost, measured beside its run
        results["restart"] = restarts[0]
    document = write_result(out, results, shape=first["shape"], model=first["model"], data=first["data"],
                            settings={"merged": {path: document["environment"] for path, document
                                                 in zip(paths, documents)}, "smoothing": smoothing})
    report(document, out)


def report(document: dict, out: str) -> None:
    """The result's PNG, and its runs, losses, speed ratios, loss agreement, restart cost and profiles."""
    draw_beside(plot, document, out)
    results, runs = document["results"], document["results"]["runs"]
    columns = ["path", "initialization", "seed", "tokens_per_second", "mfu", "model_tflops", "seconds_per_step",
               "padding_fraction", "peak_memory_gib", "first_step_seconds", "batch_shapes", "error"]
    rows = [dict(run, first_step_seconds=run.get("first_step_seconds", [])[:6]) for run in runs]
    print(markdown_table(rows, columns))
    for run in runs:
        if "loss" in run:
            curve = cross_entropy(run)
            marks = [step for step in (1, 10, 50, 100, 200, 300, run["steps"]) if step <= run["steps"]]
            print(f"cross-entropy {run['path']} ({run['initialization']}, seed {run['seed']}): "
                  + ", ".join(f"step {step} {curve[step - 1]:.3f}" for step in dict.fromkeys(marks)))
    for peer in PEERS:
        if f"fat5_over_{peer}_tokens_per_second" in results:
            print(f"FAT5 / {peer} real tokens/s: {results[f'fat5_over_{peer}_tokens_per_second']}x")
    for entry in results.get("loss_agreement", {}).get("pairs", []):
        print(f"loss curves ({entry['initialization']}, seed {entry['seed']}):",
              {key: value for key, value in entry.items() if key not in ("initialization", "seed")})
    if results.get("restart"):
        print("restart:", results["restart"])
    print_profiles(runs)
    for run in runs:
        if "time_bounds" in run.get("profile", {}):
            print(f"time bounds {run['path']} (seed {run['seed']}):", run["profile"]["time_bounds"])
    print(document["environment"]["gpu"] or "CPU", "->", out)


def plot(document: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "padding_plan" in document["results"]:
        plot_padding(document, path, plt)
        return

    figure, (speed, loss) = plt.subplots(1, 2, figsize=(13, 4.5))
    for run in document["results"]["runs"]:
        if "loss" not in run:
            continue
        label = f"{run['path']} ({run['initialization']}, seed {run['seed']})"
        # the profiled steps run under the profiler: not the training speed
        windows = [window for window in run["windows"] if not window.get("profiled")]
        speed.plot([w["last_step"] for w in windows], [w["tokens_per_second"] for w in windows], marker=".",
                   label=label)
        loss.plot(np.arange(1, len(run["loss"]) + 1), cross_entropy(run), label=label, linewidth=1)
    # a merged result was written on any machine: its runs' GPU is in the merged files' environments
    sources = [document["environment"], *document.get("settings", {}).get("merged", {}).values()]
    gpu = next((source["gpu"] for source in reversed(sources) if source.get("gpu")), None) or "CPU"
    speed.set(xlabel="step", ylabel="real tokens / s", title=f"{document['shape']} shape, {gpu}")
    loss.set(xlabel="step", ylabel="cross-entropy", title="training cross-entropy, same examples and initial weights")
    for axis in (speed, loss):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_padding(document: dict, path: str, plt) -> None:
    results = document["results"]
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for shape, plans in results["padding_plan"].items():
        axis.plot([plan["buckets"] for plan in plans], [100 * plan["padding_fraction"] for plan in plans],
                  marker="o", label=f"{shape} ({results['tokens_per_batch']} positions a batch)")
    axis.axhline(100 * results["padding_target"], color="gray", linestyle="--", linewidth=1, label="target")
    axis.set(xlabel="shape buckets (decoder widths)", ylabel="padding, % of positions processed",
             title=f"packed UL2 batches of the job, {results['epochs']} epochs (CPU count)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def padding_plan(args, scratch: str) -> None:
    """``--padding-plan``: no training. For each number of shape buckets, the padding fraction of the positions
    that the job's packed batches of ``--padding-epochs`` epochs hold (encoder and decoder, counted as a run counts
    them, the last short batch of each pool dropped), from the job's data, sampler and collator on the CPU."""
    from fat5.trainer.packing import PlannedDataset, UL2PackedBatchSampler

    job, _ = prepare_job(args, args.seeds[0], None, Path(scratch) / "job", steps=1)
    data, name = job.settings.to_dict()["data"], "tiny" if args.tiny else args.shape
    lengths = np.asarray(job.batches.train["length"])
    plans = {name: [bucket_padding(PlannedDataset(job.batches.train), job.collator, UL2PackedBatchSampler(
        lengths, job.collator.objective, tokens_per_batch=data["tokens_per_batch"], shape_buckets=count,
        drop_last=True, seed=args.seeds[0]), args.padding_epochs) for count in range(1, args.max_buckets + 1)]}
    fewest = next((plan["buckets"] for plan in plans[name] if plan["padding_fraction"] <= PADDING_TARGET), None)
    results = {"measured_on": "the CPU: sampler and collator only, no training (the positions a GPU run processes)",
               "epochs": args.padding_epochs, "padding_target": PADDING_TARGET, "padding_plan": plans,
               "tokens_per_batch": data["tokens_per_batch"], "fewest_buckets_within_target": {name: fewest}}
    document = write_result(args.out, results, config=args.config, data=data,
                            settings={key: value for key, value in vars(args).items() if key != "plot_only"})
    draw_beside(plot, document, args.out)
    rows = [{"buckets": plan["buckets"], name: f"{100 * plan['padding_fraction']:.2f}%"} for plan in plans[name]]
    print(markdown_table(rows, ["buckets", name]))
    print("fewest buckets within the target:", results["fewest_buckets_within_target"], "->", args.out)


def bucket_padding(planned, collator, sampler, epochs: int) -> dict:
    """Padding of ``epochs`` epochs of ``sampler``'s batches, collated: overall, encoder and decoder."""
    real, positions = np.zeros(2), np.zeros(2)
    batches = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for examples in sampler:
            batch = collator([planned[example] for example in examples])
            real += [int((batch["segment_ids"] > 0).sum()), int((batch["labels"] != -100).sum())]
            positions += [batch["input_ids"].numel(), batch["labels"].numel()]
            batches += 1
    return {"buckets": len(sampler.buckets.target_widths), "batch_shapes": sampler.buckets.shapes(),
            "batches": batches, "padding_fraction": round(float(1 - real.sum() / positions.sum()), 4),
            "encoder_padding": round(float(1 - real[0] / positions[0]), 4),
            "decoder_padding": round(float(1 - real[1] / positions[1]), 4)}


def print_profiles(runs: list[dict]) -> None:
    """The runs' ``--profile`` entries side by side: ms per step by kind of kernel (host operators on a CPU)."""
    profiled = [run for run in runs if run.get("profile")]
    if not profiled:
        return
    names = [f"{run['path']} ({run['initialization']}, seed {run['seed']})" for run in profiled]
    kind_key = "kernel_ms_by_kind" if any(run["profile"]["kernel_ms_by_kind"] for run in profiled) \
        else "host_operator_ms"
    kinds = list(dict.fromkeys(kind for run in profiled for kind in run["profile"][kind_key]))
    rows = [{"ms per step": kind, **{name: run["profile"][kind_key].get(kind, "")
                                     for name, run in zip(names, profiled)}} for kind in kinds]
    for key in ("kernel_ms", "device_ms", "host_enqueue_ms", "host_synchronisations"):
        rows.append({"ms per step": key, **{name: run["profile"][key] for name, run in zip(names, profiled)}})
    print(markdown_table(rows, ["ms per step", *names]))


def cudnn_attention_tflops(path: str, length: int) -> float:
    """SDPA cuDNN's bias-free, non-causal forward+backward TFLOP/s at ``length`` in an attention.py result."""
    try:
        with open(path) as handle:
            tables = json.load(handle)["results"]["tables"]
        return next(round(row["forward_backward"]["tflops"], 1) for rows in tables.values() for row in rows
                    if row["implementation"] == "sdpa_cudnn_no_bias" and not row["causal"] and row["length"] == length)
    except (OSError, KeyError, StopIteration, json.JSONDecodeError):
        raise SystemExit(f"--profile: no cuDNN figure at L {length} in {path}; give --attention-bound-tflops") from None


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_arguments(parser)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of every run")
    parser.add_argument("--runs", default=",".join(PATHS), help=f"paths to run, of {', '.join(PATHS)}")
    parser.add_argument("--initialization", nargs="+", choices=["t5x", "transformers"], default=[None],
                        help="FAT5Config(initialization=...) of the shared draw, each value its runs (default the "
                             "config's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="each run once per seed (two give noise)")
    parser.add_argument("--transformers-chunks", type=int, default=4,
                        help="micro-batches per step of the eager transformers path (its padded step must fit)")
    parser.add_argument("--warmup-steps", type=int, default=30, help="steps left out of the throughput")
    parser.add_argument("--window", type=int, default=10, help="steps per timed window")
    parser.add_argument("--restart", action="store_true",
                        help="measure the restart cost (always on a GPU): the job again in a fresh process")
    parser.add_argument("--restart-steps", type=int, default=20, help="steps of the restarted job")
    parser.add_argument("--restart-child", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="take the last N steps of each run apart: kernels by kind, host enqueue time, "
                             "synchronisations (left out of the throughput)")
    parser.add_argument("--padding-plan", action="store_true",
                        help="no training: padding by number of shape buckets on the CPU (pretrain_padding.json)")
    parser.add_argument("--max-buckets", type=int, default=8, help="--padding-plan: bucket counts 1 to this")
    parser.add_argument("--padding-epochs", type=int, default=8, help="--padding-plan: epochs of batches counted")
    parser.add_argument("--tiny", action="store_true",
                        help="check the whole path on a CPU: the built-in default config (its tiny model), 6 steps "
                             "on 60 scenes (or --max-documents)")
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/pretrain_SHAPE.json)")
    parser.add_argument("--smoothing", type=int, default=10,
                        help="steps of the moving average under which loss curves are compared")
    parser.add_argument("--attention-bound-tflops", type=float, default=None,
                        help="--profile's time bounds: the attention rate they assume (default: cuDNN's bias-free "
                             "encoder forward+backward at L 1024 in results/attention_routes.json)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="no training: the runs of these result files (one shape) as one result, compared")
    args = parse_or_plot(parser, plot, argv)
    if args is not None and args.tiny:
        args.steps, args.max_documents = min(args.steps, 6), args.max_documents or 60
        args.warmup_steps, args.window, args.transformers_chunks, args.smoothing = 2, 1, 2, 2
        args.restart_steps = min(args.restart_steps, 2)
    return parser, args


def check_arguments(parser, args) -> list[str]:
    """The paths to run, after refusing what cannot be measured."""
    paths = [path.strip() for path in args.runs.split(",") if path.strip()]
    if not paths or set(paths) - set(PATHS):
        parser.error(f"--runs takes {', '.join(PATHS)}, got {args.runs!r}")
    if args.profile and args.steps - args.profile - 1 <= args.warmup_steps:
        parser.error(f"--profile {args.profile} takes the last {args.profile + 1} of --steps {args.steps}: leave "
                     f"more than --warmup-steps {args.warmup_steps} before them")
    if args.profile and args.attention_bound_tflops is None:
        args.attention_bound_tflops = cudnn_attention_tflops(ATTENTION_ROUTES, length=1024)
    args.restart = (args.restart or args.device == "cuda") and "fat5" in paths
    args.peak_tflops = peak_tflops(torch.cuda.get_device_name(0)) if args.device == "cuda" else None
    if args.device == "cuda":
        # the compiled peer's graph for each of the job's few batch shapes
        for limit in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, 64)
    return paths


def main(argv=None) -> None:
    parser, args = parse_arguments(argv)
    if args is None:
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.restart_child:
        restart_child(args.restart_child)
        return
    if args.merge:
        if not args.out or args.out in args.merge:
            parser.error("--merge writes a new file: give an --out that is not one of the merged files")
        merge_files(args.merge, args.out, args.smoothing)
        return
    with tempfile.TemporaryDirectory(prefix="fat5-pretrain-benchmark-") as scratch:
        resolve_job_arguments(parser, args, scratch)
        if args.padding_plan:
            args.out = args.out or "benchmarks/results/pretrain_padding.json"
            padding_plan(args, scratch)
            return
        paths = check_arguments(parser, args)
        args.out = args.out or f"benchmarks/results/pretrain_{'tiny' if args.tiny else args.shape}.json"
        if args.profile:
            # the profiled runs' kernel and operator tables, this invocation's only
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            open(args.out.replace(".json", "_profile.txt"), "w").close()
        use_fresh_compile_caches(scratch)
        runs, restart, tokenizer, job = [], None, None, None
        for initialization in args.initialization:
            for seed in args.seeds:
                seed_runs, cost, job = run_seed(args, paths, seed, initialization, scratch, tokenizer,
                                                restart=args.restart and restart is None)
                runs += seed_runs
                restart, tokenizer = restart or cost, tokenizer or job_tokenizer(job)
        settings = job.settings.to_dict()
        data = settings["data"]
        results = {"runs": runs, "batch_shapes": [list(shape) for shape in fixed_shapes(job)],
                   "vocab_size": job.model.config.vocab_size, "tokens_per_batch": data["tokens_per_batch"],
                   "restart": restart, **comparisons(runs, args.smoothing)}
        document = write_result(args.out, results, shape="tiny" if args.tiny else args.shape, config=args.config,
                                job=settings, model=settings["model"], data=data,
                                settings={key: value for key, value in vars(args).items()
                                          if key not in ("plot_only", "merge", "restart_child")})
    report(document, args.out)


if __name__ == "__main__":
    main()
