"""`fat5 pretrain`: the built-in default learns, a resumed run retraces the uninterrupted one, mistakes are named."""

import json
import math
import shutil
import subprocess
import sys

import pytest

from fat5.errors import FAT5Error
from fat5.trainer.pretrain import load_config, pretrain

SMALL = {
    "model": {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_heads": 4, "num_layers": 1},
    "tokenizer": {"vocab_size": 400, "num_sentinels": 16},
    "data": {"max_input_length": 64, "max_target_length": 32, "tokens_per_batch": 512, "eval_fraction": 0.0},
    "training": {"max_steps": 8, "logging_steps": 1, "save_steps": 4, "eval_strategy": "no", "warmup_steps": 0,
                 "learning_rate": 1e-3, "save_total_limit": None},
}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The README's main job, run once: `fat5 pretrain --output-dir DIR` with the built-in default."""
    output = tmp_path_factory.mktemp("pretrain-default")
    completed = subprocess.run(
        [sys.executable, "-m", "fat5.cli", "pretrain", "--output-dir", str(output)],
        capture_output=True, text=True, timeout=1500,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return output, completed


def test_default_job_learns_and_saves_a_loadable_model(default_run):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    output, completed = default_run
    summary = json.loads((output / "pretrain_summary.json").read_text())
    losses = [entry["loss"] for entry in summary["log_history"] if "loss" in entry]
    assert summary["steps"] == load_config()["training"]["max_steps"]
    # T5X's draw starts the loss near ln(vocab_size), a uniform guess; learning takes it well below
    ln_vocab = math.log(json.loads((output / "model" / "config.json").read_text())["vocab_size"])
    assert abs(losses[0] - ln_vocab) < 0.1 * ln_vocab and losses[-1] <= ln_vocab - 1.0, losses
    assert "loss" in completed.stdout and "saved to" in completed.stdout
    logged = [entry for entry in summary["log_history"] if "tokens_per_second" in entry]
    assert logged and all(0.0 <= entry["padding_fraction"] < 0.1 for entry in logged)
    assert all(entry["z_loss"] > 0 for entry in logged)

    model = AutoModelForSeq2SeqLM.from_pretrained(output / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(output / "model")
    # rows for a multiple of 128 ids, as T5's 32,128 for 32,100 tokens (aligned products for the output layer)
    assert model.config.vocab_size % 128 == 0 and 0 <= model.config.vocab_size - len(tokenizer) < 128
    batch = tokenizer(["[S] To be, or not to be"], return_tensors="pt")
    generated = model.generate(**batch, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert generated.shape == (1, 9)


def test_resumed_run_retraces_the_uninterrupted_one(tmp_path):
    straight = pretrain(SMALL, tmp_path / "straight")
    # a run interrupted after step 4 leaves what the straight run left there: checkpoint-4 and the tokenizer (which
    # a resume reloads rather than retrains: the unigram trainer of `tokenizers` is not bit-reproducible)
    interrupted = tmp_path / "interrupted"
    for left_behind in ("checkpoint-4", "tokenizer"):
        shutil.copytree(tmp_path / "straight" / left_behind, interrupted / left_behind)
    resumed = pretrain(SMALL, interrupted, resume=True)

    def losses(summary):
        return {entry["step"]: entry["loss"] for entry in summary["log_history"] if "loss" in entry}

    assert losses(resumed).keys() >= {5, 6, 7, 8}
    for step in (5, 6, 7, 8):
        assert losses(resumed)[step] == pytest.approx(losses(straight)[step], rel=1e-5), step


def test_config_mistakes_are_named(tmp_path):
    with pytest.raises(FAT5Error, match="unknown config sections"):
        load_config({"optimizer": {}})
    with pytest.raises(FAT5Error, match="no pretraining config"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed")
    with pytest.raises(FAT5Error, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    broken = json.loads(json.dumps(SMALL))
    broken["model"]["position_encoding"] = "sinusoidal"
    with pytest.raises(FAT5Error, match="position_encoding"):
        pretrain(broken, tmp_path / "broken")
    with pytest.raises(FAT5Error, match="no checkpoint"):
        pretrain(SMALL, tmp_path / "fresh", resume=True)


def test_cli_reports_mistakes_without_a_traceback(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "fat5.cli", "pretrain", str(tmp_path / "missing.yaml"), "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 2
    assert "no pretraining config" in completed.stderr and "Traceback" not in completed.stderr
