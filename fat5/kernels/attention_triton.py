"""Triton attention: launch configurations, launchers, and the torch.library custom ops with their autograd.

``flash_attention`` and ``flash_attention_varlen`` have the signatures (and the semantics) of ``attention.attention``
and ``attention.attention_varlen``; those dispatch here for ``backend="triton"`` (or ``"auto"`` on CUDA). The kernels
live in ``attention_triton_kernels.py``; its docstring describes how the T5 bias is computed in the kernel.

Both entry points go through two custom ops (``attention_forward`` and ``attention_backward``, with fake
implementations), so ``torch.compile(fullgraph=True)`` traces through attention without a graph break. A custom op
takes only tensors and plain values: ``_CallOptions`` is where a call's ``PositionBias`` and other settings are
flattened into them, and rebuilt.
"""

import functools
import math
from dataclasses import dataclass, fields

import torch

from .dispatch import op_namespace
from .launch import cdiv, device_guard, multiprocessors, next_power_of_2
from .position_bias import NO_POSITION_BIAS, PositionBias

try:
    import triton

    from .attention_triton_kernels import (
        _attention_backward_dkdv_kernel,
        _attention_backward_dq_kernel,
        _attention_forward_kernel,
        _backward_preprocess_kernel,
        _split_combine_kernel,
        _t5_band_distance_grad_kernel,
        _t5_bias_bank_kernel,
        _t5_bias_by_distance_kernel,
        _t5_table_gradient_kernel,
    )
except ImportError:  # CPU-only installs: attention.py only calls in here when triton is importable
    triton = None

_NAMESPACE = op_namespace(__name__)
_POSITION_CODES = {"none": 0, "t5": 1, "alibi": 2, "bias": 3}
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_MAX_T5_DISTANCE = 2048  # the table-gradient kernel holds a head's 2 * max_distance + 3 sums in one program


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch parameters of one kernel. ``block_m`` tiles queries, ``block_n`` keys;
    ``max_registers`` caps the registers per thread (Triton's ``maxnreg``) so that more programs share an SM."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    max_registers: int | None = None


# Per architecture and padded head dim. Hopper entries were chosen by the sweep in benchmarks/attention.py
# (--sweep) on an H100; the Ampere ones follow the shapes FlashAttention-2 uses there and are untested.
_CONFIGS = {
    "sm90": {
        # 128 registers: four programs per SM instead of two; the near tiles' gather spills a few (8) registers
        "forward": {16: LaunchConfig(64, 64, 4, 3, 128), 32: LaunchConfig(64, 64, 4, 3, 128),
                    64: LaunchConfig(64, 64, 4, 3, 128), 128: LaunchConfig(64, 64, 4, 2),
                    256: LaunchConfig(64, 32, 4, 2)},
        "decode": {16: LaunchConfig(16, 64, 4, 4), 32: LaunchConfig(16, 64, 4, 4), 64: LaunchConfig(16, 64, 4, 4),
                   128: LaunchConfig(16, 64, 4, 4), 256: LaunchConfig(16, 32, 4, 3)},
        "dkdv": {16: LaunchConfig(64, 64, 4, 3), 32: LaunchConfig(64, 64, 4, 3), 64: LaunchConfig(64, 64, 4, 3),
                 128: LaunchConfig(64, 128, 8, 2), 256: LaunchConfig(32, 64, 4, 2)},
        "dq": {16: LaunchConfig(64, 64, 4, 3), 32: LaunchConfig(64, 64, 4, 3), 64: LaunchConfig(64, 64, 4, 3),
               128: LaunchConfig(128, 64, 8, 3), 256: LaunchConfig(64, 32, 4, 2)},
    },
    "sm80": {
        "forward": {16: LaunchConfig(128, 64, 4, 3), 32: LaunchConfig(128, 64, 4, 3), 64: LaunchConfig(128, 64, 4, 3),
                    128: LaunchConfig(128, 32, 8, 2), 256: LaunchConfig(64, 32, 4, 1)},
        "decode": {16: LaunchConfig(16, 128, 4, 3), 32: LaunchConfig(16, 128, 4, 3), 64: LaunchConfig(16, 128, 4, 3),
                   128: LaunchConfig(16, 64, 4, 3), 256: LaunchConfig(16, 32, 4, 2)},
        "dkdv": {16: LaunchConfig(32, 64, 4, 2), 32: LaunchConfig(32, 64, 4, 2), 64: LaunchConfig(64, 128, 8, 2),
                 128: LaunchConfig(64, 64, 8, 2), 256: LaunchConfig(16, 32, 4, 1)},
        "dq": {16: LaunchConfig(64, 64, 4, 2), 32: LaunchConfig(64, 64, 4, 2), 64: LaunchConfig(128, 64, 8, 2),
               128: LaunchConfig(128, 32, 8, 2), 256: LaunchConfig(32, 32, 4, 1)},
    },
}
# fp32 inputs use exact ("ieee") dot products: small tiles keep them in registers and shared memory
_FP32_CONFIG = LaunchConfig(32, 32, 4, 2)
_FP32_DECODE_CONFIG = LaunchConfig(16, 32, 4, 2)
# under TRITON_INTERPRET=1 small tiles keep the tests' tiny shapes multi-block (and the interpreter fast)
_INTERPRETER_CONFIG = LaunchConfig(16, 16, 1, 1)

# Tuning hook for benchmarks/attention.py: {"forward" | "decode" | "dkdv" | "dq": LaunchConfig} wins over the tables.
CONFIG_OVERRIDES: dict = {}
# The dk/dv kernel's unmasked near T5 tiles read their bias whole from a per-head bank of tiles (``_t5_bias_bank``)
# instead of gathering it per score where ``_dkdv_uses_t5_bias_bank`` allows; False gathers everywhere (the tests
# compare both paths, which give bitwise the same results).
T5_BIAS_BANK = True
# dq by fp32 atomics from the dk/dv kernel up to this head dim; above it (and under deterministic algorithms) dq has its
# own kernel: at head_dim 128 the extra product and accumulator in the dk/dv kernel cost more than the separate pass
# (H100, benchmarks/results/archive/attention_sweep.json).
_FUSED_DQ_MAX_HEAD_DIM = 64


def _padded_head_dim(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def _config(kind: str, device: torch.device, head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    if kind in CONFIG_OVERRIDES:
        return CONFIG_OVERRIDES[kind]
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    if dtype == torch.float32:
        return _FP32_DECODE_CONFIG if kind == "decode" else _FP32_CONFIG
    return _CONFIGS[_architecture(device.index)][kind][head_dim]


@functools.cache
def _architecture(device_index) -> str:
    major, _ = torch.cuda.get_device_capability(device_index)
    return "sm90" if major >= 9 else "sm80"


def _multiprocessors(device: torch.device) -> int:
    return multiprocessors(device, interpreter_count=4)


def _launch_kwargs(config: LaunchConfig, device: torch.device) -> dict:
    kwargs = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if config.max_registers is not None:
        kwargs["maxnreg"] = config.max_registers
    return kwargs


def _input_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


# ----------------------------------------------------------------------------------------------------------------
# T5 buckets and the per-head bias by relative position


def _check_t5_buckets(bidirectional: bool, num_buckets: int, max_distance: int) -> tuple[int, int]:
    """(buckets per direction, exact buckets), or a ValueError for parameters T5's bucket function cannot use."""
    half_buckets = num_buckets // 2 if bidirectional else num_buckets
    max_exact = half_buckets // 2
    if max_exact < 1 or max_distance <= max_exact:
        raise ValueError(
            f"T5 buckets need num_buckets >= {4 if bidirectional else 2} and max_distance > the exact range "
            f"({max_exact}); got num_buckets={num_buckets}, max_distance={max_distance}"
        )
    return half_buckets, max_exact


@functools.cache
def _t5_bucket_constants(bidirectional: bool, num_buckets: int, max_distance: int) -> dict:
    half_buckets, max_exact = _check_t5_buckets(bidirectional, num_buckets, max_distance)
    divisor = torch.tensor(math.log(max_distance / max_exact), dtype=torch.float32)
    one = torch.tensor(1.0, dtype=torch.float32)
    return {
        "inverse_max_exact": (one / torch.tensor(float(max_exact), dtype=torch.float32)).item(),
        "log_ratio_divisor": divisor.item(),
        "inverse_log_ratio": (one / divisor).item(),
        "BIDIRECTIONAL": bidirectional,
        "HALF_BUCKETS": half_buckets,
        "MAX_EXACT": max_exact,
    }


def t5_relative_buckets(
    first_relative_position: int,
    count: int,
    bidirectional: bool,
    num_buckets: int,
    max_distance: int,
    device: torch.device,
    table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The in-kernel T5 buckets of relative positions ``first, first + 1, ..., first + count - 1`` (int32), and,
    given the (num_buckets, heads) ``table``, the (heads, count) fp32 bias times log2(e) at those positions."""
    device = torch.device(device)
    buckets = torch.empty(count, dtype=torch.int32, device=device)
    num_heads = 1 if table is None else table.shape[1]
    bias = None if table is None else torch.empty(num_heads, count, dtype=torch.float32, device=device)
    block = min(1024, next_power_of_2(max(count, 16)))
    with device_guard(device):
        _t5_bias_by_distance_kernel[(cdiv(count, block), num_heads)](
            buckets if table is None else table,
            buckets if bias is None else bias,
            buckets,
            0 if table is None else table.stride(0),
            0 if table is None else table.stride(1),
            first_relative_position,
            count,
            RECIPROCAL=device.type == "cuda",
            WRITE_BIAS=table is not None,
            BLOCK=block,
            **_t5_bucket_constants(bool(bidirectional), int(num_buckets), int(max_distance)),
        )
    return buckets, bias


def _t5_bias_by_distance(table, bidirectional, num_buckets, max_distance):
    return t5_relative_buckets(
        -(max_distance + 1), 2 * max_distance + 3, bidirectional, num_buckets, max_distance, table.device, table
    )


# ----------------------------------------------------------------------------------------------------------------
# Launchers


@dataclass
class _Problem:
    """Shapes and strides shared by the launches of one attention call (dense or varlen)."""

    batch: int  # batch size, or number of segments
    num_heads: int
    head_dim: int
    seqlen_q: int  # Lq, or max_seqlen_q
    seqlen_k: int
    is_varlen: bool

    @staticmethod
    def of(query, key, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
        if cu_seqlens_q is None:
            batch, num_heads, seqlen_q, head_dim = query.shape
            return _Problem(batch, num_heads, head_dim, seqlen_q, key.shape[2], False)
        return _Problem(cu_seqlens_q.shape[0] - 1, query.shape[1], query.shape[2], max_seqlen_q, max_seqlen_k, True)


def _t5_bank_tiles(rows: int, columns: int, max_distance: int) -> tuple[int, int]:
    """(tiles left of the diagonal, all tiles) of a head's T5 bias bank of (rows, columns) tiles.

    The dk/dv kernel's near loop (``_query_ranges``; its rows are keys) visits the query blocks that end after rel
    -(D+1) and start before rel rows + D from its key block's start. With query offset 0 and ``rows`` a multiple of
    ``columns``, each starts ``t`` whole query blocks after the key block's start, fixed-length or varlen alike
    (tiles start at segment starts): t from -ceil(D / columns) to ceil((rows + D) / columns) - 1.
    """
    left_tiles = cdiv(max_distance, columns)
    return left_tiles, left_tiles + cdiv(rows + max_distance, columns)


def _t5_bias_bank(bias_rows: torch.Tensor, rows: int, columns: int, max_distance: int) -> tuple[torch.Tensor, int]:
    """(heads, tiles, rows, columns) fp32 bank of the dk/dv kernel's near (keys, queries) tiles' bias
    (``_t5_bias_bank_kernel``), made on the device from the rows, and its tiles left of the diagonal.
    4 * tiles * rows * columns bytes a head: 80 KiB at 64 x 64 tiles and D 128 (5 tiles)."""
    left_tiles, num_tiles = _t5_bank_tiles(rows, columns, max_distance)
    num_heads = bias_rows.shape[0]
    bank = torch.empty(num_heads, num_tiles, rows, columns, dtype=torch.float32, device=bias_rows.device)
    _t5_bias_bank_kernel[(num_tiles, num_heads)](
        bias_rows, bank, bias_rows.stride(0),
        MAX_DISTANCE=max_distance, LEFT_TILES=left_tiles, ROWS=rows, COLUMNS=columns,
    )
    return bank, left_tiles


def _dkdv_uses_t5_bias_bank(position: PositionBias, options, table_grad: bool, config: LaunchConfig) -> bool:
    """Whether the dk/dv kernel's unmasked near tiles read a bias bank instead of gathering: a T5 bias in a
    non-causal call whose table takes no gradient (LoRA finetuning, a frozen table), query offset 0 (training,
    prefill: the diagonal offsets are then whole query blocks, the same for every key block) and key tiles a whole
    number of query tiles. Measured on an H100 (benchmarks/README.md, Attention: the bias bank), forward+backward at
    L 512 / 1024 / 2048: 1.21 / 1.16 / 1.09x the gather there; where the table is trained (the near tiles also sum
    the table gradient along their diagonals) or causal, and in the forward, the bank was slower or equal."""
    return (T5_BIAS_BANK and position.kind == "t5" and not options.causal and not table_grad
            and options.query_offset == 0 and config.block_n % config.block_m == 0)


def _token_strides(tensor: torch.Tensor, problem: _Problem) -> tuple[int, int, int]:
    """(batch, head, token) strides; varlen tensors have no batch stride (segments start at cu_seqlens)."""
    if problem.is_varlen:
        return 0, tensor.stride(1), tensor.stride(0)
    return tensor.stride(0), tensor.stride(1), tensor.stride(2)


def _row_stats_strides(stats: torch.Tensor, problem: _Problem) -> tuple[int, int]:
    """lse and delta are (batch, heads, Lq) for dense and (heads, total_q) for varlen inputs."""
    if problem.is_varlen:
        return 0, stats.stride(0)
    return stats.stride(0), stats.stride(1)


@dataclass(frozen=True)
class _CallOptions:
    """The plain values of one attention call, in the order the custom ops take them after their tensors."""

    max_seqlen_q: int
    max_seqlen_k: int
    scale: float
    causal: bool
    query_offset: int
    position_kind: str
    bidirectional: bool
    num_buckets: int
    max_distance: int

    @staticmethod
    def of(position_bias: PositionBias, max_seqlen_q, max_seqlen_k, scale, causal, query_offset) -> "_CallOptions":
        return _CallOptions(int(max_seqlen_q), int(max_seqlen_k), float(scale), bool(causal), int(query_offset),
                            position_bias.kind, bool(position_bias.bidirectional), int(position_bias.num_buckets),
                            int(position_bias.max_distance))

    def flat(self) -> tuple:
        return tuple(getattr(self, field.name) for field in fields(self))

    def position_bias(self, tensor: torch.Tensor | None) -> PositionBias:
        return PositionBias(self.position_kind, tensor, self.bidirectional, self.num_buckets, self.max_distance)

    @property
    def differentiable_position(self) -> bool:
        """Whether the position tensor can receive a gradient (the T5 table, an explicit bias; ALiBi's slopes not)."""
        return self.position_kind in ("t5", "bias")


def _position_arguments(position: PositionBias, problem, t5_bias_rows=None):
    """(bias pointer, its four strides, MAX_DISTANCE, T5 bucket of each relative position) for the kernels; T5
    gets its bias-by-distance rows (``t5_bias_rows`` when given: no buckets then, the forward needs none)."""
    if position.kind == "t5" and t5_bias_rows is not None:
        return t5_bias_rows, (0, t5_bias_rows.stride(0), 0, 0), position.max_distance, None
    if position.kind == "t5":
        buckets, bias_by_distance = _t5_bias_by_distance(
            position.tensor, position.bidirectional, position.num_buckets, position.max_distance
        )
        return bias_by_distance, (0, bias_by_distance.stride(0), 0, 0), position.max_distance, buckets
    if position.kind == "alibi":
        return position.tensor, (0, 0, 0, 0), 0, None
    if position.kind == "bias":
        bias = _expand_bias(position.tensor, problem)
        # varlen segments share one bias: the segment index must not move the pointer
        batch_stride = 0 if problem.is_varlen else bias.stride(0)
        return bias, (batch_stride, *bias.stride()[1:]), 0, None
    return None, (0, 0, 0, 0), 0, None


def _expand_bias(attn_bias: torch.Tensor, problem: _Problem) -> torch.Tensor:
    if problem.is_varlen:
        return attn_bias.expand(1, problem.num_heads, problem.seqlen_q, problem.seqlen_k)
    return attn_bias.expand(problem.batch, problem.num_heads, problem.seqlen_q, problem.seqlen_k)


def _forward(
    query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k, options: _CallOptions,
    query_offset_tensor=None, t5_bias_rows=None,
):
    """``query_offset_tensor``, when given, replaces ``options.query_offset``: the kernel reads the offset from it.
    ``t5_bias_rows``: the T5 bias by relative position made beforehand (:func:`t5_bias_rows`)."""
    problem = _Problem.of(query, key, cu_seqlens_q, options.max_seqlen_q, options.max_seqlen_k)
    position = options.position_bias(position_tensor)
    device = query.device
    out = torch.empty_like(query)
    if problem.is_varlen:
        lse = torch.empty(problem.num_heads, query.shape[0], dtype=torch.float32, device=device)
    else:
        lse = torch.empty(problem.batch, problem.num_heads, problem.seqlen_q, dtype=torch.float32, device=device)
    if out.numel() == 0:
        lse.fill_(float("inf"))
        return out, lse
    decoding = problem.seqlen_q <= 16
    config = _config("decode" if decoding else "forward", device, problem.head_dim, query.dtype)
    num_m_blocks = cdiv(problem.seqlen_q, config.block_m)
    num_n_blocks = cdiv(max(problem.seqlen_k, 1), config.block_n)
    programs = num_m_blocks * problem.batch * problem.num_heads
    num_splits = 1
    if num_m_blocks == 1 and programs < _multiprocessors(device):
        # flash-decoding: few queries against a long cache would leave most of the GPU idle; split the keys
        num_splits = max(1, min(3 * _multiprocessors(device) // programs, num_n_blocks // 2))
    blocks_per_split = cdiv(num_n_blocks, num_splits)
    num_splits = cdiv(num_n_blocks, blocks_per_split)
    is_split = num_splits > 1

    with device_guard(device):
        bias, bias_strides, max_distance_arg, _ = _position_arguments(position, problem, t5_bias_rows)
        padding = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else None
        if is_split:
            partial_shape = (num_splits, problem.batch * problem.num_heads, config.block_m)
            partial_acc = torch.empty(*partial_shape, problem.head_dim, dtype=torch.float32, device=device)
            partial_max = torch.empty(partial_shape, dtype=torch.float32, device=device)
            partial_sum = torch.empty(partial_shape, dtype=torch.float32, device=device)
        else:
            partial_acc = partial_max = partial_sum = lse
        dummy = lse
        grid = (num_m_blocks, problem.batch * problem.num_heads, num_splits)
        _attention_forward_kernel[grid](
            query, key, value, out, lse, partial_acc, partial_max, partial_sum,
            dummy if padding is None else padding, dummy if bias is None else bias,
            dummy if cu_seqlens_q is None else cu_seqlens_q, dummy if cu_seqlens_k is None else cu_seqlens_k,
            dummy if query_offset_tensor is None else query_offset_tensor,
            *_token_strides(query, problem), *_token_strides(key, problem), *_token_strides(value, problem),
            *_token_strides(out, problem), *_row_stats_strides(lse, problem),
            0 if padding is None else padding.stride(0),
            *bias_strides,
            problem.num_heads, problem.seqlen_q, problem.seqlen_k, options.query_offset,
            options.scale * 1.4426950408889634, blocks_per_split,
            HEAD_DIM=problem.head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            POSITION=_POSITION_CODES[position.kind], MAX_DISTANCE=max_distance_arg, CAUSAL=options.causal,
            HAS_PADDING=padding is not None, IS_VARLEN=problem.is_varlen, IS_SPLIT=is_split,
            SAFE_CLEAN=padding is not None or position.kind == "bias",
            OFFSET_IN_MEMORY=query_offset_tensor is not None,
            INPUT_PRECISION=_input_precision(query.dtype), **_launch_kwargs(config, device),
        )
        if is_split:
            _split_combine_kernel[(problem.batch * problem.num_heads,)](
                partial_acc, partial_max, partial_sum, out, lse,
                dummy if cu_seqlens_q is None else cu_seqlens_q,
                *_token_strides(out, problem), *_row_stats_strides(lse, problem),
                problem.num_heads, problem.seqlen_q, num_splits,
                HEAD_DIM=problem.head_dim, BLOCK_M=config.block_m, IS_VARLEN=problem.is_varlen, num_warps=4,
            )
    return out, lse


def _t5_table_gradient(distance_grad: torch.Tensor, buckets: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The (num_buckets, heads) table gradient from the dk/dv kernel's partial sums per relative
    position, ``distance_grad`` being (..., heads, positions): one reduction over the partials (the whole GPU, a
    fixed order), then one program per head sums each bucket's positions."""
    num_heads, num_positions = distance_grad.shape[-2:]
    grad_by_distance = distance_grad.view(-1, num_heads, num_positions).sum(dim=0)
    table_grad = torch.empty(table.shape, dtype=table.dtype, device=table.device)
    with device_guard(table.device):
        _t5_table_gradient_kernel[(num_heads,)](
            grad_by_distance, buckets, table_grad, table_grad.stride(0), table_grad.stride(1),
            num_positions, table.shape[0], BLOCK=next_power_of_2(num_positions),
        )
    return table_grad


def t5_table_gradient_by_distance(by_distance: torch.Tensor, position: PositionBias) -> torch.Tensor:
    """The T5 table's gradient from the score gradient's sums by relative position, (heads, 2 * max_distance + 3)
    for rel -(D+1) .. D+1 (the ends: everything beyond)."""
    buckets, _ = t5_relative_buckets(-(position.max_distance + 1), 2 * position.max_distance + 3,
                                     position.bidirectional, position.num_buckets, position.max_distance,
                                     by_distance.device)
    return _t5_table_gradient(by_distance, buckets, position.tensor)


def t5_band_table_gradient(
    grad_out, query, key, value, out, lse_log2, position: PositionBias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, scale: float, causal: bool, far_sums: torch.Tensor,
) -> torch.Tensor:
    """The T5 table's gradient of an attention call with query offset 0 whose backward ran elsewhere: the score
    gradient over the band ``|rel| <= max_distance``, recomputed and summed by relative position here
    (``_t5_band_distance_grad_kernel``), and ``far_sums`` (heads, 2 * max_distance + 3): the sums that backward took
    by relative position, whose ends (``rel < -max_distance``, ``rel > max_distance``) are used. Tensors as
    ``flash_attention`` takes them ((batch, heads, length, head_dim), or packed with ``cu_seqlens``); ``lse_log2``
    the forward's row log-sum-exp in log2 units, +inf where a row sees no key."""
    problem = _Problem.of(query, key, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    device = query.device
    config = _config("dkdv", device, problem.head_dim, query.dtype)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    max_distance = position.max_distance
    buckets, bias_rows = _t5_bias_by_distance(position.tensor, position.bidirectional, position.num_buckets,
                                              max_distance)
    num_n_blocks = cdiv(problem.seqlen_k, config.block_n)
    distance_grad = torch.zeros(problem.batch, num_n_blocks, problem.num_heads, 2 * max_distance + 3,
                                dtype=torch.float32, device=device)
    dummy = lse_log2
    cu_pointers = (dummy if cu_seqlens_q is None else cu_seqlens_q, dummy if cu_seqlens_k is None else cu_seqlens_k)
    with device_guard(device):
        delta = torch.empty_like(lse_log2)
        preprocess_block = 64 if device.type == "cuda" else 16
        _backward_preprocess_kernel[(cdiv(problem.seqlen_q, preprocess_block), problem.batch * problem.num_heads)](
            out, grad_out, delta, cu_pointers[0],
            *_token_strides(out, problem), *_token_strides(grad_out, problem), *_row_stats_strides(delta, problem),
            problem.num_heads, problem.seqlen_q,
            HEAD_DIM=problem.head_dim, BLOCK_M=preprocess_block, IS_VARLEN=problem.is_varlen, num_warps=4,
        )
        _t5_band_distance_grad_kernel[(num_n_blocks, problem.batch * problem.num_heads)](
            query, key, value, grad_out, lse_log2, delta, bias_rows, distance_grad, *cu_pointers,
            *_token_strides(query, problem), *_token_strides(key, problem), *_token_strides(value, problem),
            *_token_strides(grad_out, problem), *_row_stats_strides(lse_log2, problem), bias_rows.stride(0),
            problem.num_heads, problem.seqlen_q, problem.seqlen_k, scale * 1.4426950408889634,
            HEAD_DIM=problem.head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n, MAX_DISTANCE=max_distance,
            CAUSAL=causal, IS_VARLEN=problem.is_varlen,
            EVEN_M=not problem.is_varlen and problem.seqlen_q % config.block_m == 0,
            INPUT_PRECISION=_input_precision(query.dtype), **_launch_kwargs(config, device),
        )
    distance_grad[0, 0, :, 0] += far_sums[:, 0]
    distance_grad[0, 0, :, -1] += far_sums[:, -1]
    return _t5_table_gradient(distance_grad, buckets, position.tensor)


def _backward(
    grad_out, query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k,
    options: _CallOptions, position_grad,
):
    problem = _Problem.of(query, key, cu_seqlens_q, options.max_seqlen_q, options.max_seqlen_k)
    position = options.position_bias(position_tensor)
    scale, causal = options.scale, options.causal
    device = query.device
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    table_grad = position_grad and position.kind == "t5"
    bias_grad = position_grad and position.kind == "bias"
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dkdv_config = _config("dkdv", device, problem.head_dim, query.dtype)
    dq_config = _config("dq", device, problem.head_dim, query.dtype)
    num_n_blocks = cdiv(problem.seqlen_k, dkdv_config.block_n)
    with device_guard(device):
        bias, bias_strides, max_distance_arg, buckets = _position_arguments(position, problem)
        padding = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else None
        dummy = lse
        delta = torch.empty_like(lse)
        preprocess_block = 64 if device.type == "cuda" else 16
        _backward_preprocess_kernel[(cdiv(problem.seqlen_q, preprocess_block), problem.batch * problem.num_heads)](
            out, grad_out, delta, dummy if cu_seqlens_q is None else cu_seqlens_q,
            *_token_strides(out, problem), *_token_strides(grad_out, problem), *_row_stats_strides(delta, problem),
            problem.num_heads, problem.seqlen_q,
            HEAD_DIM=problem.head_dim, BLOCK_M=preprocess_block, IS_VARLEN=problem.is_varlen, num_warps=4,
        )
        distance_grad = dbias = None
        if table_grad:  # one row of sums per relative position for each program of the dk/dv kernel
            distance_grad = torch.zeros(problem.batch, num_n_blocks, problem.num_heads, 2 * position.max_distance + 3,
                                        dtype=torch.float32, device=device)
        if bias_grad:
            dbias = torch.zeros(
                problem.batch, problem.num_heads, problem.seqlen_q, problem.seqlen_k, dtype=torch.float32, device=device
            )
        common = {
            "HEAD_DIM": problem.head_dim, "MAX_DISTANCE": max_distance_arg, "CAUSAL": causal,
            "HAS_PADDING": padding is not None, "IS_VARLEN": problem.is_varlen,
            "INPUT_PRECISION": _input_precision(query.dtype),
        }
        # full query blocks only (dense inputs): the dk/dv kernel loads rows without masks
        even_m = not problem.is_varlen and problem.seqlen_q % dkdv_config.block_m == 0
        padding_pointer = dummy if padding is None else padding
        bias_pointer = dummy if bias is None else bias
        cu_pointers = (
            dummy if cu_seqlens_q is None else cu_seqlens_q, dummy if cu_seqlens_k is None else cu_seqlens_k,
        )
        shape_arguments = (
            problem.num_heads, problem.seqlen_q, problem.seqlen_k, options.query_offset, scale * 1.4426950408889634,
        )
        grid = (num_n_blocks, problem.batch * problem.num_heads)
        # dq: added into an fp32 buffer by the dk/dv kernel (atomics, as FlashAttention-2), or computed by its own
        # kernel (three more products per tile, no atomics) for large heads and under deterministic algorithms
        fused_dq = problem.head_dim <= _FUSED_DQ_MAX_HEAD_DIM and not torch.are_deterministic_algorithms_enabled()
        # in the query's memory layout (the model's are transposed views): the copy into dq then runs contiguous,
        # where a (batch, heads, length, dim) buffer made it a strided transpose (1.5 ms of a 91 ms step, H100)
        dq_accumulator = torch.zeros_like(query, dtype=torch.float32) if fused_dq else dummy
        bank, bank_left_tiles = None, 0
        if _dkdv_uses_t5_bias_bank(position, options, table_grad, dkdv_config):
            bank, bank_left_tiles = _t5_bias_bank(bias, dkdv_config.block_n, dkdv_config.block_m, max_distance_arg)
        _attention_backward_dkdv_kernel[grid](
            query, key, value, grad_out, lse, delta, dk, dv, dq_accumulator, padding_pointer, bias_pointer,
            dummy if bank is None else bank, dummy if distance_grad is None else distance_grad,
            dummy if dbias is None else dbias, *cu_pointers,
            *_token_strides(query, problem), *_token_strides(key, problem), *_token_strides(value, problem),
            *_token_strides(grad_out, problem), *_token_strides(dk, problem), *_token_strides(dv, problem),
            *(_token_strides(dq_accumulator, problem) if fused_dq else (0, 0, 0)),
            *_row_stats_strides(lse, problem),
            0 if padding is None else padding.stride(0),
            *bias_strides,
            *((0, 0, 0, 0) if dbias is None else dbias.stride()),
            *shape_arguments, scale,
            BLOCK_M=dkdv_config.block_m, BLOCK_N=dkdv_config.block_n, POSITION=_POSITION_CODES[position.kind],
            EVEN_M=even_m, TABLE_GRAD=table_grad, BIAS_GRAD=bias_grad, FUSED_DQ=fused_dq,
            BANK_TILES=0 if bank is None else bank.shape[1], BANK_LEFT_TILES=bank_left_tiles,
            **common, **_launch_kwargs(dkdv_config, device),
        )
        if fused_dq:
            dq.copy_(dq_accumulator)
        else:
            dq_grid = (cdiv(problem.seqlen_q, dq_config.block_m), problem.batch * problem.num_heads)
            _attention_backward_dq_kernel[dq_grid](
                query, key, value, grad_out, lse, delta, dq, padding_pointer, bias_pointer, *cu_pointers,
                *_token_strides(query, problem), *_token_strides(key, problem), *_token_strides(value, problem),
                *_token_strides(grad_out, problem), *_token_strides(dq, problem),
                *_row_stats_strides(lse, problem),
                0 if padding is None else padding.stride(0),
                *bias_strides,
                *shape_arguments, scale,
                BLOCK_M=dq_config.block_m, BLOCK_N=dq_config.block_n, POSITION=_POSITION_CODES[position.kind],
                **common, **_launch_kwargs(dq_config, device),
            )
    position_gradient = query.new_empty(0)
    if table_grad:
        position_gradient = _t5_table_gradient(distance_grad, buckets, position_tensor)
    elif bias_grad:
        if problem.is_varlen:
            dbias = dbias.sum(dim=0)
        position_gradient = dbias.sum_to_size(position_tensor.shape).to(position_tensor.dtype).contiguous()
    return dq, dk, dv, position_gradient


# ----------------------------------------------------------------------------------------------------------------
# Custom ops and autograd


@torch.library.custom_op(f"{_NAMESPACE}::attention_forward", mutates_args=())
def attention_forward_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    position_tensor: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    query_offset: int,
    position_kind: str,
    bidirectional: bool,
    num_buckets: int,
    max_distance: int,
    query_offset_tensor: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and its row log-sum-exp (log2 units, +inf for rows that see no key). The plain values
    after the tensors are the fields of ``_CallOptions``."""
    options = _CallOptions(max_seqlen_q, max_seqlen_k, scale, causal, query_offset, position_kind, bidirectional,
                           num_buckets, max_distance)
    return _forward(query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k, options,
                    query_offset_tensor)


@attention_forward_op.register_fake
def _attention_forward_fake(query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, *_):
    if cu_seqlens_q is None:
        lse = query.new_empty(query.shape[:3], dtype=torch.float32)
    else:
        lse = query.new_empty((query.shape[1], query.shape[0]), dtype=torch.float32)
    return torch.empty_like(query), lse


@torch.library.custom_op(f"{_NAMESPACE}::attention_backward", mutates_args=())
def attention_backward_op(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    position_tensor: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    query_offset: int,
    position_kind: str,
    bidirectional: bool,
    num_buckets: int,
    max_distance: int,
    position_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and the gradient of the position tensor (the T5 table or the explicit bias; empty otherwise)."""
    options = _CallOptions(max_seqlen_q, max_seqlen_k, scale, causal, query_offset, position_kind, bidirectional,
                           num_buckets, max_distance)
    return _backward(grad_out, query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q,
                     cu_seqlens_k, options, position_grad)


@attention_backward_op.register_fake
def _attention_backward_fake(grad_out, query, key, value, out, lse, key_padding_mask, position_tensor, *rest):
    *plain_values, position_grad = rest[2:]
    if position_grad and _CallOptions(*plain_values).differentiable_position:
        position_gradient = torch.empty_like(position_tensor, memory_format=torch.contiguous_format)
    else:
        position_gradient = query.new_empty(0)
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), position_gradient


def _setup_context(ctx, inputs, output):
    query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k, *plain_values, _ = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k)
    ctx.options = _CallOptions(*plain_values)
    ctx.mark_non_differentiable(lse)


def _attention_backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    position_grad = ctx.needs_input_grad[4] and ctx.options.differentiable_position
    dq, dk, dv, position_gradient = attention_backward_op(
        grad_out, query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k,
        *ctx.options.flat(), position_grad,
    )
    # no gradient for cu_seqlens_q, cu_seqlens_k, the plain values and query_offset_tensor
    unused = (None,) * (3 + len(fields(_CallOptions)))
    return (dq, dk, dv, None, position_gradient if position_grad else None) + unused


attention_forward_op.register_autograd(_attention_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The same forward and backward as the custom ops, without their dispatch: outside ``torch.compile`` the
    custom-op machinery costs more host time than a short attention call takes on the GPU."""

    @staticmethod
    def forward(ctx, query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k,
                options: _CallOptions, query_offset_tensor):
        out, lse = _forward(query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k, options,
                            query_offset_tensor)
        ctx.save_for_backward(query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q,
                              cu_seqlens_k)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        position_grad = ctx.needs_input_grad[4] and ctx.options.differentiable_position
        dq, dk, dv, position_gradient = _backward(
            grad_out, query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k,
            ctx.options, position_grad,
        )
        return dq, dk, dv, None, position_gradient if position_grad else None, None, None, None, None


def _attention(query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k,
               options: _CallOptions, query_offset_tensor) -> torch.Tensor:
    """The custom op when traced by torch.compile (no graph break), the autograd.Function otherwise."""
    tensors = (query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k)
    if torch.compiler.is_compiling():
        return attention_forward_op(*tensors, *options.flat(), query_offset_tensor)[0]
    return _EagerAttention.apply(*tensors, options, query_offset_tensor)


# ----------------------------------------------------------------------------------------------------------------
# Entry points


def _check_triton_arguments(query, position_bias: PositionBias, num_heads, dropout_p):
    if triton is None:
        raise RuntimeError("the Triton attention needs the `triton` package, which is not installed")
    if query.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"the Triton attention supports float16, bfloat16 and float32 inputs, got {query.dtype}")
    if query.shape[-1] > _MAX_HEAD_DIM:
        raise ValueError(f"the Triton attention supports head_dim up to {_MAX_HEAD_DIM}, got {query.shape[-1]}")
    if dropout_p > 0.0:
        raise ValueError(
            "the Triton attention does not implement attention dropout: pass dropout_p=0.0, or backend='reference' "
            "to train with dropout on the attention probabilities"
        )
    if position_bias.kind == "t5":
        if position_bias.tensor.shape[1] != num_heads:
            raise ValueError(
                f"the T5 table must be (num_buckets, heads) with {num_heads} heads, "
                f"got {tuple(position_bias.tensor.shape)}"
            )
        if position_bias.max_distance > _MAX_T5_DISTANCE:
            raise ValueError(
                f"the Triton attention supports T5 max_distance up to {_MAX_T5_DISTANCE}, "
                f"got {position_bias.max_distance}"
            )
        _check_t5_buckets(position_bias.bidirectional, position_bias.num_buckets, position_bias.max_distance)
    if position_bias.kind == "alibi" and position_bias.tensor.shape != (num_heads,):
        raise ValueError(f"alibi slopes must be (heads,) = ({num_heads},), got {tuple(position_bias.tensor.shape)}")


def _prepare(tensors, head_dim):
    """Pad the head dim to the kernels' power of two (zeros leave q·k and p·v unchanged); last dim contiguous."""
    padded = _padded_head_dim(head_dim)
    prepared = []
    for tensor in tensors:
        if padded != head_dim:
            tensor = torch.nn.functional.pad(tensor, (0, padded - head_dim))
        elif tensor.stride(-1) != 1:
            tensor = tensor.contiguous()
        prepared.append(tensor)
    return prepared


def _query_offset_arguments(query_offset, tensors) -> tuple[int, torch.Tensor | None]:
    """(offset as an int, offset tensor for the kernel to read). A tensor offset stays on the device when autograd
    records nothing: no host synchronisation, and one CUDA graph of a decoding step serves every position. The
    backward kernels take the offset as an int, so a recorded call reads it back to the host."""
    if not isinstance(query_offset, torch.Tensor):
        return int(query_offset), None
    if torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in tensors):
        return int(query_offset), None
    return 0, query_offset.reshape(1)


def _position_tensor(position_bias: PositionBias) -> torch.Tensor | None:
    """The tensor the kernels read: ALiBi's slopes as fp32 constants (they receive no gradient)."""
    if position_bias.kind == "alibi":
        return position_bias.tensor.detach().float().contiguous()
    return position_bias.tensor


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    position_bias: PositionBias = NO_POSITION_BIAS,
    scale: float = 1.0,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    query_offset: int | torch.Tensor = 0,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Triton attention over (batch, heads, length, head_dim) tensors; see ``attention.attention``.

    ALiBi slopes receive no gradient; ``dropout_p > 0`` raises (use the reference backend).
    """
    batch, num_heads, query_length, head_dim = query.shape
    key_length = key.shape[2]
    _check_triton_arguments(query, position_bias, num_heads, dropout_p)
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be a bool tensor (True = attend), got {key_padding_mask.dtype}")
        if key_padding_mask.stride(-1) != 1:
            key_padding_mask = key_padding_mask.contiguous()
    if position_bias.kind == "bias":
        try:
            torch.broadcast_shapes(position_bias.tensor.shape, (batch, num_heads, query_length, key_length))
        except RuntimeError as error:
            raise ValueError(
                f"the explicit bias {tuple(position_bias.tensor.shape)} does not broadcast to (batch, heads, "
                f"query_length, key_length) = {(batch, num_heads, query_length, key_length)}"
            ) from error
    position_tensor = _position_tensor(position_bias)
    query_offset, query_offset_tensor = _query_offset_arguments(query_offset, (query, key, value, position_tensor))
    options = _CallOptions.of(position_bias, query_length, key_length, scale, causal, query_offset)
    query, key, value = _prepare((query, key, value), head_dim)
    out = _attention(query, key, value, key_padding_mask, position_tensor, None, None, options, query_offset_tensor)
    return out if out.shape[-1] == head_dim else out[..., :head_dim]


def flash_attention_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    position_bias: PositionBias = NO_POSITION_BIAS,
    scale: float = 1.0,
    causal: bool = False,
    query_offset: int | torch.Tensor = 0,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Triton attention over packed (tokens, heads, head_dim) tensors; see ``attention.attention_varlen``."""
    _, num_heads, head_dim = query.shape
    _check_triton_arguments(query, position_bias, num_heads, dropout_p)
    if position_bias.kind == "bias" and position_bias.tensor.shape[-2:] != (max_seqlen_q, max_seqlen_k):
        raise ValueError(
            f"an explicit bias for varlen attention is (heads, max_seqlen_q, max_seqlen_k) = "
            f"{(num_heads, max_seqlen_q, max_seqlen_k)}, got {tuple(position_bias.tensor.shape)}"
        )
    position_tensor = _position_tensor(position_bias)
    query_offset, query_offset_tensor = _query_offset_arguments(query_offset, (query, key, value, position_tensor))
    options = _CallOptions.of(position_bias, max_seqlen_q, max_seqlen_k, scale, causal, query_offset)
    query, key, value = _prepare((query, key, value), head_dim)
    out = _attention(
        query, key, value, None, position_tensor, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32),
        options, query_offset_tensor,
    )
    return out if out.shape[-1] == head_dim else out[..., :head_dim]


def t5_bias_rows(position_bias: PositionBias) -> torch.Tensor:
    """The (heads, 2 * max_distance + 3) fp32 rows of a T5 ``position_bias`` by relative position, which every
    forward launch of the kernels otherwise makes again: for :func:`decode_attention`, that makes them once while
    the table does not change."""
    if position_bias.kind != "t5":
        raise ValueError(f"t5_bias_rows needs a T5 PositionBias, got a {position_bias.kind!r} one")
    return _t5_bias_by_distance(
        position_bias.tensor, position_bias.bidirectional, position_bias.num_buckets, position_bias.max_distance
    )[1]


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    position_bias: PositionBias = NO_POSITION_BIAS,
    t5_bias_rows: torch.Tensor | None = None,
    scale: float = 1.0,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    query_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """The forward of :func:`flash_attention` alone, for inference (nothing recorded for autograd): a decoding step
    replayed from a CUDA graph. ``query_offset``: a one-element integer tensor on the device, read in place, or
    None for 0; ``t5_bias_rows``: :func:`t5_bias_rows` of ``position_bias``, made once instead of at every call."""
    _, num_heads, query_length, head_dim = query.shape
    _check_triton_arguments(query, position_bias, num_heads, 0.0)
    if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor (True = attend), got {key_padding_mask.dtype}")
    options = _CallOptions.of(position_bias, query_length, key.shape[2], scale, causal, 0)
    query, key, value = _prepare((query, key, value), head_dim)
    offset = None if query_offset is None else query_offset.reshape(1)
    out, _ = _forward(query, key, value, key_padding_mask, _position_tensor(position_bias), None, None, options,
                      offset, t5_bias_rows)
    return out if out.shape[-1] == head_dim else out[..., :head_dim]
