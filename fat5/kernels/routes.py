"""Which kernel serves each attention problem: one table, each row citing the measurement that put it there.

``attention.attention`` and ``attention.attention_varlen`` describe their call as an :class:`AttentionProblem` and
ask :func:`attention_kernel` for ``"reference"`` (PyTorch), ``"triton"`` (FAT5's kernels) or ``"fa4"``
(flash-attn-4's CuTe DSL kernels, ``pip install "fat5[hopper]"``). The first enabled row of ``ATTENTION_ROUTES``
whose kernel can run and that covers the problem serves it. FA4 serves only what it computes exactly as FAT5
defines attention: no position bias (T5's cross-attention; RoPE or no-position self-attention, whose rotation
happens before the kernel) or T5's bias through FAT5's Hopper T5 kernels with the first query at position 0
(``attention_fa4_t5_kernels.py``), and masks it can express (see :data:`MASKINGS`), on whole sequences, not on a
decoding step's few queries.

``FAT5_ATTENTION_ROUTE`` in the environment (read once, at import): unset or ``auto``, the table decides;
``triton`` keeps every problem on the Triton kernels, for A/B measurements of the same model; ``fa4`` turns on the
table's FA4 rows that are written but off, for checking and measuring them on a GPU (they still serve only the
problems they cover). A row is on only once ``tests/test_attention_fa4_gpu.py`` has passed on a GPU and its benchmark
won there; each row says where its figures are.
"""

import importlib.metadata
import os
import re
from dataclasses import dataclass

import torch

from .dispatch import use_triton
from .position_bias import PositionBias

# A problem's mask, as far as the choice of kernel cares:
#   "none": every query sees every key of its row (padded rows without padding mask) or of its segment (packed)
#   "causal_aligned": causal, with FAT5's query positions (query_offset + i) on FA4's bottom-right diagonal, which
#       lets query i see keys j <= i + key_length - query_length: query_offset == key_length - query_length (an int)
#       for padded rows, the same cu_seqlens tensor for queries and keys and query_offset 0 for packed rows
#   "causal_offset": any other causal problem (a query offset on the device with a static cache, unequal segments)
#   "key_padding": padded rows with a key padding mask
MASKINGS = ("none", "causal_aligned", "causal_offset", "key_padding")
POSITIONS = PositionBias.KINDS
ROUTE_ENVIRONMENT_VARIABLE = "FAT5_ATTENTION_ROUTE"
FORCED_KERNELS = ("triton", "fa4")
FA4_SERIES = (4, 0)  # pyproject.toml's hopper extra pins the same


@dataclass(frozen=True)
class AttentionProblem:
    """What decides the kernel of one attention call. ``capability`` is the CUDA device's (major, minor), None for
    CPU tensors; ``position`` a ``PositionBias.kind``; ``masking`` one of :data:`MASKINGS`; ``queries`` the query
    length of a row (padded) or its bound, ``max_seqlen_q`` (packed); ``keys`` the same for the keys;
    ``offset_zero`` whether the first query sits at position 0 (``query_offset == 0``)."""

    capability: tuple[int, int] | None
    dtype: torch.dtype
    head_dim: int
    position: str
    masking: str
    packed: bool
    dropout: bool
    queries: int
    keys: int = 0
    offset_zero: bool = True

    def __post_init__(self):
        if self.position not in POSITIONS:
            raise ValueError(f"position must be one of {POSITIONS}, got {self.position!r}")
        if self.masking not in MASKINGS:
            raise ValueError(f"masking must be one of {MASKINGS}, got {self.masking!r}")
        if self.packed and self.masking == "key_padding":
            raise ValueError("packed rows carry their padding in cu_seqlens, not in a key padding mask")


@dataclass(frozen=True)
class AttentionRoute:
    """One row of the table: ``kernel`` serves every problem within its sets (None: any value). ``enabled`` False
    keeps a row written but unused until it is measured; ``measurement`` says where its figures are;
    ``min_queries`` / ``min_keys`` leave shorter query blocks (a decoding step's) / key sequences to the next row;
    ``offset_zero`` serves only problems whose first query sits at position 0."""

    kernel: str
    measurement: str
    capabilities: frozenset | None = None
    dtypes: frozenset | None = None
    head_dims: frozenset | None = None
    positions: frozenset | None = None
    maskings: frozenset | None = None
    packed: frozenset | None = None
    dropout: bool = False
    min_queries: int = 0
    min_keys: int = 0
    offset_zero: bool = False
    enabled: bool = True

    def covers(self, problem: AttentionProblem) -> bool:
        wanted = (
            (self.capabilities, problem.capability), (self.dtypes, problem.dtype), (self.head_dims, problem.head_dim),
            (self.positions, problem.position), (self.maskings, problem.masking), (self.packed, problem.packed),
        )
        return all(values is None or value in values for values, value in wanted) and (
            self.dropout or not problem.dropout
        ) and problem.queries >= self.min_queries and problem.keys >= self.min_keys and (
            problem.offset_zero or not self.offset_zero
        )


_FA4_PROBLEMS = {
    "capabilities": frozenset({(9, 0)}),
    "dtypes": frozenset({torch.bfloat16, torch.float16}),
    # a decoding step (one query, or a few) keeps Triton's decode kernel, measured at 73-98% of the copy bandwidth
    # (benchmarks/README.md); FA4 was measured on whole sequences, and 128 queries are one of its forward tiles
    "min_queries": 128,
}
_BIAS_FREE = {**_FA4_PROBLEMS, "positions": frozenset({"none"}), "maskings": frozenset({"none", "causal_aligned"})}
_FA4_BIAS_FREE = (
    "H200, 2026-11-29 (issue 48; flash-attn-4 4.0.0b36): FAT5_ATTENTION_ROUTE=fa4 tests/test_attention_fa4_gpu.py "
    "passed; benchmarks/attention.py --tables cross_d64 none_d64 cross_d128, forward+backward against SDPA's cuDNN "
    "kernel without bias: "
)
# T5's bias in FAT5's Hopper T5 kernels (attention_fa4_t5_kernels.py), from the first query at position 0
_T5 = {**_FA4_PROBLEMS, "positions": frozenset({"t5"}), "offset_zero": True}
_ENCODER, _DECODER = frozenset({"none"}), frozenset({"causal_aligned"})
_FA4_T5 = (
    "H200, 2026-11-29: FAT5's Hopper T5 kernels, benchmarks/results/attention_hopper_t5.json (benchmarks/attention.py "
    "--tables t5_hopper_d64 t5_hopper_d128), forward+backward with the table trained against FAT5's Triton kernel: "
)
ATTENTION_ROUTES = (
    AttentionRoute(
        "fa4", head_dims=frozenset({64}), **_BIAS_FREE,
        measurement=_FA4_BIAS_FREE + "self-attention 1.08-1.17x at L 1024-16384 (1.37-1.56x FAT5's Triton kernel), "
        "causal 1.14-1.19x from 2048; cross-attention (L/4 queries) replayed from CUDA graphs 1.06-1.18x (1.14-1.57x "
        "Triton) at every length. At L 512 eager FA4 trails (0.72x cuDNN, 0.84x Triton) but leads replayed from "
        "graphs (1.09x, 1.28x Triton), as compiled training steps run; the base pretraining job with cross-attention "
        "on FA4: 396,642 real tokens/s against 390,390",
    ),
    AttentionRoute(
        "fa4", head_dims=frozenset({128}), min_keys=2048, **_BIAS_FREE,
        measurement=_FA4_BIAS_FREE + "cross-attention at head dim 128 1.02-1.10x from L 2048; shorter keys stay on "
        "Triton (not shown ahead there)",
    ),
    AttentionRoute(
        "fa4", head_dims=frozenset({64}), maskings=_ENCODER, min_keys=1024, **_T5,
        measurement=_FA4_T5 + "the encoder at head dim 64 1.12 / 1.30 / 1.32 / 1.36 / 1.39x at L 1024-16384 "
        "(0.84-0.98x cuDNN without bias from 4096); at 512 0.79x eager (1.16x replayed from CUDA graphs): Triton "
        "keeps it",
    ),
    AttentionRoute(
        "fa4", head_dims=frozenset({64}), maskings=_DECODER, min_keys=4096, **_T5,
        measurement=_FA4_T5 + "the causal decoder at head dim 64 1.26 / 1.33 / 1.37x at L 4096-16384; at 512 / 1024 "
        "/ 2048 0.45 / 0.57 / 0.99x eager (0.98 / 1.04 / 1.17x replayed from CUDA graphs): Triton keeps them",
    ),
    AttentionRoute(
        "fa4", head_dims=frozenset({128}), maskings=_ENCODER, **_T5,
        measurement=_FA4_T5 + "the encoder at head dim 128 1.23-1.37x at every L 512-16384",
    ),
    AttentionRoute(
        "fa4", head_dims=frozenset({128}), maskings=_DECODER, min_keys=1024, **_T5,
        measurement=_FA4_T5 + "the causal decoder at head dim 128 1.24-1.42x at L 1024-16384; at 512 0.97x eager "
        "(1.19x from graphs): Triton keeps it",
    ),
    AttentionRoute(
        "triton", dropout=True,
        measurement="benchmarks/README.md, Attention: every problem FAT5 defines, the T5 bias at 0.45-0.71x cuDNN "
        "without bias (attention.json, H100); dropout raises there, as it always did (backend='reference' trains "
        "with it)",
    ),
)


def fa4_unusable_reason(version=importlib.metadata.version) -> str | None:
    """Why the FA4 route cannot serve here, or None. The installed distribution is asked, not the module: flash-attn
    2 installs a ``flash_attn`` package too. Only the 4.0 series: the adapter calls its backward function, which is
    not public."""
    try:
        installed = version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return "flash-attn-4 is not installed (pip install 'fat5[hopper]')"
    if tuple(int(part) for part in re.findall(r"\d+", installed)[:2]) != FA4_SERIES:
        series = ".".join(map(str, FA4_SERIES))
        return f"flash-attn-4 {installed} is installed; FAT5's adapter is written against its {series} releases"
    return None


def forced_kernel_from(environment) -> str | None:
    """What ``FAT5_ATTENTION_ROUTE`` asks (one of ``FORCED_KERNELS``), None when unset or ``auto``; another name
    raises."""
    value = environment.get(ROUTE_ENVIRONMENT_VARIABLE, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in FORCED_KERNELS:
        raise ValueError(f"{ROUTE_ENVIRONMENT_VARIABLE} must be 'auto', 'triton' or 'fa4' (or unset), got {value!r}")
    return value


# Settled once at import, as dispatch's TRITON_UNUSABLE_REASON: the choice runs inside torch.compile'd code. Only the
# package's metadata is read (importing the CuTe DSL takes seconds); the adapter imports it on the first FA4 call.
FA4_UNUSABLE_REASON = fa4_unusable_reason()
FORCED_KERNEL = forced_kernel_from(os.environ)


def kernel_available(kernel: str) -> bool:
    return kernel == "triton" or (kernel == "fa4" and FA4_UNUSABLE_REASON is None)


def route_on(route: AttentionRoute, forced: str | None) -> bool:
    """Whether a row takes part: enabled, or its kernel's rows turned on by ``FAT5_ATTENTION_ROUTE``."""
    return route.enabled or route.kernel == forced


# whether a row beside Triton's could serve here (on, and its kernel installed)
TABLE_DECIDES = FORCED_KERNEL != "triton" and any(
    route_on(route, FORCED_KERNEL) and kernel_available(route.kernel)
    for route in ATTENTION_ROUTES if route.kernel != "triton"
)


def attention_kernel(backend: str, tensor: torch.Tensor, describe) -> str:
    """``"reference"``, ``"triton"`` or ``"fa4"`` for the problem ``describe()`` returns, whose main input is
    ``tensor``.

    ``backend`` as in ``dispatch.use_triton``: ``"reference"`` and ``"triton"`` are obeyed (an impossible choice
    raises there), ``"auto"`` takes the reference where Triton cannot run (CPU, no triton) and the table otherwise.
    The problem is described only where the table has a choice (``TABLE_DECIDES``): an eager step's host time is
    what a small model waits on, and without flash-attn-4 every call goes to Triton anyway.
    """
    if not use_triton(backend, tensor):
        return "reference"
    if backend == "triton" or not TABLE_DECIDES:
        return "triton"
    return table_kernel(describe())


def table_kernel(problem: AttentionProblem, *, forced: str | None = FORCED_KERNEL, available=kernel_available) -> str:
    """The kernel of the first enabled row that covers ``problem`` and whose kernel is ``available``; Triton for
    everything when ``forced`` is ``"triton"``, the FA4 rows on when it is ``"fa4"`` (``FAT5_ATTENTION_ROUTE``)."""
    if forced == "triton":
        return "triton"
    for route in ATTENTION_ROUTES:
        if route_on(route, forced) and available(route.kernel) and route.covers(problem):
            return route.kernel
    raise LookupError(f"no route of ATTENTION_ROUTES covers {problem}: its last row must cover every problem")


def _capability(tensor: torch.Tensor) -> tuple[int, int] | None:
    if not tensor.is_cuda:
        return None
    # get_device_properties, not get_device_capability: torch.compile folds it into a constant (no graph break)
    properties = torch.cuda.get_device_properties(tensor.device)
    return properties.major, properties.minor


def _is_zero(query_offset) -> bool:
    """A query offset known to be 0 without reading the device (a tensor offset is a decoding step's)."""
    return not isinstance(query_offset, torch.Tensor) and query_offset == 0


def padded_problem(query, key, position_kind, causal, key_padding_mask, query_offset, dropout_p) -> AttentionProblem:
    """The problem of ``attention``: (batch, heads, length, head_dim) tensors."""
    if key_padding_mask is not None:
        masking = "key_padding"
    elif not causal:
        masking = "none"
    else:
        aligned = not isinstance(query_offset, torch.Tensor) and query_offset == key.shape[2] - query.shape[2]
        masking = "causal_aligned" if aligned else "causal_offset"
    return AttentionProblem(_capability(query), query.dtype, query.shape[-1], position_kind, masking, False,
                            dropout_p > 0.0, query.shape[2], key.shape[2], _is_zero(query_offset))


def packed_problem(query, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, position_kind, causal,
                   query_offset, dropout_p) -> AttentionProblem:
    """The problem of ``attention_varlen``: (tokens, heads, head_dim) tensors. A causal problem is aligned only
    when queries and keys share one cu_seqlens tensor (every segment then as long in both, known without reading
    the device) and the offset is 0."""
    if not causal:
        masking = "none"
    else:
        aligned = cu_seqlens_q is cu_seqlens_k and _is_zero(query_offset)
        masking = "causal_aligned" if aligned else "causal_offset"
    return AttentionProblem(_capability(query), query.dtype, query.shape[-1], position_kind, masking, True,
                            dropout_p > 0.0, max_seqlen_q, max_seqlen_k, _is_zero(query_offset))
