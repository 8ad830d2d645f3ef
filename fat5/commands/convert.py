"""`fat5 convert` and `fat5 export-hf`: T5-family checkpoints to FAT5 and back (`fat5.conversion`); `fat5 convert
--bundle / --push` goes on to make the converted model a Hub folder and upload it (`fat5.hub_upload`)."""

import argparse

from ..conversion_defaults import DEFAULT_MAX_SHARD_SIZE, DEFAULT_TOLERANCE
from ..dtypes import DTYPE_CHOICES, dtype_argument
from .arguments import add_output_options, options_of


def convert_to_hub_folder(src, out, *, push_to: str | None = None, private: bool = False, overwrite: bool = False,
                          max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, **conversion_options):
    """`convert(src, out, ...)` with `out` made a self-contained Hub folder (see `fat5.hub_upload.bundle`), uploaded
    to the Hub repo `push_to` when given (`private` for a new repo); returns the `ConversionResult`."""
    from ..conversion.convert import staged_conversion
    from ..hub_upload import bundle, push
    from ..hub_upload.push import resolve_token

    if push_to:
        resolve_token()  # a missing token fails now, not after the conversion
    with staged_conversion(src, out, overwrite=overwrite, max_shard_size=max_shard_size,
                           **conversion_options) as result:
        bundled = bundle(result.output, out, overwrite=overwrite, repo_id=push_to, max_shard_size=max_shard_size)
    result.output = bundled.output
    if push_to:
        # the bundle was just loaded in a clean process and compared with the package: no second validation
        push(result.output, push_to, private=private, validate=False)
    return result


def _print_result(result) -> None:
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


CONVERSION_OPTIONS = ("dtype", "verify", "tolerance", "overwrite", "max_shard_size")


def _run_convert(args: argparse.Namespace) -> int:
    from ..conversion import convert

    options = options_of(args, *CONVERSION_OPTIONS, "revision")
    if args.bundle or args.push:
        result = convert_to_hub_folder(args.src, args.out, push_to=args.push, private=args.private, **options)
    else:
        result = convert(args.src, args.out, **options)
    _print_result(result)
    return 0


def _run_export(args: argparse.Namespace) -> int:
    from ..conversion import export_hf

    _print_result(export_hf(args.fat5_dir, args.out, **options_of(args, *CONVERSION_OPTIONS, "family")))
    return 0


def _add_conversion_options(parser: argparse.ArgumentParser) -> None:
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
    add_output_options(parser, shard_help="shard the safetensors weights above this size (default %(default)s)")


def configure_convert(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Convert a T5 v1.0, T5 v1.1, FLAN-T5, mT5 or UMT5 checkpoint (a local folder or a Hub id) into a FAT5 folder. "
        "The result is checked against transformers' own model on a random padded batch and written only if the "
        "logits agree; OUT appears atomically."
    )
    parser.add_argument("src", help="checkpoint folder, or Hub model id (e.g. google/flan-t5-base)")
    parser.add_argument("out", help="folder to create")
    _add_conversion_options(parser)
    parser.add_argument("--revision", default=None, help="Hub revision when SRC is a Hub id")
    parser.add_argument(
        "--bundle", action="store_true", help="make OUT a self-contained Hub folder (remote code, auto_map, model card)"
    )
    parser.add_argument(
        "--push", metavar="REPO_ID", default=None, help="bundle, then upload OUT to this Hub repo (validated first)"
    )
    parser.add_argument("--private", action="store_true", help="with --push: create the repo private")
    parser.set_defaults(func=_run_convert)


def configure_export_hf(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Export a FAT5 folder (T5 position encoding only) as a checkpoint that transformers' T5, MT5 or UMT5 classes "
        "load with the same outputs (verified)."
    )
    parser.add_argument("fat5_dir", help="FAT5 model folder")
    parser.add_argument("out", help="folder to create")
    parser.add_argument(
        "--family",
        choices=("t5", "mt5", "umt5"),
        default=None,
        help="target classes (default: umt5 for a bias table per layer, else the family "
        "recorded at conversion, else t5)",
    )
    _add_conversion_options(parser)
    parser.set_defaults(func=_run_export)
