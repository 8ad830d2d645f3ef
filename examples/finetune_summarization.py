"""Full finetuning of a FAT5 model on a summarisation-style task, with ROUGE on generated summaries.

It runs the `fat5 finetune` job from Python (`fat5.trainer.finetuning.finetune` takes the same configuration as the
YAML files in fat5/trainer/configs/), then loads the finetuned model and summarises a held-out speech.

    # a converted checkpoint (fat5 convert google/flan-t5-small out/fat5-flan-t5-small)
    python examples/finetune_summarization.py --model out/fat5-flan-t5-small
    # no checkpoint at hand: a tiny random model and tokenizer made on the spot (CPU, well under a minute)
    python examples/finetune_summarization.py --tiny

The data defaults to the speeches shipped with the tests (each summarised by its lead line); give your own
JSON/JSONL/CSV file with --train-file and its columns with --text-column / --target-column.
"""

import json
from pathlib import Path

import torch
from example_setup import example_parser, model_folder, short_run_arguments
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import fat5  # noqa: F401  (registers FAT5 with transformers' Auto classes)
from fat5.trainer.finetuning import finetune


def main() -> None:
    parser = example_parser(__doc__, default_output_dir="runs/example-summarization")
    parser.add_argument("--text-column", default="document")
    parser.add_argument("--target-column", default="summary")
    parser.add_argument("--learning-rate", type=float, default=None, help="default: 3e-4, or 3e-3 with --tiny")
    args = parser.parse_args()

    output_dir = Path(args.output_dir)
    model_dir = model_folder(args, output_dir, args.text_column)

    config = {
        "task": "seq2seq",
        "model": str(model_dir),
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
            **short_run_arguments(args),
            "learning_rate": args.learning_rate or (3e-3 if args.tiny else 3e-4),
            "train_sampling_strategy": "group_by_length",
            "predict_with_generate": True,
            "generation_max_length": 64,
        },
    }
    result = finetune(config, output_dir)
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
