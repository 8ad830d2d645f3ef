"""What several subcommands parse alike: the options of a command that writes a model folder, and a handler's
keyword arguments taken from the parsed options of the same names."""

import argparse

from ..conversion_defaults import DEFAULT_MAX_SHARD_SIZE


def add_output_options(parser: argparse.ArgumentParser, shard_help: str) -> None:
    """`--overwrite` (replace OUT) and `--max-shard-size` (safetensors shards above it), for a command that writes
    a model to the folder OUT."""
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT if it exists and holds only a model folder's files (never other files)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, help=shard_help)


def options_of(args: argparse.Namespace, *names: str) -> dict:
    """`{name: args.name}` for `names`: the keyword arguments of an API function whose parameters the options of a
    command are named after."""
    return {name: getattr(args, name) for name in names}
