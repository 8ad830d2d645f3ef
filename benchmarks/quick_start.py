"""The README's quick start timed whole: `fat5 pretrain --output-dir DIR` (the built-in default job), cold and warm.

Each run is a fresh process started as the console script starts it, its output read unbuffered and every line
time-stamped. Cold: a fresh HOME (no Triton, Inductor, tokenizer or `datasets` cache; the cache variables that would
point elsewhere are removed). Warm: the same HOME again, a new output folder. Per run, where each second goes:

- before the first line: the interpreter, the config read and checked, the output folder locked, torch not imported;
- imports: the first line (what the job will do) to the one that names the path (eager or compiled step), which the
  job prints once torch, transformers, accelerate and FAT5's models are imported and the device is known; a cold run
  trains its tokenizer meanwhile, in a child process (the line "training a ... tokenizer" comes first);
- tokenizer and data: the path line to the Trainer's start (the tokenizer's training awaited or a kept one loaded,
  corpus tokenized and packed, model built); the start is the end of training less the Trainer's own
  ``train_runtime``, the end being the line that logs it;
- first steps: the first step of each batch shape (``first_step_seconds``: FAT5's Triton kernels compiled on a GPU,
  cold, and Inductor's graphs on a compiled path), each shape's in the result file; other steps: the rest of the
  training (the other steps, the evaluation during training, logging);
- after training: the final evaluation, the save and its check, the process's exit.

Beside the runs, in fresh interpreters: ``import fat5.trainer.pretraining`` and ``import fat5`` (what the job imports
before it trains) with ``-X importtime``'s slowest packages, and on a CUDA machine the first CUDA call (the context's
start). ``--set KEY=VALUE`` (repeatable) passes a config change to the job, to measure another path the same way:
``--set model.attention_backend=reference`` runs the tiny model without any of FAT5's Triton kernels, so with nothing
to compile, which on a GPU tells whether compiling them repays itself over the quick start's 300 steps.

    python benchmarks/quick_start.py                  # benchmarks/results/quick_start.json and .png
    python benchmarks/quick_start.py --warm-runs 2    # a second warm run
    python benchmarks/quick_start.py --set model.attention_backend=reference --out runs/quick_start_reference.json
"""

import argparse
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # common.py
from common import draw_beside, kill_with_descendants, markdown_table, parse_or_plot, write_result  # noqa: E402

# what the `fat5` console script runs (pyproject's [project.scripts]), so the package need not be installed
CONSOLE_SCRIPT = "import sys, fat5_command; sys.argv[0] = 'fat5'; sys.exit(fat5_command.main())"
# variables that would send a cold run to caches outside its fresh HOME
CACHE_VARIABLES = ("XDG_CACHE_HOME", "HF_HOME", "HF_DATASETS_CACHE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
                   "TRANSFORMERS_CACHE", "TORCH_HOME")
# what the job imports before it trains (timed in a fresh interpreter), and how many slowest packages are kept
IMPORTED_BY_THE_JOB = "import fat5.trainer.pretraining, fat5"
SLOWEST_IMPORTS = 12
PROGRESS_BAR = re.compile(r"\d+%\|")
# the line the job prints once its imports are done and the device known
PATH_LINE = "pretraining path:"


def timed_lines(command: list[str], environment: dict, cwd: Path, timeout: float) -> tuple[list, int, float]:
    """Run ``command``; its output lines (stdout and stderr merged, progress-bar redraws split at carriage returns)
    as ``[seconds since start, text]``, its exit status and its wall time. Past ``timeout`` seconds, silent or not,
    the job and every process under it are killed and the benchmark stops."""
    started = time.perf_counter()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment, cwd=cwd)
    lines, pending = [], b""
    while True:
        ready, _, _ = select.select([job.stdout], [], [], max(0.0, timeout - (time.perf_counter() - started)))
        if not ready:
            kill_with_descendants(job.pid)
            raise SystemExit(f"{' '.join(command)} ran past {timeout} s")
        chunk = os.read(job.stdout.fileno(), 65536)
        now = round(time.perf_counter() - started, 2)
        if not chunk:
            break
        pending += chunk
        *complete, pending = re.split(rb"[\r\n]", pending)
        lines += [[now, piece.decode(errors="replace").strip()] for piece in complete if piece.strip()]
    if pending.strip():
        lines.append([round(time.perf_counter() - started, 2), pending.decode(errors="replace").strip()])
    status = job.wait()
    return lines, status, round(time.perf_counter() - started, 2)


def job_environment(home: Path) -> dict:
    environment = {name: value for name, value in os.environ.items() if name not in CACHE_VARIABLES}
    environment.update(HOME=str(home), PYTHONUNBUFFERED="1",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return environment


def quick_start_run(name: str, home: Path, work: Path, timeout: float, overrides: list[str]) -> dict:
    """One `fat5 pretrain --output-dir DIR` and where its seconds went."""
    output = work / name
    command = [sys.executable, "-c", CONSOLE_SCRIPT, "pretrain", "--output-dir", str(output)]
    command += [part for override in overrides for part in ("--set", override)]
    print(f"[{name}] fat5 pretrain --output-dir {output}", *(f"--set {override}" for override in overrides), flush=True)
    lines, status, wall = timed_lines(command, job_environment(home), work, timeout)
    if status != 0:
        tail = "\n".join(text for _, text in lines[-30:])
        raise SystemExit(f"[{name}] fat5 pretrain exited with {status}:\n{tail}")
    history = json.loads((output / "pretrain_summary.json").read_text())["log_history"]
    runtime = next(entry["train_runtime"] for entry in history if "train_runtime" in entry)
    first_steps = [entry["first_step_seconds"] for entry in history if "first_step_seconds" in entry]
    losses = [entry["loss"] for entry in history if "loss" in entry]
    stages = stages_of(lines, wall, runtime, first_steps)
    print(f"[{name}] {wall:.1f} s: " + ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in stages.items()),
          flush=True)
    return {
        "wall_seconds": wall,
        "stages_seconds": stages,
        "train_runtime": runtime,
        "batch_shapes": len(first_steps),
        "first_step_seconds": first_steps,
        "first_and_last_loss": [losses[0], losses[-1]] if losses else None,
        # progress-bar redraws left out: each bar's last state and every other line stay
        "lines": [line for index, line in enumerate(lines)
                  if not PROGRESS_BAR.search(line[1]) or index + 1 == len(lines)
                  or not PROGRESS_BAR.search(lines[index + 1][1])],
    }


def stages_of(lines: list, wall: float, runtime: float, first_steps: list[float]) -> dict:
    """Seconds from the command to its exit, by stage (the module's doc says what each covers), from the job's
    time-stamped ``lines``, its wall time, the Trainer's ``train_runtime`` and the first steps' seconds; the stages
    that the lines do not show (an older job, a failed run) are left out."""
    first_line = lines[0][0] if lines else wall
    stages = {"before the first line": first_line}
    path_line = next((stamp for stamp, text in lines if text.startswith(PATH_LINE)), None)
    training_end = next((stamp for stamp, text in lines if "train_runtime" in text), None)
    if training_end is None:
        return stages
    training_start = training_end - runtime
    if path_line is not None:
        stages["imports"] = round(path_line - first_line, 2)
        stages["tokenizer and data"] = round(training_start - path_line, 2)
    else:
        stages["before training"] = round(training_start - first_line, 2)
    stages["first steps"] = round(sum(first_steps), 2)
    stages["other steps"] = round(runtime - sum(first_steps), 2)
    stages["after training"] = round(wall - training_end, 2)
    return stages


def import_seconds(home: Path) -> dict:
    """``IMPORTED_BY_THE_JOB`` in a fresh interpreter: its wall time, and the slowest packages: each top-level
    package's first import by ``-X importtime``'s cumulative time (its submodules and what it imported then, so
    one package's figure may hold another's), wherever in the tree it happened."""
    command = [sys.executable, "-X", "importtime", "-c", IMPORTED_BY_THE_JOB]
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True, env=job_environment(home), check=True)
    wall = round(time.perf_counter() - started, 2)
    packages = {}
    for line in completed.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            package = parts[2].strip().split(".")[0]
            packages[package] = max(packages.get(package, 0.0), int(parts[1]) / 1e6)
    slowest = sorted(packages.items(), key=lambda item: -item[1])[:SLOWEST_IMPORTS]
    return {"wall_seconds": wall, "slowest_seconds": {name: round(seconds, 2) for name, seconds in slowest}}


def cuda_start_seconds() -> float | None:
    """The first CUDA call of a fresh interpreter (the context's start), torch already imported; None without CUDA."""
    program = ("import time, torch\nif torch.cuda.is_available():\n    started = time.perf_counter()\n"
               "    torch.zeros(1, device='cuda'); torch.cuda.synchronize()\n"
               "    print(round(time.perf_counter() - started, 2))\n")
    printed = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout
    return float(printed) if printed.strip() else None


def plot(document: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = document["results"]["runs"]
    names = list(runs)
    stages = list(dict.fromkeys(stage for run in runs.values() for stage in run["stages_seconds"]))
    figure, axes = plt.subplots(figsize=(10, 1.6 + 0.5 * len(names)))
    left = [0.0] * len(names)
    for stage in stages:
        widths = [runs[name]["stages_seconds"].get(stage, 0.0) for name in names]
        axes.barh(names, widths, left=left, label=stage)
        left = [start + width for start, width in zip(left, widths)]
    for row, name in enumerate(names):
        axes.annotate(f"{runs[name]['wall_seconds']:.1f} s", (runs[name]["wall_seconds"], row), xytext=(4, 0),
                      textcoords="offset points", va="center")
    axes.invert_yaxis()
    axes.set_xlabel("seconds from the command to its exit")
    gpu = document["environment"].get("gpu") or "CPU"
    axes.set_title(f"fat5 pretrain --output-dir DIR (the quick start), {gpu}")
    axes.legend(ncol=len(stages), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    axes.margins(x=0.12)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "quick_start.json"))
    parser.add_argument("--warm-runs", type=int, default=1, help="runs after the cold one, with its caches")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a run is given up")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config change passed to the job (fat5 pretrain --set), e.g. "
                        "model.attention_backend=reference; repeatable")
    args = parse_or_plot(parser, plot)
    if args is None:
        return 0
    with tempfile.TemporaryDirectory(prefix="fat5-quick-start-") as scratch:
        work = Path(scratch)
        home = work / "home"
        home.mkdir()
        runs = {"cold": quick_start_run("cold", home, work, args.timeout, args.overrides)}
        for index in range(args.warm_runs):
            name = "warm" if args.warm_runs == 1 else f"warm {index + 1}"
            runs[name] = quick_start_run(name, home, work, args.timeout, args.overrides)
        imports = import_seconds(home)
    results = {"overrides": args.overrides, "runs": runs, "imports": imports,
               "cuda_start_seconds": cuda_start_seconds()}
    document = write_result(args.out, results)
    draw_beside(plot, document, args.out)
    rows = [{"run": name, "seconds": f"{run['wall_seconds']:.1f}",
             **{stage: f"{seconds:.1f}" for stage, seconds in run["stages_seconds"].items()}}
            for name, run in runs.items()]
    print(markdown_table(rows, list(dict.fromkeys(key for row in rows for key in row))))
    print(f"{IMPORTED_BY_THE_JOB}: {imports['wall_seconds']} s; CUDA's start: {results['cuda_start_seconds']} s")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
