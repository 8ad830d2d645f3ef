"""Finetuning: full and LoRA seq2seq, encoder heads, gradient accumulation, ROUGE, configs, examples and the CLI.

Everything runs a tiny FAT5 model (built by `make_tiny_model`, with a BPE tokenizer trained on the shipped data) for
a few steps on the CPU, on tests/data/shakespeare_speeches.jsonl (64 speeches; see tests/data/make_finetune_data.py).
"""

import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import DATA, FINETUNE_QUIET, REPO, ROWS, TINY, model_without_tokenizer, seq2seq_config
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, EvalPrediction
from transformers.trainer_pt_utils import LengthGroupedSampler

import fat5
from fat5 import FAT5Error
from fat5.testing import make_tiny_model
from fat5.trainer.finetune_config import LoraSection, load_finetune_config
from fat5.trainer.finetune_model import apply_lora, check_lora_targets, default_lora_targets
from fat5.trainer.finetuning import finetune, prepare_finetuning
from fat5.trainer.metrics import (
    classification_scores,
    rouge,
    rouge_metric,
    sequence_classification_metric,
    split_sentences,
    token_classification_metric,
)
from fat5_command import build_parser


@pytest.fixture(scope="module")
def relu_model(tmp_path_factory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("relu") / "model", [row["document"] for row in ROWS], feed_forward_proj="relu"
    )


def logged_losses(log_history) -> list[float]:
    return [entry["loss"] for entry in log_history if "loss" in entry]


def sample_batch(tokenizer) -> dict:
    batch = tokenizer([ROWS[0]["document"], ROWS[40]["document"]], return_tensors="pt", padding=True)
    labels = tokenizer(text_target=[ROWS[0]["summary"], ROWS[40]["summary"]], return_tensors="pt", padding=True)
    batch["labels"] = labels["input_ids"].masked_fill(labels["attention_mask"] == 0, -100)
    return dict(batch)


@torch.no_grad()
def logits_of(model, batch) -> torch.Tensor:
    return model.eval()(**batch).logits


# ----------------------------------------------------------------------------------------------- full finetuning


def test_full_finetuning_lowers_the_loss_and_reports_rouge(tiny_model, tmp_path):
    result = finetune(seq2seq_config(tiny_model, tmp_path / "run", max_steps=40, learning_rate=3e-3, logging_steps=5))
    losses = logged_losses(result["log_history"])
    assert len(losses) == 8
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses

    evaluation = result["eval"]
    for name in ("rouge1", "rouge2", "rougeL", "rougeLsum"):
        assert 0.0 <= evaluation[f"eval_{name}"] <= 100.0
    assert evaluation["eval_gen_len"] > 0 and evaluation["eval_loss"] > 0

    # the output folder itself holds the model and tokenizer, as with transformers' Trainer
    model_dir = Path(result["model_dir"])
    assert model_dir == tmp_path / "run"
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "run")
    assert isinstance(model, fat5.FAT5ForConditionalGeneration)
    assert AutoTokenizer.from_pretrained(tmp_path / "run").pad_token == "<pad>"
    assert not [path.name for path in model_dir.iterdir() if path.name.startswith(".")]
    saved_metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved_metrics["eval"]["eval_rouge1"] == evaluation["eval_rouge1"]
    assert load_finetune_config(tmp_path / "run" / "finetune_config.yaml").training["max_steps"] == 40


def test_an_output_folder_with_a_model_or_checkpoints_needs_resume_or_overwrite(tiny_model, tmp_path, capfd):
    config = seq2seq_config(tiny_model, tmp_path / "run", validation=False, max_steps=2, save_strategy="steps",
                            save_steps=1, save_total_limit=1)
    finetune(config)
    assert sorted(path.name for path in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-2"]
    with pytest.raises(FAT5Error, match="checkpoints of an earlier run: pass --resume to continue from checkpoint-2"):
        finetune(config)
    capfd.readouterr()
    resumed = finetune(config, overrides=["training.max_steps=3"], resume=True)
    printed = capfd.readouterr()
    assert f"--resume: continuing from {tmp_path / 'run' / 'checkpoint-2'}" in printed.out
    assert "missing keys" not in printed.out + printed.err
    assert resumed["log_history"][-1]["step"] == 3
    assert AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "run").config.model_type == "fat5"

    for checkpoint in (tmp_path / "run").glob("checkpoint-*"):
        shutil.rmtree(checkpoint)
    with pytest.raises(FAT5Error, match="already holds a model: pass --overwrite"):
        finetune(config)
    finetune(config, overwrite=True)
    assert (tmp_path / "run" / "checkpoint-2").is_dir() and not (tmp_path / "run" / "checkpoint-3").exists()

    # --overwrite never empties a folder that holds the model or the data the job reads
    data = tmp_path / "data" / DATA.name
    data.parent.mkdir()
    shutil.copyfile(DATA, data)
    config["data"]["train_file"] = str(data)
    for holder in (tiny_model.parent, data.parent):
        before = sorted(path.name for path in holder.rglob("*"))
        with pytest.raises(FAT5Error, match="holds the input"):
            finetune({**config, "output_dir": str(holder)}, overwrite=True)
        assert sorted(path.name for path in holder.rglob("*")) == before


def test_training_batches_are_grouped_by_length(tiny_model, tmp_path):
    job = prepare_finetuning(seq2seq_config(tiny_model, tmp_path, validation=False))
    assert job.trainer.args.train_sampling_strategy == "group_by_length"
    sampler = job.trainer._get_train_sampler()
    assert isinstance(sampler, LengthGroupedSampler)
    # the sampler's megabatches (50 batches) are sorted by length, longest first
    lengths = [len(job.train_dataset[int(i)]["input_ids"]) for i in sampler]
    assert lengths[0] == max(lengths)


@pytest.mark.parametrize("source", ["csv", "tsv", "parquet", "dataset folder"])
def test_data_loads_from_files_and_dataset_names(source, tiny_model, tmp_path):
    import datasets

    train = datasets.Dataset.from_list([{"document": r["document"], "summary": r["summary"]} for r in ROWS[:48]])
    validation = datasets.Dataset.from_list([{"document": r["document"], "summary": r["summary"]} for r in ROWS[48:]])
    config = seq2seq_config(tiny_model, tmp_path / "run", validation=False)
    if source == "dataset folder":
        # what load_dataset("user/name") finds on the Hub, from a local folder: splits named by their files
        (tmp_path / "speeches").mkdir()
        train.to_json(tmp_path / "speeches" / "train.jsonl")
        validation.to_json(tmp_path / "speeches" / "validation.jsonl")
        config["data"].update(train_file=None, dataset_name=str(tmp_path / "speeches"))
    else:
        paths = [tmp_path / f"{split}.{source}" for split in ("train", "validation")]
        for dataset, path in zip((train, validation), paths):
            if source == "parquet":
                dataset.to_parquet(path)
            else:
                dataset.to_csv(path, index=False, sep="\t" if source == "tsv" else ",")
        config["data"].update(train_file=str(paths[0]), validation_file=str(paths[1]))
    job = prepare_finetuning(config)
    assert (len(job.train_dataset), len(job.eval_dataset)) == (48, 16)
    first = job.train_dataset[0]
    assert first["input_ids"] == job.tokenizer(ROWS[0]["document"])["input_ids"]
    labels = job.tokenizer(text_target=ROWS[0]["summary"], max_length=24, truncation=True)["input_ids"]
    assert first["labels"] == labels


def folder_fingerprint(folder: Path) -> dict:
    """Every file under ``folder`` by name, with a hash of its bytes."""
    import hashlib

    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def test_the_data_folders_read_are_never_written_to(tiny_model, tmp_path):
    """datasets writes its cache files beside the data it read from a save_to_disk folder, unless told otherwise;
    loading the folder as data files then fails on them. A job leaves the user's folders as they were."""
    import datasets

    rows = {key: [row[key] for row in ROWS] for key in ("document", "summary")}
    saved, jsonl = tmp_path / "saved", tmp_path / "jsonl"
    datasets.Dataset.from_dict(rows).save_to_disk(saved)
    jsonl.mkdir()
    shutil.copyfile(DATA, jsonl / "train.jsonl")
    before = {folder: folder_fingerprint(folder) for folder in (saved, jsonl)}
    for name, source in (("saved", {"train_file": str(saved)}),
                         ("jsonl", {"train_file": None, "dataset_name": str(jsonl)})):
        config = seq2seq_config(tiny_model, tmp_path / f"run-{name}", max_steps=1)
        config["data"].update(source)
        finetune(config)
    assert {folder: folder_fingerprint(folder) for folder in (saved, jsonl)} == before
    assert len(datasets.load_from_disk(str(saved))) == len(ROWS)
    assert len(datasets.load_dataset(str(jsonl), split="train")) == len(ROWS)


@pytest.mark.parametrize("rows", [0, 1])
def test_too_little_data_for_its_validation_share_is_named(rows, tiny_model, tmp_path):
    """An empty training file, or one example with a share held out to evaluate (datasets' split would leave no
    example to train on): one line naming the fix, nothing written."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"document": row["document"], "summary": row["summary"]}) + "\n"
                            for row in ROWS[:rows]))
    config = seq2seq_config(tiny_model, tmp_path / "run", validation=False)
    config["data"].update(train_file=str(data), validation_fraction=0.25)
    expected = "train.jsonl is empty" if rows == 0 else "validation_fraction 0.25 of 1 training example"
    with pytest.raises(FAT5Error, match=expected):
        finetune(config)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_a_malformed_line_is_named_with_its_row(tiny_model, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"document": "a", "summary": "b"}\n{"document": "c" "summary": "d"}\n')
    config = seq2seq_config(tiny_model, tmp_path / "run", validation=False)
    config["data"]["train_file"] = str(data)
    with pytest.raises(FAT5Error, match=r"cannot load .*train.jsonl: .*JSON parse error.*row 1"):
        finetune(config)


@pytest.mark.parametrize("missing", ["rouge_score", "eos token"])
def test_what_the_job_needs_is_checked_before_any_training(missing, tiny_model, tmp_path, monkeypatch):
    """A job without the package its metric imports, or whose tokenizer lacks the token its targets end with, fails in
    one line naming the fix before a trainer is built (not after training, at the first evaluation)."""
    from fat5.trainer import trainer as trainer_module

    def no_trainer(*args, **kwargs):
        raise AssertionError("a trainer was built")

    monkeypatch.setattr(trainer_module.FAT5Trainer, "__init__", no_trainer)
    config = seq2seq_config(tiny_model, tmp_path / "run", max_steps=1)
    if missing == "rouge_score":
        monkeypatch.setitem(sys.modules, "rouge_score", None)
        expected = "pip install rouge_score"
    else:
        tokenizer = AutoTokenizer.from_pretrained(tiny_model)
        tokenizer.eos_token = None
        tokenizer.save_pretrained(tmp_path / "tokenizer")
        config["tokenizer"] = str(tmp_path / "tokenizer")
        expected = "no end-of-sequence"
    with pytest.raises(FAT5Error, match=expected):
        finetune(config)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


# ----------------------------------------------------------------------------------------------- LoRA

CLEAN_PROCESS_SCRIPT = r"""
import sys
# the base model's folder carries its code: the package itself must not be needed
sys.modules["fat5"] = None
adapter_dir, batch_file, out_file = sys.argv[1:4]
import torch
from peft import AutoPeftModelForSeq2SeqLM

model = AutoPeftModelForSeq2SeqLM.from_pretrained(adapter_dir, trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(**torch.load(batch_file)).logits
torch.save({"logits": logits, "module": type(model.get_base_model()).__module__}, out_file)
"""


def load_adapter_in_clean_process(adapter_dir: Path, batch: dict, scratch: Path) -> dict:
    batch_file, out_file = scratch / "batch.pt", scratch / "out.pt"
    torch.save(batch, batch_file)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_MODULES_CACHE=str(scratch / "modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    completed = subprocess.run(
        [sys.executable, "-I", "-c", CLEAN_PROCESS_SCRIPT, str(adapter_dir), str(batch_file), str(out_file)],
        check=False, env=env, cwd=scratch, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return torch.load(out_file)


def test_lora_trains_only_the_adapters_which_reload_and_merge(tiny_model, tmp_path, monkeypatch):
    from peft import AutoPeftModelForSeq2SeqLM

    from fat5.hub_upload import bundle

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # for the bundle check's fresh process
    # a bundled base (a FAT5 folder that carries its code) lets the adapter load where fat5 is not installed
    base = bundle(tiny_model, tmp_path / "base", validate=False).output
    lora = {"r": 4, "alpha": 8, "dropout": 0.0}
    config = seq2seq_config(base, tmp_path / "run", lora=lora, validation=False, max_steps=12, learning_rate=1e-2)
    config["bundle"] = True
    job = prepare_finetuning(config)
    trainable = sorted(name for name, parameter in job.model.named_parameters() if parameter.requires_grad)
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    wrapped = {name.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for name in trainable}
    assert wrapped == {"q", "k", "v", "o", "wi_0", "wi_1", "wo"}
    before = {name: parameter.detach().clone() for name, parameter in job.model.named_parameters()}

    result = job.run()

    for name, parameter in job.model.named_parameters():
        if name in trainable:
            if ".lora_B." in name:  # B starts at zero: every one must have moved
                assert not torch.equal(parameter, before[name]), name
        else:
            assert torch.equal(parameter, before[name]), f"base weight {name} changed"
    adapter_dir = Path(result["adapter_dir"])
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    assert saved and all(".lora_A." in key or ".lora_B." in key for key in saved)
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)

    batch = sample_batch(job.tokenizer)
    expected = logits_of(job.model, batch)
    for trust_remote_code in (False, True):
        reloaded = AutoPeftModelForSeq2SeqLM.from_pretrained(adapter_dir, trust_remote_code=trust_remote_code)
        torch.testing.assert_close(logits_of(reloaded, batch), expected, rtol=1e-5, atol=1e-5)
    assert isinstance(AutoPeftModelForSeq2SeqLM.from_pretrained(adapter_dir).get_base_model(),
                      fat5.FAT5ForConditionalGeneration)

    merged = AutoModelForSeq2SeqLM.from_pretrained(result["merged_dir"])
    assert isinstance(merged, fat5.FAT5ForConditionalGeneration)
    assert not any("lora" in name for name in merged.state_dict())
    torch.testing.assert_close(logits_of(merged, batch), expected, rtol=1e-5, atol=1e-5)

    # bundle() checked the merged model's folder in a fresh process without fat5; the adapter loads there too
    assert (Path(result["bundle_dir"]) / "modeling_fat5.py").is_file()
    outside = load_adapter_in_clean_process(adapter_dir, batch, tmp_path)
    assert outside["module"].startswith("transformers_modules.")
    torch.testing.assert_close(outside["logits"], expected, rtol=1e-5, atol=1e-5)


def test_lora_targets_follow_the_feed_forward(tiny_model, relu_model):
    gated = fat5.FAT5ForConditionalGeneration.from_pretrained(tiny_model)
    relu = fat5.FAT5ForConditionalGeneration.from_pretrained(relu_model)
    assert default_lora_targets(gated) == ["q", "k", "v", "o", "wi_0", "wi_1", "wo"]
    assert default_lora_targets(relu) == ["q", "k", "v", "o", "wi", "wo"]

    with pytest.raises(FAT5Error, match=r"not gated: its input projection is `wi`"):
        check_lora_targets(relu, ["q", "wi_0"])
    with pytest.raises(FAT5Error, match=r"gated: its input projections are `wi_0` and `wi_1`"):
        check_lora_targets(gated, ["wi"])
    with pytest.raises(FAT5Error, match=r"\['query'\] name no linear layer"):
        check_lora_targets(gated, ["q", "query"])
    check_lora_targets(gated, ["encoder.block.0.layer.0.SelfAttention.q"])

    lora = LoraSection(r=2, alpha=4, dropout=0.0)
    relu_linear = [name for name, module in relu.named_modules() if isinstance(module, torch.nn.Linear)]
    peft_model = apply_lora(relu, "seq2seq", lora)
    wrapped = [name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")]
    # every projection but lm_head: 6 per encoder block, 10 per decoder block (self- and cross-attention)
    assert len(wrapped) == len(relu_linear) - 1 == 2 * 6 + 2 * 10


# ----------------------------------------------------------------------------------------------- encoder heads


def head_config(task, model, output_dir, lora=None, **training) -> dict:
    columns = {"sequence_classification": ("document", "genre"), "token_classification": ("words", "tags")}[task]
    return {
        "task": task,
        "model": str(model),
        "output_dir": str(output_dir),
        "data": {"train_file": str(DATA), "validation_fraction": 0.25, "text_column": columns[0],
                 "target_column": columns[1]},
        "lora": lora,
        "training": {"per_device_train_batch_size": 8, "per_device_eval_batch_size": 16, **FINETUNE_QUIET, **training},
    }


@pytest.mark.parametrize("task", ["sequence_classification", "token_classification"])
def test_encoder_heads_finetune(task, tiny_model, tmp_path):
    result = finetune(head_config(task, tiny_model, tmp_path, max_steps=30, learning_rate=3e-3, logging_steps=5))
    losses = logged_losses(result["log_history"])
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.05, losses
    assert 0.0 <= result["eval"]["eval_accuracy"] <= 1.0 and "eval_f1_macro" in result["eval"]
    config = json.loads((Path(result["model_dir"]) / "config.json").read_text())
    expected_labels = ["comedy", "tragedy"] if task == "sequence_classification" else ["NAME", "O"]
    assert [config["id2label"][str(index)] for index in range(2)] == expected_labels


def test_token_labels_mark_the_first_piece_of_each_word(tiny_model, tmp_path):
    config = head_config("token_classification", tiny_model, tmp_path)
    config["data"]["validation_fraction"] = None  # the training rows stay in the file's order
    job = prepare_finetuning(config)
    tag_index = job.model.config.label2id
    for row, example in zip(ROWS[:3], job.train_dataset):
        expected = []
        for word, tag in zip(row["words"], row["tags"]):
            pieces = job.tokenizer(word, add_special_tokens=False)["input_ids"]
            expected += [tag_index[tag]] + [-100] * (len(pieces) - 1)
        assert example["labels"] == expected + [-100]  # the closing </s> is not scored


def test_lora_on_a_classification_head_trains_the_head_in_full(tiny_model, tmp_path):
    lora = {"r": 4, "alpha": 8, "dropout": 0.0}
    config = head_config("sequence_classification", tiny_model, tmp_path, lora=lora, max_steps=6, learning_rate=1e-2)
    job = prepare_finetuning(config)
    before = {name: parameter.detach().clone() for name, parameter in job.model.named_parameters()}
    trainable = {name for name, parameter in job.model.named_parameters() if parameter.requires_grad}
    assert any("classification_head" in name for name in trainable)
    assert all(".lora_" in name or "classification_head.modules_to_save" in name for name in trainable)

    result = job.run()
    for name, parameter in job.model.named_parameters():
        changed = not torch.equal(parameter, before[name])
        if name not in trainable:
            assert not changed, f"frozen weight {name} changed"
        elif ".lora_B." in name or "modules_to_save" in name:
            assert changed, f"trainable weight {name} did not change"
    merged = fat5.FAT5ForSequenceClassification.from_pretrained(result["merged_dir"])
    batch = job.tokenizer([ROWS[0]["document"], ROWS[40]["document"]], return_tensors="pt", padding=True)
    torch.testing.assert_close(logits_of(merged, dict(batch)), logits_of(job.model, dict(batch)))


# ----------------------------------------------------------------------------------------------- gradient accumulation


def one_sgd_step(config: dict, batch_size: int, accumulation: int) -> tuple[float, dict]:
    """Training loss and weight update of one plain SGD step (lr 1: the update is the gradient)."""
    _, loss, update = trained_sgd_step(config, batch_size, accumulation)
    return loss, update


def trained_sgd_step(config: dict, batch_size: int, accumulation: int):
    """``one_sgd_step`` that also returns the trainer that took the step: (trainer, loss, update)."""
    config = json.loads(json.dumps(config))
    config["training"].update(
        max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
        train_sampling_strategy="sequential",
    )
    # overwrite: a second step of the same config (a compiled one, compared with the eager) runs in the same folder
    job = prepare_finetuning(config, overwrite=True)
    before = {name: p.detach().clone() for name, p in job.model.named_parameters() if p.requires_grad}
    loss = job.trainer.train().training_loss
    update = {name: before[name] - p.detach() for name, p in job.model.named_parameters() if p.requires_grad}
    return job.trainer, loss, update


def assert_same_step(config: dict) -> None:
    loss_whole, update_whole = one_sgd_step(config, batch_size=4, accumulation=1)
    loss_split, update_split = one_sgd_step(config, batch_size=2, accumulation=2)
    assert loss_split == pytest.approx(loss_whole, rel=1e-6)
    for name, update in update_whole.items():
        if not update.any():  # LoRA's A matrices get no gradient while B is still zero
            assert not update_split[name].any(), name
            continue
        # relative to the whole update (the bug this guards against gives 1.0: twice the step)
        error = ((update_split[name] - update).norm() / update.norm()).item()
        assert error < 1e-5, f"{name}: relative difference {error:.2e} between accumulated and whole-batch steps"


def assert_updates_close(updates: dict, eager_updates: dict, what: str) -> None:
    """A compiled step's weight updates within 1e-4 (relative) of the eager step's."""
    for name, update in eager_updates.items():
        error = ((updates[name] - update).norm() / update.norm()).item()
        assert error < 1e-4, f"{name}: {what} and eager updates differ by {error:.2e}"


@pytest.fixture
def four_rows(tmp_path) -> Path:
    """Two comedies and two tragedies whose targets differ in length, so that a mean of per-batch means is wrong."""
    path = tmp_path / "four.jsonl"
    path.write_text("".join(json.dumps(ROWS[index]) + "\n" for index in (0, 40, 1, 41)), encoding="utf-8")
    return path


@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8, "dropout": 0.0}], ids=["full", "lora"])
def test_gradient_accumulation_is_exact_for_seq2seq(lora, tiny_model, tmp_path, four_rows):
    config = seq2seq_config(tiny_model, tmp_path / "run", lora=lora, validation=False)
    config["data"]["train_file"] = str(four_rows)
    assert_same_step(config)


def test_torch_compile_in_the_training_section_takes_the_eager_step(tiny_model, tmp_path, four_rows):
    """``training: {torch_compile: true}`` (what the README suggests on a GPU, there with mode reduce-overhead): the
    Trainer compiles the model, and the compiled step is the eager one."""
    config = seq2seq_config(tiny_model, tmp_path / "run", validation=False)
    config["data"]["train_file"] = str(four_rows)
    loss_eager, update_eager = one_sgd_step(config, batch_size=4, accumulation=1)
    config["training"]["torch_compile"] = True
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps the counts of what earlier tests compiled
    loss_compiled, update_compiled = one_sgd_step(config, batch_size=4, accumulation=1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile
    assert loss_compiled == pytest.approx(loss_eager, rel=1e-5)
    assert_updates_close(update_compiled, update_eager, "compiled")


def test_regional_compilation_with_an_accelerate_that_lacks_it_is_refused_by_name(monkeypatch, tmp_path):
    """Before accelerate 1.7 the Trainer would compile the whole model instead: say so rather than do that."""
    import dataclasses

    import accelerate.utils

    from fat5.trainer.trainer import FAT5TrainingArguments

    @dataclasses.dataclass
    class PluginWithoutTheSwitch:
        backend: str = "no"

    monkeypatch.setattr(accelerate.utils, "TorchDynamoPlugin", PluginWithoutTheSwitch)
    with pytest.raises(ValueError, match=r"torch_compile_regional needs accelerate >= 1\.7"):
        FAT5TrainingArguments(output_dir=str(tmp_path), torch_compile_regional=True, report_to="none")


def test_training_steps_do_not_read_the_loss_back_unless_asked(tmp_path, monkeypatch):
    """transformers' ``logging_nan_inf_filter`` tests every step's loss for NaN on the host (a GPU synchronisation
    per step): FAT5's arguments leave it off unless a config asks, and then the Trainer does test each step."""
    from transformers import Seq2SeqTrainer

    from fat5 import FAT5Config, FAT5ForConditionalGeneration
    from fat5.trainer.trainer import FAT5TrainingArguments

    model = FAT5ForConditionalGeneration(FAT5Config(**TINY))
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(2, TINY["vocab_size"], (6,), generator=generator),
             "labels": torch.randint(2, TINY["vocab_size"], (3,), generator=generator)} for _ in range(6)]
    tested = []
    original_isnan = torch.isnan
    monkeypatch.setattr(torch, "isnan", lambda tensor: tested.append(tensor.dim()) or original_isnan(tensor))
    for asked, expected_tests in ((None, 0), (True, 3)):
        tested.clear()
        extra = {} if asked is None else {"logging_nan_inf_filter": asked}
        arguments = FAT5TrainingArguments(output_dir=str(tmp_path / str(asked)), max_steps=3, report_to="none",
                                          per_device_train_batch_size=2, logging_steps=10, use_cpu=True, **extra)
        Seq2SeqTrainer(model=model, args=arguments, train_dataset=rows).train()
        assert tested.count(0) == expected_tests, (asked, tested)


def test_ddp_is_not_asked_to_search_for_unused_parameters_unless_the_config_says(tmp_path):
    """transformers asks DDP to search the autograd graph for unused parameters after every forward when the model
    has no activation checkpointing; every FAT5 parameter takes part in every step, so FAT5's arguments switch the
    search off (tests/test_distributed.py trains both jobs on two processes with it off) unless a config asks."""
    from transformers import Seq2SeqTrainer

    from fat5 import FAT5Config, FAT5ForConditionalGeneration
    from fat5.trainer.trainer import FAT5TrainingArguments

    model = FAT5ForConditionalGeneration(FAT5Config(**TINY))
    for asked, expected in ((None, False), (True, True)):
        extra = {} if asked is None else {"ddp_find_unused_parameters": asked}
        arguments = FAT5TrainingArguments(output_dir=str(tmp_path / str(asked)), report_to="none", use_cpu=True,
                                          **extra)
        handler = Seq2SeqTrainer(model=model, args=arguments).accelerator.ddp_handler
        assert handler.find_unused_parameters is expected, asked


def test_a_model_path_found_nowhere_is_named_without_the_hubs_retries(tiny_model, tmp_path, monkeypatch):
    """`model: out/fat5-flan-t5-small` before its conversion, offline: transformers' download retried for 27 s before
    the clear error. One request to the Hub (refused here as a machine without network refuses it) says it at once;
    transformers is not asked."""
    import huggingface_hub
    import transformers

    def no_network(*args, **kwargs):
        raise ConnectionError("[Errno -2] Name or service not known")

    def not_asked(*args, **kwargs):
        raise AssertionError("transformers was asked to download")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", no_network)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", not_asked)
    monkeypatch.chdir(tmp_path)
    config = seq2seq_config("out/fat5-flan-t5-small", tmp_path / "run")
    with pytest.raises(FAT5Error, match=r"out/fat5-flan-t5-small: no such folder here, and the Hub at .* cannot be "
                                        r"reached .*Name or service not known"):
        finetune(config)
    assert not (tmp_path / "run").exists()


def test_no_memory_is_pinned_without_an_accelerator(tmp_path, monkeypatch):
    """On a CPU a finetuning run printed torch's "pin_memory ... no accelerator is found" warning; with an
    accelerator the transformers default (pinned) stays (transformers itself pins nothing under use_cpu)."""
    import warnings

    from fat5.trainer.trainer import FAT5TrainingArguments

    arguments = FAT5TrainingArguments(output_dir=str(tmp_path), report_to="none")
    assert arguments.dataloader_pin_memory is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        next(iter(torch.utils.data.DataLoader([1, 2], pin_memory=arguments.dataloader_pin_memory)))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert FAT5TrainingArguments(output_dir=str(tmp_path), report_to="none").dataloader_pin_memory


def test_regional_compilation_compiles_each_block_and_takes_the_eager_step(tiny_model, tmp_path, four_rows):
    """``training: {torch_compile_regional: true}``: the Trainer trains a model whose blocks are compiled one by one
    (the model itself is not), the step is the eager one, and the saved model is the plain one."""
    config = seq2seq_config(tiny_model, tmp_path / "run", validation=False)
    config["data"]["train_file"] = str(four_rows)
    loss_eager, update_eager = one_sgd_step(config, batch_size=4, accumulation=1)
    config["training"]["torch_compile_regional"] = True
    torch._dynamo.reset()
    trainer, loss_regional, update_regional = trained_sgd_step(config, batch_size=4, accumulation=1)
    assert trainer.args.torch_compile
    compiled = trainer.model_wrapped
    assert not isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    for stack in (compiled.encoder, compiled.decoder):
        assert all(isinstance(block, torch._dynamo.eval_frame.OptimizedModule) for block in stack.block)
    # what the Trainer saves is the model with its usual parameter names, and it loads
    trainer.save_model(str(tmp_path / "saved"))
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert saved and not [name for name in saved if "_orig_mod" in name]
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "saved")
    for name, parameter in reloaded.named_parameters():
        torch.testing.assert_close(parameter, trainer.model.get_parameter(name), rtol=0, atol=0)
    assert loss_regional == pytest.approx(loss_eager, rel=1e-5)
    assert_updates_close(update_regional, update_eager, "regional-compiled")


@pytest.mark.parametrize("task", ["sequence_classification", "token_classification"])
def test_gradient_accumulation_is_exact_for_encoder_heads(task, tiny_model, tmp_path, four_rows):
    config = head_config(task, tiny_model, tmp_path / "run")
    config["data"].update(train_file=str(four_rows), validation_fraction=None)
    assert_same_step(config)


# ----------------------------------------------------------------------------------------------- metrics


def test_rouge_against_hand_computed_scores():
    prediction, reference = "the cat sat on the mat", "the cat lay on the mat"
    # unigrams: 5 of 6 shared; bigrams: the-cat, on-the, the-mat (3 of 5); longest common subsequence: 5 words
    scores = rouge([prediction], [reference])
    assert scores["rouge1"] == pytest.approx(5 / 6)
    assert scores["rouge2"] == pytest.approx(3 / 5)
    assert scores["rougeL"] == pytest.approx(5 / 6)

    per_example = rouge([prediction, "a b c d"], [reference, "a b x y"], use_aggregator=False)
    assert per_example["rouge1"] == pytest.approx([5 / 6, 1 / 2])
    # the best of several references counts
    assert rouge(["a b c d"], [["x y z w", "a b c d"]])["rouge1"] == pytest.approx(1.0)
    # rougeLsum takes each line as a sentence: swapped sentences keep their full overlap there, not in rougeL
    swapped = split_sentences("a b. c d."), split_sentences("c d. a b.")
    assert swapped[0] == "a b.\nc d."
    scores = rouge([swapped[0]], [swapped[1]], rouge_types=["rougeL", "rougeLsum"])
    assert scores == {"rougeL": pytest.approx(0.5), "rougeLsum": pytest.approx(1.0)}
    with pytest.raises(ValueError, match="unknown rouge types"):
        rouge(["a"], ["a"], rouge_types=["bleu"])


def test_rouge_metric_decodes_generated_ids(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    predicted = tokenizer(["the cat sat on the mat", "a b c d"])["input_ids"]
    expected = tokenizer(["the cat lay on the mat", "a b x y"])["input_ids"]
    width = max(map(len, predicted + expected)) + 2
    # generated ids start with the decoder start token (pad); the evaluation loop pads rows with -100
    predictions = torch.tensor([[0] + ids + [-100] * (width - len(ids) - 1) for ids in predicted]).numpy()
    labels = torch.tensor([ids + [-100] * (width - len(ids)) for ids in expected]).numpy()
    result = rouge_metric(tokenizer)(EvalPrediction(predictions=predictions, label_ids=labels))
    assert result["rouge1"] == pytest.approx(100 * (5 / 6 + 1 / 2) / 2, abs=1e-4)
    assert result["gen_len"] == pytest.approx(sum(map(len, predicted)) / 2)


def test_classification_scores_against_hand_computed_values():
    scores = classification_scores([0, 1, 1, 2], [0, 1, 2, 2])
    # F1 per class: 1 (class 0), 2/3 (class 1: one right of two predicted), 2/3 (class 2: one found of two)
    assert scores == {"accuracy": pytest.approx(0.75), "f1_macro": pytest.approx(7 / 9)}

    logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [1.0, 0.5]]).numpy()
    assert sequence_classification_metric(EvalPrediction(logits, torch.tensor([0, 1, 1]).numpy()))["accuracy"] == (
        pytest.approx(2 / 3)
    )
    regression = EvalPrediction(torch.tensor([[1.0], [2.0]]).numpy(), torch.tensor([0.0, 4.0]).numpy())
    assert sequence_classification_metric(regression) == {"mse": pytest.approx((1 + 4) / 2)}
    # token predictions count where a label is given (-100 marks padding and continuation pieces)
    token_logits = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [5.0, 0.0]]]).numpy()
    tokens = EvalPrediction(token_logits, torch.tensor([[0, 0, -100]]).numpy())
    assert token_classification_metric(tokens)["accuracy"] == pytest.approx(1 / 2)


def test_float_targets_train_a_regression_head(tiny_model, tmp_path):
    path = tmp_path / "scores.jsonl"
    path.write_text("".join(json.dumps({"text": r["document"], "score": len(r["words"]) / 10}) + "\n" for r in ROWS))
    config = {"task": "sequence_classification", "model": str(tiny_model), "output_dir": str(tmp_path / "run"),
              "data": {"train_file": str(path), "validation_fraction": 0.25, "target_column": "score"},
              "training": {**FINETUNE_QUIET, "max_steps": 2}}
    result = finetune(config)
    saved = json.loads((Path(result["model_dir"]) / "config.json").read_text())
    assert (saved["num_labels"] if "num_labels" in saved else len(saved["id2label"])) == 1
    assert saved["problem_type"] == "regression" and "eval_mse" in result["eval"]


# ----------------------------------------------------------------------------------------------- configuration


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


CONFIG_MISTAKES = {
    "no model": (lambda c, d: c.pop("model"), r"`model` is missing"),
    "unknown model path": (lambda c, d: c.update(model=str(d / "nowhere")), r"not a model folder"),
    "folder without config": (lambda c, d: c.update(model=str(d)), r"has no config.json"),
    "not a FAT5 model": (
        lambda c, d: c.update(model=str(write(d / "config.json", '{"model_type": "t5"}').parent)),
        r"'t5' model, not a FAT5 one; convert it first",
    ),
    "model without a tokenizer": (
        lambda c, d: c.update(model=str(model_without_tokenizer(Path(c["model"]), d / "converted"))),
        (r"model: .*converted holds no tokenizer \(none of tokenizer.json, .*\), and the config names none: save "
         r"the tokenizer of the checkpoint it was converted from into it, AutoTokenizer.from_pretrained\(NAME\)"),
    ),
    "unreadable data": (lambda c, d: c["data"].update(train_file=str(d / "none.jsonl")), r"cannot read"),
    "unknown data format": (
        lambda c, d: c["data"].update(train_file=str(write(d / "data.txt", "text"))), r"one format among",
    ),
    "malformed data": (
        lambda c, d: c["data"].update(train_file=str(write(d / "bad.jsonl", "{not json\n"))), r"data: cannot load",
    ),
    "missing column": (
        lambda c, d: c["data"].update(target_column="abstract"), r"no column\(s\) \['abstract'\]; its columns are",
    ),
    "bad LoRA target": (
        lambda c, d: c.update(lora={"target_modules": ["q", "wi"]}), r"\['wi'\] name no linear layer",
    ),
    "bad LoRA rank": (lambda c, d: c.update(lora={"r": 0}), r"lora.r must be an integer >= 1"),
    "unknown LoRA key": (lambda c, d: c.update(lora={"rank": 4}), r"lora: unknown key\(s\) \['rank'\]"),
    "bundle without a merged model": (
        lambda c, d: c.update(bundle=True, lora={"merge": False}), r"with LoRA, keep lora.merge: true",
    ),
    "unknown dtype": (lambda c, d: c.update(dtype="fp8"), r"dtype must be one of"),
    "unknown section": (lambda c, d: c.update(trainer={}), r"unknown key\(s\) \['trainer'\]"),
    "unknown task": (lambda c, d: c.update(task="translation"), r"task must be one of"),
    "transformers 4 argument": (
        lambda c, d: c["training"].update(group_by_length=True), r"train_sampling_strategy: group_by_length",
    ),
    "bad training choice": (
        lambda c, d: c["training"].update(train_sampling_strategy="shortest"),
        r"train_sampling_strategy must be one of \['random', 'sequential', 'group_by_length'.*got 'shortest'",
    ),
    "bad training value": (
        lambda c, d: c["training"].update(eval_strategy="sometimes"),
        r"training.eval_strategy must be one of \['no', 'steps', 'epoch'\], got 'sometimes'",
    ),
    "unknown model field": (
        lambda c, d: c.update(model_overrides={"dropout": 0.1}), r"\['dropout'\] are not FAT5Config fields",
    ),
    "invalid model field": (
        lambda c, d: c.update(model_overrides={"dropout_rate": 2.0}), r"dropout_rate must lie in \[0, 1\)",
    ),
    "output_dir in training": (lambda c, d: c["training"].update(output_dir="x"), r"at the top level"),
    "classification with generation": (
        lambda c, d: c.update(task="sequence_classification", training={"predict_with_generate": True})
        or c["data"].update(target_column="genre"),
        r"predict_with_generate needs task seq2seq",
    ),
    "single class": (
        lambda c, d: c.update(task="sequence_classification") or c["data"].update(
            target_column="genre",
            train_file=str(write(d / "one.jsonl", "".join(json.dumps(row) + "\n" for row in ROWS[:4]))),
            validation_fraction=None,
        ),
        r"holds a single class \('comedy'\)",
    ),
}


@pytest.mark.parametrize("mistake", sorted(CONFIG_MISTAKES))
def test_config_mistakes_raise_fat5_error(mistake, tiny_model, tmp_path):
    change, message = CONFIG_MISTAKES[mistake]
    config = seq2seq_config(tiny_model, tmp_path / "run", max_steps=1)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    change(config, scratch)
    with pytest.raises(FAT5Error, match=message):
        prepare_finetuning(config)
    # the mistakes that only the model, once loaded, shows (its fields, its layers' names) come once the output folder
    # is made (with --overwrite, once a run is removed; the others before): a job that fails before its first write
    # leaves no folder behind either way
    assert not (tmp_path / "run").exists()


def test_yaml_file_mistakes_raise_fat5_error(tmp_path):
    with pytest.raises(FAT5Error, match="no such file"):
        finetune(tmp_path / "missing.yaml")
    with pytest.raises(FAT5Error, match="not valid YAML"):
        finetune(write(tmp_path / "bad.yaml", "task: [seq2seq\n"))
    with pytest.raises(FAT5Error, match="must be a YAML mapping"):
        finetune(write(tmp_path / "list.yaml", "- task\n"))
    with pytest.raises(FAT5Error, match="must read KEY=VALUE"):
        load_finetune_config({"model": "m", "output_dir": "o"}, overrides=["training.max_steps"])


@pytest.mark.parametrize("name", ["summarization", "lora", "classification"])
def test_example_configs_run(name, tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the configs name the shipped data relative to the repository root
    path = REPO / "fat5" / "trainer" / "configs" / f"finetune_{name}.yaml"
    overrides = [f"model={tiny_model}", "training.max_steps=2", "training.eval_strategy=no", "bundle=false",
                 "training.disable_tqdm=true", "training.use_cpu=true"]
    result = finetune(path, output_dir=tmp_path / "run", overrides=overrides)
    assert result["train"]["train_loss"] > 0
    assert result["eval"] is not None
    assert (result["model_dir"] or result["merged_dir"]) is not None


# ----------------------------------------------------------------------------------------------- CLI and examples


def test_finetune_command(tiny_model, tmp_path, capsys):
    parser = build_parser()
    config = seq2seq_config(tiny_model, tmp_path / "from-file", validation=False)
    path = write(tmp_path / "config.yaml", json.dumps(config))  # JSON is YAML
    args = parser.parse_args(["finetune", str(path), "--output-dir", str(tmp_path / "run"),
                              "--set", "training.max_steps=2", "--set", "lora={r: 2}"])
    assert args.func(args) == 0
    output = capsys.readouterr().out
    assert f"adapter: {tmp_path / 'run' / 'adapter'}" in output and "merged:" in output
    args = parser.parse_args(["finetune", str(path), "--set", "data.text_column=body"])
    with pytest.raises(FAT5Error, match=r"no column\(s\) \['body'\]"):
        args.func(args)


def test_ctrl_c_says_how_to_resume(tiny_model, tmp_path, monkeypatch, capsys):
    from fat5.cli import main
    from fat5.trainer import finetuning as finetune_module

    run = tmp_path / "run"
    path = write(tmp_path / "config.yaml", json.dumps(seq2seq_config(tiny_model, run, validation=False)))
    left = []  # what the run writes before Ctrl-C stops it

    def interrupted(*args, **kwargs):
        for write_it in left:
            write_it()
        raise KeyboardInterrupt

    def complete_checkpoint_2():
        shutil.copytree(tiny_model, run / "checkpoint-2")
        (run / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')

    monkeypatch.setattr(finetune_module, "finetune", interrupted)
    left.append(lambda: (run / "checkpoint-3").mkdir())
    assert main(["finetune", str(path)]) == 130
    # checkpoint-3 is incomplete (empty): nothing to resume from yet
    assert f"no checkpoint was written yet; `fat5 finetune {path} --overwrite` starts over" in capsys.readouterr().err
    left[:] = [complete_checkpoint_2]
    assert main(["finetune", str(path), "--set", "training.max_steps=9", "--overwrite"]) == 130
    assert (f"`fat5 finetune {path} --set training.max_steps=9 --resume` continues from {run / 'checkpoint-2'}"
            in capsys.readouterr().err)


@pytest.mark.parametrize(
    "script, arguments",
    [
        ("finetune_summarization.py", []),
        ("finetune_lora.py", []),
        ("finetune_classification.py", ["--task", "token_classification"]),
    ],
)
def test_examples_run_as_written(script, arguments, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    argv = [script, "--tiny", "--max-steps", "3", "--output-dir", str(tmp_path / "run"), *arguments]
    monkeypatch.setattr(sys, "argv", argv)
    # as `python examples/SCRIPT` does: the script's folder on the path, for the examples' shared example_setup.py
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    runpy.run_path(str(REPO / "examples" / script), run_name="__main__")
    assert "saved in" in capsys.readouterr().out or (tmp_path / "run" / "bundle").is_dir()
