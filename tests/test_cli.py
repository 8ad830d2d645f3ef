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
