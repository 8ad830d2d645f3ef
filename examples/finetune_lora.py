"""LoRA finetuning of a FAT5 model with the usual transformers + PEFT code, then merging and bundling the result.

Nothing here is FAT5-specific but the model class and FAT5Trainer (a Seq2SeqTrainer that also logs the loss parts,
tokens/s and padding): PEFT wraps FAT5's `nn.Linear` projections, which keep T5's names (q, k, v, o, wi_0, wi_1,
wo; wi for ReLU models). The steps:

1. LoRA adapters on every attention and feed-forward projection; only they train.
2. Training with length-grouped batches, evaluation with generated summaries and ROUGE.
3. The adapter saved, reloaded with `peft.AutoPeftModelForSeq2SeqLM`, merged into the base weights
   (`merge_and_unload`) and saved as a plain FAT5 model.
4. That model bundled into a self-contained folder that loads with `trust_remote_code=True`, without fat5.

    python examples/finetune_lora.py --model out/fat5-flan-t5-small   # fat5 convert google/flan-t5-small ...
    python examples/finetune_lora.py --tiny                            # a tiny random model, CPU, about a minute

The same job from a YAML file: `fat5 finetune fat5/trainer/configs/finetune_lora.yaml`.
"""

from pathlib import Path

import torch
from datasets import load_dataset
from example_setup import example_parser, model_folder, short_run_arguments
from peft import AutoPeftModelForSeq2SeqLM, LoraConfig, TaskType, get_peft_model
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, Seq2SeqTrainingArguments

import fat5  # noqa: F401  (registers FAT5 with transformers' Auto classes)
from fat5.hub_upload import bundle
from fat5.trainer.metrics import rouge_metric
from fat5.trainer.trainer import FAT5Trainer


def main() -> None:
    parser = example_parser(__doc__, default_output_dir="runs/example-lora")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank r")
    args = parser.parse_args()

    output_dir = Path(args.output_dir)
    # an absolute base path: the saved adapter records it to find its base model again
    model_dir = str(model_folder(args, output_dir).resolve())
    prefix = "" if args.tiny else "summarize: "

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = load_dataset("json", data_files=args.train_file)["train"].train_test_split(test_size=0.25, seed=0)

    def tokenize(batch):
        encoded = tokenizer([prefix + text for text in batch["document"]], max_length=512, truncation=True)
        encoded["labels"] = tokenizer(text_target=batch["summary"], max_length=64, truncation=True)["input_ids"]
        return encoded

    data = data.map(tokenize, batched=True, remove_columns=data["train"].column_names)

    # 1. LoRA on T5's projections; a ReLU model (T5 v1.0) has `wi` where gated ones have `wi_0` and `wi_1`
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    feed_forward = ["wi_0", "wi_1", "wo"] if model.config.is_gated_act else ["wi", "wo"]
    lora_config = LoraConfig(
        task_type=TaskType.SEQ_2_SEQ_LM, r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.05,
        target_modules=["q", "k", "v", "o", *feed_forward],
    )
    model = get_peft_model(model, lora_config)
    model.print_trainable_parameters()

    # 2. training; FAT5 computes the loss (fused cross-entropy, exact under gradient accumulation)
    training_args = Seq2SeqTrainingArguments(
        output_dir=str(output_dir),
        **short_run_arguments(args),
        learning_rate=3e-3 if args.tiny else 1e-3,
        train_sampling_strategy="group_by_length",
        predict_with_generate=True,
        generation_max_length=64,
        report_to="none",
    )
    trainer = FAT5Trainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data["test"],
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100),
        compute_metrics=rouge_metric(tokenizer),
    )
    trainer.train()
    print({name: value for name, value in trainer.evaluate().items() if "rouge" in name or name == "eval_loss"})

    # 3. the adapter alone (a few hundred kB), reloaded with PEFT's auto class, then merged into a plain FAT5 model
    adapter_dir, merged_dir = output_dir / "adapter", output_dir / "merged"
    trainer.save_model(str(adapter_dir))
    reloaded = AutoPeftModelForSeq2SeqLM.from_pretrained(str(adapter_dir))
    merged = reloaded.merge_and_unload()
    merged.save_pretrained(merged_dir)
    tokenizer.save_pretrained(merged_dir)

    # the merged model computes what the adapter model computes
    batch = tokenizer([prefix + "Hamlet: To be, or not to be, that is the question."], return_tensors="pt")
    batch["labels"] = tokenizer(text_target=["Hamlet: To be, or not to be"], return_tensors="pt")["input_ids"]
    batch = batch.to(model.device)
    model.eval()
    merged.to(model.device).eval()
    with torch.no_grad():
        difference = (model(**batch).logits - merged(**batch).logits).abs().max()
    print(f"adapter model vs merged model logits, largest difference: {difference:.2e}")

    # 4. a folder that loads anywhere with trust_remote_code=True (checked in a fresh process without fat5)
    bundled = bundle(merged_dir, output_dir / "bundle", overwrite=True)
    print(f"adapter: {adapter_dir}\nmerged model: {merged_dir}\nbundle: {bundled.output}")


if __name__ == "__main__":
    main()
