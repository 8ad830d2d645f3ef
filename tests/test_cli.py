"""The `fat5` command as a user meets it: every subcommand has --help, a mistake is one line on stderr."""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

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
    from fat5.trainer.finetune_config import load_finetune_config
    from fat5_command import build_parser

    parser = build_parser()
    assert parser.parse_args(["convert", "src", "out", "--dtype", spelling]).dtype == name
    assert parser.parse_args(["export-hf", "src", "out", "--dtype", spelling]).dtype == name
    config = {"model": "some/model", "output_dir": str(tmp_path), "data": {"train_file": "train.jsonl"}}
    assert load_finetune_config(dict(config, dtype=spelling)).dtype == name


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


GPU_ONLY_BENCHMARKS = ["attention", "cross-entropy", "rms-norm", "model", "launch-overhead", "linear-cross-entropy"]


TINY_ON_CPU_BENCHMARKS = ["finetune", "pretrain", "distributed", "generation", "generation-profile", "gradient-check",
                          "transformers-t5"]


@pytest.mark.parametrize("name", [*GPU_ONLY_BENCHMARKS, *TINY_ON_CPU_BENCHMARKS])
def test_a_gpu_benchmark_without_cuda_is_one_line(name, capfd):
    """attention, cross-entropy and rms-norm used to end in `Torch not compiled with CUDA enabled` tracebacks."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["bench", name]) == 2
    captured = capfd.readouterr()
    [line] = captured.err.splitlines()
    assert line.startswith(f"fat5 bench: error: {name} measures on a CUDA GPU and this machine has none")
    assert ("--tiny" in line) == (name in TINY_ON_CPU_BENCHMARKS)
    assert captured.out == ""


def test_bench_writes_a_new_result_file_unless_told_where(monkeypatch, tmp_path):
    """`fat5 bench NAME` used to overwrite the tracked benchmarks/results/NAME.json."""
    import fat5.commands.bench

    commands = []
    monkeypatch.setattr(fat5.commands.bench.subprocess, "run", lambda command, **_: commands.append(command) or
                        subprocess.CompletedProcess(command, 0))
    assert main(["bench", "collator", "--seconds", "1"]) == 0
    out = Path(commands[-1][commands[-1].index("--out") + 1])
    assert out.parent == fat5.commands.bench.BENCHMARKS.parent / "runs" / "bench"
    assert out.name.startswith("collator-") and out.suffix == ".json"
    assert "benchmarks/results" not in " ".join(commands[-1])
    assert main(["bench", "collator", "--out", str(tmp_path / "mine.json")]) == 0
    assert commands[-1][-2:] == ["--out", str(tmp_path / "mine.json")]
    assert main(["bench", "collator", "--out=" + str(tmp_path / "mine.json")]) == 0
    assert commands[-1].count("--out") == 0 and commands[-1][-1] == "--out=" + str(tmp_path / "mine.json")


def test_training_log_lines_hold_numbers(capsys):
    """The progress bar's log line is a dict of numbers (transformers' own bar writes 'tokens_per_second':
    '1.453e+04'), rounded for reading."""
    import ast

    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import ProgressCallback

    from fat5.trainer.metrics import numeric_progress_callback

    callback = numeric_progress_callback()()
    assert isinstance(callback, ProgressCallback)
    state = TrainerState(max_steps=10)
    arguments = TrainingArguments(output_dir="unused", report_to="none")
    callback.on_train_begin(arguments, state, TrainerControl())
    logs = {"loss": 7.123456, "tokens_per_second": 14532.77, "epoch": 0.5, "step": 3, "total_flos": 1e12}
    callback.on_log(arguments, state, TrainerControl(), logs=logs)
    callback.on_train_end(arguments, state, TrainerControl())
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert ast.literal_eval(line) == {"loss": 7.123, "tokens_per_second": 14530.0, "epoch": 0.5, "step": 3}


def test_fat5_trainer_logs_through_the_numeric_bar(tiny_model):
    from transformers.trainer_callback import ProgressCallback

    from fat5 import FAT5ForConditionalGeneration
    from fat5.trainer.trainer import FAT5Trainer, FAT5TrainingArguments

    trainer = FAT5Trainer(model=FAT5ForConditionalGeneration.from_pretrained(tiny_model),
                          args=FAT5TrainingArguments(output_dir="unused", report_to="none"))
    [bar] = [c for c in trainer.callback_handler.callbacks if isinstance(c, ProgressCallback)]
    assert type(bar).__name__ == "NumericProgressCallback"


def test_loss_curve_png_and_its_absence_without_matplotlib(tmp_path, monkeypatch):
    from fat5.trainer.metrics import plot_loss_curve

    history = [{"loss": 9.0 - step / 10, "step": step} for step in range(1, 30, 5)] + [{"eval_loss": 6.5, "step": 26}]
    assert plot_loss_curve(history, tmp_path / "loss_curve.png")
    assert (tmp_path / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["loss_curve.png"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert not plot_loss_curve(history, tmp_path / "other.png")
    assert not (tmp_path / "other.png").exists()


def _console_script_entry() -> tuple[str, str]:
    """(module, function) of pyproject's `fat5` console script: what `pip install` makes `fat5` run."""
    import re

    text = (REPO / "pyproject.toml").read_text()
    match = re.search(r'^\[project\.scripts\]\s*\nfat5 = "([\w.]+):(\w+)"', text, re.MULTILINE)
    assert match, "no fat5 console script in pyproject.toml"
    return match[1], match[2]


@pytest.mark.parametrize("arguments", [["--help"], ["--version"], []])
def test_help_and_version_do_not_import_torch(arguments):
    """`fat5 --help` took 4.5 s importing torch and transformers; the console script's entry now answers it alone.
    Checked on what was imported, not on a time."""
    module, function = _console_script_entry()
    program = (
        f"import sys\nfrom {module} import {function}\n"
        f"try:\n    {function}({arguments!r})\nexcept SystemExit as exit:\n    status = exit.code\n"
        "print('imported:', sorted(name for name in ('torch', 'transformers', 'fat5') if name in sys.modules))\n"
        "print('status:', status)\n"
    )
    completed = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300,
                               check=False)
    assert "imported: []" in completed.stdout, completed.stdout + completed.stderr
    if arguments == ["--version"]:
        assert "fat5 0." in completed.stdout and "status: 0" in completed.stdout
    elif arguments:
        assert completed.stdout.startswith("usage: fat5") and "status: 0" in completed.stdout
        assert all(name in completed.stdout for name in SUBCOMMANDS)
    else:  # no command: argparse's usage error
        assert "status: 2" in completed.stdout and "required: COMMAND" in completed.stderr


def test_the_quick_help_is_the_full_parsers_help(capsys):
    """The help the entry answers alone is the one the full parser would give: the two cannot drift apart."""
    from fat5_command import build_parser, top_level_parser

    assert top_level_parser().format_help() == build_parser().format_help()


def test_a_subcommand_goes_through_to_the_full_parser(capsys):
    from fat5_command import main as entry

    with pytest.raises(SystemExit) as exit_info:
        entry(["pretrain", "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: fat5 pretrain")
