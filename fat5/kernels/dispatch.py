"""How a fused op picks its implementation, and where its custom ops are registered.

Every op takes ``backend``: ``"reference"`` (pure PyTorch, any device), ``"triton"`` (the fused kernels;
on CPU tensors only under ``TRITON_INTERPRET=1``, which is how the CPU test suite runs them) or ``"auto"``
(Triton for CUDA tensors when triton is installed, the reference otherwise).
"""

import hashlib
import os

import torch

BACKENDS = ("auto", "reference", "triton")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(backend: str, tensor: torch.Tensor) -> bool:
    """Resolve ``backend`` for an op whose main input is ``tensor``; a wrong name or an impossible choice raises."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return False
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' needs the `triton` package, which is not installed")
        if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "backend='triton' got tensors on the CPU: move them to a CUDA device, set TRITON_INTERPRET=1 "
                "to run the kernels through Triton's interpreter, or use backend='reference'"
            )
        return True
    return tensor.is_cuda and triton_available()


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
