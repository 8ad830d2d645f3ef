"""Triton kernels of FAT5's attention (the FlashAttention-2 algorithm) with the position bias computed in the kernel.

Conventions shared by every kernel here:

* Scores are kept in log2 units, ``s = log2(e) * (scale * q·k + bias)``, so that the softmax uses ``exp2``; the
  log-sum-exp saved for the backward is in the same units, and is ``+inf`` for a query row that sees no key (its
  probabilities recompute to 0 in the backward instead of NaN).
* Query row ``i`` of a program sits at position ``query_offset + i`` and key ``j`` at ``j`` (varlen: within its
  segment). ``rel = j - (query_offset + i)``.
* T5: the kernels never compute a bucket per score. A prologue (``_t5_bias_by_distance_kernel``) evaluates T5's
  bucket function (fp32 log, as in the reference) once per relative position in ``[-(D+1), D+1]`` (D =
  max_distance) and gathers the table into a per-head row ``bias_by_distance[h, rel + D + 1]`` (log2 units).
  Every ``|rel| > D`` falls in the last bucket of its direction, so relative positions are clamped to that range.
  A tile of the score matrix that lies wholly beyond ``D`` ("far") adds one scalar; the others ("near") gather
  from the row (it stays in L1). Where the table takes no gradient in a non-causal call with query offset 0, the
  dk/dv kernel's near tiles read their bias instead from a small per-head bank of whole tiles, one per diagonal
  offset a near tile can have (``_t5_bias_bank_kernel``; ``_dkdv_uses_t5_bias_bank`` in attention_triton.py): an
  aligned, contiguous load in place of a clamped per-score gather, the same values, bitwise the same results.
  In the backward, a far tile's share of the table gradient is one tile sum (taken
  by the dk/dv kernel); a near tile's score gradient is summed along its diagonals (equal ``rel``) by the same
  kernel, the tile skewed in shared memory by ``tl.gather``, into that program's own fp32 row of sums per relative
  position: no atomics, deterministic. The rows are reduced in a fixed order and mapped to
  buckets afterwards.
* dq: fp32 atomics from the dk/dv kernel (as FlashAttention-2) for head_dim <= 64, else (and under
  ``torch.use_deterministic_algorithms``) its own kernel.
* Each program splits its loop over the other axis into ranges with compile-time behaviour: tiles that need no
  causal/boundary mask, split for T5 into far-left, near and far-right, and the tiles that need masking.
"""

try:
    import triton
    import triton.language as tl
except ImportError as error:  # attention_triton.py catches this: CPU-only installs never launch these kernels
    raise ImportError("fat5's Triton attention kernels need the `triton` package") from error

from .launch import CachedLauncher

LOG2E = tl.constexpr(1.4426950408889634)

POSITION_NONE = tl.constexpr(0)
POSITION_T5 = tl.constexpr(1)
POSITION_ALIBI = tl.constexpr(2)
POSITION_BIAS = tl.constexpr(3)

# Triton compiles a kernel again for every new combination of "is 1" and "divisible by 16" of its integer
# arguments. The lengths, the query offset and the row-statistic strides stay specialised: without it the dk/dv
# kernel ran 12% slower at head_dim 64 and 80% slower causal at 128 (register allocation at its limit; H100), for
# at most a few compilations per kernel over a run. The arguments below buy nothing from it and are not.
VARYING_ARGUMENTS = ("blocks_per_split", "num_splits", "stride_mask_b", "first_relative_position", "num_positions")


def _jit_for_varying_shapes(kernel):
    """``triton.jit``, not specialised on the arguments of ``VARYING_ARGUMENTS`` that the kernel takes, behind a
    ``CachedLauncher`` (``launch.py``): these kernels take 16 to 65 arguments, which Triton's own launch path
    binds and specialises again at every call."""
    names = kernel.__code__.co_varnames[: kernel.__code__.co_argcount]
    return CachedLauncher(triton.jit(kernel, do_not_specialize=[name for name in VARYING_ARGUMENTS if name in names]))


BIAS_PER_SCORE = tl.constexpr(0)  # near T5 tiles (gather), ALiBi, explicit bias, none
BIAS_SCALAR = tl.constexpr(1)  # far T5 tiles: one value per head
BIAS_TILE = tl.constexpr(2)  # the dk/dv kernel's unmasked near T5 tiles with a bias bank: each read whole
# The forward's loops over near T5 tiles are not software-pipelined: the pipeliner would stage the gathered bias
# tile through shared memory with the keys and values and keep its pointers live across stages, and the registers
# this takes (248 instead of 128 per thread, H100) halve the programs per SM for the far tiles as well. The backward
# kernels hold more (dk, dv, the fused dq) and gain from pipelining their near tiles all the same.
GATHER_LOOP_STAGES = tl.constexpr(1)


@triton.jit
def _floor_div(numerator, denominator):
    """Floor division for a possibly negative numerator (Triton's ``//`` truncates toward zero)."""
    return tl.where(numerator >= 0, numerator // denominator, -((denominator - 1 - numerator) // denominator))


@triton.jit
def _ceil_div(numerator, denominator):
    return -_floor_div(-numerator, denominator)


@triton.jit
def _t5_relative_bucket(
    relative_position,
    inverse_max_exact,
    log_ratio_divisor,
    inverse_log_ratio,
    BIDIRECTIONAL: tl.constexpr,
    HALF_BUCKETS: tl.constexpr,
    MAX_EXACT: tl.constexpr,
    RECIPROCAL: tl.constexpr,
):
    """T5's ``_relative_position_bucket`` in fp32, as the reference computes it on the same device.

    ``HALF_BUCKETS`` is num_buckets // 2 when bidirectional, else num_buckets. PyTorch divides a CUDA tensor by a
    Python scalar as a multiplication by the fp32 reciprocal, and a CPU tensor by true division; ``RECIPROCAL``
    picks the same arithmetic so that the buckets agree bit for bit with the reference on either device
    (``inverse_max_exact`` = 1/max_exact, ``log_ratio_divisor`` = log(max_distance / max_exact) and
    ``inverse_log_ratio`` = 1/that, each rounded to fp32 as PyTorch rounds them).
    """
    if BIDIRECTIONAL:
        bucket = tl.where(relative_position > 0, HALF_BUCKETS, 0)
        distance = tl.abs(relative_position)
    else:
        bucket = tl.zeros_like(relative_position)
        distance = tl.maximum(-relative_position, 0)
    # distances below MAX_EXACT take the exact branch; clamping them keeps log(0) out of the unused branch
    distance_float = tl.maximum(distance, MAX_EXACT).to(tl.float32)
    if RECIPROCAL:
        log_ratio = tl.log(distance_float * inverse_max_exact) * inverse_log_ratio
    else:
        log_ratio = tl.log(distance_float / MAX_EXACT) / log_ratio_divisor
    large = MAX_EXACT + (log_ratio * (HALF_BUCKETS - MAX_EXACT)).to(tl.int32)
    large = tl.minimum(large, HALF_BUCKETS - 1)
    return bucket + tl.where(distance < MAX_EXACT, distance, large)


@_jit_for_varying_shapes
def _t5_bias_by_distance_kernel(
    Table,
    BiasByDistance,
    BucketByDistance,
    stride_table_bucket,
    stride_table_head,
    first_relative_position,
    num_positions,
    inverse_max_exact,
    log_ratio_divisor,
    inverse_log_ratio,
    BIDIRECTIONAL: tl.constexpr,
    HALF_BUCKETS: tl.constexpr,
    MAX_EXACT: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    WRITE_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Buckets (and, with ``WRITE_BIAS``, table values times log2(e)) for consecutive relative positions."""
    head = tl.program_id(1)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < num_positions
    bucket = _t5_relative_bucket(
        first_relative_position + offsets, inverse_max_exact, log_ratio_divisor, inverse_log_ratio,
        BIDIRECTIONAL, HALF_BUCKETS, MAX_EXACT, RECIPROCAL,
    )
    if head == 0:
        tl.store(BucketByDistance + offsets, bucket, mask=in_range)
    if WRITE_BIAS:
        value = tl.load(Table + bucket * stride_table_bucket + head * stride_table_head, mask=in_range, other=0.0)
        tl.store(BiasByDistance + head * num_positions + offsets, value.to(tl.float32) * LOG2E, mask=in_range)


@_jit_for_varying_shapes
def _t5_bias_bank_kernel(
    BiasByDistance,
    Bank,
    stride_bias_head,
    MAX_DISTANCE: tl.constexpr,
    LEFT_TILES: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    """Tile ``t`` of one head's bias bank for the dk/dv kernel: the bias of every near (keys ROWS, queries COLUMNS)
    tile whose query block starts ``c = (t - LEFT_TILES) * COLUMNS`` after its key block, copied from the row (the
    gather's values: the bank path's scores are bitwise the gather's):
    ``bank[h, t, i, j] = row[h, clamp(i - j - c, -(D+1), D+1) + D + 1]``."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    offs_row = tl.arange(0, ROWS)
    offs_column = tl.arange(0, COLUMNS)
    relative = offs_row[:, None] - offs_column[None, :] - (tile - LEFT_TILES) * COLUMNS
    clamped = tl.minimum(tl.maximum(relative, -(MAX_DISTANCE + 1)), MAX_DISTANCE + 1)
    value = tl.load(BiasByDistance + head * stride_bias_head + clamped + MAX_DISTANCE + 1)
    tile_base = Bank + (head * tl.num_programs(0) + tile).to(tl.int64) * (ROWS * COLUMNS)
    tl.store(tile_base + offs_row[:, None] * COLUMNS + offs_column[None, :], value)


@_jit_for_varying_shapes
def _t5_table_gradient_kernel(
    GradByDistance,
    BucketByDistance,
    TableGrad,
    stride_table_bucket,
    stride_table_head,
    num_positions,
    num_buckets,
    BLOCK: tl.constexpr,
):
    """One head's column of the table gradient: each bucket takes the sum of the (heads, positions) gradient over
    the relative positions that fall in it, in a fixed order (deterministic)."""
    head = tl.program_id(0)
    positions = tl.arange(0, BLOCK)
    in_range = positions < num_positions
    grad = tl.load(GradByDistance + head * num_positions + positions, mask=in_range, other=0.0)
    bucket_of_position = tl.load(BucketByDistance + positions, mask=in_range, other=-1)
    for bucket in range(num_buckets):
        total = tl.sum(tl.where(bucket_of_position == bucket, grad, 0.0), axis=0)
        tl.store(
            TableGrad + bucket * stride_table_bucket + head * stride_table_head,
            total.to(TableGrad.dtype.element_ty),
        )


@triton.jit
def _score_bias(
    scores,
    query_positions,
    key_positions,
    rows,
    seqlen_q,
    seqlen_k,
    bias_base,
    stride_bias_m,
    stride_bias_n,
    bias_scalar,
    POSITION: tl.constexpr,
    BIAS_MODE: tl.constexpr,
    MAX_DISTANCE: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """Add the position bias (log2 units) to ``scores`` (already times qk_scale).

    ``scores`` is (queries, keys), or (keys, queries) when ``TRANSPOSED`` (the dk/dv kernel). For T5 far tiles and
    ALiBi ``bias_scalar`` is the tile's value / the head's slope (both times log2(e)).
    """
    if TRANSPOSED:
        relative = key_positions[:, None] - query_positions[None, :]
    else:
        relative = key_positions[None, :] - query_positions[:, None]
    if POSITION == POSITION_T5:
        if BIAS_MODE == BIAS_SCALAR:
            scores = scores + bias_scalar
        else:
            clamped = tl.minimum(tl.maximum(relative, -(MAX_DISTANCE + 1)), MAX_DISTANCE + 1)
            scores = scores + tl.load(bias_base + (clamped + MAX_DISTANCE + 1))
    elif POSITION == POSITION_ALIBI:
        scores = scores - bias_scalar * tl.abs(relative).to(tl.float32)
    elif POSITION == POSITION_BIAS:
        if TRANSPOSED:
            offsets = rows[None, :] * stride_bias_m + key_positions[:, None] * stride_bias_n
            inside = (rows[None, :] < seqlen_q) & (key_positions[:, None] < seqlen_k)
        else:
            offsets = rows[:, None] * stride_bias_m + key_positions[None, :] * stride_bias_n
            inside = (rows[:, None] < seqlen_q) & (key_positions[None, :] < seqlen_k)
        scores = scores + tl.load(bias_base + offsets, mask=inside, other=0.0).to(tl.float32) * LOG2E
    return scores


@triton.jit
def _forward_inner(
    acc,
    row_sum,
    row_max,
    q,
    key_base,
    value_base,
    stride_kn,
    stride_vn,
    mask_base,
    bias_base,
    stride_bias_m,
    stride_bias_n,
    rows,
    query_positions,
    seqlen_q,
    seqlen_k,
    qk_scale,
    bias_scalar,
    block_start,
    block_end,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    POSITION: tl.constexpr,
    BIAS_MODE: tl.constexpr,
    MAX_DISTANCE: tl.constexpr,
    APPLY_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    SAFE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if POSITION == POSITION_T5 and BIAS_MODE == BIAS_PER_SCORE:
        loop_stages: tl.constexpr = GATHER_LOOP_STAGES
    else:
        loop_stages: tl.constexpr = None
    for block in tl.range(block_start, block_end, num_stages=loop_stages):
        keys = block * BLOCK_N + offs_n
        if APPLY_MASK:
            k = tl.load(key_base + keys[:, None] * stride_kn + offs_d[None, :], mask=keys[:, None] < seqlen_k,
                        other=0.0)
        else:
            k = tl.load(key_base + keys[:, None] * stride_kn + offs_d[None, :])
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        scores = _score_bias(
            scores, query_positions, keys, rows, seqlen_q, seqlen_k, bias_base, stride_bias_m, stride_bias_n,
            bias_scalar, POSITION, BIAS_MODE, MAX_DISTANCE, False,
        )
        if APPLY_MASK:
            visible = keys[None, :] < seqlen_k
            if CAUSAL:
                visible = visible & (keys[None, :] <= query_positions[:, None])
            scores = tl.where(visible, scores, float("-inf"))
        if HAS_PADDING:
            keep = tl.load(mask_base + keys, mask=keys < seqlen_k, other=0) != 0
            scores = tl.where(keep[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        if SAFE:  # a row may have seen only masked keys so far: subtract 0 instead of -inf (no NaN)
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        else:
            shift = new_max
        p = tl.math.exp2(scores - shift[:, None])
        alpha = tl.math.exp2(row_max - shift)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if APPLY_MASK:
            v = tl.load(value_base + keys[:, None] * stride_vn + offs_d[None, :], mask=keys[:, None] < seqlen_k,
                        other=0.0)
        else:
            v = tl.load(value_base + keys[:, None] * stride_vn + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        row_max = new_max
    return acc, row_sum, row_max


@triton.jit
def _program_coordinates(
    CuSeqlensQ,
    CuSeqlensK,
    batch,
    seqlen_q,
    seqlen_k,
    IS_VARLEN: tl.constexpr,
):
    """Start token (int64) and length of this program's query and key sequences."""
    q_start = tl.zeros([], tl.int64)
    k_start = tl.zeros([], tl.int64)
    if IS_VARLEN:
        q_start = tl.load(CuSeqlensQ + batch).to(tl.int64)
        seqlen_q = (tl.load(CuSeqlensQ + batch + 1) - q_start).to(tl.int32)
        k_start = tl.load(CuSeqlensK + batch).to(tl.int64)
        seqlen_k = (tl.load(CuSeqlensK + batch + 1) - k_start).to(tl.int32)
    return q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def _key_ranges(
    start_m,
    seqlen_k,
    query_offset,
    block_lo,
    block_hi_limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_DISTANCE: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Key-block ranges for the query block at ``start_m``: [lo, far_left_end) far-left, [far_left_end,
    far_right_start) near, [far_right_start, clean_end) far-right (T5 splits only the unmasked blocks), then
    [clean_end, hi) the blocks that need the causal or the key-boundary mask."""
    if CAUSAL:
        visible_end = tl.minimum(seqlen_k, query_offset + start_m + BLOCK_M)
        block_hi = tl.cdiv(tl.maximum(visible_end, 0), BLOCK_N)
        clean_end = tl.minimum(seqlen_k // BLOCK_N, _floor_div(query_offset + start_m + 1, BLOCK_N))
    else:
        block_hi = tl.cdiv(seqlen_k, BLOCK_N)
        clean_end = seqlen_k // BLOCK_N
    block_hi = tl.minimum(block_hi, block_hi_limit)
    clean_end = tl.maximum(tl.minimum(clean_end, block_hi), block_lo)
    far_left_end = tl.minimum(
        tl.maximum(_floor_div(query_offset + start_m - MAX_DISTANCE, BLOCK_N), block_lo), clean_end
    )
    far_right_start = tl.minimum(
        tl.maximum(_ceil_div(query_offset + start_m + BLOCK_M + MAX_DISTANCE, BLOCK_N), far_left_end), clean_end
    )
    return far_left_end, far_right_start, clean_end, block_hi


@_jit_for_varying_shapes
def _attention_forward_kernel(
    Q, K, V, Out, Lse, PartialAcc, PartialMax, PartialSum,
    KeyPaddingMask, Bias, CuSeqlensQ, CuSeqlensK, QueryOffset,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_lse_b, stride_lse_h,
    stride_mask_b,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    num_heads, seqlen_q, seqlen_k, query_offset, qk_scale, blocks_per_split,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    POSITION: tl.constexpr,
    MAX_DISTANCE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    SAFE_CLEAN: tl.constexpr,
    OFFSET_IN_MEMORY: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    if OFFSET_IN_MEMORY:  # decoding with a static cache: the position advances between replays of one CUDA graph
        query_offset = tl.load(QueryOffset).to(tl.int32)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    if CAUSAL:  # the longest rows first, so that the short ones fill the tail of the grid
        pid_m = tl.num_programs(0) - 1 - pid_m
    batch = pid_bh // num_heads
    head = pid_bh % num_heads
    q_start, seqlen_q, k_start, seqlen_k = _program_coordinates(
        CuSeqlensQ, CuSeqlensK, batch, seqlen_q, seqlen_k, IS_VARLEN
    )
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    query_positions = rows + query_offset
    batch64 = batch.to(tl.int64)
    head64 = head.to(tl.int64)
    q_base = Q + batch64 * stride_qb + head64 * stride_qh + q_start * stride_qm
    key_base = K + batch64 * stride_kb + head64 * stride_kh + k_start * stride_kn
    value_base = V + batch64 * stride_vb + head64 * stride_vh + k_start * stride_vn
    mask_base = KeyPaddingMask + batch64 * stride_mask_b
    q = tl.load(q_base + rows[:, None] * stride_qm + offs_d[None, :], mask=rows[:, None] < seqlen_q, other=0.0)

    bias_base = Bias
    bias_scalar = 0.0
    if POSITION == POSITION_T5:
        bias_base = Bias + head * stride_bias_h
    elif POSITION == POSITION_ALIBI:
        bias_scalar = tl.load(Bias + head).to(tl.float32) * LOG2E
    elif POSITION == POSITION_BIAS:
        bias_base = Bias + batch64 * stride_bias_b + head64 * stride_bias_h

    block_lo = 0
    block_hi_limit = tl.cdiv(seqlen_k, BLOCK_N)
    if IS_SPLIT:
        block_lo = tl.program_id(2) * blocks_per_split
        block_hi_limit = block_lo + blocks_per_split
    far_left_end, far_right_start, clean_end, block_hi = _key_ranges(
        start_m, seqlen_k, query_offset, block_lo, block_hi_limit, BLOCK_M, BLOCK_N, MAX_DISTANCE, CAUSAL
    )
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if POSITION == POSITION_T5:
        acc, row_sum, row_max = _forward_inner(
            acc, row_sum, row_max, q, key_base, value_base, stride_kn, stride_vn, mask_base, bias_base,
            stride_bias_m, stride_bias_n, rows, query_positions, seqlen_q, seqlen_k, qk_scale, tl.load(bias_base),
            block_lo, far_left_end, BLOCK_N, HEAD_DIM, POSITION, BIAS_SCALAR, MAX_DISTANCE,
            False, CAUSAL, HAS_PADDING, SAFE_CLEAN, INPUT_PRECISION,
        )
        if CAUSAL:  # nothing lies far to the right: the near blocks run in the masked loop (one pipeline fill less)
            masked_start = far_left_end
        else:
            acc, row_sum, row_max = _forward_inner(
                acc, row_sum, row_max, q, key_base, value_base, stride_kn, stride_vn, mask_base, bias_base,
                stride_bias_m, stride_bias_n, rows, query_positions, seqlen_q, seqlen_k, qk_scale, bias_scalar,
                far_left_end, far_right_start, BLOCK_N, HEAD_DIM, POSITION, BIAS_PER_SCORE, MAX_DISTANCE,
                False, CAUSAL, HAS_PADDING, SAFE_CLEAN, INPUT_PRECISION,
            )
            acc, row_sum, row_max = _forward_inner(
                acc, row_sum, row_max, q, key_base, value_base, stride_kn, stride_vn, mask_base, bias_base,
                stride_bias_m, stride_bias_n, rows, query_positions, seqlen_q, seqlen_k, qk_scale,
                tl.load(bias_base + 2 * MAX_DISTANCE + 2),
                far_right_start, clean_end, BLOCK_N, HEAD_DIM, POSITION, BIAS_SCALAR, MAX_DISTANCE,
                False, CAUSAL, HAS_PADDING, SAFE_CLEAN, INPUT_PRECISION,
            )
            masked_start = clean_end
    else:
        acc, row_sum, row_max = _forward_inner(
            acc, row_sum, row_max, q, key_base, value_base, stride_kn, stride_vn, mask_base, bias_base,
            stride_bias_m, stride_bias_n, rows, query_positions, seqlen_q, seqlen_k, qk_scale, bias_scalar,
            block_lo, clean_end, BLOCK_N, HEAD_DIM, POSITION, BIAS_PER_SCORE, MAX_DISTANCE,
            False, CAUSAL, HAS_PADDING, SAFE_CLEAN, INPUT_PRECISION,
        )
        masked_start = clean_end
    acc, row_sum, row_max = _forward_inner(
        acc, row_sum, row_max, q, key_base, value_base, stride_kn, stride_vn, mask_base, bias_base,
        stride_bias_m, stride_bias_n, rows, query_positions, seqlen_q, seqlen_k, qk_scale, bias_scalar,
        masked_start, block_hi, BLOCK_N, HEAD_DIM, POSITION, BIAS_PER_SCORE, MAX_DISTANCE,
        True, CAUSAL, HAS_PADDING, True, INPUT_PRECISION,
    )

    if IS_SPLIT:  # unnormalised partial results, merged by _split_combine_kernel
        partial = (tl.program_id(2) * tl.num_programs(1) + pid_bh).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(PartialAcc + partial[:, None] * HEAD_DIM + offs_d[None, :], acc)
        tl.store(PartialMax + partial, row_max)
        tl.store(PartialSum + partial, row_sum)
    else:
        empty = row_sum == 0.0
        out = acc / tl.where(empty, 1.0, row_sum)[:, None]
        out_base = Out + batch64 * stride_ob + head64 * stride_oh + q_start * stride_om
        tl.store(out_base + rows[:, None] * stride_om + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=rows[:, None] < seqlen_q)
        lse = tl.where(empty, float("inf"), row_max + tl.math.log2(tl.where(empty, 1.0, row_sum)))
        lse_base = Lse + batch64 * stride_lse_b + head64 * stride_lse_h + q_start
        tl.store(lse_base + rows, lse, mask=rows < seqlen_q)


@_jit_for_varying_shapes
def _split_combine_kernel(
    PartialAcc, PartialMax, PartialSum, Out, Lse, CuSeqlensQ,
    stride_ob, stride_oh, stride_om,
    stride_lse_b, stride_lse_h,
    num_heads, seqlen_q, num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """Merge the per-split (acc, max, sum) of the split-key (decoding) forward into out and lse."""
    pid_bh = tl.program_id(0)
    batch = pid_bh // num_heads
    head = pid_bh % num_heads
    q_start = tl.zeros([], tl.int64)
    if IS_VARLEN:
        q_start = tl.load(CuSeqlensQ + batch).to(tl.int64)
        seqlen_q = (tl.load(CuSeqlensQ + batch + 1) - q_start).to(tl.int32)
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    total_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for split in range(num_splits):
        partial = (split * tl.num_programs(0) + pid_bh).to(tl.int64) * BLOCK_M + rows
        total_max = tl.maximum(total_max, tl.load(PartialMax + partial))
    shift = tl.where(total_max == float("-inf"), 0.0, total_max)
    total_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for split in range(num_splits):
        partial = (split * tl.num_programs(0) + pid_bh).to(tl.int64) * BLOCK_M + rows
        weight = tl.math.exp2(tl.load(PartialMax + partial) - shift)
        total_sum += tl.load(PartialSum + partial) * weight
        acc += tl.load(PartialAcc + partial[:, None] * HEAD_DIM + offs_d[None, :]) * weight[:, None]
    empty = total_sum == 0.0
    out = acc / tl.where(empty, 1.0, total_sum)[:, None]
    batch64 = batch.to(tl.int64)
    head64 = head.to(tl.int64)
    out_base = Out + batch64 * stride_ob + head64 * stride_oh + q_start * stride_om
    tl.store(out_base + rows[:, None] * stride_om + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=rows[:, None] < seqlen_q)
    lse = tl.where(empty, float("inf"), total_max + tl.math.log2(tl.where(empty, 1.0, total_sum)))
    tl.store(Lse + batch64 * stride_lse_b + head64 * stride_lse_h + q_start + rows, lse, mask=rows < seqlen_q)


@_jit_for_varying_shapes
def _backward_preprocess_kernel(
    Out, GradOut, Delta, CuSeqlensQ,
    stride_ob, stride_oh, stride_om,
    stride_gb, stride_gh, stride_gm,
    stride_delta_b, stride_delta_h,
    num_heads, seqlen_q,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """delta_i = sum_d out_id * grad_out_id (fp32), the softmax-backward row term."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // num_heads
    head = pid_bh % num_heads
    q_start = tl.zeros([], tl.int64)
    if IS_VARLEN:
        q_start = tl.load(CuSeqlensQ + batch).to(tl.int64)
        seqlen_q = (tl.load(CuSeqlensQ + batch + 1) - q_start).to(tl.int32)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    batch64 = batch.to(tl.int64)
    head64 = head.to(tl.int64)
    inside = rows[:, None] < seqlen_q
    out = tl.load(Out + batch64 * stride_ob + head64 * stride_oh + (q_start + rows[:, None]) * stride_om
                  + offs_d[None, :], mask=inside, other=0.0)
    grad = tl.load(GradOut + batch64 * stride_gb + head64 * stride_gh + (q_start + rows[:, None]) * stride_gm
                   + offs_d[None, :], mask=inside, other=0.0)
    delta = tl.sum(out.to(tl.float32) * grad.to(tl.float32), axis=1)
    tl.store(Delta + batch64 * stride_delta_b + head64 * stride_delta_h + q_start + rows, delta, mask=rows < seqlen_q)


@triton.jit
def _query_ranges(
    start_n,
    seqlen_q,
    seqlen_k,
    query_offset,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_DISTANCE: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Query-block ranges for the key block at ``start_n``: [lo, clean_start) needs the causal or key-boundary
    mask (a partial key block masks every tile); the unmasked rest splits into [clean_start, far_right_end) far-right
    (queries far before the keys), [far_right_end, far_left_start) near, [far_left_start, num_m_blocks) far-left."""
    num_m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    if CAUSAL:
        block_lo = tl.minimum(tl.maximum(start_n - query_offset, 0) // BLOCK_M, num_m_blocks)
        clean_start = tl.maximum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - query_offset, 0), BLOCK_M), block_lo)
        clean_start = tl.minimum(clean_start, num_m_blocks)
    else:
        block_lo = 0
        clean_start = 0
    clean_start = tl.where(start_n + BLOCK_N > seqlen_k, num_m_blocks, clean_start)
    far_right_end = tl.minimum(tl.maximum(_floor_div(start_n - query_offset - MAX_DISTANCE, BLOCK_M), clean_start),
                               num_m_blocks)
    far_left_start = tl.minimum(
        tl.maximum(_ceil_div(start_n + BLOCK_N + MAX_DISTANCE - query_offset, BLOCK_M), far_right_end), num_m_blocks
    )
    return num_m_blocks, block_lo, clean_start, far_right_end, far_left_start


@triton.jit
def _backward_tile_ds(
    k, v, keys, key_keep, q_base, do_base, stride_qm, stride_dom, lse_base, delta_base,
    bias_base, stride_bias_m, stride_bias_n, seqlen_q, seqlen_k, query_offset, qk_scale, bias_scalar, block,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    POSITION: tl.constexpr,
    BIAS_MODE: tl.constexpr,
    MAX_DISTANCE: tl.constexpr,
    APPLY_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    EVEN_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """For query block ``block`` against this program's keys: (q, do, p^T, ds^T), the (keys, queries) tiles of the
    probabilities and of the score gradient. ``EVEN_M``: every query block is full, the row loads need no mask.
    ``BIAS_TILE``: ``bias_base`` is the transposed bank tile of query block 0 (that of block b is b tiles further)."""
    offs_d = tl.arange(0, HEAD_DIM)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    query_positions = rows + query_offset
    in_rows = rows < seqlen_q
    if EVEN_M:
        q = tl.load(q_base + rows[:, None] * stride_qm + offs_d[None, :])
        lse = tl.load(lse_base + rows)
    else:
        q = tl.load(q_base + rows[:, None] * stride_qm + offs_d[None, :], mask=in_rows[:, None], other=0.0)
        # rows past the end get lse = +inf: their probabilities are 0 without a score mask
        lse = tl.load(lse_base + rows, mask=in_rows, other=float("inf"))
    scores_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale
    if BIAS_MODE == BIAS_TILE:  # a contiguous, aligned tile: vector loads, no clamp, no data-dependent index
        tile = bias_base + block * (BLOCK_M * BLOCK_N)
        scores_t = scores_t + tl.load(tile + tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :])
    else:
        scores_t = _score_bias(
            scores_t, query_positions, keys, rows, seqlen_q, seqlen_k, bias_base, stride_bias_m, stride_bias_n,
            bias_scalar, POSITION, BIAS_MODE, MAX_DISTANCE, True,
        )
    if APPLY_MASK:
        visible = keys[:, None] < seqlen_k
        if CAUSAL:
            visible = visible & (keys[:, None] <= query_positions[None, :])
        scores_t = tl.where(visible, scores_t, float("-inf"))
    p_t = tl.math.exp2(scores_t - lse[None, :])
    if HAS_PADDING:
        p_t = tl.where(key_keep[:, None], p_t, 0.0)
    if EVEN_M:
        do = tl.load(do_base + rows[:, None] * stride_dom + offs_d[None, :])
        delta = tl.load(delta_base + rows)
    else:
        do = tl.load(do_base + rows[:, None] * stride_dom + offs_d[None, :], mask=in_rows[:, None], other=0.0)
        delta = tl.load(delta_base + rows, mask=in_rows, other=0.0)
    dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    return q, do, p_t, ds_t


@triton.jit
def _near_tile_table_gradient(
    ds_t, distance_row, base, left_sum, right_sum,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_DISTANCE: tl.constexpr,
):
    """Add a near tile's score gradient to the table gradient's row of relative positions (slot = rel +
    MAX_DISTANCE + 1; everything beyond either end goes to ``left_sum`` / ``right_sum``). ``ds_t[jl, il]`` has
    rel = base + jl - il."""
    # skewed[t, i] = ds_t[(i + t) % BLOCK_N, i]: one tl.gather (through shared memory) puts diagonal t (jl - il = t)
    # in row t where i + t < BLOCK_N, and diagonal t - BLOCK_N where it wrapped; BLOCK_M <= BLOCK_N keeps that one wrap.
    tl.static_assert(BLOCK_M <= BLOCK_N)
    shifts = tl.arange(0, BLOCK_N)
    unwrapped = shifts[:, None] + tl.arange(0, BLOCK_M)[None, :]
    wrapped = unwrapped >= BLOCK_N
    skewed = tl.gather(ds_t, tl.where(wrapped, unwrapped - BLOCK_N, unwrapped), 0)
    upper = tl.sum(tl.where(wrapped, 0.0, skewed), axis=1)
    lower = tl.sum(tl.where(wrapped, skewed, 0.0), axis=1)
    upper_slot = base + shifts + MAX_DISTANCE + 1
    lower_slot = upper_slot - BLOCK_N
    left_sum += tl.sum(tl.where(upper_slot <= 0, upper, 0.0) + tl.where(lower_slot <= 0, lower, 0.0), axis=0)
    right_sum += tl.sum(tl.where(upper_slot >= 2 * MAX_DISTANCE + 2, upper, 0.0)
                        + tl.where(lower_slot >= 2 * MAX_DISTANCE + 2, lower, 0.0), axis=0)
    upper_inner = (upper_slot > 0) & (upper_slot < 2 * MAX_DISTANCE + 2)
    # rows whose wrapped part is empty (t <= BLOCK_N - BLOCK_M) have nothing to add
    lower_inner = (shifts > BLOCK_N - BLOCK_M) & (lower_slot > 0) & (lower_slot < 2 * MAX_DISTANCE + 2)
    # The slots a tile updates are disjoint, but the next tile's overlap them through other threads: the barrier
    # orders this tile's read-modify-writes before the next tile's.
    tl.store(distance_row + upper_slot, tl.load(distance_row + upper_slot, mask=upper_inner, other=0.0) + upper,
             mask=upper_inner)
    tl.store(distance_row + lower_slot, tl.load(distance_row + lower_slot, mask=lower_inner, other=0.0) + lower,
             mask=lower_inner)
    tl.debug_barrier()
    return left_sum, right_sum


@triton.jit
def _backward_dkdv_inner(
    dk, dv, far_sum, near_left, near_right, distance_row, start_n, k, v, keys, key_keep,
    q_base, do_base, stride_qm, stride_dom, lse_base, delta_base,
    bias_base, stride_bias_m, stride_bias_n, dbias_base, stride_dbias_m, stride_dbias_n, dq_base, stride_dqm,
    seqlen_q, seqlen_k, query_offset, qk_scale, scale, bias_scalar,
    block_start, block_end,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    POSITION: tl.constexpr,
    BIAS_MODE: tl.constexpr,
    MAX_DISTANCE: tl.constexpr,
    APPLY_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    EVEN_M: tl.constexpr,
    FAR_TABLE_GRAD: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    FUSED_DQ: tl.constexpr,
    NEAR_TABLE_GRAD: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    for block in range(block_start, block_end):
        q, do, p_t, ds_t = _backward_tile_ds(
            k, v, keys, key_keep, q_base, do_base, stride_qm, stride_dom, lse_base, delta_base,
            bias_base, stride_bias_m, stride_bias_n, seqlen_q, seqlen_k, query_offset, qk_scale, bias_scalar, block,
            BLOCK_M, BLOCK_N, HEAD_DIM, POSITION, BIAS_MODE, MAX_DISTANCE, APPLY_MASK, CAUSAL, HAS_PADDING, EVEN_M,
            INPUT_PRECISION,
        )
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        if FUSED_DQ:  # dq of this tile, added in fp32 (atomics: the order of the additions varies run to run)
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=INPUT_PRECISION)
            if EVEN_M:
                tl.atomic_add(dq_base + rows[:, None] * stride_dqm + offs_d[None, :], dq * scale, sem="relaxed")
            else:
                tl.atomic_add(dq_base + rows[:, None] * stride_dqm + offs_d[None, :], dq * scale,
                              mask=rows[:, None] < seqlen_q, sem="relaxed")
        if FAR_TABLE_GRAD:  # a far tile: one bucket, its share of the table gradient is the tile sum
            far_sum += tl.sum(tl.sum(ds_t, axis=1), axis=0)
        if NEAR_TABLE_GRAD:
            near_left, near_right = _near_tile_table_gradient(
                ds_t, distance_row, start_n - query_offset - block * BLOCK_M, near_left, near_right,
                BLOCK_M, BLOCK_N, MAX_DISTANCE,
            )
        if BIAS_GRAD:
            tl.store(dbias_base + rows[None, :] * stride_dbias_m + keys[:, None] * stride_dbias_n, ds_t,
                     mask=(rows[None, :] < seqlen_q) & (keys[:, None] < seqlen_k))
    return dk, dv, far_sum, near_left, near_right


@triton.jit
def _key_block_setup(
    K, V, KeyPaddingMask, Bias, CuSeqlensQ, CuSeqlensK,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_mask_b, stride_bias_h,
    num_heads, seqlen_q, seqlen_k, pid_n, pid_bh,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    POSITION: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """What the programs over one key block share: coordinates, the block's keys, values and padding flags."""
    batch = pid_bh // num_heads
    head = pid_bh % num_heads
    q_start, seqlen_q, k_start, seqlen_k = _program_coordinates(
        CuSeqlensQ, CuSeqlensK, batch, seqlen_q, seqlen_k, IS_VARLEN
    )
    start_n = pid_n * BLOCK_N
    keys = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    batch64 = batch.to(tl.int64)
    head64 = head.to(tl.int64)
    in_keys = keys[:, None] < seqlen_k
    k = tl.load(K + batch64 * stride_kb + head64 * stride_kh + (k_start + keys[:, None]) * stride_kn + offs_d[None, :],
                mask=in_keys, other=0.0)
    v = tl.load(V + batch64 * stride_vb + head64 * stride_vh + (k_start + keys[:, None]) * stride_vn + offs_d[None, :],
                mask=in_keys, other=0.0)
    key_keep = keys < seqlen_k
    if HAS_PADDING:
        key_keep = tl.load(KeyPaddingMask + batch64 * stride_mask_b + keys, mask=keys < seqlen_k, other=0) != 0
    bias_scalar = 0.0
    if POSITION == POSITION_ALIBI:
        bias_scalar = tl.load(Bias + head).to(tl.float32) * LOG2E
    return batch64, head64, q_start, seqlen_q, k_start, seqlen_k, start_n, keys, k, v, key_keep, bias_scalar


@_jit_for_varying_shapes
def _attention_backward_dkdv_kernel(
    Q, K, V, GradOut, Lse, Delta, DK, DV, DQAccumulator,
    KeyPaddingMask, Bias, BiasBank, DistanceGrad, DBias, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_gb, stride_gh, stride_gm,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqm,
    stride_lse_b, stride_lse_h,
    stride_mask_b,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    stride_dbias_b, stride_dbias_h, stride_dbias_m, stride_dbias_n,
    num_heads, seqlen_q, seqlen_k, query_offset, qk_scale, scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    POSITION: tl.constexpr,
    MAX_DISTANCE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    EVEN_M: tl.constexpr,
    TABLE_GRAD: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    FUSED_DQ: tl.constexpr,
    BANK_TILES: tl.constexpr,
    BANK_LEFT_TILES: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """dk and dv of one key block, looping over the query blocks. For T5 it also sums the table gradient into this
    block's row of ``DistanceGrad``: each near tile along its diagonals, each far tile whole into an end slot.
    ``BANK_TILES`` > 0 (non-causal, the table frozen): the unmasked near tiles read their bias from
    ``BiasBank``'s transposed tiles, query block ``t - BANK_LEFT_TILES`` blocks (of BLOCK_M) after the key block's
    start reading tile ``t``."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch64, head64, q_start, seqlen_q, k_start, seqlen_k, start_n, keys, k, v, key_keep, bias_scalar = (
        _key_block_setup(
            K, V, KeyPaddingMask, Bias, CuSeqlensQ, CuSeqlensK,
            stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_mask_b, stride_bias_h,
            num_heads, seqlen_q, seqlen_k, pid_n, pid_bh, BLOCK_N, HEAD_DIM, POSITION, HAS_PADDING, IS_VARLEN,
        )
    )
    if start_n >= seqlen_k:
        return
    q_base = Q + batch64 * stride_qb + head64 * stride_qh + q_start * stride_qm
    do_base = GradOut + batch64 * stride_gb + head64 * stride_gh + q_start * stride_gm
    lse_base = Lse + batch64 * stride_lse_b + head64 * stride_lse_h + q_start
    delta_base = Delta + batch64 * stride_lse_b + head64 * stride_lse_h + q_start
    bias_base = Bias + batch64 * stride_bias_b + head64 * stride_bias_h
    dbias_base = DBias + batch64 * stride_dbias_b + head64 * stride_dbias_h
    dq_base = DQAccumulator + batch64 * stride_dqb + head64 * stride_dqh + q_start * stride_dqm
    num_m_blocks, block_lo, clean_start, far_right_end, far_left_start = _query_ranges(
        start_n, seqlen_q, seqlen_k, query_offset, BLOCK_M, BLOCK_N, MAX_DISTANCE, CAUSAL
    )

    distance_row = DistanceGrad + ((batch64 * tl.num_programs(0) + pid_n) * num_heads + head64) * (2 * MAX_DISTANCE + 3)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    # the far tiles' sums, then the near tiles' sums of everything beyond either end of the row
    far_left, far_right = tl.zeros([], dtype=tl.float32), tl.zeros([], dtype=tl.float32)
    near_left, near_right = tl.zeros([], dtype=tl.float32), tl.zeros([], dtype=tl.float32)
    unused = tl.zeros([], dtype=tl.float32)
    if POSITION == POSITION_T5:
        if CAUSAL:  # nothing lies far to the right (queries before the keys): the near blocks join the masked loop
            masked_end = far_left_start
        else:
            masked_end = clean_start
    else:
        masked_end = clean_start
    dk, dv, unused, near_left, near_right = _backward_dkdv_inner(
        dk, dv, unused, near_left, near_right, distance_row, start_n, k, v, keys, key_keep, q_base, do_base,
        stride_qm, stride_gm, lse_base, delta_base,
        bias_base, stride_bias_m, stride_bias_n, dbias_base, stride_dbias_m, stride_dbias_n, dq_base, stride_dqm,
        seqlen_q, seqlen_k, query_offset, qk_scale, scale, bias_scalar, block_lo, masked_end,
        BLOCK_M, BLOCK_N, HEAD_DIM, POSITION, BIAS_PER_SCORE, MAX_DISTANCE, True, CAUSAL, HAS_PADDING, EVEN_M,
        False, BIAS_GRAD, FUSED_DQ, TABLE_GRAD, INPUT_PRECISION,
    )
    if POSITION == POSITION_T5:
        if not CAUSAL:
            dk, dv, far_right, near_left, near_right = _backward_dkdv_inner(
                dk, dv, far_right, near_left, near_right, distance_row, start_n, k, v, keys, key_keep, q_base, do_base,
                stride_qm, stride_gm, lse_base,
                delta_base, bias_base, stride_bias_m, stride_bias_n, dbias_base, stride_dbias_m, stride_dbias_n,
                dq_base, stride_dqm, seqlen_q, seqlen_k, query_offset, qk_scale, scale,
                tl.load(bias_base + 2 * MAX_DISTANCE + 2), clean_start, far_right_end,
                BLOCK_M, BLOCK_N, HEAD_DIM, POSITION, BIAS_SCALAR, MAX_DISTANCE, False, CAUSAL, HAS_PADDING, EVEN_M,
                TABLE_GRAD, BIAS_GRAD, FUSED_DQ, False, INPUT_PRECISION,
            )
            if BANK_TILES > 0:  # the tile query block 0 would read (block b reads the b-th after it)
                near_mode: tl.constexpr = BIAS_TILE
                first_tile = head64 * BANK_TILES + BANK_LEFT_TILES - start_n // BLOCK_M
                near_base = BiasBank + first_tile * (BLOCK_M * BLOCK_N)
            else:
                near_mode: tl.constexpr = BIAS_PER_SCORE
                near_base = bias_base
            dk, dv, unused, near_left, near_right = _backward_dkdv_inner(
                dk, dv, unused, near_left, near_right, distance_row, start_n, k, v, keys, key_keep, q_base, do_base,
                stride_qm, stride_gm, lse_base,
                delta_base, near_base, stride_bias_m, stride_bias_n, dbias_base, stride_dbias_m, stride_dbias_n,
                dq_base, stride_dqm, seqlen_q, seqlen_k, query_offset, qk_scale, scale, bias_scalar, far_right_end,
                far_left_start, BLOCK_M, BLOCK_N, HEAD_DIM, POSITION, near_mode, MAX_DISTANCE, False, CAUSAL,
                HAS_PADDING, EVEN_M, False, BIAS_GRAD, FUSED_DQ, TABLE_GRAD, INPUT_PRECISION,
            )
        dk, dv, far_left, near_left, near_right = _backward_dkdv_inner(
            dk, dv, far_left, near_left, near_right, distance_row, start_n, k, v, keys, key_keep, q_base, do_base,
            stride_qm, stride_gm, lse_base,
            delta_base, bias_base, stride_bias_m, stride_bias_n, dbias_base, stride_dbias_m, stride_dbias_n,
            dq_base, stride_dqm, seqlen_q, seqlen_k, query_offset, qk_scale, scale, tl.load(bias_base),
            far_left_start, num_m_blocks,
            BLOCK_M, BLOCK_N, HEAD_DIM, POSITION, BIAS_SCALAR, MAX_DISTANCE, False, CAUSAL, HAS_PADDING, EVEN_M,
            TABLE_GRAD, BIAS_GRAD, FUSED_DQ, False, INPUT_PRECISION,
        )
    else:
        dk, dv, unused, near_left, near_right = _backward_dkdv_inner(
            dk, dv, unused, near_left, near_right, distance_row, start_n, k, v, keys, key_keep, q_base, do_base,
            stride_qm, stride_gm, lse_base,
            delta_base, bias_base, stride_bias_m, stride_bias_n, dbias_base, stride_dbias_m, stride_dbias_n,
            dq_base, stride_dqm, seqlen_q, seqlen_k, query_offset, qk_scale, scale, bias_scalar, clean_start,
            num_m_blocks, BLOCK_M, BLOCK_N, HEAD_DIM, POSITION, BIAS_PER_SCORE, MAX_DISTANCE, False, CAUSAL,
            HAS_PADDING, EVEN_M, False, BIAS_GRAD, FUSED_DQ, False, INPUT_PRECISION,
        )
    offs_d = tl.arange(0, HEAD_DIM)
    in_keys = keys[:, None] < seqlen_k
    dk_base = DK + batch64 * stride_dkb + head64 * stride_dkh + k_start * stride_dkn
    dv_base = DV + batch64 * stride_dvb + head64 * stride_dvh + k_start * stride_dvn
    tl.store(dk_base + keys[:, None] * stride_dkn + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=in_keys)
    tl.store(dv_base + keys[:, None] * stride_dvn + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=in_keys)
    if TABLE_GRAD:
        tl.store(distance_row, far_left + near_left)
        tl.store(distance_row + 2 * MAX_DISTANCE + 2, far_right + near_right)


@triton.jit
def _backward_dq_inner(
    dq, q, do, lse, delta, key_base, value_base, stride_kn, stride_vn, mask_base,
    bias_base, stride_bias_m, stride_bias_n, rows, query_positions,
    seqlen_q, seqlen_k, qk_scale, bias_scalar, block_start, block_end,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    POSITION: tl.constexpr,
    BIAS_MODE: tl.constexpr,
    MAX_DISTANCE: tl.constexpr,
    APPLY_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for block in range(block_start, block_end):
        keys = block * BLOCK_N + offs_n
        if APPLY_MASK:
            k = tl.load(key_base + keys[:, None] * stride_kn + offs_d[None, :], mask=keys[:, None] < seqlen_k,
                        other=0.0)
            v = tl.load(value_base + keys[:, None] * stride_vn + offs_d[None, :], mask=keys[:, None] < seqlen_k,
                        other=0.0)
        else:
            k = tl.load(key_base + keys[:, None] * stride_kn + offs_d[None, :])
            v = tl.load(value_base + keys[:, None] * stride_vn + offs_d[None, :])
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        scores = _score_bias(
            scores, query_positions, keys, rows, seqlen_q, seqlen_k, bias_base, stride_bias_m, stride_bias_n,
            bias_scalar, POSITION, BIAS_MODE, MAX_DISTANCE, False,
        )
        if APPLY_MASK:
            visible = keys[None, :] < seqlen_k
            if CAUSAL:
                visible = visible & (keys[None, :] <= query_positions[:, None])
            scores = tl.where(visible, scores, float("-inf"))
        p = tl.math.exp2(scores - lse[:, None])
        if HAS_PADDING:
            keep = tl.load(mask_base + keys, mask=keys < seqlen_k, other=0) != 0
            p = tl.where(keep[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@_jit_for_varying_shapes
def _attention_backward_dq_kernel(
    Q, K, V, GradOut, Lse, Delta, DQ,
    KeyPaddingMask, Bias, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_gb, stride_gh, stride_gm,
    stride_dqb, stride_dqh, stride_dqm,
    stride_lse_b, stride_lse_h,
    stride_mask_b,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    num_heads, seqlen_q, seqlen_k, query_offset, qk_scale, scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    POSITION: tl.constexpr,
    MAX_DISTANCE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """dq of one query block, looping over the key blocks (no atomics: dq is written once)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    batch = pid_bh // num_heads
    head = pid_bh % num_heads
    q_start, seqlen_q, k_start, seqlen_k = _program_coordinates(
        CuSeqlensQ, CuSeqlensK, batch, seqlen_q, seqlen_k, IS_VARLEN
    )
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    query_positions = rows + query_offset
    batch64 = batch.to(tl.int64)
    head64 = head.to(tl.int64)
    in_rows = rows < seqlen_q
    q = tl.load(Q + batch64 * stride_qb + head64 * stride_qh + (q_start + rows[:, None]) * stride_qm + offs_d[None, :],
                mask=in_rows[:, None], other=0.0)
    do = tl.load(GradOut + batch64 * stride_gb + head64 * stride_gh + (q_start + rows[:, None]) * stride_gm
                 + offs_d[None, :], mask=in_rows[:, None], other=0.0)
    lse = tl.load(Lse + batch64 * stride_lse_b + head64 * stride_lse_h + q_start + rows, mask=in_rows,
                  other=float("inf"))
    delta = tl.load(Delta + batch64 * stride_lse_b + head64 * stride_lse_h + q_start + rows, mask=in_rows, other=0.0)
    key_base = K + batch64 * stride_kb + head64 * stride_kh + k_start * stride_kn
    value_base = V + batch64 * stride_vb + head64 * stride_vh + k_start * stride_vn
    mask_base = KeyPaddingMask + batch64 * stride_mask_b
    bias_base = Bias
    bias_scalar = 0.0
    if POSITION == POSITION_T5:
        bias_base = Bias + head * stride_bias_h
    elif POSITION == POSITION_ALIBI:
        bias_scalar = tl.load(Bias + head).to(tl.float32) * LOG2E
    elif POSITION == POSITION_BIAS:
        bias_base = Bias + batch64 * stride_bias_b + head64 * stride_bias_h

    far_left_end, far_right_start, clean_end, block_hi = _key_ranges(
        start_m, seqlen_k, query_offset, 0, tl.cdiv(seqlen_k, BLOCK_N), BLOCK_M, BLOCK_N, MAX_DISTANCE, CAUSAL
    )
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if POSITION == POSITION_T5:
        dq = _backward_dq_inner(
            dq, q, do, lse, delta, key_base, value_base, stride_kn, stride_vn, mask_base, bias_base,
            stride_bias_m, stride_bias_n, rows, query_positions, seqlen_q, seqlen_k, qk_scale, tl.load(bias_base),
            0, far_left_end, BLOCK_N, HEAD_DIM, POSITION, BIAS_SCALAR, MAX_DISTANCE, False, CAUSAL, HAS_PADDING,
            INPUT_PRECISION,
        )
        if CAUSAL:  # nothing lies far to the right: the near blocks run in the masked loop
            masked_start = far_left_end
        else:
            dq = _backward_dq_inner(
                dq, q, do, lse, delta, key_base, value_base, stride_kn, stride_vn, mask_base, bias_base,
                stride_bias_m, stride_bias_n, rows, query_positions, seqlen_q, seqlen_k, qk_scale, bias_scalar,
                far_left_end, far_right_start, BLOCK_N, HEAD_DIM, POSITION, BIAS_PER_SCORE, MAX_DISTANCE, False,
                CAUSAL, HAS_PADDING, INPUT_PRECISION,
            )
            dq = _backward_dq_inner(
                dq, q, do, lse, delta, key_base, value_base, stride_kn, stride_vn, mask_base, bias_base,
                stride_bias_m, stride_bias_n, rows, query_positions, seqlen_q, seqlen_k, qk_scale,
                tl.load(bias_base + 2 * MAX_DISTANCE + 2), far_right_start, clean_end, BLOCK_N, HEAD_DIM, POSITION,
                BIAS_SCALAR, MAX_DISTANCE, False, CAUSAL, HAS_PADDING, INPUT_PRECISION,
            )
            masked_start = clean_end
    else:
        dq = _backward_dq_inner(
            dq, q, do, lse, delta, key_base, value_base, stride_kn, stride_vn, mask_base, bias_base,
            stride_bias_m, stride_bias_n, rows, query_positions, seqlen_q, seqlen_k, qk_scale, bias_scalar,
            0, clean_end, BLOCK_N, HEAD_DIM, POSITION, BIAS_PER_SCORE, MAX_DISTANCE, False, CAUSAL, HAS_PADDING,
            INPUT_PRECISION,
        )
        masked_start = clean_end
    dq = _backward_dq_inner(
        dq, q, do, lse, delta, key_base, value_base, stride_kn, stride_vn, mask_base, bias_base,
        stride_bias_m, stride_bias_n, rows, query_positions, seqlen_q, seqlen_k, qk_scale, bias_scalar,
        masked_start, block_hi, BLOCK_N, HEAD_DIM, POSITION, BIAS_PER_SCORE, MAX_DISTANCE, True, CAUSAL, HAS_PADDING,
        INPUT_PRECISION,
    )
    dq_base = DQ + batch64 * stride_dqb + head64 * stride_dqh + q_start * stride_dqm
    tl.store(dq_base + rows[:, None] * stride_dqm + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=in_rows[:, None])


@_jit_for_varying_shapes
def _t5_band_distance_grad_kernel(
    Q, K, V, GradOut, Lse, Delta, Bias, DistanceGrad, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_gb, stride_gh, stride_gm,
    stride_lse_b, stride_lse_h,
    stride_bias_h,
    num_heads, seqlen_q, seqlen_k, qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_DISTANCE: tl.constexpr,
    CAUSAL: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    EVEN_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """The T5 table gradient's band ``|rel| <= MAX_DISTANCE`` for one key block, query offset 0: the score gradient of
    the query blocks that reach the band, recomputed, summed along its diagonals into this program's row of
    ``DistanceGrad`` (slots 1 .. 2 * MAX_DISTANCE + 1; the end slots, everything beyond, are left to the caller:
    the Hopper T5 kernels' backward sums them, ``attention_fa4_t5_kernels``). No dk, dv or dq: two products a
    tile where the dk/dv kernel takes four, over about (BLOCK_N + 2 * MAX_DISTANCE) / BLOCK_M query blocks."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch64, head64, q_start, seqlen_q, _k_start, seqlen_k, start_n, keys, k, v, key_keep, _bias_scalar = (
        _key_block_setup(
        K, V, K, Bias, CuSeqlensQ, CuSeqlensK,
        stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, 0, stride_bias_h,
        num_heads, seqlen_q, seqlen_k, pid_n, pid_bh, BLOCK_N, HEAD_DIM, POSITION_T5, False, IS_VARLEN,
    ))
    if start_n >= seqlen_k:
        return
    q_base = Q + batch64 * stride_qb + head64 * stride_qh + q_start * stride_qm
    do_base = GradOut + batch64 * stride_gb + head64 * stride_gh + q_start * stride_gm
    lse_base = Lse + batch64 * stride_lse_b + head64 * stride_lse_h + q_start
    delta_base = Delta + batch64 * stride_lse_b + head64 * stride_lse_h + q_start
    bias_base = Bias + head64 * stride_bias_h
    distance_row = DistanceGrad + ((batch64 * tl.num_programs(0) + pid_n) * num_heads + head64) * (2 * MAX_DISTANCE + 3)
    # query block b holds rel from start_n - (b + 1) * BLOCK_M + 1 to start_n + BLOCK_N - 1 - b * BLOCK_M
    block_lo = tl.maximum(_floor_div(start_n - MAX_DISTANCE, BLOCK_M), 0)
    if CAUSAL:  # blocks wholly before the keys see none of them
        block_lo = tl.maximum(block_lo, start_n // BLOCK_M)
    block_hi = tl.minimum(_floor_div(start_n + BLOCK_N - 1 + MAX_DISTANCE, BLOCK_M) + 1, tl.cdiv(seqlen_q, BLOCK_M))
    beyond = tl.zeros([], dtype=tl.float32)  # the sums beyond either end, which this pass leaves out
    for block in range(block_lo, block_hi):
        _q, _do, _p_t, ds_t = _backward_tile_ds(
            k, v, keys, key_keep, q_base, do_base, stride_qm, stride_gm, lse_base, delta_base,
            bias_base, 0, 0, seqlen_q, seqlen_k, 0, qk_scale, 0.0, block,
            BLOCK_M, BLOCK_N, HEAD_DIM, POSITION_T5, BIAS_PER_SCORE, MAX_DISTANCE, True, CAUSAL, False, EVEN_M,
            INPUT_PRECISION,
        )
        _near_tile_table_gradient(
            ds_t, distance_row, start_n - block * BLOCK_M, beyond, beyond, BLOCK_M, BLOCK_N, MAX_DISTANCE,
        )
