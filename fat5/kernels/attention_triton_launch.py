"""The launchers of FAT5's Triton attention kernels: one attention call's forward (``launch_forward``) and backward
(``launch_backward``), and the T5 table gradient's band pass for a backward that ran elsewhere
(``t5_band_table_gradient``). ``CallOptions`` flattens a call's ``PositionBias`` and settings into the plain values the
custom ops take, and rebuilds them."""

from dataclasses import dataclass, fields

import torch

from . import attention_triton_config
from .attention_triton_config import (
    FUSED_DQ_MAX_HEAD_DIM,
    LaunchConfig,
    input_precision,
    kernel_multiprocessors,
    launch_config,
    launch_kwargs,
)
from .attention_triton_t5 import t5_bias_bank, t5_bias_by_distance, t5_table_gradient
from .launch import cdiv, device_guard
from .position_bias import PositionBias

try:
    from .attention_triton_kernels import (
        _attention_backward_dkdv_kernel,
        _attention_backward_dq_kernel,
        _attention_forward_kernel,
        _backward_preprocess_kernel,
        _split_combine_kernel,
        _t5_band_distance_grad_kernel,
    )
except ImportError:  # CPU-only installs: attention.py only calls in here when triton is importable
    pass

POSITION_CODES = {"none": 0, "t5": 1, "alibi": 2, "bias": 3}

@dataclass
class Problem:
    """Shapes and strides shared by the launches of one attention call (dense or varlen)."""

    batch: int  # batch size, or number of segments
    num_heads: int
    head_dim: int
    seqlen_q: int  # Lq, or max_seqlen_q
    seqlen_k: int
    is_varlen: bool

    def row_stats(self, query: torch.Tensor) -> torch.Tensor:
        """An empty fp32 tensor of one value per query row: (batch, heads, Lq), or (heads, total_q) for varlen."""
        shape = (self.num_heads, query.shape[0]) if self.is_varlen else (self.batch, self.num_heads, self.seqlen_q)
        return torch.empty(shape, dtype=torch.float32, device=query.device)

    @staticmethod
    def of(query, key, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
        if cu_seqlens_q is None:
            batch, num_heads, seqlen_q, head_dim = query.shape
            return Problem(batch, num_heads, head_dim, seqlen_q, key.shape[2], False)
        return Problem(cu_seqlens_q.shape[0] - 1, query.shape[1], query.shape[2], max_seqlen_q, max_seqlen_k, True)


def _dkdv_uses_t5_bias_bank(position: PositionBias, options, table_grad: bool, config: LaunchConfig) -> bool:
    """Whether the dk/dv kernel's unmasked near tiles read a bias bank instead of gathering: a T5 bias in a
    non-causal call whose table takes no gradient (LoRA finetuning, a frozen table), query offset 0 (training,
    prefill: the diagonal offsets are then whole query blocks, the same for every key block) and key tiles a whole
    number of query tiles. Measured on an H100 (benchmarks/README.md, Attention: the bias bank), forward+backward at
    L 512 / 1024 / 2048: 1.21 / 1.16 / 1.09x the gather there; where the table is trained (the near tiles also sum
    the table gradient along their diagonals) or causal, and in the forward, the bank was slower or equal."""
    return (attention_triton_config.T5_BIAS_BANK and position.kind == "t5" and not options.causal and not table_grad
            and options.query_offset == 0 and config.block_n % config.block_m == 0)


def token_strides(tensor: torch.Tensor, problem: Problem) -> tuple[int, int, int]:
    """(batch, head, token) strides; varlen tensors have no batch stride (segments start at cu_seqlens)."""
    if problem.is_varlen:
        return 0, tensor.stride(1), tensor.stride(0)
    return tensor.stride(0), tensor.stride(1), tensor.stride(2)


def row_stats_strides(stats: torch.Tensor, problem: Problem) -> tuple[int, int]:
    """lse and delta are (batch, heads, Lq) for dense and (heads, total_q) for varlen inputs."""
    if problem.is_varlen:
        return 0, stats.stride(0)
    return stats.stride(0), stats.stride(1)


@dataclass(frozen=True)
class CallOptions:
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
    def of(position_bias: PositionBias, max_seqlen_q, max_seqlen_k, scale, causal, query_offset) -> "CallOptions":
        return CallOptions(int(max_seqlen_q), int(max_seqlen_k), float(scale), bool(causal), int(query_offset),
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
        buckets, bias_by_distance = t5_bias_by_distance(
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


def _expand_bias(attn_bias: torch.Tensor, problem: Problem) -> torch.Tensor:
    if problem.is_varlen:
        return attn_bias.expand(1, problem.num_heads, problem.seqlen_q, problem.seqlen_k)
    return attn_bias.expand(problem.batch, problem.num_heads, problem.seqlen_q, problem.seqlen_k)


def _key_splits(problem: Problem, config: LaunchConfig, num_m_blocks: int, device) -> tuple[int, int]:
    """(splits of the keys, key blocks a split): one unless few query blocks would leave most of the GPU idle
    (flash-decoding: a few queries against a long cache), then enough for about three programs an SM."""
    num_n_blocks = cdiv(max(problem.seqlen_k, 1), config.block_n)
    programs = num_m_blocks * problem.batch * problem.num_heads
    num_splits = 1
    if num_m_blocks == 1 and programs < kernel_multiprocessors(device):
        num_splits = max(1, min(3 * kernel_multiprocessors(device) // programs, num_n_blocks // 2))
    blocks_per_split = cdiv(num_n_blocks, num_splits)
    return cdiv(num_n_blocks, blocks_per_split), blocks_per_split


def _row_deltas(out, grad_out, like, problem: Problem, cu_seqlens_q, device) -> torch.Tensor:
    """``delta_i = sum_d out_id * grad_out_id`` (fp32) of every query row, laid out as ``like`` (lse's layout):
    the softmax backward's row term."""
    delta = torch.empty_like(like)
    block = 64 if device.type == "cuda" else 16
    _backward_preprocess_kernel[(cdiv(problem.seqlen_q, block), problem.batch * problem.num_heads)](
        out, grad_out, delta, like if cu_seqlens_q is None else cu_seqlens_q,
        *token_strides(out, problem), *token_strides(grad_out, problem), *row_stats_strides(delta, problem),
        problem.num_heads, problem.seqlen_q,
        HEAD_DIM=problem.head_dim, BLOCK_M=block, IS_VARLEN=problem.is_varlen, num_warps=4,
    )
    return delta


def launch_forward(
    query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k, options: CallOptions,
    query_offset_tensor=None, t5_bias_rows=None,
):
    """``query_offset_tensor``, when given, replaces ``options.query_offset``: the kernel reads the offset from it.
    ``t5_bias_rows``: the T5 bias by relative position made beforehand (:func:`t5_bias_rows`)."""
    problem = Problem.of(query, key, cu_seqlens_q, options.max_seqlen_q, options.max_seqlen_k)
    position = options.position_bias(position_tensor)
    device = query.device
    out = torch.empty_like(query)
    lse = problem.row_stats(query)
    if out.numel() == 0:
        lse.fill_(float("inf"))
        return out, lse
    decoding = problem.seqlen_q <= 16
    config = launch_config("decode" if decoding else "forward", device, problem.head_dim, query.dtype)
    num_m_blocks = cdiv(problem.seqlen_q, config.block_m)
    num_splits, blocks_per_split = _key_splits(problem, config, num_m_blocks, device)
    is_split = num_splits > 1

    with device_guard(device):
        bias, bias_strides, max_distance_arg, _ = _position_arguments(position, problem, t5_bias_rows)
        padding = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else None
        # each split's running output, max and sum, combined afterwards
        partial_acc = partial_max = partial_sum = lse
        if is_split:
            partial_shape = (num_splits, problem.batch * problem.num_heads, config.block_m)
            partial_acc = torch.empty(*partial_shape, problem.head_dim, dtype=torch.float32, device=device)
            partial_max, partial_sum = (torch.empty(partial_shape, dtype=torch.float32, device=device)
                                        for _ in range(2))
        dummy = lse
        grid = (num_m_blocks, problem.batch * problem.num_heads, num_splits)
        _attention_forward_kernel[grid](
            query, key, value, out, lse, partial_acc, partial_max, partial_sum,
            dummy if padding is None else padding, dummy if bias is None else bias,
            dummy if cu_seqlens_q is None else cu_seqlens_q, dummy if cu_seqlens_k is None else cu_seqlens_k,
            dummy if query_offset_tensor is None else query_offset_tensor,
            *token_strides(query, problem), *token_strides(key, problem), *token_strides(value, problem),
            *token_strides(out, problem), *row_stats_strides(lse, problem),
            0 if padding is None else padding.stride(0),
            *bias_strides,
            problem.num_heads, problem.seqlen_q, problem.seqlen_k, options.query_offset,
            options.scale * 1.4426950408889634, blocks_per_split,
            HEAD_DIM=problem.head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            POSITION=POSITION_CODES[position.kind], MAX_DISTANCE=max_distance_arg, CAUSAL=options.causal,
            HAS_PADDING=padding is not None, IS_VARLEN=problem.is_varlen, IS_SPLIT=is_split,
            SAFE_CLEAN=padding is not None or position.kind == "bias",
            OFFSET_IN_MEMORY=query_offset_tensor is not None,
            INPUT_PRECISION=input_precision(query.dtype), **launch_kwargs(config, device),
        )
        if is_split:
            _split_combine_kernel[(problem.batch * problem.num_heads,)](
                partial_acc, partial_max, partial_sum, out, lse,
                dummy if cu_seqlens_q is None else cu_seqlens_q,
                *token_strides(out, problem), *row_stats_strides(lse, problem),
                problem.num_heads, problem.seqlen_q, num_splits,
                HEAD_DIM=problem.head_dim, BLOCK_M=config.block_m, IS_VARLEN=problem.is_varlen, num_warps=4,
            )
    return out, lse


def t5_band_table_gradient(
    grad_out, query, key, value, out, lse_log2, position: PositionBias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, scale: float, causal: bool, far_sums: torch.Tensor,
) -> torch.Tensor:
    """The T5 table's gradient of an attention call with query offset 0 whose backward ran elsewhere: the score
    gradient over the band ``|rel| <= max_distance``, recomputed and summed by relative position here
    (``_t5_band_distance_grad_kernel``), and ``far_sums`` (heads, 2 * max_distance + 3): the sums that backward took
    by relative position, whose ends (``rel < -max_distance``, ``rel > max_distance``) are used. Tensors as
    ``attention_triton.triton_attention`` takes them ((batch, heads, length, head_dim), or packed with
    ``cu_seqlens``); ``lse_log2`` the forward's row log-sum-exp in log2 units, +inf where a row sees no key."""
    problem = Problem.of(query, key, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    device = query.device
    config = launch_config("dkdv", device, problem.head_dim, query.dtype)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    max_distance = position.max_distance
    buckets, bias_rows = t5_bias_by_distance(position.tensor, position.bidirectional, position.num_buckets,
                                             max_distance)
    num_n_blocks = cdiv(problem.seqlen_k, config.block_n)
    distance_grad = torch.zeros(problem.batch, num_n_blocks, problem.num_heads, 2 * max_distance + 3,
                                dtype=torch.float32, device=device)
    dummy = lse_log2
    cu_pointers = (dummy if cu_seqlens_q is None else cu_seqlens_q, dummy if cu_seqlens_k is None else cu_seqlens_k)
    with device_guard(device):
        delta = _row_deltas(out, grad_out, lse_log2, problem, cu_seqlens_q, device)
        _t5_band_distance_grad_kernel[(num_n_blocks, problem.batch * problem.num_heads)](
            query, key, value, grad_out, lse_log2, delta, bias_rows, distance_grad, *cu_pointers,
            *token_strides(query, problem), *token_strides(key, problem), *token_strides(value, problem),
            *token_strides(grad_out, problem), *row_stats_strides(lse_log2, problem), bias_rows.stride(0),
            problem.num_heads, problem.seqlen_q, problem.seqlen_k, scale * 1.4426950408889634,
            HEAD_DIM=problem.head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n, MAX_DISTANCE=max_distance,
            CAUSAL=causal, IS_VARLEN=problem.is_varlen,
            EVEN_M=not problem.is_varlen and problem.seqlen_q % config.block_m == 0,
            INPUT_PRECISION=input_precision(query.dtype), **launch_kwargs(config, device),
        )
    distance_grad[0, 0, :, 0] += far_sums[:, 0]
    distance_grad[0, 0, :, -1] += far_sums[:, -1]
    return t5_table_gradient(distance_grad, buckets, position.tensor)


@dataclass
class _BackwardArguments:
    """What the dk/dv kernel and the dq kernel take alike: the inputs and their strides, the mask, bias and segment
    pointers (``lse`` stands in for those absent), the shape and scale, and the shared constexprs."""

    leading: tuple  # query, key, value, grad_out, lse, delta
    pointers: tuple  # padding, bias, cu_seqlens_q, cu_seqlens_k
    input_strides: tuple  # query, key, value, grad_out
    lse_strides: tuple
    mask_and_bias_strides: tuple
    trailing: tuple  # heads, lengths, query offset, scales
    constexprs: dict

    @staticmethod
    def of(query, key, value, grad_out, lse, delta, padding, bias, bias_strides, cu_seqlens_q, cu_seqlens_k,
           problem: Problem, options: CallOptions, max_distance: int) -> "_BackwardArguments":
        def pointer(tensor):
            return lse if tensor is None else tensor

        return _BackwardArguments(
            (query, key, value, grad_out, lse, delta),
            tuple(map(pointer, (padding, bias, cu_seqlens_q, cu_seqlens_k))),
            tuple(stride for tensor in (query, key, value, grad_out) for stride in token_strides(tensor, problem)),
            row_stats_strides(lse, problem),
            (0 if padding is None else padding.stride(0), *bias_strides),
            (problem.num_heads, problem.seqlen_q, problem.seqlen_k, options.query_offset,
             options.scale * 1.4426950408889634, options.scale),
            {"HEAD_DIM": problem.head_dim, "MAX_DISTANCE": max_distance, "CAUSAL": options.causal,
             "HAS_PADDING": padding is not None, "IS_VARLEN": problem.is_varlen,
             "INPUT_PRECISION": input_precision(query.dtype)},
        )


def launch_backward(
    grad_out, query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k,
    options: CallOptions, position_grad,
):
    problem = Problem.of(query, key, cu_seqlens_q, options.max_seqlen_q, options.max_seqlen_k)
    position = options.position_bias(position_tensor)
    device = query.device
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    table_grad = position_grad and position.kind == "t5"
    bias_grad = position_grad and position.kind == "bias"
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dkdv_config = launch_config("dkdv", device, problem.head_dim, query.dtype)
    num_n_blocks = cdiv(problem.seqlen_k, dkdv_config.block_n)
    with device_guard(device):
        bias, bias_strides, max_distance, buckets = _position_arguments(position, problem)
        padding = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else None
        delta = _row_deltas(out, grad_out, lse, problem, cu_seqlens_q, device)
        shared = _BackwardArguments.of(query, key, value, grad_out, lse, delta, padding, bias, bias_strides,
                                       cu_seqlens_q, cu_seqlens_k, problem, options, max_distance)
        distance_grad = dbias = None
        if table_grad:  # one row of sums per relative position for each program of the dk/dv kernel
            distance_grad = torch.zeros(problem.batch, num_n_blocks, problem.num_heads, 2 * position.max_distance + 3,
                                        dtype=torch.float32, device=device)
        if bias_grad:
            dbias = torch.zeros(
                problem.batch, problem.num_heads, problem.seqlen_q, problem.seqlen_k, dtype=torch.float32, device=device
            )
        # dq: added into an fp32 buffer by the dk/dv kernel (atomics, as FlashAttention-2), or computed by its own
        # kernel (three more products per tile, no atomics) for large heads and under deterministic algorithms
        fused_dq = problem.head_dim <= FUSED_DQ_MAX_HEAD_DIM and not torch.are_deterministic_algorithms_enabled()
        # in the query's memory layout (the model's are transposed views): the copy into dq then runs contiguous,
        # where a (batch, heads, length, dim) buffer made it a strided transpose (1.5 ms of a 91 ms step, H100)
        dq_accumulator = torch.zeros_like(query, dtype=torch.float32) if fused_dq else None
        bank, bank_left_tiles = None, 0
        if _dkdv_uses_t5_bias_bank(position, options, table_grad, dkdv_config):
            bank, bank_left_tiles = t5_bias_bank(bias, dkdv_config.block_n, dkdv_config.block_m, max_distance)
        _launch_dkdv(shared, problem, position, dkdv_config, num_n_blocks, dk, dv, dq_accumulator, bank,
                     bank_left_tiles, distance_grad, dbias, device)
        if fused_dq:
            dq.copy_(dq_accumulator)
        else:
            _launch_dq(shared, problem, position, dq, device)
    return dq, dk, dv, _position_gradient(query, problem, position_tensor, distance_grad, buckets, dbias)


def _launch_dkdv(shared: _BackwardArguments, problem: Problem, position: PositionBias, config: LaunchConfig,
                 num_n_blocks: int, dk, dv, dq_accumulator, bank, bank_left_tiles, distance_grad, dbias, device):
    """dk and dv (and dq's fp32 sums when ``dq_accumulator`` is given), one program per key block and head."""
    dummy = shared.leading[4]
    grid = (num_n_blocks, problem.batch * problem.num_heads)
    _attention_backward_dkdv_kernel[grid](
        *shared.leading, dk, dv, dummy if dq_accumulator is None else dq_accumulator, *shared.pointers[:2],
        dummy if bank is None else bank, dummy if distance_grad is None else distance_grad,
        dummy if dbias is None else dbias, *shared.pointers[2:],
        *shared.input_strides, *token_strides(dk, problem), *token_strides(dv, problem),
        *((0, 0, 0) if dq_accumulator is None else token_strides(dq_accumulator, problem)),
        *shared.lse_strides, *shared.mask_and_bias_strides,
        *((0, 0, 0, 0) if dbias is None else dbias.stride()),
        *shared.trailing,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, POSITION=POSITION_CODES[position.kind],
        # full query blocks only (dense inputs): the kernel loads rows without masks
        EVEN_M=not problem.is_varlen and problem.seqlen_q % config.block_m == 0,
        TABLE_GRAD=distance_grad is not None, BIAS_GRAD=dbias is not None, FUSED_DQ=dq_accumulator is not None,
        BANK_TILES=0 if bank is None else bank.shape[1], BANK_LEFT_TILES=bank_left_tiles,
        **shared.constexprs, **launch_kwargs(config, device),
    )


def _launch_dq(shared: _BackwardArguments, problem: Problem, position: PositionBias, dq, device):
    """dq by its own kernel, one program per query block and head."""
    config = launch_config("dq", device, problem.head_dim, dq.dtype)
    grid = (cdiv(problem.seqlen_q, config.block_m), problem.batch * problem.num_heads)
    _attention_backward_dq_kernel[grid](
        *shared.leading, dq, *shared.pointers,
        *shared.input_strides, *token_strides(dq, problem),
        *shared.lse_strides, *shared.mask_and_bias_strides,
        *shared.trailing,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, POSITION=POSITION_CODES[position.kind],
        **shared.constexprs, **launch_kwargs(config, device),
    )


def _position_gradient(query, problem: Problem, position_tensor, distance_grad, buckets, dbias) -> torch.Tensor:
    """The position tensor's gradient from the dk/dv kernel's sums: the T5 table's (``distance_grad``), an explicit
    bias's (``dbias``), or an empty tensor."""
    if distance_grad is not None:
        return t5_table_gradient(distance_grad, buckets, position_tensor)
    if dbias is not None:
        if problem.is_varlen:
            dbias = dbias.sum(dim=0)
        return dbias.sum_to_size(position_tensor.shape).to(position_tensor.dtype).contiguous()
    return query.new_empty(0)
