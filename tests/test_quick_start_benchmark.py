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
