"""The `fat5` command: convert, export, bundle, push, pretrain, finetune, bench.

Each area registers its own subcommands; a user mistake (FAT5Error) is printed on stderr with exit status 2 and no
traceback.
"""

import argparse
import subprocess
import sys
from pathlib import Path

from .errors import FAT5Error

# The benchmark scripts live beside the package in a source checkout (they are not installed with it).
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .conversion import add_convert_commands
    from .hub_upload import add_hub_commands
    from .trainer.finetune import add_finetune_command
    from .trainer.pretrain import add_pretrain_command

    parser = argparse.ArgumentParser(
        prog="fat5",
        description="FAT5 (Flash Attention T5): convert T5-family checkpoints, pretrain, finetune and publish.",
    )
    parser.add_argument("--version", action="version", version=f"fat5 {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_convert_commands(subparsers)
    add_hub_commands(subparsers)
    add_pretrain_command(subparsers)
    add_finetune_command(subparsers)
    add_bench_command(subparsers)
    return parser


def benchmark_names() -> list[str]:
    """The runnable scripts of benchmarks/ (``common.py`` is their shared code), as ``fat5 bench`` names them."""
    if not BENCHMARKS.is_dir():
        return []
    return sorted(path.stem.replace("_", "-") for path in BENCHMARKS.glob("*.py") if path.stem != "common")


def add_bench_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run one of the benchmarks (model, attention, cross-entropy, rms-norm, distributed, ...)",
        description="Run benchmarks/NAME.py of FAT5's source checkout with the arguments that follow; "
        "`fat5 bench NAME --help` shows the script's own options. Results go to benchmarks/results/ by default.",
    )
    parser.add_argument("benchmark", metavar="NAME", help=f"one of: {', '.join(benchmark_names()) or '(none found)'}")
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help="passed to the script")
    parser.set_defaults(func=run_benchmark)


def run_benchmark(args) -> int:
    names = benchmark_names()
    if not names:
        raise FAT5Error(
            f"no benchmarks/ folder beside the fat5 package ({BENCHMARKS}): the benchmarks ship with the source "
            "checkout; run `pip install -e .` in a clone of FAT5"
        )
    if args.benchmark not in names:
        raise FAT5Error(f"unknown benchmark {args.benchmark!r}; choose one of: {', '.join(names)}")
    script = BENCHMARKS / f"{args.benchmark.replace('-', '_')}.py"
    return subprocess.run([sys.executable, str(script), *args.arguments], cwd=BENCHMARKS.parent, check=False).returncode


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except FAT5Error as error:
        print(f"fat5 {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fat5 {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
