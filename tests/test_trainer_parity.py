"""FAT5Trainer against transformers' Seq2SeqTrainer: the same run on the same model gives the same losses, updates,
checkpoints, predictions and logs (plus FAT5's own log keys); mistakes are refused by name.

Each test runs a tiny FAT5 (``make_tiny_model``, tokenizer trained on tests/data) for a few steps, fp32, on the CPU,
through both trainers, or through FAT5Trainer and transformers' T5 with the same weights (``export_hf``).
"""

import functools
import json
import time

import pytest
import torch
from helpers import DATA, ROWS, SMALL_PRETRAIN, seq2seq_config
from transformers import (
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    DataCollatorWithPadding,
    EarlyStoppingCallback,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5ForConditionalGeneration,
    TrainerCallback,
)

from fat5 import FAT5Error, FAT5ForConditionalGeneration, FAT5ForSequenceClassification
from fat5.trainer.finetuning import finetune
from fat5.trainer.pretrain_config import load_pretrain_config
from fat5.trainer.trainer import FAT5Trainer, FAT5TrainingArguments

TRAINERS = {Seq2SeqTrainer: Seq2SeqTrainingArguments, FAT5Trainer: FAT5TrainingArguments}
SGD_STEP = {"max_steps": 1, "learning_rate": 1.0, "optim": "sgd", "lr_scheduler_type": "constant",
            "weight_decay": 0.0, "max_grad_norm": 0.0}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def examples(tokenizer) -> list[dict]:
    """16 speeches and their summaries, of several lengths (so that the collator pads labels with -100)."""
    return [
        {"input_ids": tokenizer(row["document"], max_length=32, truncation=True)["input_ids"],
         "labels": tokenizer(text_target=row["summary"], max_length=24, truncation=True)["input_ids"]}
        for row in ROWS[:16]
    ]


def build_trainer(trainer_class, model, tokenizer, output_dir, train=None, evaluation=None, collator=None,
                  callbacks=None, compute_metrics=None, **arguments):
    settings = {"output_dir": str(output_dir), "report_to": [], "use_cpu": True, "disable_tqdm": True,
                "save_strategy": "no", "per_device_train_batch_size": 4, "per_device_eval_batch_size": 4,
                "train_sampling_strategy": "sequential", "logging_steps": 1, **arguments}
    return trainer_class(
        model=model, args=TRAINERS[trainer_class](**settings), train_dataset=train, eval_dataset=evaluation,
        processing_class=tokenizer, callbacks=callbacks, compute_metrics=compute_metrics,
        # with the model, the collator makes the decoder inputs, which the model needs once the LabelSmoother has
        # taken the labels away
        data_collator=collator or DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
    )


def sgd_step(trainer_class, model, tokenizer, output_dir, train, **arguments):
    """(trainer, loss, update) of one plain SGD step at learning rate 1: the update is the gradient."""
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    trainer = build_trainer(trainer_class, model, tokenizer, output_dir, train, **SGD_STEP, **arguments)
    loss = trainer.train().training_loss
    update = {name: before[name] - p.detach() for name, p in model.named_parameters() if p.requires_grad}
    return trainer, loss, update


def assert_same_update(update, expected):
    assert update.keys() == expected.keys()
    for name, value in expected.items():
        error = ((update[name] - value).norm() / value.norm().clamp_min(1e-30)).item()
        assert error < 1e-5, f"{name}: relative difference {error:.2e}"


def load(path, **config):
    return FAT5ForConditionalGeneration.from_pretrained(path, **config)


# ----------------------------------------------------------------------------------------------- 1. the loss


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_smoothing_padding_and_accumulation_take_seq2seq_trainers_step(smoothing, tiny_model, tokenizer, examples,
                                                                       tmp_path):
    train = examples[:4]
    collated = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)(train)
    assert (collated["labels"] == -100).any()
    _, expected_loss, expected = sgd_step(Seq2SeqTrainer, load(tiny_model), tokenizer, tmp_path / "hf", train,
                                          label_smoothing_factor=smoothing)
    for batch_size, accumulation in ((4, 1), (2, 2)):
        model = load(tiny_model)
        trainer, loss, update = sgd_step(FAT5Trainer, model, tokenizer, tmp_path / "fat5", train,
                                         label_smoothing_factor=smoothing, per_device_train_batch_size=batch_size,
                                         gradient_accumulation_steps=accumulation)
        assert loss == pytest.approx(expected_loss, rel=1e-6)
        assert_same_update(update, expected)
        # the factor was the trainer's: the model and what it saves keep their own smoothing, as Seq2SeqTrainer's do
        assert model.config.label_smoothing == 0.0
        trainer.save_model(str(tmp_path / "saved"))
        assert load(tmp_path / "saved").config.label_smoothing == 0.0


# ----------------------------------------------------------------------------------------------- 2. resuming


def test_resumed_run_retraces_the_uninterrupted_one(tiny_model, tokenizer, examples, tmp_path):
    """Dropout, AdamW and a warmed-up linear schedule: resuming must restore the RNG, optimizer and scheduler."""
    settings = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "learning_rate": 1e-2,
                "lr_scheduler_type": "linear", "warmup_steps": 1}
    runs = {}
    for name, trainer_class in (("hf", Seq2SeqTrainer), ("straight", FAT5Trainer), ("resumed", FAT5Trainer)):
        trainer = build_trainer(trainer_class, load(tiny_model, dropout_rate=0.1), tokenizer, tmp_path / name,
                                examples[:8], **settings)
        if name == "resumed":
            trainer.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
        else:
            trainer.train()
        runs[name] = trainer

    def logged(trainer, key):
        return {entry["step"]: entry[key] for entry in trainer.state.log_history if key in entry}

    straight, resumed = runs["straight"], runs["resumed"]
    assert logged(straight, "loss") == pytest.approx(logged(runs["hf"], "loss"), rel=1e-6)
    assert set(logged(resumed, "loss")) >= {3, 4}
    for key in ("loss", "ce_loss", "learning_rate"):
        for step in (3, 4):
            assert logged(resumed, key)[step] == pytest.approx(logged(straight, key)[step], rel=1e-5), (key, step)
    for (name, parameter), resumed_parameter in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(resumed_parameter, parameter, rtol=1e-5, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------------------------- 3. evaluation


def generated_length(prediction) -> dict:
    return {"tokens": float((prediction.predictions > 1).sum()), "rows": float(len(prediction.predictions))}


def test_generated_evaluation_and_predictions_are_seq2seq_trainers(tiny_model, tokenizer, examples, tmp_path):
    settings = {"predict_with_generate": True, "generation_max_length": 7, "generation_num_beams": 2,
                "label_smoothing_factor": 0.1}
    results = {}
    for trainer_class in TRAINERS:
        trainer = build_trainer(trainer_class, load(tiny_model), tokenizer, tmp_path / trainer_class.__name__,
                                evaluation=examples[8:], compute_metrics=generated_length, **settings)
        results[trainer_class] = trainer.evaluate(), trainer.predict(examples[8:])
    (expected_eval, expected), (evaluation, prediction) = results[Seq2SeqTrainer], results[FAT5Trainer]
    assert prediction.predictions.shape == expected.predictions.shape
    assert (prediction.predictions == expected.predictions).all()
    assert (prediction.label_ids == expected.label_ids).all()
    for key in ("eval_loss", "eval_tokens", "eval_rows"):
        assert evaluation[key] == pytest.approx(expected_eval[key], rel=1e-6), key
    for key in ("test_loss", "test_tokens"):
        assert prediction.metrics[key] == pytest.approx(expected.metrics[key], rel=1e-6), key


# ----------------------------------------------------------------------------------------------- 4. LoRA


def test_lora_trains_saves_the_adapter_alone_and_merges(tiny_model, tokenizer, examples, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    def lora_model():
        torch.manual_seed(0)
        return get_peft_model(load(tiny_model), LoraConfig(r=4, lora_alpha=8, target_modules=["q", "k", "v", "o"],
                                                           task_type="SEQ_2_SEQ_LM"))

    trained = {}
    for trainer_class in TRAINERS:
        trainer = build_trainer(trainer_class, lora_model(), tokenizer, tmp_path / trainer_class.__name__,
                                examples[:8], max_steps=3, learning_rate=1.0, optim="sgd",
                                label_smoothing_factor=0.1)
        trainer.train()
        trained[trainer_class] = trainer
    # plain SGD: Adam would blow the rounding differences of the still tiny LoRA gradients up to the learning rate
    model = trained[FAT5Trainer].model
    expected = dict(trained[Seq2SeqTrainer].model.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter, expected[name], rtol=1e-5, atol=1e-6, msg=name)

    trained[FAT5Trainer].save_model(str(tmp_path / "adapter"))
    saved = {path.name for path in (tmp_path / "adapter").iterdir()}
    assert "adapter_model.safetensors" in saved and not {"model.safetensors", "config.json"} & saved
    from safetensors.torch import load_file

    assert all(".lora_" in key for key in load_file(tmp_path / "adapter" / "adapter_model.safetensors"))

    batch = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)(examples[8:12])
    with torch.no_grad():
        adapted = model.eval()(**batch).logits
        reloaded = PeftModel.from_pretrained(load(tiny_model), str(tmp_path / "adapter")).eval()
        torch.testing.assert_close(reloaded(**batch).logits, adapted, rtol=1e-5, atol=1e-5)
        merged = reloaded.merge_and_unload()
        assert isinstance(merged, FAT5ForConditionalGeneration)
        # merging rounds W + BA once: logits of about 30 agree to a few 1e-5
        torch.testing.assert_close(merged(**batch).logits, adapted, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------- 5. callbacks, logs


def test_early_stopping_best_model_and_logs_match_seq2seq_trainers(tiny_model, tokenizer, examples, tmp_path):
    settings = {"max_steps": 12, "learning_rate": 5e-2, "logging_steps": 2, "eval_strategy": "steps",
                "eval_steps": 2, "save_strategy": "steps", "save_steps": 2, "save_total_limit": 1,
                "load_best_model_at_end": True, "metric_for_best_model": "eval_loss", "greater_is_better": False}
    runs = {}
    for trainer_class in TRAINERS:
        trainer = build_trainer(trainer_class, load(tiny_model, z_loss=1e-3), tokenizer,
                                tmp_path / trainer_class.__name__, examples[:8], examples[8:],
                                callbacks=[EarlyStoppingCallback(early_stopping_patience=1)], **settings)
        trainer.train()
        runs[trainer_class] = trainer
    expected, fat5 = runs[Seq2SeqTrainer].state, runs[FAT5Trainer].state
    assert fat5.global_step == expected.global_step
    assert fat5.best_metric == pytest.approx(expected.best_metric, rel=1e-6)
    assert fat5.best_model_checkpoint.rsplit("-", 1)[1] == expected.best_model_checkpoint.rsplit("-", 1)[1]
    assert sorted(path.name for path in (tmp_path / "FAT5Trainer").glob("checkpoint-*")) == sorted(
        path.name for path in (tmp_path / "Seq2SeqTrainer").glob("checkpoint-*"))
    for key in ("loss", "eval_loss", "grad_norm"):
        values = [entry[key] for entry in fat5.log_history if key in entry]
        assert values == pytest.approx([entry[key] for entry in expected.log_history if key in entry], rel=1e-5)
    training_logs = [entry for entry in fat5.log_history if "loss" in entry]
    for entry in training_logs:
        assert entry["z_loss"] > 0
        assert entry["ce_loss"] + entry["z_loss"] == pytest.approx(entry["loss"], rel=1e-5)
        assert entry["tokens_per_second"] > 0 and 0 <= entry["padding_fraction"] < 1
    # the state written with the last checkpoint holds the same log entries, extra keys included
    checkpoint = max((tmp_path / "FAT5Trainer").glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    written = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    assert [entry.get("ce_loss") for entry in written] == [entry.get("ce_loss") for entry in fat5.log_history[
        :len(written)]]


@pytest.mark.parametrize("best_at_end", [False, True], ids=["last weights", "best weights loaded at the end"])
def test_the_final_weights_are_evaluated_once_and_as_evaluate_would(best_at_end, tiny_model, tokenizer, examples,
                                                                    tmp_path):
    """The Trainer's evaluation at the last step stands for the final weights' (no second pass over the evaluation
    data, generation included for a finetuning job); weights replaced at the end are evaluated anew."""
    settings = {"max_steps": 4, "learning_rate": 5e-2, "eval_strategy": "steps", "eval_steps": 2,
                "save_strategy": "steps", "save_steps": 2, "load_best_model_at_end": best_at_end,
                "metric_for_best_model": "eval_loss", "greater_is_better": False}
    trainer = build_trainer(FAT5Trainer, load(tiny_model), tokenizer, tmp_path, examples[:8], examples[8:],
                            **settings)
    trainer.train()
    evaluations_before = sum("eval_loss" in entry for entry in trainer.state.log_history)
    final = trainer.evaluate_final_weights()
    evaluations_made = sum("eval_loss" in entry for entry in trainer.state.log_history) - evaluations_before
    assert evaluations_made == (1 if best_at_end else 0)
    assert "step" not in final
    assert final["eval_loss"] == pytest.approx(trainer.evaluate()["eval_loss"], rel=1e-6)


def test_logged_figures_reach_tensorboard(tiny_model, tokenizer, examples, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = build_trainer(FAT5Trainer, load(tiny_model), tokenizer, tmp_path, examples[:8], max_steps=2,
                            report_to=["tensorboard"])
    trainer.train()
    (event_file,) = (tmp_path / "runs").rglob("events.out.tfevents.*")
    events = EventAccumulator(str(event_file)).Reload()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    for key in ("loss", "ce_loss", "z_loss", "tokens_per_second", "padding_fraction"):
        values = [event.value for event in events.Scalars(f"train/{key}")]
        assert values == pytest.approx([entry[key] for entry in logged], rel=1e-5), key


class SlowEvaluation(TrainerCallback):
    seconds = 1.0

    def on_evaluate(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def test_tokens_per_second_leave_out_evaluation_time(tiny_model, tokenizer, examples, tmp_path):
    """The window after a slow evaluation counts the tokens of its two training steps over their time only."""
    trainer = build_trainer(FAT5Trainer, load(tiny_model), tokenizer, tmp_path, examples[:8], examples[8:12],
                            callbacks=[SlowEvaluation()], max_steps=4, logging_steps=2, eval_strategy="steps",
                            eval_steps=2)
    trainer.train()
    # steps 3 and 4 take the 8 training examples once (sequential sampling, 4 per batch)
    window_tokens = sum(len(example["input_ids"]) + len(example["labels"]) for example in examples[:8])
    after_evaluation = [entry for entry in trainer.state.log_history if entry.get("step") == 4 and "loss" in entry]
    assert after_evaluation[0]["tokens_per_second"] * SlowEvaluation.seconds > window_tokens


@pytest.mark.parametrize("custom_loss", [False, True])
def test_training_steps_leave_out_the_logits_unless_something_reads_them(custom_loss, tiny_model, tokenizer, examples,
                                                                          tmp_path):
    """accelerate's mixed precision converts every bf16 output to fp32, the logits included: FAT5Trainer's training
    steps ask the model for none, unless a custom loss function reads them; the step's update is the same."""
    model = load(tiny_model)
    calls = []
    original_forward = model.forward

    @functools.wraps(original_forward)  # the Trainer reads forward's signature
    def spied_forward(*args, **kwargs):
        output = original_forward(*args, **kwargs)
        calls.append((kwargs.get("return_logits", True), output.logits is None))
        return output

    model.forward = spied_forward
    extra = {}
    if custom_loss:
        extra["compute_loss_func"] = lambda outputs, labels, num_items_in_batch=None: torch.nn.functional.cross_entropy(
            outputs.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    trainer = build_trainer(FAT5Trainer, model, tokenizer, tmp_path, examples[:4], **SGD_STEP)
    if custom_loss:
        trainer.compute_loss_func = extra["compute_loss_func"]
    trainer.train()
    assert calls == [(custom_loss, not custom_loss)]


def test_packed_batches_honour_the_dataloader_arguments(tiny_model, tokenizer, tmp_path):
    """FAT5's loader for a batch sampler takes transformers' dataloader arguments, and workers kept across epochs
    still give each epoch's own batches (the sampler plans them in the main process)."""
    import numpy as np
    from torch.utils.data import DataLoader

    from fat5.trainer.collator import UL2DataCollator
    from fat5.trainer.packing import PlannedDataset, UL2PackedBatchSampler
    from fat5.trainer.ul2 import UL2Objective

    sequences = [tokenizer(row["document"])["input_ids"] for row in ROWS[:24]]
    vocabulary = len(tokenizer)
    objective = UL2Objective(sentinel_ids=np.arange(vocabulary - 1, vocabulary - 17, -1),
                             prefix_ids={"[R]": 3, "[S]": 4, "[X]": 5}, eos_id=tokenizer.eos_token_id,
                             max_input_length=64, max_target_length=64)
    collator = UL2DataCollator(objective=objective, packed=True, pad_token_id=tokenizer.pad_token_id)

    def sampler(epoch=0):
        planner = UL2PackedBatchSampler([len(s) for s in sequences], collator.objective, rows_per_batch=2, seed=5)
        planner.set_epoch(epoch)
        return planner

    arguments = FAT5TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                      dataloader_num_workers=1, dataloader_persistent_workers=True,
                                      dataloader_prefetch_factor=3)
    trainer = FAT5Trainer(model=load(tiny_model), args=arguments, train_dataset=sequences, data_collator=collator,
                          train_batch_sampler=sampler())
    loader = trainer.get_train_dataloader()
    assert loader.persistent_workers and loader.prefetch_factor == 3
    epochs = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        expected = list(DataLoader(PlannedDataset(sequences), batch_sampler=sampler(epoch), collate_fn=collator))
        batches = list(loader)
        assert len(batches) == len(expected) > 1
        for batch, reference in zip(batches, expected):
            assert all(np.array_equal(batch[key].numpy(), reference[key].numpy()) for key in reference)
        epochs.append(torch.cat([batch["input_ids"].flatten() for batch in batches]))
    assert not torch.equal(*epochs), "the two epochs gave the same batches: the workers missed the new epoch"


# ----------------------------------------------------------------------------------------------- 6. other models


def classification_step(trainer_class, model_path, tokenizer, output_dir, smoothing):
    model = FAT5ForSequenceClassification.from_pretrained(model_path, num_labels=2)
    rows = [{**tokenizer(row["document"], max_length=32, truncation=True), "labels": int(row["genre"] == "comedy")}
            for row in ROWS[:4]]
    return sgd_step(trainer_class, model, tokenizer, output_dir, rows, label_smoothing_factor=smoothing,
                    collator=DataCollatorWithPadding(tokenizer))


@pytest.mark.parametrize("model_kind", ["transformers T5", "FAT5 classifier"])
def test_models_without_the_fused_loss_get_transformers_smoothing(model_kind, tiny_model, tokenizer, examples,
                                                                 tmp_path):
    results = {}
    for trainer_class in TRAINERS:
        output_dir = tmp_path / trainer_class.__name__
        if model_kind == "transformers T5":
            from fat5.conversion.convert import export_hf

            if not (tmp_path / "t5").is_dir():
                export_hf(tiny_model, tmp_path / "t5")
            model = T5ForConditionalGeneration.from_pretrained(tmp_path / "t5")
            results[trainer_class] = sgd_step(trainer_class, model, tokenizer, output_dir, examples[:4],
                                              label_smoothing_factor=0.2)
        else:
            results[trainer_class] = classification_step(trainer_class, tiny_model, tokenizer, output_dir, 0.2)
    (_, expected_loss, expected), (_, loss, update) = results[Seq2SeqTrainer], results[FAT5Trainer]
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    assert_same_update(update, expected)
    # and the smoothing is there: without it the loss differs
    _, unsmoothed_loss, _ = (classification_step(FAT5Trainer, tiny_model, tokenizer, tmp_path / "plain", 0.0)
                             if model_kind == "FAT5 classifier" else
                             sgd_step(FAT5Trainer, T5ForConditionalGeneration.from_pretrained(tmp_path / "t5"),
                                      tokenizer, tmp_path / "plain", examples[:4]))
    assert unsmoothed_loss != pytest.approx(loss, rel=1e-4)


# ----------------------------------------------------------------------------------------------- 7. bad input


def test_a_dataset_without_labels_is_refused_by_name(tiny_model, tokenizer, examples, tmp_path):
    unlabelled = [{"input_ids": example["input_ids"]} for example in examples[:4]]
    trainer = build_trainer(FAT5Trainer, load(tiny_model), tokenizer, tmp_path, unlabelled, max_steps=1)
    with pytest.raises(ValueError, match=r"the training batch has no \['labels'\] \(it holds \['attention_mask', "
                                         r"'input_ids'\]\): the dataset needs a `labels` column"):
        trainer.train()


FINETUNE_MISTAKES = {
    "learning rate read as text": (
        {"learning_rate": "3e-4"}, r"training.learning_rate must be a number, got '3e-4' \(YAML reads a number without"
    ),
    "steps as a word": ({"max_steps": "ten"}, r"training.max_steps must be an integer, got 'ten'"),
    "fractional batch": ({"per_device_train_batch_size": 2.5}, r"per_device_train_batch_size must be an integer"),
    "switch as text": ({"bf16": "yes"}, r"training.bf16 must be true or false, got 'yes'"),
    "unknown reporter": ({"report_to": "wandbx"}, r"training.report_to: wandbx is not supported"),
    "unknown field": ({"max_step": 3}, r"training: \['max_step'\] not FAT5TrainingArguments field"),
}


@pytest.mark.parametrize("mistake", sorted(FINETUNE_MISTAKES))
def test_finetune_training_mistakes_are_named(mistake, tiny_model, tmp_path):
    training, message = FINETUNE_MISTAKES[mistake]
    config = seq2seq_config(tiny_model, tmp_path, max_steps=1)
    config["training"].update(training)
    with pytest.raises(FAT5Error, match=message):
        finetune(config)


PRETRAIN_MISTAKES = {
    "misspelt model field": ("model", {"d_modle": 32}, r"unknown key\(s\) \['d_modle'\] in the model section"),
    "misspelt data key": ("data", {"max_input_lenght": 64}, r"data: unknown key\(s\) \['max_input_lenght'\]"),
    "misspelt tokenizer key": ("tokenizer", {"vocab": 300}, r"tokenizer: unknown key\(s\) \['vocab'\]"),
    "batch size as text": ("data", {"tokens_per_batch": "512"}, r"data.tokens_per_batch must be an integer >= 1"),
    "learning rate as text": ("training", {"learning_rate": "1e-3"}, r"training.learning_rate must be a number"),
}


@pytest.mark.parametrize("mistake", sorted(PRETRAIN_MISTAKES))
def test_pretrain_config_mistakes_are_named(mistake):
    section, change, message = PRETRAIN_MISTAKES[mistake]
    config = json.loads(json.dumps(SMALL_PRETRAIN))
    config[section] = {**config[section], **change}
    with pytest.raises(FAT5Error, match=message):
        load_pretrain_config(config)


def test_missing_data_files_are_named(tiny_model, tmp_path):
    from fat5.trainer.pretraining import pretrain

    config = json.loads(json.dumps(SMALL_PRETRAIN))
    config["data"] = {**config["data"], "path": str(tmp_path / "none.jsonl")}
    # the pre-flight finds it before any work
    with pytest.raises(FAT5Error, match=r"the corpus .*none.jsonl: no such file or folder; give a data file"):
        pretrain(config, tmp_path / "pretrain")
    config = seq2seq_config(tiny_model, tmp_path / "finetune")
    config["data"]["validation_file"] = str(DATA.with_name("none.jsonl"))
    with pytest.raises(FAT5Error, match=r"data.validation_file: cannot read .*none.jsonl"):
        finetune(config)
