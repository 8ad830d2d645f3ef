"""T5's buckets for the Triton attention kernels: the bucket of each relative position and the per-head bias by relative
position (``t5_relative_buckets``), the dk/dv kernel's bias bank of whole tiles, and the table's gradient mapped from
sums by relative position to buckets. How the kernels use them: ``attention_triton_kernels.py``'s docstring."""

import functools
import math

import torch

from .launch import cdiv, device_guard, next_power_of_2

try:
    from .attention_triton_kernels import _t5_bias_bank_kernel, _t5_bias_by_distance_kernel, _t5_table_gradient_kernel
except ImportError:  # CPU-only installs: attention.py only calls in here when triton is importable
    pass

def check_t5_buckets(bidirectional: bool, num_buckets: int, max_distance: int) -> tuple[int, int]:
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
    half_buckets, max_exact = check_t5_buckets(bidirectional, num_buckets, max_distance)
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


def t5_bias_by_distance(table, bidirectional, num_buckets, max_distance):
    return t5_relative_buckets(
        -(max_distance + 1), 2 * max_distance + 3, bidirectional, num_buckets, max_distance, table.device, table
    )


def t5_bank_tiles(rows: int, columns: int, max_distance: int) -> tuple[int, int]:
    """(tiles left of the diagonal, all tiles) of a head's T5 bias bank of (rows, columns) tiles.

    The dk/dv kernel's near loop (``_query_ranges``; its rows are keys) visits the query blocks that end after rel
    -(D+1) and start before rel rows + D from its key block's start. With query offset 0 and ``rows`` a multiple of
    ``columns``, each starts ``t`` whole query blocks after the key block's start, fixed-length or varlen alike
    (tiles start at segment starts): t from -ceil(D / columns) to ceil((rows + D) / columns) - 1.
    """
    left_tiles = cdiv(max_distance, columns)
    return left_tiles, left_tiles + cdiv(rows + max_distance, columns)


def t5_bias_bank(bias_rows: torch.Tensor, rows: int, columns: int, max_distance: int) -> tuple[torch.Tensor, int]:
    """(heads, tiles, rows, columns) fp32 bank of the dk/dv kernel's near (keys, queries) tiles' bias
    (``_t5_bias_bank_kernel``), made on the device from the rows, and its tiles left of the diagonal.
    4 * tiles * rows * columns bytes a head: 80 KiB at 64 x 64 tiles and D 128 (5 tiles)."""
    left_tiles, num_tiles = t5_bank_tiles(rows, columns, max_distance)
    num_heads = bias_rows.shape[0]
    bank = torch.empty(num_heads, num_tiles, rows, columns, dtype=torch.float32, device=bias_rows.device)
    _t5_bias_bank_kernel[(num_tiles, num_heads)](
        bias_rows, bank, bias_rows.stride(0),
        MAX_DISTANCE=max_distance, LEFT_TILES=left_tiles, ROWS=rows, COLUMNS=columns,
    )
    return bank, left_tiles


def t5_table_gradient(distance_grad: torch.Tensor, buckets: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
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
