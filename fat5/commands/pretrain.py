"""`fat5 pretrain`: UL2 pretraining from a YAML config (`fat5.trainer.pretraining`), with a closing summary."""

import argparse
import shlex
import sys
import time
from pathlib import Path

from ..trainer import pretraining as pretrain_job
from ..trainer.jobs import is_main_launch_process
from ..trainer.pretrain_config import PretrainConfig
from .arguments import add_job_options, run_job


def configure_pretrain(parser: argparse.ArgumentParser) -> None:
    parser.description = pretrain_job.__doc__
    parser.epilog = ("CONFIG's keys, with their defaults, the built-in job's (fat5/trainer/pretrain_config.py; "
                     "examples: fat5/trainer/configs/pretrain_*.yaml):\n\n" + PretrainConfig.reference())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("config", nargs="?", help="YAML config; its keys update the built-in default (listed "
                        "below); with --resume and no config, the run's saved pretrain_config.yaml")
    add_job_options(parser, pretrain_job.DEFAULT_OUTPUT_DIR)
    parser.set_defaults(func=_run_pretrain)


def _output_dir(args: argparse.Namespace) -> str:
    return args.output_dir or pretrain_job.DEFAULT_OUTPUT_DIR


def _run_pretrain(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    summary = run_job(pretrain_job.begun_pretraining, pretrain_job.pretrain, args)
    if summary is None:
        return 130
    # one process reports (and draws the curve, which the others would rename from under it)
    if is_main_launch_process():
        print_closing_summary(summary, Path(_output_dir(args)), time.perf_counter() - start)
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
        compiling = " (compilation included)" if summary["first_steps_compile"] else ""
        print(f"new batch shapes: {len(first_steps)}, their first steps{compiling} took {sum(first_steps):.1f} s in "
              f"all, {max(first_steps):.1f} s at most")
    print(f"model and tokenizer saved to {summary['output']}")
    print(f"summary and log history: {output_dir / pretrain_job.SUMMARY_FILE}")
    curve = output_dir / "loss_curve.png"
    if plot_loss_curve(summary["log_history"], curve):
        print(f"loss curve: {curve}")
    else:
        # matplotlib is in the dev extra only: a plain install gets the one command that draws the curve later
        python = shlex.quote(sys.executable)
        print(f"no loss curve drawn: matplotlib is not installed; after `{python} -m pip install matplotlib`, "
              f"`{loss_curve_command(output_dir / pretrain_job.SUMMARY_FILE)}` draws it")
