"""Issue 41's first hour of `fat5 pretrain` on a CPU, as a new user meets it: a quick plain --help, a prompt Ctrl-C
while the tokenizer trains, an output folder of someone else's files refused, a loss curve drawn or one command that
draws it, one line for each interruption, and everything the job needs checked before its first step."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fat5.cli import main

FAT5_SCRIPT = Path(sys.executable).parent / "fat5"


@pytest.mark.parametrize("command", ["pretrain", "finetune"])
def test_help_is_quick_plain_text_and_the_full_parsers(command, capsys):
    """`fat5 pretrain --help` took 10.8 s (torch imported first) and showed Sphinx markup; it imports neither torch
    nor transformers now, and says what the full parser (the one that runs the command) says."""
    program = ("import sys\nfrom fat5_command import main\ntry:\n"
               f"    main([{command!r}, '--help'])\nexcept SystemExit as exit:\n    status = exit.code\n"
               "heavy = sorted(name for name in ('torch', 'transformers', 'datasets') if name in sys.modules)\n"
               "print('status:', status, 'imported:', heavy, file=sys.stderr)\n")
    quick = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=False)
    assert quick.stderr.strip() == "status: 0 imported: []"
    with pytest.raises(SystemExit):
        main([command, "--help"])  # fat5 is imported in this process: the full parser answers
    assert quick.stdout == capsys.readouterr().out
    assert ":class:" not in quick.stdout and "``" not in quick.stdout

    start = time.perf_counter()
    subprocess.run([str(FAT5_SCRIPT), command, "--help"], capture_output=True, timeout=120, check=True)
    assert time.perf_counter() - start < 3.0  # about 0.3 s; a loaded machine gets room
