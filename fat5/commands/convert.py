"""`fat5 convert` and `fat5 export-hf`: T5-family checkpoints to FAT5 and back (`fat5.conversion`)."""

import argparse

from ..conversion import ConversionResult, convert, export_hf
from ..conversion.verify import DEFAULT_TOLERANCE
from ..dtypes import DTYPE_CHOICES, dtype_argument


def _print_result(result: ConversionResult) -> None:
    print(f"{result.source_architecture} ({result.source}) -> {result.target_architecture}, {result.dtype}")
    if result.verification:
        figures = ", ".join(
            f"{name.removesuffix('_relative_error')} {value:.2e}"
            for name, value in result.verification.items()
            if name.endswith("_relative_error")
        )
        print(
            f"verified against {result.verification['reference']}: relative error {figures} "
            f"(tolerance {result.verification['tolerance']:g})"
        )
    else:
        print("not verified (--no-verify)")
    for note in result.notes:
        print(f"note: {note}")
    print(f"wrote {result.output}")


def _run_convert(args: argparse.Namespace) -> int:
    result = convert(
        args.src,
        args.out,
        dtype=args.dtype,
        verify=args.verify,
        tolerance=args.tolerance,
        overwrite=args.overwrite,
        revision=args.revision,
        max_shard_size=args.max_shard_size,
        bundle=args.bundle,
        push_to=args.push,
        private=args.private,
    )
    _print_result(result)
    return 0


def _run_export(args: argparse.Namespace) -> int:
    result = export_hf(
        args.fat5_dir,
        args.out,
        family=args.family,
        dtype=args.dtype,
        verify=args.verify,
        tolerance=args.tolerance,
        overwrite=args.overwrite,
        max_shard_size=args.max_shard_size,
    )
    _print_result(result)
    return 0


def _add_common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        type=dtype_argument,
        default=None,
        help=f"dtype of the written weights: {DTYPE_CHOICES} (default: the source's)",
    )
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip the numerical check against transformers (not recommended)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="largest relative error of logits / hidden states the check accepts (default %(default)g)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument(
        "--max-shard-size", default="5GB", help="shard the safetensors weights above this size (default %(default)s)"
    )


def add_convert_commands(subparsers) -> None:
    """Register `convert` and `export-hf` on the `fat5` command's subparsers; each sets `func(args) -> int`."""
    convert_parser = subparsers.add_parser(
        "convert",
        help="convert a T5 / FLAN-T5 / mT5 / UMT5 checkpoint to FAT5 (verified against transformers)",
        description="Convert a T5 v1.0, T5 v1.1, FLAN-T5, mT5 or UMT5 checkpoint (a local folder or a Hub id) into a "
        "FAT5 folder. The result is checked against transformers' own model on a random padded batch and written "
        "only if the logits agree; OUT appears atomically.",
    )
    convert_parser.add_argument("src", help="checkpoint folder, or Hub model id (e.g. google/flan-t5-base)")
    convert_parser.add_argument("out", help="folder to create")
    _add_common_options(convert_parser)
    convert_parser.add_argument("--revision", default=None, help="Hub revision when SRC is a Hub id")
    convert_parser.add_argument(
        "--bundle", action="store_true", help="make OUT a self-contained Hub folder (remote code, auto_map, model card)"
    )
    convert_parser.add_argument(
        "--push", metavar="REPO_ID", default=None, help="bundle, then upload OUT to this Hub repo (validated first)"
    )
    convert_parser.add_argument("--private", action="store_true", help="with --push: create the repo private")
    convert_parser.set_defaults(func=_run_convert)

    export_parser = subparsers.add_parser(
        "export-hf",
        help="write a FAT5 model back as a transformers T5 / MT5 / UMT5 checkpoint",
        description="Export a FAT5 folder (T5 position encoding only) as a checkpoint that transformers' T5, MT5 or "
        "UMT5 classes load with the same outputs (verified).",
    )
    export_parser.add_argument("fat5_dir", help="FAT5 model folder")
    export_parser.add_argument("out", help="folder to create")
    export_parser.add_argument(
        "--family",
        choices=("t5", "mt5", "umt5"),
        default=None,
        help="target classes (default: umt5 for a bias table per layer, else the family "
        "recorded at conversion, else t5)",
    )
    _add_common_options(export_parser)
    export_parser.set_defaults(func=_run_export)
