"""Hopper-specific Triton routes for the T5-bias attention forward (issue 24), against cuDNN and FAT5's kernels.

Issue 24 asks whether Hopper's features, used from Triton, close the gap between FAT5's T5-bias forward and SDPA's
cuDNN backend without a bias (FAT5 reached about 0.45-0.7x of it at L 512-2048 on an H100). This script writes
a small FlashAttention-2 forward of its own (one program per (query block, batch x head), online softmax in exp2,
fixed length, non-causal, inputs in the model's (batch, length, heads, head_dim) memory layout) in the variants
that issue names, and times each against the same peers:

* ``pointer``: K and V read with plain pointer loads (pipelined by Triton into cp.async): the kernel's baseline;
* ``tma``: Q, K, V and the output moved through device-side tensor descriptors (``tl.make_tensor_descriptor``,
  TMA on Hopper); the descriptors need the global scratch that ``triton.set_allocator`` provides;
* ``tma_host``: ``tma`` with the descriptors made on the host (``triton.tools.tensor_descriptor``) and passed by
  value, as Triton's fused-attention tutorial does on Hopper, instead of by every program;
* ``persistent``: ``tma`` on a persistent grid (as many programs as SMs, each looping over the tiles);
* ``tma_ws`` and ``persistent_ws``: the same with ``warp_specialize=True`` on the key loop (producer warps issue
  the TMA loads).

Each variant runs with five biases: ``no_bias``; ``t5``, where every tile gathers its scores' bias from the head's
row of bias by relative distance, ``row[h, clamp(rel, -(D+1), D+1) + D + 1]`` (D = max_distance; computed in torch
beforehand: T5's bucket function, the table gathered, times log2(e)); ``t5_far``, FAT5's optimisation on top:
the key tiles wholly beyond D from the query tile (far) add one scalar and skip the gather, in one loop over both
runs of far tiles after the loop over the near ones; and ``t5_bank``, ``t5_far`` without the per-score gather, which
is what costs (on an H100, ``pointer_t5`` runs at under half of ``pointer_no_bias``): a near tile's bias depends only
on the head and on the tile's diagonal offset ``start_n - start_m`` (fixed length, no query offset), which takes a
handful of values (six at 128 x 64 tiles and D = 128), so a bank of those tiles per head, ``bank[h, t, i, j] =
row[h, clamp(offset_t + j - i, -(D+1), D+1) + D + 1]`` (fp32; 2.4 MB for 12 heads at 128 x 64: it stays in L2),
is built per launch config's tile shape and the near loop reads its tile with one contiguous 2-D load;
``t5_bank16`` keeps the bank in bf16 (half the bytes, converted to fp32 on load; its error is held to bf16's bound
whatever the inputs' dtype). The T5 table is (32, heads), bidirectional, max_distance 128. The rows and the banks are
built outside the timed call (a stack builds them once per forward; their cost is reported apart as
``t5_bias_rows_ms`` and ``t5_bank_ms``, the banks' size as ``t5_bank_bytes``); FAT5's own time includes its prologue
kernel that builds its rows.

The near loop (the pointer gather, or the bank's load) is never warp-specialized under ``t5_far`` and ``t5_bank``:
Triton 3.9, compiling for sm_90, rejects a pointer load in a warp-specialized loop ("unsupported load type for
producer commit") and a kernel with a warp-specialized loop beside another loop, so there ``*_ws`` with the T5
biases are expected to come out unsupported and only ``no_bias`` to be warp-specialized; another Triton may differ,
and the JSON says, per route, whether its TTGIR holds a warp-specialized region and TMA copies (Triton drops
``warp_specialize`` silently from a loop it does not pipeline). Configs with a fifth element set the stages of the
gathering loop, or of the bank's near loop (FAT5 runs its gather with one: pipelined, it stages the gathered bias
tile through shared memory beside K and V).

Peers: ``cudnn_no_bias``, SDPA forced to cuDNN without a bias (the ceiling), and FAT5's production forward
(``fat5.kernels.attention.attention``, backend "triton", under no_grad) with no bias and with the T5 table, both
on the (batch, heads, length, head_dim) transposed views that the model hands them.

Method: bf16, 12 heads, head_dim 64, batch x length = 32768 tokens; TFLOP/s = 4·B·H·L²·D / time, the time a
``triton.testing.do_bench`` median. Every (variant, bias, launch config) is first checked on the GPU against an
fp32 reference (softmax(q kᵀ + bias) v, the bias materialised by FAT5's PyTorch T5 buckets) at batch 4, L 512
(where far tiles exist); a relative error above 2e-2 is reported as failed and not timed, and a route that the
installed Triton rejects is reported as unsupported with its error. Each variant keeps its best config per length
in the summary; the JSON holds every config, with its registers and spills.

    python benchmarks/attention_hopper.py                        # H100: JSON, PNG, markdown table (< 4 minutes)
    python benchmarks/attention_hopper.py --variants pointer tma --configs 128,64,4,3 128,64,4,3,1
    python benchmarks/attention_hopper.py --interpret-check      # CPU: the kernels' logic under TRITON_INTERPRET=1
    python benchmarks/attention_hopper.py --plot-only benchmarks/results/attention_hopper.json
"""

import argparse
import functools
import math
import os
import sys
import time

# the interpreter is chosen when triton is imported: the CPU check must set it first
os.environ["TRITON_INTERPRET"] = "1" if "--interpret-check" in sys.argv else os.environ.get("TRITON_INTERPRET", "0")

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import draw_beside, markdown_table, parse_or_plot, save_png, write_result

TOKENS = 32768
HEADS = 12
HEAD_DIM = 64
NUM_BUCKETS = 32
MAX_DISTANCE = 128
LENGTHS = [512, 1024, 2048]
# block_m, block_n, warps, stages[, stages of the loop over gathering (or bank-reading) T5 tiles]: Triton's
# pipeliner stages the gathered bias tile through shared memory with K and V (32 KB a stage at 128 x 64; 128 KB in
# all at 3 stages, one program per SM), which FAT5 avoids by not pipelining that loop (its GATHER_LOOP_STAGES); the
# 5-element configs try that too, and are skipped without a bias
CONFIGS = [(128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3, 1), (128, 64, 8, 2, 1)]
# name: (TMA descriptors, warp-specialized key loop, persistent grid, descriptors made on the host); the
# warp-specialized ones last, where a compiler crash would cost the least (the result file is rewritten after each
# variant)
VARIANTS = {
    "pointer": (False, False, False, False),
    "tma": (True, False, False, False),
    "tma_host": (True, False, False, True),
    "persistent": (True, False, True, False),
    "tma_ws": (True, True, False, False),
    "persistent_ws": (True, True, True, False),
}
CHECK_BATCH, CHECK_LENGTH = 4, 512
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}
# --interpret-check: tiny shapes, tiles small enough to leave several query and key blocks, and a max_distance
# short enough that far tiles exist on both sides
INTERPRET_SHAPE = {"batch": 2, "length": 128, "heads": 2, "head_dim": 16, "max_distance": 32}
INTERPRET_CONFIG = (32, 16, 1, 1)
INTERPRET_PROGRAMS = 3  # the persistent grid's size under the interpreter: several tiles per program

LOG2E = 1.4426950408889634
BIAS_T5 = tl.constexpr(1)  # every tile gathers from the row of bias by distance
BIAS_T5_FAR = tl.constexpr(2)  # near tiles gather, far tiles add one scalar (FAT5's split)
BIAS_T5_BANK = tl.constexpr(3)  # t5_far with the near tiles read whole from a bank of precomputed bias tiles
BIASES = {"no_bias": 0, "t5": BIAS_T5.value, "t5_far": BIAS_T5_FAR.value, "t5_bank": BIAS_T5_BANK.value,
          "t5_bank16": BIAS_T5_BANK.value}
BANK_DTYPES = {"t5_bank": torch.float32, "t5_bank16": torch.bfloat16}
TILE_PLAIN = tl.constexpr(0)
TILE_GATHER = tl.constexpr(1)
TILE_SCALAR = tl.constexpr(2)
TILE_BANK = tl.constexpr(3)


# ----------------------------------------------------------------------------------------------------------------
# The experimental kernel


@triton.jit
def _load_rows(source, row, column, row_stride, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows [row, row + ROWS) of one head's columns from the (tokens, heads x head_dim) view of a tensor."""
    if USE_TMA:
        block = source.load([row.to(tl.int32), column])
    else:  # (an early return would not spare the pointer path from being compiled for a descriptor)
        offsets = (row + tl.arange(0, ROWS))[:, None] * row_stride + column + tl.arange(0, HEAD_DIM)[None, :]
        block = tl.load(source + offsets)
    return block


@triton.jit
def _store_rows(target, row, column, row_stride, block, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                USE_TMA: tl.constexpr):
    if USE_TMA:
        target.store([row.to(tl.int32), column], block)
    else:
        offsets = (row + tl.arange(0, ROWS))[:, None] * row_stride + column + tl.arange(0, HEAD_DIM)[None, :]
        tl.store(target + offsets, block)


@triton.jit
def _key_loop(
    acc, row_sum, row_max, q, keys, values, first_row, column, row_stride, bias_source, query_positions, qk_scale,
    step_start, step_end, gap_start, gap, left_bias, right_bias,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_BIAS: tl.constexpr,
    MAX_DISTANCE: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, GATHER_STAGES: tl.constexpr,
):
    """The online softmax over key blocks ``step`` for step in [step_start, gap_start) and ``step + gap`` for step in
    [gap_start, step_end), scores in log2 units; TILE_SCALAR adds ``left_bias`` before the gap, ``right_bias`` after
    it. One loop walks both runs of far tiles: Triton 3.9 rejects consecutive warp-specialized loops.
    ``bias_source``: TILE_GATHER's head row of bias by distance; TILE_BANK's bank tile for key block 0 (that of
    key block b is b tiles further: the query block's diagonal offsets are consecutive tiles of the bank)."""
    if TILE_BIAS == TILE_GATHER or TILE_BIAS == TILE_BANK:
        loop_stages: tl.constexpr = GATHER_STAGES
    else:
        loop_stages: tl.constexpr = None
    for step in tl.range(step_start, step_end, num_stages=loop_stages, warp_specialize=WARP_SPECIALIZE):
        after_gap = step >= gap_start
        key_start = (step + tl.where(after_gap, gap, 0)) * BLOCK_N
        k = _load_rows(keys, first_row + key_start, column, row_stride, BLOCK_N, HEAD_DIM, USE_TMA)
        scores = tl.dot(q, tl.trans(k)) * qk_scale
        if TILE_BIAS == TILE_GATHER:
            relative = (key_start + tl.arange(0, BLOCK_N))[None, :] - query_positions[:, None]
            clamped = tl.minimum(tl.maximum(relative, -(MAX_DISTANCE + 1)), MAX_DISTANCE + 1)
            scores += tl.load(bias_source + clamped + MAX_DISTANCE + 1)
        elif TILE_BIAS == TILE_BANK:
            tile = bias_source + (key_start // BLOCK_N) * (BLOCK_M * BLOCK_N)
            scores += tl.load(tile + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                              ).to(tl.float32)
        elif TILE_BIAS == TILE_SCALAR:
            scores += tl.where(after_gap, right_bias, left_bias)
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        p = tl.math.exp2(scores - new_max[:, None])
        alpha = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v = _load_rows(values, first_row + key_start, column, row_stride, BLOCK_N, HEAD_DIM, USE_TMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        row_max = new_max
    return acc, row_sum, row_max


@triton.jit
def _attention_tile(
    query_block, batch_head, queries, keys, values, out, BiasRows, BiasBank, num_heads, seqlen, row_stride, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BIAS: tl.constexpr,
    MAX_DISTANCE: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, GATHER_STAGES: tl.constexpr,
):
    """One (query block, batch x head) tile of the output."""
    head = batch_head % num_heads
    first_row = (batch_head // num_heads).to(tl.int64) * seqlen  # the sequence's first token
    column = head * HEAD_DIM
    start_m = query_block * BLOCK_M
    q = _load_rows(queries, first_row + start_m, column, row_stride, BLOCK_M, HEAD_DIM, USE_TMA)
    query_positions = start_m + tl.arange(0, BLOCK_M)
    bias_row = BiasRows + head * (2 * MAX_DISTANCE + 3)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    num_blocks = seqlen // BLOCK_N
    if BIAS == BIAS_T5_FAR or BIAS == BIAS_T5_BANK:
        # key blocks wholly at rel <= -(D+1) (left) or >= D+1 (right) see one bias value (T5's last buckets); the
        # near blocks between them gather (or read the bank), in a loop that is never warp-specialized (Triton 3.9
        # rejects the pointer gather in a warp-specialized loop: "unsupported load type for producer commit")
        far_left_end = tl.minimum(tl.maximum((start_m - MAX_DISTANCE) // BLOCK_N, 0), num_blocks)
        far_right_start = tl.minimum(tl.maximum(tl.cdiv(start_m + BLOCK_M + MAX_DISTANCE, BLOCK_N), far_left_end),
                                     num_blocks)
        if BIAS == BIAS_T5_BANK:
            near_tile: tl.constexpr = TILE_BANK
            # t5_bias_bank's layout: per head, the tiles of diagonal offsets -left_tiles .. right_tiles blocks
            left_tiles: tl.constexpr = (MAX_DISTANCE + BLOCK_N - 1) // BLOCK_N
            bank_tiles: tl.constexpr = left_tiles + (BLOCK_M + MAX_DISTANCE - 1) // BLOCK_N + 1
            near_source = BiasBank + (head * bank_tiles + left_tiles - start_m // BLOCK_N) * (BLOCK_M * BLOCK_N)
        else:
            near_tile: tl.constexpr = TILE_GATHER
            near_source = bias_row
        acc, row_sum, row_max = _key_loop(
            acc, row_sum, row_max, q, keys, values, first_row, column, row_stride, near_source, query_positions,
            qk_scale, far_left_end, far_right_start, far_right_start, 0, 0.0, 0.0,
            BLOCK_M, BLOCK_N, HEAD_DIM, near_tile, MAX_DISTANCE, USE_TMA, False, GATHER_STAGES)
        near_blocks = far_right_start - far_left_end
        acc, row_sum, row_max = _key_loop(
            acc, row_sum, row_max, q, keys, values, first_row, column, row_stride, bias_row, query_positions,
            qk_scale, 0, num_blocks - near_blocks, far_left_end, near_blocks,
            tl.load(bias_row), tl.load(bias_row + 2 * MAX_DISTANCE + 2),
            BLOCK_M, BLOCK_N, HEAD_DIM, TILE_SCALAR, MAX_DISTANCE, USE_TMA, WARP_SPECIALIZE, GATHER_STAGES)
    else:
        tile_bias: tl.constexpr = TILE_GATHER if BIAS == BIAS_T5 else TILE_PLAIN
        acc, row_sum, row_max = _key_loop(
            acc, row_sum, row_max, q, keys, values, first_row, column, row_stride, bias_row, query_positions,
            qk_scale, 0, num_blocks, num_blocks, 0, 0.0, 0.0,
            BLOCK_M, BLOCK_N, HEAD_DIM, tile_bias, MAX_DISTANCE, USE_TMA, WARP_SPECIALIZE, GATHER_STAGES)
    output = acc / row_sum[:, None]
    _store_rows(out, first_row + start_m, column, row_stride, output.to(q.dtype), BLOCK_M, HEAD_DIM, USE_TMA)


@triton.jit
def _forward_kernel(
    Q, K, V, Out, BiasRows, BiasBank, batch_heads, num_heads, seqlen, total_rows, row_stride, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BIAS: tl.constexpr,
    MAX_DISTANCE: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PERSISTENT: tl.constexpr,
    GATHER_STAGES: tl.constexpr, HOST_DESCRIPTORS: tl.constexpr,
):
    """Q, K, V, Out are (batch x length, heads x head_dim) with unit column stride; a grid of (query blocks,
    batch x heads) programs, or a persistent grid whose programs stride over the tiles (query blocks fastest, so
    that the programs running together share a head's keys and values in L2). With HOST_DESCRIPTORS they are
    tensor descriptors already (made by the host, passed by value); else each program makes its own."""
    if USE_TMA and not HOST_DESCRIPTORS:
        queries = tl.make_tensor_descriptor(Q, [total_rows, row_stride], [row_stride, 1], [BLOCK_M, HEAD_DIM])
        keys = tl.make_tensor_descriptor(K, [total_rows, row_stride], [row_stride, 1], [BLOCK_N, HEAD_DIM])
        values = tl.make_tensor_descriptor(V, [total_rows, row_stride], [row_stride, 1], [BLOCK_N, HEAD_DIM])
        out = tl.make_tensor_descriptor(Out, [total_rows, row_stride], [row_stride, 1], [BLOCK_M, HEAD_DIM])
    else:
        queries, keys, values, out = Q, K, V, Out
    query_blocks = seqlen // BLOCK_M
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), query_blocks * batch_heads, tl.num_programs(0)):
            _attention_tile(
                tile % query_blocks, tile // query_blocks, queries, keys, values, out, BiasRows, BiasBank, num_heads,
                seqlen, row_stride, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, BIAS, MAX_DISTANCE, USE_TMA,
                WARP_SPECIALIZE, GATHER_STAGES)
    else:
        _attention_tile(
            tl.program_id(0), tl.program_id(1), queries, keys, values, out, BiasRows, BiasBank, num_heads, seqlen,
            row_stride, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, BIAS, MAX_DISTANCE, USE_TMA, WARP_SPECIALIZE,
            GATHER_STAGES)


def scratch_allocator(device):
    """``triton.set_allocator``'s function: the global scratch that device-side tensor descriptors live in."""
    def allocate(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8, device=device)
    return allocate


def check_bias_bank(bias_bank, bias, heads, block_m, block_n, max_distance):
    """A clear error unless ``bias_bank`` is t5_bias_bank's bank for this bias, head count and launch config."""
    if bias_bank is None:
        raise ValueError(f"bias {bias!r} needs bias_bank (t5_bias_bank of the rows for block_m {block_m}, block_n "
                         f"{block_n})")
    expected = (heads, len(bank_diagonals(block_m, block_n, max_distance)), block_m, block_n)
    if tuple(bias_bank.shape) != expected or bias_bank.dtype != BANK_DTYPES[bias] or not bias_bank.is_contiguous():
        raise ValueError(f"bias {bias!r} needs a contiguous {BANK_DTYPES[bias]} bank of shape {expected} (the launch "
                         f"config's tiles), got {bias_bank.dtype} {tuple(bias_bank.shape)}")


def hopper_forward(q, k, v, bias_rows, variant, bias, config, max_distance=MAX_DISTANCE, programs=None, *,
                   bias_bank=None):
    """The experimental forward of (batch, length, heads, head_dim) tensors with unit last stride and heads x
    head_dim as the token stride; returns (out, the compiled kernel). ``bias_rows`` is (heads, 2 * max_distance + 3)
    in log2 units (ignored for no_bias); ``bias_bank`` is t5_bias_bank's bank for the config's tiles (t5_bank and
    t5_bank16 only); ``programs`` is the persistent grid's size (default: the SM count)."""
    batch, length, heads, head_dim = q.shape
    block_m, block_n, num_warps, num_stages, *gather_stages = config
    if length % block_m or length % block_n:
        raise ValueError(f"length {length} must be a multiple of block_m {block_m} and block_n {block_n}")
    if bias in BANK_DTYPES:
        check_bias_bank(bias_bank, bias, heads, block_m, block_n, max_distance)
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.shape != q.shape or tensor.stride() != (length * heads * head_dim, heads * head_dim, head_dim, 1):
            raise ValueError(f"{name} must be a contiguous (batch, length, heads, head_dim) tensor like q "
                             f"{tuple(q.shape)}, got shape {tuple(tensor.shape)} strides {tensor.stride()}")
    use_tma, warp_specialize, persistent, host_descriptors = VARIANTS[variant]
    out = torch.empty_like(q)
    operands = (q, k, v, out)
    if host_descriptors:
        from triton.tools.tensor_descriptor import TensorDescriptor

        operands = [TensorDescriptor.from_tensor(tensor.view(batch * length, heads * head_dim), [rows, head_dim])
                    for tensor, rows in zip(operands, (block_m, block_n, block_n, block_m))]
    tiles = (length // block_m, batch * heads)
    if persistent:
        count = programs or torch.cuda.get_device_properties(q.device).multi_processor_count
        grid = (min(count, tiles[0] * tiles[1]),)
    else:
        grid = tiles
    compiled = _forward_kernel[grid](
        *operands, bias_rows, bias_rows if bias_bank is None else bias_bank, batch * heads, heads, length,
        batch * length, heads * head_dim, LOG2E,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BIAS=BIASES[bias], MAX_DISTANCE=max_distance,
        USE_TMA=use_tma, WARP_SPECIALIZE=warp_specialize, PERSISTENT=persistent,
        GATHER_STAGES=gather_stages[0] if gather_stages else None, HOST_DESCRIPTORS=host_descriptors,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, compiled


# ----------------------------------------------------------------------------------------------------------------
# Inputs, reference and checks


def make_inputs(batch, length, heads, head_dim, device, dtype, seed=0):
    """q, k, v as (batch, length, heads, head_dim) (the model's projections before their transpose), unit-variance
    scores at T5's scale of 1, and a (num_buckets, heads) T5 table."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def tensor(scale):
        return (torch.randn(batch, length, heads, head_dim, device=device, generator=generator) * scale).to(dtype)

    std = head_dim**-0.25
    table = torch.randn(NUM_BUCKETS, heads, device=device, generator=generator) * 2
    return tensor(std), tensor(std), tensor(1.0), table


def t5_bias_rows(table, max_distance):
    """(heads, 2 * max_distance + 3) fp32: the bias at rel = -(D+1) .. D+1, times log2(e); every |rel| > D
    shares the bias at +-(D+1) (T5's last bucket of each direction)."""
    from fat5.kernels.position_bias import t5_relative_bucket

    relative = torch.arange(-(max_distance + 1), max_distance + 2, device=table.device)
    buckets = t5_relative_bucket(relative, True, table.shape[0], max_distance)
    return (table.float()[buckets].t() * LOG2E).contiguous()


def bank_diagonals(block_m, block_n, max_distance):
    """The diagonal offsets (key_start - start_m) // block_n of the key blocks that t5_far treats as near: a near
    block ends after rel -(D+1) and starts before D+1, so from -ceil(D / block_n) to ceil((block_m + D) / block_n) - 1
    (block_m a multiple of block_n: the offset is then a whole number of key blocks)."""
    if block_m % block_n:
        raise ValueError(f"the T5 bias bank needs block_m ({block_m}) to be a multiple of block_n ({block_n})")
    return range(-((max_distance + block_n - 1) // block_n), (block_m + max_distance - 1) // block_n + 1)


def t5_bias_bank(bias_rows, block_m, block_n, max_distance, dtype=torch.float32):
    """(heads, diagonals, block_m, block_n): every near tile's bias, ``bank[h, t, i, j] = row[h, clamp(offset_t + j
    - i, -(D+1), D+1) + D + 1]`` with offset_t the t-th of bank_diagonals times block_n; a near tile's bias depends
    only on its head and diagonal offset (fixed length, no query offset), so the kernel reads it whole."""
    diagonals = bank_diagonals(block_m, block_n, max_distance)
    offsets = torch.arange(diagonals.start, diagonals.stop, device=bias_rows.device) * block_n
    relative = (offsets[:, None, None] + torch.arange(block_n, device=bias_rows.device)[None, None, :]
                - torch.arange(block_m, device=bias_rows.device)[None, :, None])
    index = relative.clamp(-(max_distance + 1), max_distance + 1) + max_distance + 1
    return bias_rows[:, index].to(dtype).contiguous()


def reference_forward(q, k, v, table, max_distance):
    """softmax(q kᵀ + bias) v in fp32, the bias materialised by FAT5's PyTorch T5 buckets (None: no bias)."""
    from fat5.kernels.position_bias import t5_position_bias

    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2)
    if table is not None:
        length = q.shape[-2]
        scores = scores + t5_position_bias(table.float(), length, length, 0, True, table.shape[0], max_distance)
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


def compiled_facts(compiled):
    """What the compiled kernel shows of the route: registers, spills, TMA copies and a warp-specialized region."""
    facts = {}
    for field in ("n_regs", "n_spills"):
        if isinstance(getattr(compiled, field, None), int):
            facts[field] = getattr(compiled, field)
    ttgir = getattr(compiled, "asm", {}).get("ttgir") if hasattr(compiled, "asm") else None
    if ttgir:
        facts["ttgir_tma_copies"] = "async_tma_copy" in ttgir
        facts["ttgir_warp_specialize"] = "ttg.warp_specialize" in ttgir
    return facts


def check(variant, bias, config, inputs, expected, max_distance, programs=None):
    """{"status": "ok" | "failed: ..." | "unsupported: ..." | "dropped: ...", "rel_error", compiled facts} of one
    route."""
    from fat5.conversion.verify import relative_error

    q, k, v, table = inputs
    bias_rows = t5_bias_rows(table, max_distance)
    bank = t5_bias_bank(bias_rows, *config[:2], max_distance, BANK_DTYPES[bias]) if bias in BANK_DTYPES else None
    try:
        out, compiled = hopper_forward(q, k, v, bias_rows, variant, bias, config, max_distance, programs,
                                       bias_bank=bank)
    except Exception as error:  # noqa: BLE001 - a route the installed Triton rejects is a result, not a crash
        return {"status": f"unsupported: {type(error).__name__}: {str(error).strip()[:400]}"}
    error = relative_error(out, expected[bias != "no_bias"])
    row = {"rel_error": error, **compiled_facts(compiled)}
    # a bias stored in bf16 is rounded to bf16 whatever the inputs' dtype: its bound is bf16's
    tolerance = max(TOLERANCE[q.dtype], TOLERANCE[BANK_DTYPES.get(bias, q.dtype)])
    row["status"] = "ok" if error <= tolerance else f"failed: relative error {error:.3g}"
    if row["status"] == "ok" and VARIANTS[variant][1] and row.get("ttgir_warp_specialize") is False:
        # Triton 3.9 drops warp_specialize silently at 8 warps and from an unpipelined loop: the kernel without it
        row["status"] = "dropped: no warp-specialized region in the TTGIR, not timed"
    return row


def interpret_check(dtypes: list[str]):
    """The kernels' logic on the CPU under TRITON_INTERPRET=1, in each of ``dtypes`` (warp specialization and the
    TMA hardware are not emulated: the descriptors' addressing and every loop split are)."""
    shape = INTERPRET_SHAPE
    triton.set_allocator(scratch_allocator("cpu"))
    failures = []
    for dtype in (getattr(torch, name) for name in dtypes):
        inputs = make_inputs(shape["batch"], shape["length"], shape["heads"], shape["head_dim"], "cpu", dtype)
        q, k, v, table = inputs
        expected = {with_bias: reference_forward(q, k, v, table if with_bias else None, shape["max_distance"])
                    for with_bias in (False, True)}
        for variant in VARIANTS:
            for bias in BIASES:
                row = check(variant, bias, INTERPRET_CONFIG, inputs, expected, shape["max_distance"],
                            INTERPRET_PROGRAMS)
                print(f"{dtype!s:14} {variant:14} {bias:9} {row['status']:10} rel_error {row.get('rel_error')}")
                if row["status"] != "ok":
                    failures.append((dtype, variant, bias, row["status"]))
    if failures:
        raise SystemExit(f"{len(failures)} routes failed under the interpreter: {failures}")
    print("every route agrees with the fp32 reference under the interpreter")


# ----------------------------------------------------------------------------------------------------------------
# Measurements


def forward_flops(batch, length):
    return 4 * batch * HEADS * length * length * HEAD_DIM


def peer(name):
    """fn(q, k, v, table) for cudnn_no_bias, fat5_no_bias and fat5_t5, called on the (batch, heads, length,
    head_dim) transposed views that the model hands them."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fat5.kernels.attention import attention
    from fat5.kernels.position_bias import PositionBias

    if name == "cudnn_no_bias":
        def run(q, k, v, table):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, scale=1.0)
        return run

    def run(q, k, v, table):
        position = PositionBias.t5(table, max_distance=MAX_DISTANCE) if name == "fat5_t5" else PositionBias.none()
        return attention(q, k, v, position_bias=position, backend="triton")
    return run


PEERS = ("cudnn_no_bias", "fat5_no_bias", "fat5_t5")


def measure_peers(lengths, inputs_by_length):
    """Each peer checked at the check shape, then timed at every length."""
    import triton.testing

    from fat5.conversion.verify import relative_error

    q, k, v, table = make_inputs(CHECK_BATCH, CHECK_LENGTH, HEADS, HEAD_DIM, "cuda", torch.bfloat16, seed=1)
    rows = []
    for name in PEERS:
        expected = reference_forward(q, k, v, table if name == "fat5_t5" else None, MAX_DISTANCE)
        try:
            error = relative_error(peer(name)(*(t.transpose(1, 2) for t in (q, k, v)), table).transpose(1, 2),
                                   expected)
        except Exception as failure:  # noqa: BLE001 - a backend this torch lacks is recorded, not fatal
            rows.append({"implementation": name, "status": f"unsupported: {type(failure).__name__}: {failure}"})
            continue
        row = {"implementation": name, "rel_error": error, "timings": {}}
        row["status"] = "ok" if error <= TOLERANCE[torch.bfloat16] else f"failed: relative error {error:.3g}"
        for length in lengths if row["status"] == "ok" else ():
            lq, lk, lv, ltable = inputs_by_length[length]
            views = [t.transpose(1, 2) for t in (lq, lk, lv)]
            ms = triton.testing.do_bench(functools.partial(peer(name), *views, ltable), warmup=25, rep=100,
                                         return_mode="median")
            row["timings"][str(length)] = {"ms": ms, "tflops": forward_flops(lq.shape[0], length) / ms / 1e9}
        rows.append(row)
        print(row, flush=True)
    return rows


def measure_routes(lengths, inputs_by_length, variants, configs, rows, save):
    """Every (variant, bias, config) appended to ``rows``: checked at the check shape, then, if it passed, timed at
    every length; ``save()`` after each variant (a route that breaks the CUDA context leaves what came before)."""
    import triton.testing

    inputs = make_inputs(CHECK_BATCH, CHECK_LENGTH, HEADS, HEAD_DIM, "cuda", torch.bfloat16, seed=1)
    q, k, v, table = inputs
    expected = {with_bias: reference_forward(q, k, v, table if with_bias else None, MAX_DISTANCE)
                for with_bias in (False, True)}
    bias_rows = {length: t5_bias_rows(inputs_by_length[length][3], MAX_DISTANCE) for length in lengths}

    @functools.cache
    def bias_bank(length, bias, block_m, block_n):  # built once per length and tile shape, outside the timings
        return t5_bias_bank(bias_rows[length], block_m, block_n, MAX_DISTANCE, BANK_DTYPES[bias])

    for variant in variants:
        for bias in BIASES:
            for config in configs:
                if bias == "no_bias" and len(config) > 4:
                    continue
                started = time.time()
                row = {"variant": variant, "bias": bias, "config": list(config),
                       **check(variant, bias, config, inputs, expected, MAX_DISTANCE), "timings": {}}
                for length in lengths if row["status"] == "ok" else ():
                    lq, lk, lv, _ = inputs_by_length[length]
                    bank = bias_bank(length, bias, *config[:2]) if bias in BANK_DTYPES else None
                    ms = triton.testing.do_bench(
                        functools.partial(hopper_forward, lq, lk, lv, bias_rows[length], variant, bias, config,
                                          MAX_DISTANCE, bias_bank=bank),
                        warmup=25, rep=100, return_mode="median")
                    row["timings"][str(length)] = {"ms": ms, "tflops": forward_flops(lq.shape[0], length) / ms / 1e9}
                row["seconds"] = round(time.time() - started, 1)
                rows.append(row)
                tflops = {length: round(t["tflops"], 1) for length, t in row["timings"].items()}
                print(f"{variant:14} {bias:9} {config} {row['status'][:120]} {tflops} ({row['seconds']} s)",
                      flush=True)
        save()


def bias_rows_ms(table):
    """The host-side build of the T5 bias rows, which the routes' timings leave out (once per forward of a stack)."""
    import triton.testing

    return triton.testing.do_bench(functools.partial(t5_bias_rows, table, MAX_DISTANCE), warmup=25, rep=100,
                                   return_mode="median")


def bias_bank_costs(table, configs):
    """{"BLOCK_MxBLOCK_N dtype": ms} and {same: bytes} of building each config's T5 bias bank from the rows (left out
    of the routes' timings like the rows: a stack would build it once per forward)."""
    import triton.testing

    rows = t5_bias_rows(table, MAX_DISTANCE)
    build_ms, size_bytes = {}, {}
    for block_m, block_n in dict.fromkeys(config[:2] for config in configs):
        for dtype in dict.fromkeys(BANK_DTYPES.values()):
            build = functools.partial(t5_bias_bank, rows, block_m, block_n, MAX_DISTANCE, dtype)
            key = f"{block_m}x{block_n} {str(dtype).removeprefix('torch.')}"
            build_ms[key] = triton.testing.do_bench(build, warmup=25, rep=100, return_mode="median")
            bank = build()
            size_bytes[key] = bank.numel() * bank.element_size()
    return build_ms, size_bytes


def summarise(peers, routes, lengths):
    """One row per implementation (each route at its best config per length): TFLOP/s and the ratio to cuDNN; an
    implementation that was never timed shows why (its first config's status)."""
    best, notes = {}, {}
    for row in peers:
        best[row["implementation"]] = {length: (timing["tflops"], None) for length, timing in row.get("timings",
                                                                                                      {}).items()}
        notes[row["implementation"]] = row["status"]
    for row in routes:
        name = f"{row['variant']}_{row['bias']}"
        notes.setdefault(name, row["status"])
        entries = best.setdefault(name, {})
        for length, timing in row["timings"].items():
            if length not in entries or timing["tflops"] > entries[length][0]:
                entries[length] = (timing["tflops"], row["config"])
    cudnn = best.get("cudnn_no_bias", {})
    summary = []
    for name, entries in best.items():
        line = {"implementation": name, "note": "" if entries else notes[name][:100]}
        for length in map(str, lengths):
            if length not in entries:
                line[f"L{length} TFLOP/s"] = "-"
                continue
            tflops, config = entries[length]
            line[f"L{length} TFLOP/s"] = round(tflops, 1)
            line[f"L{length} / cuDNN"] = round(tflops / cudnn[length][0], 3) if length in cudnn else None
            line[f"L{length} config"] = config
        summary.append(line)
    return summary


def plot(document, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = document["results"]["summary"]
    lengths = document["lengths"]
    panels = (("no position bias", ("no_bias",)),
              ("T5 bias (32 buckets, max_distance 128)", ("_t5", "_t5_far", "_t5_bank", "_t5_bank16")))
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for axis, (title, endings) in zip(axes, panels):
        for line in summary:
            name = line["implementation"]
            points = [(length, line[f"L{length} TFLOP/s"]) for length in lengths
                      if isinstance(line.get(f"L{length} TFLOP/s"), float)]
            if not points:
                continue
            if name == "cudnn_no_bias":
                axis.plot(*zip(*points), "k--", linewidth=2, label=name)
            elif name.endswith(endings):
                axis.plot(*zip(*points), marker="o", linewidth=2.5 if name.startswith("fat5") else 1.2,
                          label=name)
        axis.set_xscale("log", base=2)
        axis.set_xticks(lengths, [str(length) for length in lengths])
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("sequence length")
        axis.set_ylabel("forward TFLOP/s")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    save_png(figure, path, document, f"attention forward, bf16, {document['heads']} heads, head_dim "
             f"{document['head_dim']}, {document['tokens']} tokens",
             dpi=110)


def benchmark(args):
    """The peers, then every route; the result file is rewritten after each variant."""
    triton.set_allocator(scratch_allocator("cuda"))
    started = time.time()
    inputs_by_length = {length: make_inputs(TOKENS // length, length, HEADS, HEAD_DIM, "cuda", torch.bfloat16)
                        for length in args.lengths}
    results = {"peers": [], "routes": [], "summary": []}

    def save():
        results["summary"] = summarise(results["peers"], results["routes"], args.lengths)
        results["seconds"] = round(time.time() - started, 1)
        return write_result(args.out, results, lengths=args.lengths, configs=args.configs, heads=HEADS,
                            head_dim=HEAD_DIM, tokens=TOKENS, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE)

    with torch.no_grad():
        results["t5_bias_rows_ms"] = bias_rows_ms(inputs_by_length[args.lengths[0]][3])
        results["t5_bank_ms"], results["t5_bank_bytes"] = bias_bank_costs(inputs_by_length[args.lengths[0]][3],
                                                                          args.configs)
        results["peers"] = measure_peers(args.lengths, inputs_by_length)
        save()
        measure_routes(args.lengths, inputs_by_length, args.variants, args.configs, results["routes"], save)
    return results, save()


def parse_config(text):
    values = tuple(int(value) for value in text.split(","))
    if len(values) not in (4, 5):
        raise argparse.ArgumentTypeError(f"a config is block_m,block_n,warps,stages[,gather_stages], got {text!r}")
    return values


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/attention_hopper.json")
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    parser.add_argument("--configs", type=parse_config, nargs="+", default=CONFIGS,
                        help="launch configs block_m,block_n,warps,stages[,gather_stages] (default: %(default)s)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="the experimental kernel's variants to time (default: all)")
    parser.add_argument("--interpret-check", action="store_true",
                        help="check the kernels against the fp32 reference on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--interpret-dtypes", nargs="+", default=["float32", "float16"],
                        choices=["float32", "float16"], help="--interpret-check: the input dtypes checked")
    args = parse_or_plot(parser, plot)
    if args is None:
        return
    if args.interpret_check:
        interpret_check(args.interpret_dtypes)
        return
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark times CUDA kernels; without a GPU, --interpret-check checks their logic")
    block = math.lcm(*(config[0] for config in args.configs), *(config[1] for config in args.configs))
    wrong = [length for length in args.lengths if length % block or TOKENS % length]
    if wrong:
        raise SystemExit(f"lengths {wrong} must divide {TOKENS} tokens and be multiples of every config's blocks "
                         f"({block})")
    results, document = benchmark(args)
    draw_beside(plot, document, args.out)
    columns = ["implementation"] + [f"L{length} {field}" for length in args.lengths for field in ("TFLOP/s", "/ cuDNN")]
    columns.append("note")
    print()
    print(markdown_table(results["summary"], columns))
    print(f"\nT5 bias rows, built outside the routes' timings: {results['t5_bias_rows_ms']} ms; T5 bias banks "
          f"(built from the rows, outside too): {results['t5_bank_ms']} ms, {results['t5_bank_bytes']} bytes; "
          f"{results['seconds']} s in all")


if __name__ == "__main__":
    main()
