import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

# Triton's interpreter must be chosen before triton is first imported: on a machine without CUDA the
# Triton kernels run on the CPU through it, so their logic is tested in the CPU suite.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests' models are tiny: their products run fastest on one thread, and far faster when other processes share the
# cores (a product split over two threads waits for a core another process holds: test_modeling's five static-cache
# tests took 99 s on two threads, 8 s on one, on a loaded 2-core machine). The processes the tests start (the `fat5`
# command, fresh interpreters) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# the jobs' caches (~/.cache/fat5: trained tokenizers, compiled code) in a folder of the session's, shared by its tests:
# the suite leaves the user's home alone, and a test that must see a tokenizer trained gives its job a cache of its own
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="fat5-tests-cache-")

import pytest
from helpers import ROWS, run_quick_start  # after the choice above: helpers imports fat5, which imports triton


@pytest.fixture(scope="session")
def quick_start_run(tmp_path_factory):
    """The README's quick-start job (the built-in default pretraining), run once for the tests of the job and of the
    README: a folder laid out as the repository root where it ran, and that run. Its tests only read the model.

    Once for the whole run, whichever pytest-xdist worker asks first (the job is the suite's longest setup, minutes on
    a CPU): the others wait for it and read its record from the folder the workers share."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent
    folder, record = shared / "reader", shared / "reader.json"
    with FileLock(shared / "reader.lock"):
        if not record.is_file():
            folder.mkdir()
            try:
                completed = run_quick_start(folder)
            except AssertionError as failure:
                # said to every test that asks, not run again into the folder it left
                record.write_text(json.dumps({"failure": str(failure)}))
                raise
            record.write_text(json.dumps({"args": completed.args, "returncode": completed.returncode,
                                          "stdout": completed.stdout, "stderr": completed.stderr}))
    saved = json.loads(record.read_text())
    if "failure" in saved:
        pytest.fail(saved["failure"])
    return folder, subprocess.CompletedProcess(**saved)


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Every test runs with OMP_NUM_THREADS threads (one unless the environment says otherwise: see above)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def restored_environment():
    """What a test sets in os.environ ends with it: benchmarks/pretrain.py --restart, run in-process, pointed the
    compile caches at its own empty folder, and every later compile of the session, in the processes the tests start
    too, began cold (test_t5_parity's two compiles: 97 s instead of 35 s)."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny FAT5 and its tokenizer, trained on the speeches (``fat5.testing.make_tiny_model``)."""
    from fat5.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", [row["document"] for row in ROWS])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            # these give the kernels CPU tensors, which only the interpreter runs; the GPU has its own gpu tests
            skip_interpreted = pytest.mark.skip(
                reason="runs the Triton kernels on CPU tensors through Triton's interpreter: set TRITON_INTERPRET=1 "
                "to run it on a machine with a GPU"
            )
            for item in items:
                if "interpreter" in item.keywords and "gpu" not in item.keywords:
                    item.add_marker(skip_interpreted)
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
