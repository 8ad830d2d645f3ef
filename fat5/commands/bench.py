"""`fat5 bench NAME`: run one of the benchmark scripts of a source checkout, its result in a new file."""

import argparse
import subprocess
import sys
import time
from pathlib import Path

from ..errors import FAT5Error

# The benchmark scripts live beside the package in a source checkout (they are not installed with it).
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def benchmark_names() -> list[str]:
    """The runnable scripts of benchmarks/ (``common.py`` is their shared code), as ``fat5 bench`` names them."""
    if not BENCHMARKS.is_dir():
        return []
    return sorted(path.stem.replace("_", "-") for path in BENCHMARKS.glob("*.py") if path.stem != "common")


# the benchmarks that run without a GPU: always (None) or with the option that shrinks them to a CPU check
CPU_MODES = {"collator": None, "distributed": "--tiny", "finetune": "--tiny", "generation": "--tiny",
             "generation-profile": "--tiny", "gradient-check": "--tiny", "pretrain": "--tiny",
             "transformers-t5": "--tiny"}
# options under which a benchmark measures nothing (and writes no result, or only one merged from result files)
NON_MEASURING_OPTIONS = ("-h", "--help", "--plot-only", "--merge")
RESULTS_FOLDER = Path("runs") / "bench"


def configure_bench(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run benchmarks/NAME.py of FAT5's source checkout with the arguments that follow; "
        "`fat5 bench NAME --help` shows the script's own options. The result goes to a new file, "
        f"{RESULTS_FOLDER}/NAME-YYYYMMDD-HHMMSS.json under the checkout, unless `--out FILE` says where (the "
        "measured runs the README quotes are kept in benchmarks/results/, which `fat5 bench` never overwrites "
        "unless given that path). Without CUDA, only collator runs as is; distributed, finetune, generation, "
        "generation-profile, gradient-check, pretrain and transformers-t5 take --tiny for a CPU check of their path; "
        "the others need a GPU."
    )
    parser.add_argument("benchmark", metavar="NAME", help=f"one of: {', '.join(benchmark_names()) or '(none found)'}")
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help="passed to the script")
    parser.set_defaults(func=run_benchmark)


def _has_option(arguments: list[str], option: str) -> bool:
    return any(argument == option or argument.startswith(option + "=") for argument in arguments)


def run_benchmark(args) -> int:
    names = benchmark_names()
    if not names:
        raise FAT5Error(
            f"no benchmarks/ folder beside the fat5 package ({BENCHMARKS}): the benchmarks ship with the source "
            "checkout; run `pip install -e .` in a clone of FAT5"
        )
    if args.benchmark not in names:
        raise FAT5Error(f"unknown benchmark {args.benchmark!r}; choose one of: {', '.join(names)}")
    arguments = list(args.arguments)
    if not any(_has_option(arguments, option) for option in NON_MEASURING_OPTIONS):
        _require_a_device(args.benchmark, arguments)
        if not _has_option(arguments, "--out"):
            out = BENCHMARKS.parent / RESULTS_FOLDER / f"{args.benchmark}-{time.strftime('%Y%m%d-%H%M%S')}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            print(f"fat5 bench {args.benchmark}: the result goes to {out}", flush=True)
            arguments += ["--out", str(out)]
    script = BENCHMARKS / f"{args.benchmark.replace('-', '_')}.py"
    return subprocess.run([sys.executable, str(script), *arguments], cwd=BENCHMARKS.parent, check=False).returncode


def _require_a_device(name: str, arguments: list[str]) -> None:
    """Refuse, in one line, a measurement that needs CUDA on a machine without it."""
    import torch

    if torch.cuda.is_available() or (name in CPU_MODES and (CPU_MODES[name] is None or CPU_MODES[name] in arguments)):
        return
    if name in CPU_MODES:
        raise FAT5Error(f"{name} measures on a CUDA GPU and this machine has none; add {CPU_MODES[name]} to check "
                        "its path on the CPU")
    raise FAT5Error(f"{name} measures on a CUDA GPU and this machine has none (torch.cuda.is_available() is False)")
