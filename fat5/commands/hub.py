"""`fat5 bundle` and `fat5 push`: self-contained Hub folders and uploading them (`fat5.hub_upload`)."""

import argparse

from ..hub_upload import bundle, push


def _run_bundle(args: argparse.Namespace) -> int:
    result = bundle(
        args.model_dir,
        args.out,
        overwrite=args.overwrite,
        repo_id=args.repo_id,
        license=args.license,
        base_model=args.base_model,
        max_shard_size=args.max_shard_size,
        validate=args.validate,
    )
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
    push(
        args.folder,
        args.repo_id,
        private=args.private,
        revision=args.revision,
        commit_message=args.commit_message,
        dry_run=args.dry_run,
        force=args.force,
    )
    return 0


def add_hub_commands(subparsers) -> None:
    """Register `bundle` and `push` on the `fat5` command's subparsers; each sets `func(args) -> int`."""
    bundle_parser = subparsers.add_parser(
        "bundle",
        help="make a self-contained Hub folder (remote code, auto_map, model card) from a FAT5 model folder",
        description="Write OUT: MODEL_DIR's FAT5 model with its modelling code flattened beside it, so that "
        "AutoModelForSeq2SeqLM.from_pretrained(OUT or its Hub repo, trust_remote_code=True) works without fat5. "
        "OUT is checked in a fresh process that cannot import fat5 or triton before it appears.",
    )
    bundle_parser.add_argument("model_dir", help="FAT5 model folder (e.g. written by `fat5 convert`)")
    bundle_parser.add_argument("out", help="folder to create")
    bundle_parser.add_argument("--repo-id", default=None, help="Hub repo id to show in the model card's example")
    bundle_parser.add_argument("--license", default=None, help="licence for the card (default: the source's)")
    bundle_parser.add_argument("--base-model", default=None, help="Hub id of the base model (default: the source's)")
    bundle_parser.add_argument(
        "--max-shard-size", default="5GB", help="shard weights above this size (default %(default)s)"
    )
    bundle_parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    bundle_parser.add_argument(
        "--no-validate",
        dest="validate",
        action="store_false",
        help="skip loading OUT in a fresh process (not recommended)",
    )
    bundle_parser.set_defaults(func=_run_bundle)

    push_parser = subparsers.add_parser(
        "push",
        help="upload a bundled FAT5 folder to the Hub (validated first)",
        description="Validate FOLDER (its code, weights and config must be what `fat5 bundle` wrote, and it must load "
        "with trust_remote_code=True in a fresh process), create REPO_ID if needed and upload FOLDER. "
        "The token comes from `hf auth login` or HF_TOKEN; HF_ENDPOINT picks the Hub.",
    )
    push_parser.add_argument("folder", help="bundled folder (from `fat5 bundle` or `fat5 convert --bundle`)")
    push_parser.add_argument("repo_id", help="Hub model repo, e.g. user/fat5-flan-t5-base")
    push_parser.add_argument("--private", action="store_true", help="create the repo private")
    push_parser.add_argument("--revision", default=None, help="branch to upload to (created if missing)")
    push_parser.add_argument("--commit-message", default=None, help="commit message")
    push_parser.add_argument("--dry-run", action="store_true", help="validate and list the files, upload nothing")
    push_parser.add_argument("--force", action="store_true",
                             help="push a folder whose code, weights or config differ from what `fat5 bundle` wrote")
    push_parser.set_defaults(func=_run_push)
