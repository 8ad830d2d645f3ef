"""The `fat5` command: convert, export, bundle, push, pretrain, finetune, bench.

The console script enters through the top-level ``fat5_command`` module, which answers ``fat5 --help`` and
``--version`` without importing this package (and with it torch), then calls :func:`main`.

Every subcommand's options and handler live in `fat5.commands` (one module per area); a user mistake (FAT5Error) is
printed on stderr with exit status 2 and no traceback.
"""

import argparse
import sys

from .errors import FAT5Error


def build_parser() -> argparse.ArgumentParser:
    from fat5_command import COMMANDS, DESCRIPTION, version

    from .commands.bench import add_bench_command
    from .commands.convert import add_convert_commands
    from .commands.finetune import add_finetune_command
    from .commands.hub import add_hub_commands
    from .commands.pretrain import add_pretrain_command

    parser = argparse.ArgumentParser(prog="fat5", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"fat5 {version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_convert_commands(subparsers)
    add_hub_commands(subparsers)
    add_pretrain_command(subparsers)
    add_finetune_command(subparsers)
    add_bench_command(subparsers)
    missing = set(COMMANDS) ^ set(subparsers.choices)
    if missing:
        raise RuntimeError(f"fat5_command.COMMANDS and the subcommands differ in {sorted(missing)}")
    return parser


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
