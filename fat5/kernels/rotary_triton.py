"""Triton kernel for rotary position embeddings; imported lazily by ``rotary.py``.

One launch rotates a (batch, heads, length, head_dim) tensor at per-token positions. The angles are computed in
the kernel from the positions and the inverse frequencies (fp32, the same product as the reference), so neither
the cos/sin tables nor the rotated halves are ever written to memory. The backward is the same kernel rotating by
the opposite angle (a rotation's transpose is its inverse).
"""

try:
    import triton
    import triton.language as tl
except ImportError as error:  # rotary.py falls back to the reference
    raise ImportError("rotary_triton needs the `triton` package") from error

import torch

from .launch import CachedLauncher, cdiv, device_guard, next_power_of_2

_BLOCK_ROWS = 32


@CachedLauncher
@triton.jit
def _rotary_kernel(
    input_ptr, output_ptr, position_ptr, inverse_frequency_ptr,
    stride_ib, stride_ih, stride_il, stride_ob, stride_oh, stride_ol, stride_pb, stride_pl,
    num_heads, length,
    HALF_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr, INVERSE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    batch = tl.program_id(1) // num_heads
    head = tl.program_id(1) % num_heads
    half = tl.arange(0, BLOCK_HALF)
    in_rows = rows < length
    mask = in_rows[:, None] & (half < HALF_DIM)[None, :]
    position = tl.load(position_ptr + batch.to(tl.int64) * stride_pb + rows * stride_pl, mask=in_rows, other=0)
    inverse_frequency = tl.load(inverse_frequency_ptr + half, mask=half < HALF_DIM, other=0.0)
    angle = position.to(tl.float32)[:, None] * inverse_frequency[None, :]
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    if INVERSE:
        sin = -sin
    in_base = input_ptr + batch.to(tl.int64) * stride_ib + head.to(tl.int64) * stride_ih
    offsets = rows[:, None] * stride_il + half[None, :]
    first = tl.load(in_base + offsets, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(in_base + offsets + HALF_DIM, mask=mask, other=0.0).to(tl.float32)
    # rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), both halves sharing the pair's angle
    out_base = output_ptr + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    out_offsets = rows[:, None] * stride_ol + half[None, :]
    tl.store(out_base + out_offsets, (first * cos - second * sin).to(output_ptr.dtype.element_ty), mask=mask)
    tl.store(out_base + out_offsets + HALF_DIM, (second * cos + first * sin).to(output_ptr.dtype.element_ty),
             mask=mask)


def rotate(states: torch.Tensor, position_ids: torch.Tensor, inverse_frequency: torch.Tensor,
           inverse: bool = False) -> torch.Tensor:
    """``states`` (batch, heads, length, head_dim) with unit stride along head_dim, rotated by the angles
    ``position_ids[b, l] * inverse_frequency`` (by their opposites when ``inverse``); returns a new tensor."""
    batch, num_heads, length, head_dim = states.shape
    output = torch.empty((batch, num_heads, length, head_dim), dtype=states.dtype, device=states.device)
    if output.numel() == 0:
        return output
    half_dim = head_dim // 2
    grid = (cdiv(length, _BLOCK_ROWS), batch * num_heads)
    with device_guard(states.device):
        _rotary_kernel[grid](
            states, output, position_ids, inverse_frequency,
            states.stride(0), states.stride(1), states.stride(2), output.stride(0), output.stride(1),
            output.stride(2), position_ids.stride(0), position_ids.stride(1),
            num_heads, length,
            HALF_DIM=half_dim, BLOCK_HALF=next_power_of_2(half_dim), BLOCK_ROWS=_BLOCK_ROWS, INVERSE=inverse,
            num_warps=4,
        )
    return output

