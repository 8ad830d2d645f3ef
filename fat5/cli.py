"""The `fat5` command: convert, export, bundle, push, pretrain, finetune.

Each area registers its own subcommands; a user mistake (FAT5Error) is printed on stderr with exit status 2 and no
traceback.
"""

import argparse
import sys

from .errors import FAT5Error


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
