"""README.md as a new user runs it: every ```python block and every ```bash line, in order, in a fresh folder.

The quick start's `fat5 pretrain --output-dir outputs/fat5-tiny` (the built-in CPU default job) runs once, in the
session's fixture (tests/test_pretrain.py checks the same run); the blocks after it use what it wrote, as the
README's reader does. A block the test cannot run here carries a marker comment on the line before its fence,
``<!-- readme-test: skip: REASON -->``, and a few commands are not run for the reasons in ``NOT_RUN`` (the
environment they set up is the one running the test).
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import QUICK_START_JOB, READER_ENVIRONMENT, REPO, run_as_a_reader

README = REPO / "README.md"
# commands of the README's bash blocks that the test does not run, and why
NOT_RUN = {
    "pip install": "installs the environment this test already runs in (and needs the network)",
    "python -m pytest": "runs the test suite, which is what is running this test",
}
_BLOCK = re.compile(
    r"(?:<!-- readme-test: skip: (?P<skip>[^>]*?) -->\n)?```(?P<language>\w+)\n(?P<code>.*?)```", re.DOTALL
)


def readme_blocks() -> list[tuple[str, str, str | None, int]]:
    """(language, code, skip reason or None, line number) of every fenced block of README.md, in order."""
    text = README.read_text(encoding="utf-8")
    return [
        (match["language"], match["code"], match["skip"], text.count("\n", 0, match.start("code")) + 1)
        for match in _BLOCK.finditer(text)
    ]


def bash_commands(code: str) -> list[str]:
    """The commands of a bash block: its lines, each split at `&&` (continuations joined)."""
    lines = code.replace("\\\n", " ").splitlines()
    return [part.strip() for line in lines if line.strip() for part in line.split("&&")]


@pytest.fixture(scope="module")
def reader_folder(quick_start_run) -> tuple[Path, subprocess.CompletedProcess]:
    """A folder laid out as the repository root where the quick start's pretraining job has run, and that run."""
    return quick_start_run


def test_the_readme_runs_as_written(reader_folder):
    folder, _ = reader_folder
    blocks = readme_blocks()
    assert any(QUICK_START_JOB in code for _, code, _, _ in blocks), "the quick start no longer runs the default job"
    ran, skipped = [], []
    for language, code, skip, line in blocks:
        if skip:
            skipped.append(f"README.md:{line} ({skip})")
            continue
        if language == "python":
            completed = run_as_a_reader([sys.executable, "-c", code], folder)
            assert completed.returncode == 0 and "Traceback" not in completed.stderr, (
                f"README.md:{line}: the python block fails:\n{completed.stderr[-3000:]}"
            )
            ran.append(f"README.md:{line} python")
        elif language == "bash":
            for command in bash_commands(code):
                if command == QUICK_START_JOB:
                    ran.append(f"README.md:{line} {command} (the fixture's run)")
                    continue
                reason = next((why for start, why in NOT_RUN.items() if command.startswith(start)), None)
                if reason:
                    skipped.append(f"README.md:{line} {command} ({reason})")
                    continue
                completed = run_as_a_reader(command, folder, shell=True)
                assert completed.returncode == 0 and "Traceback" not in completed.stderr, (
                    f"README.md:{line}: `{command}` fails:\n{completed.stdout[-2000:]}{completed.stderr[-3000:]}"
                )
                ran.append(f"README.md:{line} {command}")
        else:
            pytest.fail(f"README.md:{line}: a ```{language} block, which this test does not know how to run")
    print("ran:", *ran, "not run:", *skipped, sep="\n  ")
    assert any("python" in entry for entry in ran) and any("fat5 finetune" in entry for entry in ran)


def test_every_skipped_block_says_why():
    for _language, _code, skip, line in readme_blocks():
        assert skip is None or skip.strip(), f"README.md:{line}: a skip marker without a reason"


def test_the_quick_start_installs_the_cpu_torch_first():
    """On a machine without a GPU a bare `pip install -e .` fetches a multi-GB CUDA build of torch."""
    commands = [command for language, code, _, _ in readme_blocks() if language == "bash"
                for command in bash_commands(code)]
    cpu_torch = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert cpu_torch in commands
    assert commands.index(cpu_torch) < commands.index("pip install -e .")


def test_the_pretraining_job_closes_with_a_summary_and_numeric_logs(reader_folder):
    """Its log lines are dicts of numbers; it ends with the time, the throughput, the summary's path and the loss
    curve it drew beside it."""
    folder, completed = reader_folder
    logs = [ast.literal_eval(match) for match in re.findall(r"\{'loss'.*?\}", completed.stdout)]
    assert logs, "no training log line in the job's output"
    assert all(isinstance(value, (int, float)) for entry in logs for value in entry.values())
    assert any("tokens_per_second" in entry for entry in logs)
    closing = completed.stdout.splitlines()[-6:]
    assert re.search(r"trained 300 steps in [\d.]+ min: loss [\d.]+ -> [\d.]+, eval loss [\d.]+", "\n".join(closing))
    assert re.search(r"throughput: [\d,]+ tokens/s", "\n".join(closing))
    summary = Path("outputs/fat5-tiny/pretrain_summary.json")
    assert f"summary and log history: {summary}" in closing
    assert (folder / summary).is_file()
    assert f"loss curve: {summary.with_name('loss_curve.png')}" in closing
    assert (folder / summary.with_name("loss_curve.png")).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_extra_is_used():
    """An extra that nothing imports (the old `flash-attn`) promises what FAT5 does not do."""
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads pyproject.toml")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    tools = {"ruff": "a command, not a module", "tensorboard": "transformers' report_to: tensorboard",
             "parameterized": "imported by transformers' own common tests (test_transformers_mixins.py)",
             "pytest-xdist": "a pytest plugin, run by pyproject.toml's addopts (-n 2)",
             "quack-kernels": "imported by flash-attn-4's kernels (flash_attn.cute.flash_fwd_sm90 and others)"}
    modules = {"flash-attn-4": "flash_attn"}
    sources = "\n".join(path.read_text(encoding="utf-8") for folder in ("fat5", "benchmarks", "tests", "examples")
                        for path in (REPO / folder).rglob("*.py"))
    for extra, requirements in extras.items():
        for requirement in requirements:
            name = re.match(r"[\w-]+", requirement)[0]
            if name in tools:
                continue
            module = modules.get(name, name.replace("-", "_"))
            assert re.search(rf"^\s*(import|from) {module}\b", sources, re.MULTILINE), (
                f"extra {extra!r}: {name} is unused"
            )


def test_the_bundles_model_card_runs_as_written_without_a_prompt(tiny_model, tmp_path):
    """The card's code, in a process that cannot import fat5, stdin closed: no "Do you wish to run the custom code?
    [y/N]" (its AutoTokenizer call lacked trust_remote_code), no "model of type `fat5` to instantiate a model of type
    ``" warning; and the tokenizer alone loads without remote code, as a plain fast tokenizer."""
    from fat5.hub_upload import bundle

    bundle(tiny_model, tmp_path / "bundle")
    card = (tmp_path / "bundle" / "README.md").read_text(encoding="utf-8")
    [code] = [code for language, code in re.findall(r"```(\w+)\n(.*?)```", card, re.DOTALL) if language == "python"]
    assert 'from_pretrained("path/to/this/folder"' in code
    code = code.replace("path/to/this/folder", str(tmp_path / "bundle"))
    plain_tokenizer = (
        "import sys\nfrom transformers import AutoTokenizer, PreTrainedTokenizerFast\n"
        f"plain = PreTrainedTokenizerFast.from_pretrained({str(tmp_path / 'bundle')!r})\n"
        f"auto = AutoTokenizer.from_pretrained({str(tmp_path / 'bundle')!r}, trust_remote_code=True)\n"
        "assert plain('To be, or not')['input_ids'] == auto('To be, or not')['input_ids']\n"
        "assert 'fat5' not in sys.modules\n"
    )
    # a folder with nothing but the bundle beside the program: fat5 cannot be imported there. The card's code and the
    # tokenizer check run in one process, which imports torch and transformers once
    environment = {key: value for key, value in READER_ENVIRONMENT.items() if key != "PYTHONPATH"}
    completed = subprocess.run([sys.executable, "-c", code + "\n" + plain_tokenizer], cwd=tmp_path,
                               stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600, check=False,
                               env=environment)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-3000:]
    assert "Do you wish to run the custom code" not in output and "to instantiate a model of type" not in output
