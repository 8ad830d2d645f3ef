"""The weight dtypes FAT5 takes, under the names people write them: ``bf16`` / ``bfloat16``, ``fp16`` / ``float16``,
``fp32`` / ``float32``. One parser for every place a dtype is given (CLI flags, YAML fields, Python arguments), so
that a name accepted by one is accepted by all.
"""

from .errors import FAT5Error

# every accepted spelling -> the torch attribute it names
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
DTYPE_CHOICES = "bf16, fp16, fp32 (or bfloat16, float16, float32)"


def canonical_dtype(name, *, what: str = "dtype", allow_auto: bool = False) -> str:
    """The torch name (``"bfloat16"``, ``"float16"``, ``"float32"``) of ``name``; ``"auto"`` when ``allow_auto`` and
    asked for. A ``torch.dtype`` is accepted too. Raises :class:`FAT5Error` naming ``what`` for anything else."""
    if allow_auto and name == "auto":
        return "auto"
    if type(name).__name__ == "dtype" and type(name).__module__ == "torch":
        name = str(name).removeprefix("torch.")
    if isinstance(name, str) and name.strip().lower() in DTYPE_NAMES:
        return DTYPE_NAMES[name.strip().lower()]
    choices = DTYPE_CHOICES + (" or auto" if allow_auto else "")
    raise FAT5Error(f"{what} must be one of {choices}, got {name!r}")


def torch_dtype(name, *, what: str = "dtype"):
    """The ``torch.dtype`` that ``name`` (any accepted spelling, or a ``torch.dtype``) names."""
    import torch

    return getattr(torch, canonical_dtype(name, what=what))


def dtype_argument(value: str) -> str:
    """``argparse`` type for a ``--dtype`` flag: the canonical name, or argparse's one-line usage error."""
    import argparse

    try:
        return canonical_dtype(value)
    except FAT5Error as error:
        raise argparse.ArgumentTypeError(str(error)) from None
