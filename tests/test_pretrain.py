"""`fat5 pretrain`: the built-in default learns, a resumed run retraces the uninterrupted one, mistakes are named."""

import json
import math
import shutil
from pathlib import Path

import pytest
from helpers import SMALL_PRETRAIN, TINY_PRETRAIN

from fat5.errors import FAT5Error
from fat5.trainer.pretrain_config import load_pretrain_config
from fat5.trainer.pretraining import pretrain


@pytest.fixture(scope="module")
def default_run(quick_start_run):
    """The README's main job, run once for this module and the README's test: `fat5 pretrain --output-dir DIR` with
    the built-in default."""
    folder, completed = quick_start_run
    return folder / "outputs" / "fat5-tiny", completed


def test_default_job_learns_and_saves_a_loadable_model(default_run):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    output, completed = default_run
    summary = json.loads((output / "pretrain_summary.json").read_text())
    losses = [entry["loss"] for entry in summary["log_history"] if "loss" in entry]
    assert summary["steps"] == load_pretrain_config().training["max_steps"]
    # T5X's draw starts the loss near ln(vocab_size), a uniform guess; learning takes it well below
    ln_vocab = math.log(json.loads((output / "config.json").read_text())["vocab_size"])
    assert abs(losses[0] - ln_vocab) < 0.1 * ln_vocab and losses[-1] <= ln_vocab - 1.0, losses
    assert "loss" in completed.stdout and "saved to" in completed.stdout
    logged = [entry for entry in summary["log_history"] if "tokens_per_second" in entry]
    assert logged and all(0.0 <= entry["padding_fraction"] < 0.1 for entry in logged)
    assert all(entry["z_loss"] > 0 for entry in logged)
    # the final weights are evaluated once: the Trainer's evaluation at the last step is the summary's
    last_step_evaluations = [entry for entry in summary["log_history"]
                             if "eval_loss" in entry and entry["step"] == summary["steps"]]
    assert [entry["eval_loss"] for entry in last_step_evaluations] == [summary["eval_loss"]]

    model = AutoModelForSeq2SeqLM.from_pretrained(output).eval()
    tokenizer = AutoTokenizer.from_pretrained(output)
    # rows for a multiple of 128 ids, as T5's 32,128 for 32,100 tokens (aligned products for the output layer)
    assert model.config.vocab_size % 128 == 0 and 0 <= model.config.vocab_size - len(tokenizer) < 128
    batch = tokenizer(["[S] To be, or not to be"], return_tensors="pt")
    generated = model.generate(**batch, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert generated.shape == (1, 9)


def test_the_quick_start_says_what_it_does_at_once_and_draws_no_progress_bar(default_run):
    """Its first line says what the job does before torch and transformers load (issue 50), the tokenizer is trained
    (or loaded) once, by the training begun then; its output, read from a pipe, holds no progress bar; and its summary
    claims no compilation on the CPU's eager step."""
    _, completed = default_run
    lines = completed.stdout.splitlines()
    assert lines[0] == ("pretraining 300 steps on the built-in Shakespeare plays, into outputs/fat5-tiny (loading "
                        "torch and transformers)")
    assert len([line for line in lines if line.startswith(("training a", "tokenizer:"))]) == 1
    assert "%|" not in completed.stdout + completed.stderr and "it/s]" not in completed.stdout + completed.stderr
    assert "compilation" not in completed.stdout


def test_the_tokenizer_begun_before_the_imports_trains_on_the_jobs_texts():
    """`begun_pretraining` reads the built-in corpus without `datasets`: the texts it trains the tokenizer on are the
    ones the job's `datasets` corpus gives it, in their order (else the job would train a second one)."""
    from fat5.trainer.data import shakespeare_training_texts
    from fat5.trainer.pretraining import load_corpus

    settings = load_pretrain_config()
    train, _ = load_corpus(settings.data, settings.seed)
    assert shakespeare_training_texts(settings.data.unit, settings.data.eval_fraction, settings.seed) == train["text"]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """SMALL_PRETRAIN run once, uninterrupted: checkpoint-4, checkpoint-8 and the final model in one folder."""
    output = tmp_path_factory.mktemp("straight")
    return output, pretrain(SMALL_PRETRAIN, output)


def test_the_output_folder_itself_holds_the_model(straight_run):
    """`from_pretrained(output_dir)` loads the final model and tokenizer (transformers' Trainer layout), with the
    checkpoints beside them and no temporary folder left."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    output, summary = straight_run
    assert summary["output"] == str(output)
    model = AutoModelForSeq2SeqLM.from_pretrained(output)
    tokenizer = AutoTokenizer.from_pretrained(output)
    assert model.config.vocab_size >= len(tokenizer)
    assert {"checkpoint-4", "checkpoint-8", "config.json", "model.safetensors", "pretrain_summary.json"} <= {
        path.name for path in output.iterdir()}
    assert not [path.name for path in output.iterdir() if path.name.startswith(".")]


def test_resumed_run_retraces_the_uninterrupted_one(straight_run, tmp_path, capfd):
    output, straight = straight_run
    # a run killed while writing checkpoint-8 (by an older release, without the atomic rename) leaves checkpoint-4,
    # a half-written checkpoint-8 and the tokenizer: resume skips the broken one, saying why
    interrupted = tmp_path / "interrupted"
    for left_behind in ("checkpoint-4", "checkpoint-8", "tokenizer"):
        shutil.copytree(output / left_behind, interrupted / left_behind)
    weights = interrupted / "checkpoint-8" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    capfd.readouterr()
    resumed = pretrain(SMALL_PRETRAIN, interrupted, resume=True)
    printed = capfd.readouterr()
    assert "skipping the incomplete checkpoint-8: model.safetensors is damaged" in printed.out
    assert f"continuing from {interrupted / 'checkpoint-4'}" in printed.out
    # the tied embedding is stored once; its other names are not reported missing
    assert "missing keys" not in printed.out + printed.err

    def losses(summary):
        return {entry["step"]: entry["loss"] for entry in summary["log_history"] if "loss" in entry}

    assert losses(resumed).keys() >= {5, 6, 7, 8}
    for step in (5, 6, 7, 8):
        assert losses(resumed)[step] == pytest.approx(losses(straight)[step], rel=1e-5), step

    # the report says what this process trained (steps 5 to 8, which train_loss averages) and the run's total
    assert (straight["steps"], straight["resumed_from_step"], straight["steps_this_run"]) == (8, 0, 8)
    assert (resumed["steps"], resumed["resumed_from_step"], resumed["steps_this_run"]) == (8, 4, 4)
    assert resumed["train_loss"] == pytest.approx(sum(losses(resumed)[step] for step in (5, 6, 7, 8)) / 4, rel=1e-3)
    from fat5.commands.pretrain import print_closing_summary

    print_closing_summary(resumed, interrupted, elapsed=60.0)
    assert capfd.readouterr().out.startswith(
        "trained 4 steps (resumed from step 4, 8 in all; train_loss covers these 4) in 1.0 min: loss ")


@pytest.mark.parametrize("damage", ["only config.json", "no trainer_state.json", "truncated weights",
                                    "truncated optimizer", "damaged trainer_state.json"])
def test_an_incomplete_checkpoint_is_never_chosen(straight_run, tmp_path, damage):
    from fat5.checkpoints import newest_complete_checkpoint

    output, _ = straight_run
    for name in ("checkpoint-4", "checkpoint-8"):
        shutil.copytree(output / name, tmp_path / name)
    newest = tmp_path / "checkpoint-8"
    if damage == "only config.json":
        for path in newest.iterdir():
            if path.name != "config.json":
                path.unlink()
    elif damage == "no trainer_state.json":
        (newest / "trainer_state.json").unlink()
    elif damage == "damaged trainer_state.json":
        (newest / "trainer_state.json").write_text('{"global_st')
    else:
        path = newest / ("model.safetensors" if damage == "truncated weights" else "optimizer.pt")
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    chosen, skipped = newest_complete_checkpoint(tmp_path)
    assert chosen == tmp_path / "checkpoint-4"
    assert len(skipped) == 1 and skipped[0].startswith("checkpoint-8: ")
    assert newest_complete_checkpoint(output)[0] == output / "checkpoint-8"


def test_a_folder_with_a_model_or_checkpoints_is_refused_without_a_flag(straight_run, tmp_path):
    output, _ = straight_run
    run = tmp_path / "run"
    shutil.copytree(output, run)
    with pytest.raises(FAT5Error, match=r"holds a finished run: checkpoint-8 reached its max_steps \(8\)"):
        pretrain(SMALL_PRETRAIN, run)
    shutil.rmtree(run / "checkpoint-8")
    with pytest.raises(FAT5Error, match=r"checkpoints of an earlier run: pass --resume to continue from "
                                        r"checkpoint-4, or --overwrite"):
        pretrain(SMALL_PRETRAIN, run)
    for checkpoint in run.glob("checkpoint-*"):
        shutil.rmtree(checkpoint)
    with pytest.raises(FAT5Error, match="already holds a model: pass --overwrite"):
        pretrain(SMALL_PRETRAIN, run)
    with pytest.raises(FAT5Error, match="pass one of them"):
        pretrain(SMALL_PRETRAIN, run, resume=True, overwrite=True)
    assert (run / "model.safetensors").is_file()


def test_overwrite_never_removes_the_input(tmp_path):
    """--overwrite on a folder that holds the config (or a tokenizer, corpus, ul2 file the job reads) is refused."""
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "config.yaml").write_text(json.dumps(SMALL_PRETRAIN))
    (runs / "config.json").write_text("{}")
    with pytest.raises(FAT5Error, match="holds the input"):
        pretrain(runs / "config.yaml", runs, overwrite=True)
    assert (runs / "config.yaml").is_file() and (runs / "config.json").is_file()


def test_ctrl_c_says_how_to_resume(straight_run, tmp_path, monkeypatch, capsys):
    from fat5.cli import main
    from fat5.trainer import pretraining as pretrain_module

    output, _ = straight_run

    def interrupted(config, output_dir, **options):  # a run stopped after writing checkpoint-4 (none in "empty")
        if Path(output_dir).name == "run":
            shutil.copytree(output / "checkpoint-4", Path(output_dir) / "checkpoint-4")
        raise KeyboardInterrupt

    monkeypatch.setattr(pretrain_module, "pretrain", interrupted)
    assert main(["pretrain", "--output-dir", str(tmp_path / "run")]) == 130
    message = capsys.readouterr().err
    run = tmp_path / "run"
    assert f"`fat5 pretrain --output-dir {run} --resume` continues from {run / 'checkpoint-4'}" in message
    assert main(["pretrain", "--output-dir", str(tmp_path / "empty")]) == 130
    assert "no checkpoint was written yet; `fat5 pretrain --output-dir" in capsys.readouterr().err


def test_config_mistakes_are_named(tmp_path):
    with pytest.raises(FAT5Error, match=r"unknown key\(s\) \['optimizer'\]"):
        load_pretrain_config({"optimizer": {}})
    with pytest.raises(FAT5Error, match="missing.yaml: no such file"):
        load_pretrain_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed")
    with pytest.raises(FAT5Error, match="not valid YAML"):
        load_pretrain_config(tmp_path / "bad.yaml")
    broken = json.loads(json.dumps(SMALL_PRETRAIN))
    broken["model"]["position_encoding"] = "sinusoidal"
    with pytest.raises(FAT5Error, match="position_encoding"):
        pretrain(broken, tmp_path / "broken")


@pytest.mark.parametrize("section, change, message", [
    ("model", {"position_encoding": "sinusoidal"}, "invalid model section.*position_encoding"),
    ("model", {"num_heads": 0}, "invalid model section"),
    ("ul2", "missing_ul2.yaml", r"ul2: no such file .*missing_ul2.yaml"),
    ("ul2", {"denoisers": []}, "ul2: "),
    ("training", {"max_steps": -3}, r"training.max_steps must be -1 \(train num_train_epochs\) or an integer >= 1"),
    ("training", {"learning_rate": -1.0e-3}, "training.learning_rate must be >= 0"),
    ("training", {"adam_beta2": 1.5}, r"training.adam_beta2 must be in \[0, 1\)"),
    ("training", {"per_device_train_batch_size": 0}, "training.per_device_train_batch_size must be >= 1"),
    ("training", {"save_steps": 0}, "training.save_steps must be > 0"),
    ("training", {"num_train_epochs": float("nan")}, "training.num_train_epochs must be > 0"),
    ("training", {"warmup_steps": -1}, "training.warmup_steps must be >= 0"),
    ("tokenizer", {"vocab_size": 0}, "tokenizer.vocab_size must be an integer >= 8"),
])
def test_the_whole_config_is_checked_before_any_work(tmp_path, monkeypatch, section, change, message):
    """A mistake anywhere in the config is named before the corpus is read or a tokenizer trained."""
    from fat5.trainer import pretraining as pretrain_module

    def no_work(*args, **kwargs):
        raise AssertionError("the job started working on an invalid config")

    monkeypatch.setattr(pretrain_module, "load_corpus", no_work)
    monkeypatch.chdir(tmp_path)
    config = json.loads(json.dumps(SMALL_PRETRAIN))
    config[section] = {**config.get(section, {}), **change} if isinstance(change, dict) and section != "ul2" else change
    with pytest.raises(FAT5Error, match=message):
        pretrain(config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_resume_without_a_complete_checkpoint_starts_over_and_says_so(tmp_path, capfd):
    config = json.loads(json.dumps(SMALL_PRETRAIN))
    config["training"].update(max_steps=2, save_steps=2)
    (tmp_path / "run" / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint-2" / "config.json").write_text("{}")
    summary = pretrain(config, tmp_path / "run", resume=True)
    printed = capfd.readouterr().out
    assert "skipping the incomplete checkpoint-2: no trainer_state.json" in printed
    assert "no complete checkpoint in" in printed and "starting from step 0" in printed
    assert summary["steps"] == 2 and (tmp_path / "run" / "checkpoint-2" / "trainer_state.json").is_file()


def test_cli_reports_mistakes_without_a_traceback(tmp_path, capsys):
    """The command's entry, in this process (test_cli.py runs the installed script): an exception it let through
    would fail the test here as a traceback would there."""
    from fat5.cli import main

    assert main(["pretrain", str(tmp_path / "missing.yaml"), "--output-dir", str(tmp_path)]) == 2
    stderr = capsys.readouterr().err
    assert "missing.yaml: no such file" in stderr and "Traceback" not in stderr


def test_the_corpus_folders_read_are_never_written_to(tmp_path):
    """A save_to_disk folder and a folder of JSONL files, read as the corpus: byte for byte as they were after the
    job, and still loadable (datasets would write its cache files beside the saved dataset unless told otherwise)."""
    import datasets
    from helpers import ROWS, TINY_PRETRAIN

    from fat5.trainer.data import load_text_dataset

    texts = [row["document"] for row in ROWS]
    saved, jsonl = tmp_path / "saved", tmp_path / "jsonl"
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(saved)
    jsonl.mkdir()
    (jsonl / "train.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    before = {folder: folder_fingerprint(folder) for folder in (saved, jsonl)}
    for folder in (saved, jsonl):
        overrides = {"data": {"corpus": None, "path": str(folder), "text_column": "text"},
                     "training": {"max_steps": 1, "eval_strategy": "no"}}
        pretrain(TINY_PRETRAIN, tmp_path / f"run-{folder.name}", overrides=overrides)
    assert {folder: folder_fingerprint(folder) for folder in (saved, jsonl)} == before
    assert len(datasets.load_from_disk(str(saved))) == len(ROWS)
    assert len(load_text_dataset(str(jsonl))) == len(ROWS)


def folder_fingerprint(folder) -> dict:
    """Every file under ``folder`` by name, with a hash of its bytes."""
    import hashlib

    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def test_new_shapes_first_steps_are_kept_in_the_log_and_said_once_at_the_end(tmp_path, capfd):
    """Each new batch shape's first step is in the log history (and pretrain_summary.json) but prints no line of its
    own: the closing summary gives them all in one."""
    from helpers import TINY_PRETRAIN

    from fat5.commands.pretrain import print_closing_summary

    output = tmp_path / "run"
    summary = pretrain(TINY_PRETRAIN, output, overrides={"training": {"max_steps": 3, "logging_steps": 1}})
    printed = capfd.readouterr().out
    first_steps = [entry for entry in summary["log_history"] if "first_step_seconds" in entry]
    assert first_steps and [entry["batch_shapes"] for entry in first_steps] == list(range(1, len(first_steps) + 1))
    assert json.loads((output / "pretrain_summary.json").read_text())["log_history"] == summary["log_history"]
    assert "first_step_seconds" not in printed and "'loss'" in printed
    print_closing_summary(summary, output, elapsed=1.0)
    closing = [line for line in capfd.readouterr().out.splitlines() if "new batch shapes" in line]
    total = sum(entry["first_step_seconds"] for entry in first_steps)
    # the eager step on the CPU compiles nothing
    assert summary["first_steps_compile"] is False
    assert closing == [(f"new batch shapes: {len(first_steps)}, their first steps took {total:.1f} s in all, "
                        f"{max(e['first_step_seconds'] for e in first_steps):.1f} s at most")]


# the README's quick start in small: the built-in save_total_limit of 1 keeps only the newest checkpoint, and the run
# ends mid-epoch (the speeches give more than 4 batches), where transformers' loop, resumed, draws one more batch
KEEPS_ONE_CHECKPOINT = {**TINY_PRETRAIN, "training": {"max_steps": 4, "save_steps": 2, "save_total_limit": 1,
                                                      "logging_steps": 1, "warmup_steps": 0, "disable_tqdm": True}}


def _trainer_state(checkpoint) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def _checkpoints(run) -> list[str]:
    return sorted(path.name for path in run.glob("checkpoint-*"))


def test_ctrl_c_then_resume_finishes_though_rotation_deletes_the_checkpoint_resumed_from(tmp_path, monkeypatch, capfd):
    """`fat5 pretrain --resume` after a Ctrl-C trained to the end, then failed on reading the checkpoint it resumed
    from, which the rotation had deleted when it wrote the next one: no summary, exit status 1."""
    from fat5.cli import main
    from fat5.trainer.trainer import FAT5Trainer

    config, run = tmp_path / "config.yaml", tmp_path / "run"
    config.write_text(json.dumps(KEEPS_ONE_CHECKPOINT))
    save = FAT5Trainer._save_checkpoint

    def save_then_ctrl_c(trainer, model, trial):
        save(trainer, model, trial)
        raise KeyboardInterrupt

    monkeypatch.setattr(FAT5Trainer, "_save_checkpoint", save_then_ctrl_c)
    assert main(["pretrain", str(config), "--output-dir", str(run)]) == 130
    monkeypatch.undo()
    assert _checkpoints(run) == ["checkpoint-2"]
    resume = f"`fat5 pretrain {config} --output-dir {run} --resume` continues from {run / 'checkpoint-2'}"
    assert resume in capfd.readouterr().err

    assert main(["pretrain", str(config), "--output-dir", str(run), "--resume"]) == 0
    assert _checkpoints(run) == ["checkpoint-4"] and _trainer_state(run / "checkpoint-4")["global_step"] == 4
    summary = json.loads((run / "pretrain_summary.json").read_text())
    assert (summary["steps"], summary["resumed_from_step"], summary["steps_this_run"]) == (4, 2, 2)
    closing = capfd.readouterr().out
    assert "trained 2 steps (resumed from step 2, 4 in all; train_loss covers these 2) in " in closing


def test_a_finished_run_is_not_advised_resume_and_resumed_trains_no_step(tmp_path, capfd):
    """A finished run's folder advised --resume, which trained a step past max_steps (transformers' loop trains on
    to the epoch's next batch before it checks max_steps) and then failed as above. It is now refused as finished;
    --resume trains nothing, says so, and keeps the run's model and summary (the way to finish a run stopped between
    its last checkpoint and its final model)."""
    from safetensors.torch import load_file

    from fat5.cli import main
    from fat5.output_folder import resume_hint

    config, run = tmp_path / "config.yaml", tmp_path / "run"
    config.write_text(json.dumps(KEEPS_ONE_CHECKPOINT))
    command = ["pretrain", str(config), "--output-dir", str(run)]
    assert main(command) == 0
    last = run / "checkpoint-4"
    assert _trainer_state(last)["global_step"] == 4 and _trainer_state(last)["epoch"] < 1
    capfd.readouterr()

    assert main(command) == 2
    assert capfd.readouterr().err.strip() == (
        f"fat5 pretrain: error: {run} holds a finished run: checkpoint-4 reached its max_steps (4) and the model "
        "is saved; pass --overwrite to start over, or choose another output folder")

    assert main([*command, "--resume"]) == 0
    printed = capfd.readouterr().out
    assert f"--resume: {last} reached the run's max_steps (4): no step left to train" in printed
    assert _checkpoints(run) == ["checkpoint-4"] and _trainer_state(last)["global_step"] == 4
    summary = json.loads((run / "pretrain_summary.json").read_text())
    assert (summary["steps"], summary["resumed_from_step"], summary["steps_this_run"]) == (4, 4, 0)
    assert summary["train_loss"] is None
    assert "no step left to train: the run had reached its 4 steps before --resume; loss " in printed
    final, checkpointed = load_file(run / "model.safetensors"), load_file(last / "model.safetensors")
    assert final.keys() == checkpointed.keys() and all(final[name].equal(checkpointed[name]) for name in final)

    for name in ("config.json", "model.safetensors"):  # a run stopped after its last checkpoint, before its model
        (run / name).unlink()
    assert resume_hint("fat5 pretrain", run) == (
        f"`fat5 pretrain --resume` saves the model of {last}, which reached max_steps (no step is trained)")
    assert main(command) == 2
    assert capfd.readouterr().err.strip() == (
        f"fat5 pretrain: error: {run} holds a run that reached its max_steps (4, checkpoint-4) but did not save its "
        "model: pass --resume to save it (no step is trained), or --overwrite to start over")
    assert main([*command, "--resume"]) == 0
    assert _checkpoints(run) == ["checkpoint-4"] and (run / "model.safetensors").is_file()


def test_set_overrides_a_config_entry_as_finetune_does(tmp_path, capfd):
    """`fat5 pretrain --set KEY=VALUE` (finetune had it, pretrain answered "unrecognized arguments"): the run and its
    saved config follow the override; a malformed one is named."""
    import yaml

    from fat5.cli import main

    config, run = tmp_path / "config.yaml", tmp_path / "run"
    config.write_text(json.dumps(KEEPS_ONE_CHECKPOINT))
    assert main(["pretrain", str(config), "--output-dir", str(run), "--set", "training.max_steps=3",
                 "--set", "training.save_steps=3"]) == 0
    assert _checkpoints(run) == ["checkpoint-3"] and _trainer_state(run / "checkpoint-3")["global_step"] == 3
    assert yaml.safe_load((run / "pretrain_config.yaml").read_text())["training"]["max_steps"] == 3
    capfd.readouterr()
    assert main(["pretrain", str(config), "--output-dir", str(tmp_path / "other"), "--set", "training.max_steps"]) == 2
    assert "must read KEY=VALUE" in capfd.readouterr().err
