"""How a fused op picks its implementation, where its custom ops are registered, and the row layout its kernels read.

Every op takes ``backend``: ``"reference"`` (pure PyTorch, any device), ``"triton"`` (the fused kernels;
on CPU tensors only under ``TRITON_INTERPRET=1``, which is how the CPU test suite runs them) or ``"auto"``
(Triton for CUDA tensors when triton is installed, the reference otherwise).
"""

import hashlib
import os
import re
import warnings

import torch

BACKENDS = ("auto", "reference", "triton")
# tl.gather (the near-tile reduction of the T5 table gradient) first shipped in Triton 3.3 (PyTorch 2.7)
MIN_TRITON_VERSION = (3, 3)
_TRITON_NOT_INSTALLED = "the `triton` package is not installed"


def _triton_unusable_reason() -> str | None:
    try:
        import triton
    except ImportError:
        return _TRITON_NOT_INSTALLED
    version = tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2])
    if version < MIN_TRITON_VERSION:
        wanted = ".".join(map(str, MIN_TRITON_VERSION))
        return f"the kernels need triton >= {wanted} (PyTorch >= 2.7), this environment has triton {triton.__version__}"
    return None


# Why the Triton kernels cannot run here, or None when they can. Settled once at import: the ops read it inside
# torch.compile'd code, where a check that imports or parses would be traced.
TRITON_UNUSABLE_REASON = _triton_unusable_reason()
# CPU-only installs lack triton by design (it is no base dependency); only a CUDA machine loses the kernels by it
if TRITON_UNUSABLE_REASON == _TRITON_NOT_INSTALLED and torch.cuda.is_available():
    warnings.warn("FAT5's Triton kernels are off on this CUDA machine, the slower PyTorch reference ops run instead: "
                  "the `triton` package is not installed (pip install 'triton>=3.3')", stacklevel=2)
elif TRITON_UNUSABLE_REASON not in (None, _TRITON_NOT_INSTALLED):
    warnings.warn(
        f"FAT5's Triton kernels are off, its PyTorch reference ops run instead: {TRITON_UNUSABLE_REASON}", stacklevel=2
    )


def triton_available() -> bool:
    return TRITON_UNUSABLE_REASON is None


def use_triton(backend: str, tensor: torch.Tensor) -> bool:
    """Resolve ``backend`` for an op whose main input is ``tensor``; a wrong name or an impossible choice raises."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return False
    if backend == "triton":
        if not triton_available():
            raise RuntimeError(f"backend='triton' cannot run: {TRITON_UNUSABLE_REASON}")
        if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "backend='triton' got tensors on the CPU: move them to a CUDA device, set TRITON_INTERPRET=1 "
                "to run the kernels through Triton's interpreter, or use backend='reference'"
            )
        return True
    return tensor.is_cuda and triton_available()


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as (rows, last dimension) with unit stride along a row, as the row kernels read it; copied
    only when no such view exists."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def op_namespace(module_name: str) -> str:
    """The torch.library namespace for the ops defined in ``module_name``.

    The installed package registers under ``fat5``. A Hub checkout of the same files is imported again by
    transformers under ``transformers_modules.<repo>.<hash>``; registering the same op name twice fails, so each
    such copy gets a namespace of its own derived from its module name.
    """
    if module_name == "fat5" or module_name.startswith("fat5."):
        return "fat5"
    package = module_name.rpartition(".")[0]
    return "fat5_" + hashlib.sha1(package.encode()).hexdigest()[:12]
