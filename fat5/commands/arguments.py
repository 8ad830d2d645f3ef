"""What several subcommands share: the options of a command that writes a model folder, those of a training job
(`fat5 pretrain`, `fat5 finetune`) and how a job is run from the command line, and a handler's keyword arguments
taken from the parsed options of the same names."""

import argparse
import os
import sys

from ..conversion_defaults import DEFAULT_MAX_SHARD_SIZE


def add_output_options(parser: argparse.ArgumentParser, shard_help: str) -> None:
    """`--overwrite` (replace OUT) and `--max-shard-size` (safetensors shards above it), for a command that writes
    a model to the folder OUT."""
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT if it exists and holds only a model folder's files (never other files)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, help=shard_help)


def add_job_options(parser: argparse.ArgumentParser, output_dir_default: str) -> None:
    """The options both training jobs take, named as their Python functions' parameters: `--output-dir` (said to
    default to ``output_dir_default``), `--resume`, `--overwrite` and `--set KEY=VALUE` (``overrides``)."""
    parser.add_argument("--output-dir", default=None,
                        help="where the final model and tokenizer go (from_pretrained(DIR) loads them), with the "
                        f"checkpoints in DIR/checkpoint-N (default: {output_dir_default})")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in the output folder")
    parser.add_argument("--overwrite", action="store_true",
                        help="remove what a run wrote in the output folder (model, checkpoints, records) and start "
                        "over; your other files there are kept (never a folder that holds the input)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config entry (dotted key, YAML value), e.g. --set training.max_steps=100; "
                        "repeatable")


def run_job(begun, job, args: argparse.Namespace) -> dict | None:
    """``job(args.config, args.output_dir, overrides=..., resume=..., overwrite=...)``'s result, once the job has
    begun (``begun``, its context manager, given the same arguments: its config and inputs checked, its output folder
    locked and the job said in a line, before the package, torch and transformers load: ``args.load_the_package``);
    None when Ctrl-C stopped it, after one line saying how to continue. A full disk met outside the jobs' own checkpoint
    and final writes (a tokenizer, a record) is said in one line as well."""
    from ..output_folder import disk_full_error, is_disk_full, resume_hint

    options = {"overrides": args.overrides, "resume": args.resume, "overwrite": args.overwrite}
    if not sys.stderr.isatty():
        # redrawn progress bars written to a file or a pipe are noise (24 KB of them in the quick start's log): its
        # lines (the logs, the job's own) stay. tqdm reads this for every bar (the Trainer's, datasets', the Hub's)
        os.environ.setdefault("TQDM_DISABLE", "1")
    output_dir = None
    try:
        with begun(args.config, args.output_dir, **options) as output_dir:
            args.load_the_package()
            return job(args.config, args.output_dir, **options)
    except KeyboardInterrupt:
        if output_dir is None:  # stopped before the job said anything
            raise
        command = " ".join([f"fat5 {args.command}", *([args.config] if args.config else []),
                            *(["--output-dir", args.output_dir] if args.output_dir else []),
                            *(f"--set {override}" for override in args.overrides)])
        # this line says it all: returning (not raising) keeps `fat5` from adding an "interrupted" of its own; it
        # starts a line of its own, a progress bar may have been drawing on the last one
        print(f"\nfat5 {args.command}: interrupted; {resume_hint(command, output_dir)}", file=sys.stderr, flush=True)
        return None
    except OSError as error:
        if output_dir is None or not is_disk_full(error, output_dir):
            raise
        raise disk_full_error(output_dir, f"writing {error.filename or 'a file'} failed") from None


def options_of(args: argparse.Namespace, *names: str) -> dict:
    """`{name: args.name}` for `names`: the keyword arguments of an API function whose parameters the options of a
    command are named after."""
    return {name: getattr(args, name) for name in names}
