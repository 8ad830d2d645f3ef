"""The `fat5` command: convert, export, bundle, push, pretrain, finetune, bench.

`fat5`, `fat5 --help` and `fat5 --version` are answered from the command table below without importing the `fat5`
package: `import fat5` registers FAT5 with transformers' Auto classes, which imports torch and transformers (seconds),
and that must stay so for ``import fat5`` to do what it says. A command whose module the table marks light (it
imports neither torch nor transformers to add its options) is parsed with the package's submodules only,
fat5/__init__.py left unrun (`fat5 COMMAND --help` ends there), and the package is loaded before its handler runs; a
command marked ``loads_the_package`` gets the loader instead (``args.load_the_package()``), to say what it will do,
or what is wrong, before those imports. A user mistake (FAT5Error) is printed on stderr with exit status 2 and no
traceback. `python -m fat5.cli` runs this same command.
"""

import argparse
import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

DESCRIPTION = "FAT5 (Flash Attention T5): convert T5-family checkpoints, pretrain, finetune and publish."


class Command(NamedTuple):
    help: str
    module: str  # the `fat5.commands` module whose function `configure` adds the command's options and handler
    configure: str
    # the module, and its configure function, import neither torch nor transformers: `--help` is answered without them
    light: bool = False
    # its handler runs before fat5/__init__.py, and loads the package itself once it has said what it will do
    loads_the_package: bool = False


COMMANDS = {
    "convert": Command("convert a T5 / FLAN-T5 / mT5 / UMT5 checkpoint to FAT5 (verified against transformers)",
                       "fat5.commands.convert", "configure_convert", light=True),
    "export-hf": Command("write a FAT5 model back as a transformers T5 / MT5 / UMT5 checkpoint",
                         "fat5.commands.convert", "configure_export_hf", light=True),
    "bundle": Command("make a self-contained Hub folder (remote code, auto_map, model card) from a FAT5 model folder",
                      "fat5.commands.hub", "configure_bundle", light=True),
    "push": Command("upload a bundled FAT5 folder to the Hub (validated first)", "fat5.commands.hub", "configure_push",
                    light=True),
    "pretrain": Command("UL2 pretraining of a FAT5 model (the built-in tiny default when no config is given)",
                        "fat5.commands.pretrain", "configure_pretrain", light=True, loads_the_package=True),
    "finetune": Command("finetune a FAT5 model (seq2seq or an encoder head), fully or with LoRA, from a YAML config",
                        "fat5.commands.finetune", "configure_finetune", light=True, loads_the_package=True),
    # a benchmark runs in a process of its own: this one never needs the package
    "bench": Command("run one of the benchmarks (model, attention, cross-entropy, rms-norm, distributed, ...)",
                     "fat5.commands.bench", "configure_bench", light=True, loads_the_package=True),
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
    """`fat5` with its subcommands' names and help lines only: what `--help` and `--version` need."""
    return _parser(options_of=())


def build_parser() -> argparse.ArgumentParser:
    """`fat5` with every subcommand's options and handler (`func(args) -> int`)."""
    return _parser(options_of=COMMANDS)


def _parser(options_of: Iterable[str]) -> argparse.ArgumentParser:
    """`fat5` with every subcommand's name and help line, and the options and handler of those in ``options_of``."""
    parser = argparse.ArgumentParser(prog="fat5", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"fat5 {version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        subparser = subparsers.add_parser(name, help=command.help)
        # `main` gives the handler the loader of the package it deferred; a parser built apart imports the package
        subparser.set_defaults(load_the_package=lambda: None)
        if name in options_of:
            getattr(importlib.import_module(command.module), command.configure)(subparser)
    return parser


@contextlib.contextmanager
def _package_deferred() -> Iterator[Callable[[], None]]:
    """Within the block, `fat5.X` imports run X and the packages between, not fat5/__init__.py (torch and
    transformers, seconds), until the function the block is given runs it, in the module the submodules already hang
    from. A package left unloaded is forgotten at the end, every `fat5` module with it, so that a later
    ``import fat5`` runs the real one."""
    if "fat5" in sys.modules:  # imported already (`python -m fat5.cli`, a test): nothing to spare
        yield lambda: None
        return
    package = importlib.util.module_from_spec(importlib.util.find_spec("fat5"))
    sys.modules["fat5"] = package
    loaded = []

    def load_the_package() -> None:
        if not loaded:
            package.__spec__.loader.exec_module(package)
            loaded.append(package)

    try:
        yield load_the_package
    finally:
        if not loaded:
            for name in [name for name in sys.modules if name == "fat5" or name.startswith("fat5.")]:
                del sys.modules[name]


def main(argv=None) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    if not arguments or arguments[0] in ("-h", "--help", "--version"):
        top_level_parser().parse_args(arguments)  # prints the help, the version or the usage error, and exits
    command = COMMANDS.get(arguments[0])
    if command is None or not command.light:
        return _run(build_parser().parse_args(arguments), load_the_package=lambda: None)
    with _package_deferred() as load_the_package:
        # the command's options alone (its --help ends here)
        return _run(_parser(options_of=[arguments[0]]).parse_args(arguments), load_the_package)


def _run(args: argparse.Namespace, load_the_package: Callable[[], None]) -> int:
    """The command's handler, given ``args.load_the_package`` or run once the package is loaded; a mistake is one
    line on stderr (exit status 2), Ctrl-C one line too (130)."""
    from fat5.errors import FAT5Error

    args.load_the_package = load_the_package
    try:
        if not COMMANDS[args.command].loads_the_package:
            load_the_package()
        return args.func(args) or 0
    except FAT5Error as error:
        print(f"fat5 {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fat5 {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
