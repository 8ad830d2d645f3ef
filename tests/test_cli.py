"""The `fat5` command as a user meets it: every subcommand has --help, a mistake is one line on stderr."""

import subprocess
import sys
from pathlib import Path

import pytest

from fat5.cli import main

SUBCOMMANDS = ["convert", "export-hf", "bundle", "push", "pretrain", "finetune", "bench"]


@pytest.mark.parametrize("command", [[], *([name] for name in SUBCOMMANDS)])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith(" ".join(["usage: fat5", *command]))
    if not command:  # the top-level help lists every subcommand
        assert all(name in help_text for name in SUBCOMMANDS)


def test_installed_command_reports_a_mistake_in_one_line(tmp_path):
    """The console script `pip install` made (pyproject's [project.scripts]): exit status 2, no traceback."""
    script = Path(sys.executable).parent / "fat5"
    assert script.is_file(), f"no `fat5` console script beside {sys.executable}: pip install -e ."
    completed = subprocess.run(
        [str(script), "convert", str(tmp_path / "nowhere"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 2
    [line] = completed.stderr.splitlines()
    assert line.startswith(f"fat5 convert: error: {tmp_path / 'nowhere'}: no such folder")
    assert not (tmp_path / "out").exists()


def test_bench_runs_a_benchmark_script_with_its_arguments(capfd):
    """`fat5 bench model --help` is benchmarks/model.py's own help; an unknown name lists the known ones."""
    assert main(["bench", "model", "--help"]) == 0
    assert "--generation-caches" in capfd.readouterr().out
    assert main(["bench", "cross-entropy", "--help"]) == 0
    assert "usage: cross_entropy.py" in capfd.readouterr().out
    assert main(["bench", "nonsense"]) == 2
    error = capfd.readouterr().err
    assert "unknown benchmark 'nonsense'" in error and "rms-norm" in error


DTYPE_SPELLINGS = [("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16"), ("float16", "float16"),
                   ("fp32", "float32"), ("float32", "float32"), ("BF16", "bfloat16")]


@pytest.mark.parametrize("spelling, name", DTYPE_SPELLINGS)
def test_every_dtype_spelling_is_taken_by_every_dtype_option(spelling, name, tmp_path):
    """The README's `--dtype bf16` works: the short and the torch names alike, in `fat5 convert` / `export-hf`
    flags and in a finetuning config's `dtype` field."""
    from fat5.cli import build_parser
    from fat5.trainer.finetune import load_finetune_config

    parser = build_parser()
    assert parser.parse_args(["convert", "src", "out", "--dtype", spelling]).dtype == name
    assert parser.parse_args(["export-hf", "src", "out", "--dtype", spelling]).dtype == name
    config = {"model": "some/model", "output_dir": str(tmp_path), "data": {"train_file": "train.jsonl"}}
    assert load_finetune_config(dict(config, dtype=spelling))["dtype"] == name


def test_an_unknown_dtype_is_one_line_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "src", "out", "--dtype", "fp8"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--dtype: dtype must be one of bf16, fp16, fp32 (or bfloat16, float16, float32), got 'fp8'" in error


def test_convert_writes_the_weights_in_the_short_named_dtype(tmp_path):
    """`fat5 convert SRC OUT --dtype bf16`, end to end on a tiny T5."""
    import torch
    from safetensors.torch import load_file
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0)
    T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    assert main(["convert", str(tmp_path / "t5"), str(tmp_path / "fat5"), "--dtype", "bf16"]) == 0
    assert {tensor.dtype for tensor in load_file(tmp_path / "fat5" / "model.safetensors").values()} == {torch.bfloat16}
