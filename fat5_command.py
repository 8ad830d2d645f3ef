"""The `fat5` console script's first stop.

`fat5`, `fat5 --help` and `fat5 --version` are answered here, without importing the `fat5` package: `import fat5`
registers FAT5 with transformers' Auto classes, which imports torch and transformers (seconds), and that must stay
so for ``import fat5`` to do what it says. Every other command goes on to :func:`fat5.cli.main`.
"""

import argparse
import sys

DESCRIPTION = "FAT5 (Flash Attention T5): convert T5-family checkpoints, pretrain, finetune and publish."
# the subcommands as `fat5 --help` lists them; tests/test_cli.py checks that this help is the full parser's
COMMANDS = {
    "convert": "convert a T5 / FLAN-T5 / mT5 / UMT5 checkpoint to FAT5 (verified against transformers)",
    "export-hf": "write a FAT5 model back as a transformers T5 / MT5 / UMT5 checkpoint",
    "bundle": "make a self-contained Hub folder (remote code, auto_map, model card) from a FAT5 model folder",
    "push": "upload a bundled FAT5 folder to the Hub (validated first)",
    "pretrain": "UL2 pretraining of a FAT5 model (the built-in tiny default when no config is given)",
    "finetune": "finetune a FAT5 model (seq2seq or an encoder head), fully or with LoRA, from a YAML config",
    "bench": "run one of the benchmarks (model, attention, cross-entropy, rms-norm, distributed, ...)",
}


def version() -> str:
    """The installed distribution's version (the package's own when it runs from a source tree only)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fat5")
    except PackageNotFoundError:
        from fat5 import __version__

        return __version__


def top_level_parser() -> argparse.ArgumentParser:
    """`fat5` without its subcommands' options: what `--help` and `--version` need."""
    parser = argparse.ArgumentParser(prog="fat5", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"fat5 {version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_line in COMMANDS.items():
        subparsers.add_parser(name, help=help_line)
    return parser


def main(argv=None) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    if not arguments or arguments[0] in ("-h", "--help", "--version"):
        top_level_parser().parse_args(arguments)  # prints the help, the version or the usage error, and exits
    from fat5.cli import main as run_command

    return run_command(arguments)


if __name__ == "__main__":
    sys.exit(main())
