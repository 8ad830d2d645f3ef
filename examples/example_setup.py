"""What the finetuning examples share: their command line (a model folder or a tiny random model, the data, the
output folder, how long to train) and the model folder it names."""

import argparse
import json
from pathlib import Path

import torch

from fat5.testing import make_tiny_model

SHIPPED_DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "shakespeare_speeches.jsonl"


def example_parser(description: str, default_output_dir: str | None) -> argparse.ArgumentParser:
    """The options every example takes; each adds its own after these."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_choice = parser.add_mutually_exclusive_group(required=True)
    model_choice.add_argument("--model", help="FAT5 model folder (e.g. written by `fat5 convert`)")
    model_choice.add_argument("--tiny", action="store_true", help="make a tiny random FAT5 model to try the pipeline")
    parser.add_argument("--train-file", default=str(SHIPPED_DATA), help="JSON/JSONL/CSV data (default: shipped)")
    parser.add_argument("--output-dir", default=default_output_dir)
    parser.add_argument("--epochs", type=float, default=10.0)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (default: --epochs)")
    return parser


def model_folder(args: argparse.Namespace, output_dir: Path, text_column: str = "document") -> Path:
    """``--model``, or with ``--tiny`` a tiny random FAT5 and a tokenizer trained on the training texts, written
    beside ``output_dir`` (a job refuses an output folder holding files no run wrote)."""
    if not args.tiny:
        return Path(args.model)
    with open(args.train_file, encoding="utf-8") as file:
        texts = [json.loads(line)[text_column] for line in file if line.strip()]
    return make_tiny_model(output_dir.parent / f"{output_dir.name}-tiny-model", texts)


def short_run_arguments(args: argparse.Namespace) -> dict:
    """Training arguments of the examples' short runs: a log every 5 steps, nothing saved on the way, bf16 where
    the GPU has it."""
    return {
        "num_train_epochs": args.epochs,
        "max_steps": args.max_steps,
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 16,
        "save_strategy": "no",
        "logging_steps": 5,
        "bf16": torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    }
