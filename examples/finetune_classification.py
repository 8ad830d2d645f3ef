"""Finetuning FAT5's encoder with a task head: sequence classification or token classification.

The heads load from a seq2seq FAT5 folder (the decoder and lm_head are left out) and start from T5's initialisation.
On the shipped speeches, `--task sequence_classification` learns whether a speech comes from a comedy or a tragedy;
`--task token_classification` learns to tag the words that are characters' names.

    python examples/finetune_classification.py --model out/fat5-flan-t5-small   # fat5 convert google/flan-t5-small
    python examples/finetune_classification.py --tiny --task token_classification   # tiny random model, CPU
    python examples/finetune_classification.py --tiny --lora                        # LoRA, the head trains in full

The same job from a YAML file: `fat5 finetune fat5/trainer/configs/finetune_classification.yaml`.
"""

import json
from pathlib import Path

import torch
from example_setup import example_parser, model_folder, short_run_arguments
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

import fat5  # noqa: F401  (registers FAT5 with transformers' Auto classes)
from fat5.trainer.finetuning import finetune

COLUMNS = {"sequence_classification": ("document", "genre"), "token_classification": ("words", "tags")}


def main() -> None:
    parser = example_parser(__doc__, default_output_dir=None)
    parser.add_argument("--task", choices=sorted(COLUMNS), default="sequence_classification")
    parser.add_argument("--lora", action="store_true", help="LoRA adapters on the encoder, the head in full")
    args = parser.parse_args()

    output_dir = Path(args.output_dir or f"runs/example-{args.task}")
    text_column, target_column = COLUMNS[args.task]
    model_dir = model_folder(args, output_dir)

    config = {
        "task": args.task,
        "model": str(model_dir),
        "data": {
            "train_file": args.train_file,
            "validation_fraction": 0.25,
            "text_column": text_column,
            "target_column": target_column,
        },
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0} if args.lora else None,
        "training": {
            **short_run_arguments(args),
            "learning_rate": 3e-3 if args.tiny or args.lora else 3e-4,
        },
    }
    result = finetune(config, output_dir)
    losses = [entry["loss"] for entry in result["log_history"] if "loss" in entry]
    print(f"training loss, as logged every 5 steps: {' '.join(f'{loss:.3f}' for loss in losses)}")
    print(f"held-out accuracy {result['eval']['eval_accuracy']:.3f}, macro F1 {result['eval']['eval_f1_macro']:.3f}")

    # a plain FAT5 folder (LoRA: the merged one) that transformers' Auto classes load once fat5 is imported
    saved = result["model_dir"] or result["merged_dir"]
    auto_class = AutoModelForSequenceClassification if args.task == "sequence_classification" else (
        AutoModelForTokenClassification
    )
    model, tokenizer = auto_class.from_pretrained(saved).eval(), AutoTokenizer.from_pretrained(saved)
    with open(args.train_file, encoding="utf-8") as file:
        example = json.loads(file.readline())
    if args.task == "sequence_classification":
        with torch.no_grad():
            logits = model(**tokenizer([example["document"]], return_tensors="pt")).logits
        print(f"{example['document']!r}\n  -> {model.config.id2label[int(logits.argmax(-1))]} "
              f"(truth: {example['genre']})")
    else:
        encoded = tokenizer([example["words"]], is_split_into_words=True, return_tensors="pt")
        with torch.no_grad():
            predicted = model(**encoded).logits.argmax(-1)[0].tolist()
        first_pieces = {}
        for position, word in enumerate(encoded.word_ids(0)):
            if word is not None:
                first_pieces.setdefault(word, position)
        names = [word for index, word in enumerate(example["words"])
                 if model.config.id2label[predicted[first_pieces[index]]] == "NAME"]
        print(f"{' '.join(example['words'])!r}\n  -> names: {names} "
              f"(truth: {[w for w, t in zip(example['words'], example['tags']) if t == 'NAME']})")
    print(f"model saved in {saved}")


if __name__ == "__main__":
    main()
