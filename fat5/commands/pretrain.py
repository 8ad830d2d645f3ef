"""`fat5 pretrain`: UL2 pretraining from a YAML config (`fat5.trainer.pretraining`), with a closing summary."""

import argparse
import shlex
import sys
import time
from pathlib import Path

from ..trainer import pretraining as pretrain_job
from ..trainer.config_schema import apply_overrides
from ..trainer.pretrain_config import config_reference


def configure_pretrain(parser: argparse.ArgumentParser) -> None:
    parser.description = pretrain_job.__doc__
    parser.epilog = ("CONFIG's keys, with their defaults, the built-in job's (fat5/trainer/pretrain_config.py; "
                     "examples: fat5/trainer/configs/pretrain_*.yaml):\n\n" + config_reference())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("config", nargs="?", help="YAML config; its keys update the built-in default (listed "
                        "below); with --resume and no config, the run's saved pretrain_config.yaml")
    parser.add_argument("--output-dir", default=pretrain_job.DEFAULT_OUTPUT_DIR,
                        help="where the final model and tokenizer go (from_pretrained(DIR) loads them), with the "
                        "checkpoints in DIR/checkpoint-N (default %(default)s)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in --output-dir")
    parser.add_argument("--overwrite", action="store_true",
                        help="remove what a run wrote in --output-dir (model, checkpoints, records) and start over; "
                        "your other files there are kept (never a folder that holds the input)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config entry (dotted key, YAML value), e.g. --set training.max_steps=100; "
                        "repeatable")
    parser.set_defaults(func=_run_pretrain)


def _run_pretrain(args: argparse.Namespace) -> int:
    # here, not at the top: `fat5 pretrain --help` imports this module without torch, which output_folder imports
    from ..output_folder import disk_full_error, is_disk_full, resume_hint

    start = time.perf_counter()
    try:
        summary = pretrain_job.pretrain(args.config, args.output_dir, resume=args.resume, overwrite=args.overwrite,
                                        overrides=apply_overrides({}, args.overrides))
    except KeyboardInterrupt:
        command = " ".join(["fat5 pretrain", *([args.config] if args.config else []), "--output-dir", args.output_dir,
                            *(f"--set {override}" for override in args.overrides)])
        # this line says it all: returning (not raising) keeps `fat5` from adding an "interrupted" of its own; it
        # starts a line of its own, a progress bar may have been drawing on the last one
        print(f"\nfat5 pretrain: interrupted; {resume_hint(command, args.output_dir)}", file=sys.stderr, flush=True)
        return 130
    except OSError as error:
        # a full disk met outside the checkpoint and final writes (the tokenizer, the summary) is said as plainly
        if not is_disk_full(error, args.output_dir):
            raise
        raise disk_full_error(args.output_dir, f"writing {error.filename or 'a file'} failed") from None
    from accelerate import PartialState

    # under `accelerate launch` every process returns here: one of them reports (and draws the curve, which the
    # others would rename from under it)
    if PartialState().is_main_process:
        print_closing_summary(summary, Path(args.output_dir), time.perf_counter() - start)
    return 0


def print_closing_summary(summary: dict, output_dir: Path, elapsed: float) -> None:
    """What the job did, how fast, and where its results are; draws the loss curve beside the summary file."""
    from ..trainer.metrics import loss_curve_command, plot_loss_curve

    first, last = summary["first_logged_loss"], summary["last_logged_loss"]
    losses = f"loss {first:.3f} -> {last:.3f}" + (
        f", eval loss {summary['eval_loss']:.3f}" if summary["eval_loss"] is not None else "")
    if summary["resumed_from_step"] and not summary["steps_this_run"]:
        print(f"no step left to train: the run had reached its {summary['steps']} steps before --resume; {losses}")
    else:
        trained = f"trained {summary['steps']} steps"
        if summary["resumed_from_step"]:
            trained = (f"trained {summary['steps_this_run']} steps (resumed from step {summary['resumed_from_step']}, "
                       f"{summary['steps']} in all; train_loss covers these {summary['steps_this_run']})")
        print(f"{trained} in {elapsed / 60:.1f} min: {losses}")
    speeds = sorted(entry["tokens_per_second"] for entry in summary["log_history"] if "tokens_per_second" in entry)
    if speeds:
        print(f"throughput: {speeds[len(speeds) // 2]:,.0f} tokens/s (median of {len(speeds)} logged windows)")
    first_steps = [entry["first_step_seconds"] for entry in summary["log_history"] if "first_step_seconds" in entry]
    if first_steps:
        print(f"new batch shapes: {len(first_steps)}, their first steps (compilation included) took "
              f"{sum(first_steps):.1f} s in all, {max(first_steps):.1f} s at most")
    print(f"model and tokenizer saved to {summary['output']}")
    print(f"summary and log history: {output_dir / 'pretrain_summary.json'}")
    curve = output_dir / "loss_curve.png"
    if plot_loss_curve(summary["log_history"], curve):
        print(f"loss curve: {curve}")
    else:
        # matplotlib is in the dev extra only: a plain install gets the one command that draws the curve later
        python = shlex.quote(sys.executable)
        print(f"no loss curve drawn: matplotlib is not installed; after `{python} -m pip install matplotlib`, "
              f"`{loss_curve_command(output_dir / 'pretrain_summary.json')}` draws it")
