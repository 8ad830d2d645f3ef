"""Full finetuning of a FAT5 model on a summarisation-style task, with ROUGE on generated summaries.

It runs the `fat5 finetune` job from Python (`fat5.trainer.finetune.finetune` takes the same configuration as the
YAML files in fat5/trainer/configs/), then loads the finetuned model and summarises a held-out speech.

    # a converted checkpoint (fat5 convert google/flan-t5-small out/fat5-flan-t5-small)
    python examples/finetune_summarization.py --model out/fat5-flan-t5-small
    # no checkpoint at hand: a tiny random model and tokenizer made on the spot (CPU, well under a minute)
    python examples/finetune_summarization.py --tiny

The data defaults to the speeches shipped with the tests (each summarised by its lead line); give your own
JSON/JSONL/CSV file with --train-file and its columns with --text-column / --target-column.
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import fat5  # noqa: F401  (registers FAT5 with transformers' Auto classes)
from fat5.testing import make_tiny_model
from fat5.trainer.finetune import finetune

SHIPPED_DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "shakespeare_speeches.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_choice = parser.add_mutually_exclusive_group(required=True)
    model_choice.add_argument("--model", help="FAT5 model folder (e.g. written by `fat5 convert`)")
    model_choice.add_argument("--tiny", action="store_true", help="make a tiny random FAT5 model to try the pipeline")
    parser.add_argument("--train-file", default=str(SHIPPED_DATA), help="JSON/JSONL/CSV data (default: shipped)")
    parser.add_argument("--text-column", default="document")
    parser.add_argument("--target-column", default="summary")
    parser.add_argument("--output-dir", default="runs/example-summarization")
    parser.add_argument("--epochs", type=float, default=10.0)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (default: --epochs)")
    parser.add_argument("--learning-rate", type=float, default=None, help="default: 3e-4, or 3e-3 with --tiny")
    args = parser.parse_args()

    output_dir = Path(args.output_dir)
    model_dir = args.model
    if args.tiny:
        with open(args.train_file, encoding="utf-8") as file:
            texts = [json.loads(line)[args.text_column] for line in file if line.strip()]
        model_dir = make_tiny_model(output_dir / "tiny-model", texts)

    config = {
        "task": "seq2seq",
        "model": str(model_dir),
        "output_dir": str(output_dir),
        "data": {
            "train_file": args.train_file,
            "validation_fraction": 0.25,
            "text_column": args.text_column,
            "target_column": args.target_column,
            # FLAN-T5 knows this task prefix; a tiny random model needs none
            "source_prefix": "" if args.tiny else "summarize: ",
            "max_target_length": 64,
        },
        "training": {
            "learning_rate": args.learning_rate or (3e-3 if args.tiny else 3e-4),
            "num_train_epochs": args.epochs,
            "max_steps": args.max_steps,
            "per_device_train_batch_size": 8,
            "per_device_eval_batch_size": 16,
            "train_sampling_strategy": "group_by_length",
            "predict_with_generate": True,
            "generation_max_length": 64,
            "save_strategy": "no",
            "logging_steps": 5,
            "bf16": torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        },
    }
    result = finetune(config)
    losses = [entry["loss"] for entry in result["log_history"] if "loss" in entry]
    print(f"training loss, as logged every 5 steps: {' '.join(f'{loss:.3f}' for loss in losses)}")
    print("ROUGE on the held-out quarter: " + ", ".join(
        f"{name} {result['eval'][f'eval_{name}']:.1f}" for name in ("rouge1", "rouge2", "rougeL", "rougeLsum")
    ))

    # the saved model is a plain FAT5 folder: transformers' Auto classes load it once fat5 is imported
    model = AutoModelForSeq2SeqLM.from_pretrained(result["model_dir"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(result["model_dir"])
    with open(args.train_file, encoding="utf-8") as file:
        document = json.loads(file.readline())[args.text_column]
    batch = tokenizer([config["data"]["source_prefix"] + document], return_tensors="pt")
    with torch.no_grad():
        summary = model.generate(**batch, max_new_tokens=64)
    print(f"document: {document}\nsummary:  {tokenizer.decode(summary[0], skip_special_tokens=True)}")
    print(f"model saved in {result['model_dir']}")


if __name__ == "__main__":
    main()
