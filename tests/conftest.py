import os
import tempfile
from pathlib import Path

import torch

# Triton's interpreter must be chosen before triton is first imported: on a machine without CUDA the
# Triton kernels run on the CPU through it, so their logic is tested in the CPU suite.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the jobs' caches (~/.cache/fat5: trained tokenizers, compiled code) in a folder of the session's, shared by its tests:
# the suite leaves the user's home alone, and a test that must see a tokenizer trained gives its job a cache of its own
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="fat5-tests-cache-")

import pytest
from helpers import ROWS, run_quick_start  # after the choice above: helpers imports fat5, which imports triton


@pytest.fixture(scope="session")
def quick_start_run(tmp_path_factory):
    """The README's quick-start job (the built-in default pretraining), run once for the tests of the job and of the
    README: a folder laid out as the repository root where it ran, and that run. Its tests only read the model."""
    folder = tmp_path_factory.mktemp("reader")
    return folder, run_quick_start(folder)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and far faster when other processes share the cores (a module opts in
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
