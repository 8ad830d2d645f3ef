"""`fat5 bundle` and `fat5 push`: self-contained Hub folders and uploading them (`fat5.hub_upload`)."""

import argparse

from .arguments import add_output_options, options_of


def _run_bundle(args: argparse.Namespace) -> int:
    from ..hub_upload import bundle

    options = options_of(args, "overwrite", "repo_id", "license", "base_model", "max_shard_size", "validate")
    result = bundle(args.model_dir, args.out, **options)
    if result.validation:
        figures = ", ".join(
            f"{name.removesuffix('_relative_error')} {value:.1e}"
            for name, value in result.validation.items()
            if name.endswith("_relative_error")
        )
        print(f"loads with trust_remote_code=True without fat5 or triton; matches the package ({figures})")
    print(f"wrote {result.output}: {', '.join(result.files)}")
    return 0


def _run_push(args: argparse.Namespace) -> int:
    from ..hub_upload import push

    push(args.folder, args.repo_id, **options_of(args, "private", "revision", "commit_message", "dry_run", "force"))
    return 0


def configure_bundle(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write OUT: MODEL_DIR's FAT5 model with its modelling code flattened beside it, so that "
        "AutoModelForSeq2SeqLM.from_pretrained(OUT or its Hub repo, trust_remote_code=True) works without fat5. "
        "OUT is checked in a fresh process that cannot import fat5 or triton before it appears."
    )
    parser.add_argument("model_dir", help="FAT5 model folder (e.g. written by `fat5 convert`)")
    parser.add_argument("out", help="folder to create")
    parser.add_argument("--repo-id", default=None, help="Hub repo id to show in the model card's example")
    parser.add_argument("--license", default=None, help="licence for the card (default: the source's)")
    parser.add_argument("--base-model", default=None, help="Hub id of the base model (default: the source's)")
    add_output_options(parser, shard_help="shard weights above this size (default %(default)s)")
    parser.add_argument(
        "--no-validate",
        dest="validate",
        action="store_false",
        help="skip loading OUT in a fresh process (not recommended)",
    )
    parser.set_defaults(func=_run_bundle)


def configure_push(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Validate FOLDER (its code, weights and config must be what `fat5 bundle` wrote, and it must load with "
        "trust_remote_code=True in a fresh process), create REPO_ID if needed and upload FOLDER. "
        "The token comes from `hf auth login` or HF_TOKEN; HF_ENDPOINT picks the Hub."
    )
    parser.add_argument("folder", help="bundled folder (from `fat5 bundle` or `fat5 convert --bundle`)")
    parser.add_argument("repo_id", help="Hub model repo, e.g. user/fat5-flan-t5-base")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--revision", default=None, help="branch to upload to (created if missing)")
    parser.add_argument("--commit-message", default=None, help="commit message")
    parser.add_argument("--dry-run", action="store_true", help="validate and list the files, upload nothing")
    parser.add_argument("--force", action="store_true",
                        help="push a folder whose code, weights or config differ from what `fat5 bundle` wrote")
    parser.set_defaults(func=_run_push)
