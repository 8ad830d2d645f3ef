"""benchmarks/quick_start.py's pieces that decide its figures: lines time-stamped as they arrive (progress-bar redraws
split at carriage returns), cold runs kept away from caches outside their fresh HOME, and the import's slowest
packages read from ``-X importtime``."""

import sys
import time

import pytest
from helpers import benchmark_module


@pytest.fixture(scope="module")
def quick_start():
    return benchmark_module("quick_start")


def test_each_line_is_stamped_when_it_arrives(quick_start, tmp_path):
    program = ("import sys, time\nprint('first', flush=True)\ntime.sleep(0.6)\n"
               "sys.stderr.write('bar 50%|\\rbar 100%|\\n'); sys.stderr.flush()\ntime.sleep(0.6)\nprint('last')\n")
    lines, status, wall = quick_start.timed_lines([sys.executable, "-c", program], None, tmp_path, timeout=60)
    assert status == 0
    assert [text for _, text in lines] == ["first", "bar 50%|", "bar 100%|", "last"]
    stamps = [stamp for stamp, _ in lines]
    assert stamps[1] - stamps[0] >= 0.5 and stamps[3] - stamps[2] >= 0.5 and stamps[3] <= wall


def test_a_silent_job_past_its_timeout_is_ended(quick_start, tmp_path):
    program = "import time\ntime.sleep(60)\n"
    started = time.perf_counter()
    with pytest.raises(SystemExit, match="ran past 1"):
        quick_start.timed_lines([sys.executable, "-c", program], None, tmp_path, timeout=1)
    assert time.perf_counter() - started < 30


def test_a_cold_run_sees_only_its_own_home(quick_start, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere/triton")
    monkeypatch.setenv("XDG_CACHE_HOME", "/elsewhere")
    environment = quick_start.job_environment(tmp_path)
    assert environment["HOME"] == str(tmp_path)
    assert not set(quick_start.CACHE_VARIABLES) & set(environment)


def test_the_slowest_imports_are_counted_by_package(quick_start, tmp_path, monkeypatch):
    # a package whose submodule takes 0.3 s, imported inside the package's first import: one figure for the package,
    # at least its submodule's (a fast package such as json ties at 0.00 s with the interpreter's own imports)
    package = tmp_path / "slow_package"
    package.mkdir()
    (package / "__init__.py").write_text("from . import waiting\n")
    (package / "waiting.py").write_text("import time\ntime.sleep(0.3)\n")
    monkeypatch.setattr(quick_start, "IMPORTED_BY_THE_JOB",
                        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import slow_package")
    imports = quick_start.import_seconds(tmp_path)
    assert imports["slowest_seconds"]["slow_package"] >= 0.3
    assert next(iter(imports["slowest_seconds"])) == "slow_package"
    assert not [name for name in imports["slowest_seconds"] if "." in name]
    assert imports["wall_seconds"] >= max(imports["slowest_seconds"].values())


def test_each_second_is_placed_in_one_stage(quick_start):
    # the job's lines as a run stamps them: its first at 0.3 s, the path line once the imports are done, the
    # Trainer's runtime logged at 40 s, the process ending at 42 s
    lines = [[0.3, "pretraining 300 steps on the built-in Shakespeare plays, into out (loading torch and ...)"],
             [0.6, "training a 1024-token tokenizer on the corpus"],
             [6.3, "pretraining path: eager step, 5 batch shapes (compile.mode auto: ...)"],
             [40.0, "{'train_runtime': 30.0, 'train_loss': 5.5}"], [41.5, "model and tokenizer saved to out"]]
    stages = quick_start.stages_of(lines, wall=42.0, runtime=30.0, first_steps=[3.0, 1.0])
    assert stages == {"before the first line": 0.3, "imports": 6.0, "tokenizer and data": 3.7, "first steps": 4.0,
                      "other steps": 26.0, "after training": 2.0}
    assert sum(stages.values()) == pytest.approx(42.0)
    # a job that names no path (an older one): the imports are not told apart from the rest before training
    older = quick_start.stages_of([line for line in lines if "path" not in line[1]], 42.0, 30.0, [3.0, 1.0])
    assert older["before training"] == pytest.approx(9.7) and "imports" not in older
