"""Triton kernels for RMSNorm with T5LayerNorm semantics; imported lazily by ``rms_norm.py``.

Forward: each program normalises ``rows_per_program`` whole rows held in registers (T5's widths, 512 to 4096, are
small, so one row alone leaves most of a program idle). Backward: each program walks a contiguous slab of rows,
writes their input gradient, and accumulates its share of the weight gradient in fp32 registers; the per-program
partial sums are then added by one reduction, so the weight gradient is deterministic.
"""

try:
    import triton
    import triton.language as tl
except ImportError as error:  # rms_norm.py falls back to the reference
    raise ImportError("rms_norm_triton needs the `triton` package") from error

import torch

from .launch import CachedLauncher, cdiv, device_guard, multiprocessors, next_power_of_2

# One program keeps (rows x padded width) fp32 values in registers; wider rows would spill.
MAX_WIDTH = 65536


@CachedLauncher
@triton.jit
def _rms_norm_forward_kernel(
    input_ptr, input_row_stride, weight_ptr, output_ptr, output_row_stride, inverse_rms_ptr,
    n_rows, n_cols, eps,
    CAST_TO_WEIGHT_DTYPE: tl.constexpr, BLOCK_COLS: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    x = tl.load(input_ptr + rows[:, None] * input_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    normalised = x * inverse_rms[:, None]
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0)
    if CAST_TO_WEIGHT_DTYPE:
        # T5 rounds the normalised x to the (half) weight dtype before the multiply.
        normalised = normalised.to(weight.dtype).to(tl.float32)
    output = weight.to(tl.float32)[None, :] * normalised
    tl.store(
        output_ptr + rows[:, None] * output_row_stride + cols[None, :],
        output.to(output_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(inverse_rms_ptr + rows, inverse_rms, mask=row_mask)


@CachedLauncher
@triton.jit
def _rms_norm_backward_kernel(
    grad_output_ptr, grad_output_row_stride, input_ptr, input_row_stride, weight_ptr, inverse_rms_ptr,
    grad_input_ptr, grad_input_row_stride, partial_grad_weight_ptr,
    n_rows, n_cols, rows_per_program,
    CAST_TO_WEIGHT_DTYPE: tl.constexpr, BLOCK_COLS: tl.constexpr, ROWS_PER_STEP: tl.constexpr,
):
    program = tl.program_id(0)
    first_row = program.to(tl.int64) * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0)
    weight_fp32 = weight.to(tl.float32)
    grad_weight = tl.zeros((ROWS_PER_STEP, BLOCK_COLS), dtype=tl.float32)

    for row_start in range(first_row, last_row, ROWS_PER_STEP):
        rows = row_start + tl.arange(0, ROWS_PER_STEP)
        row_mask = rows < last_row
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(input_ptr + rows[:, None] * input_row_stride + cols[None, :], mask=mask, other=0.0)
        grad_output = tl.load(
            grad_output_ptr + rows[:, None] * grad_output_row_stride + cols[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        inverse_rms = tl.load(inverse_rms_ptr + rows, mask=row_mask, other=0.0)

        normalised = x.to(tl.float32) * inverse_rms[:, None]
        if CAST_TO_WEIGHT_DTYPE:
            grad_weight += grad_output * normalised.to(weight.dtype).to(tl.float32)
        else:
            grad_weight += grad_output * normalised
        # y = x * r with r = rsqrt(mean(x^2) + eps): dx = r * (dy - y * mean(dy * y)), dy = grad_output * weight
        grad_normalised = grad_output * weight_fp32[None, :]
        projection = tl.sum(grad_normalised * normalised, axis=1) / n_cols
        grad_input = inverse_rms[:, None] * (grad_normalised - normalised * projection[:, None])
        tl.store(
            grad_input_ptr + rows[:, None] * grad_input_row_stride + cols[None, :],
            grad_input.to(grad_input_ptr.dtype.element_ty),
            mask=mask,
        )

    tl.store(partial_grad_weight_ptr + program * n_cols + cols, tl.sum(grad_weight, axis=0), mask=col_mask)


@CachedLauncher
@triton.jit
def _column_sum_kernel(
    partial_ptr, output_ptr, n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """``output[c] = sum over rows of partial[r, c]`` in fp32, rows in a fixed order (deterministic)."""
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    total = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for row_start in range(0, n_rows, BLOCK_ROWS):
        rows = row_start + tl.arange(0, BLOCK_ROWS)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        total += tl.load(partial_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(output_ptr + cols, tl.sum(total, axis=0).to(output_ptr.dtype.element_ty), mask=col_mask)


def _cast_to_weight_dtype(weight: torch.Tensor) -> bool:
    return weight.dtype in (torch.float16, torch.bfloat16)


# Measured on an H100 at 32768 tokens (benchmarks/results/rms_norm.json, sweeps of two runs): 4 warps and about 4k
# elements per program for the forward (within 1.3x of the bandwidth floor from d 512 to 4096); for the backward up
# to 4 rows of at most 4k elements per step, 4 warps, 8 programs per multiprocessor each reducing a slab of rows.
def forward_config(n_cols: int) -> tuple[int, int]:
    """(rows per program, num_warps) for the forward at this width."""
    block_cols = next_power_of_2(n_cols)
    rows_per_program = max(1, min(16, 4096 // block_cols))
    elements = rows_per_program * block_cols
    num_warps = 4 if elements <= 4096 else 8 if elements <= 8192 else 16
    return rows_per_program, num_warps


def backward_config(n_cols: int) -> tuple[int, int, int]:
    """(rows per step, num_warps, programs per multiprocessor) for the backward at this width."""
    block_cols = next_power_of_2(n_cols)
    rows_per_step = max(1, min(4, 4096 // block_cols))
    elements = rows_per_step * block_cols
    num_warps = 4 if elements <= 4096 else 8 if elements <= 8192 else 16
    return rows_per_step, num_warps, 8


def _multiprocessors(device: torch.device) -> int:
    return multiprocessors(device, interpreter_count=1)


def rms_norm_forward(rows, weight, output, inverse_rms, eps, rows_per_program=None, num_warps=None):
    """Launch the forward on 2-D ``rows`` (unit stride along the width) into ``output`` and ``inverse_rms``."""
    n_rows, n_cols = rows.shape
    if n_rows == 0:
        return
    default_rows, default_warps = forward_config(n_cols)
    rows_per_program = rows_per_program or default_rows
    with device_guard(rows.device):
        _rms_norm_forward_kernel[(cdiv(n_rows, rows_per_program),)](
            rows, rows.stride(0), weight, output, output.stride(0), inverse_rms,
            n_rows, n_cols, eps,
            CAST_TO_WEIGHT_DTYPE=_cast_to_weight_dtype(weight),
            BLOCK_COLS=next_power_of_2(n_cols),
            ROWS_PER_PROGRAM=rows_per_program,
            num_warps=num_warps or default_warps,
        )


def rms_norm_backward(
    grad_rows, rows, weight, inverse_rms, grad_input, rows_per_step=None, num_warps=None, programs_per_sm=None
):
    """Launch the backward; writes ``grad_input`` and returns the weight gradient (fp32 sums, weight's dtype)."""
    n_rows, n_cols = rows.shape
    if n_rows == 0:
        return torch.zeros_like(weight)
    default_rows, default_warps, default_programs = backward_config(n_cols)
    rows_per_step = rows_per_step or default_rows
    # At least 4 programs on the CPU interpreter, so that tests cover the partial-sum reduction.
    program_budget = max(4, (programs_per_sm or default_programs) * _multiprocessors(rows.device))
    programs = max(1, min(cdiv(n_rows, rows_per_step), program_budget))
    rows_per_program = cdiv(cdiv(n_rows, programs), rows_per_step) * rows_per_step
    programs = max(1, cdiv(n_rows, rows_per_program))
    partial_grad_weight = torch.empty((programs, n_cols), dtype=torch.float32, device=rows.device)
    with device_guard(rows.device):
        _rms_norm_backward_kernel[(programs,)](
            grad_rows, grad_rows.stride(0), rows, rows.stride(0), weight, inverse_rms,
            grad_input, grad_input.stride(0), partial_grad_weight,
            n_rows, n_cols, rows_per_program,
            CAST_TO_WEIGHT_DTYPE=_cast_to_weight_dtype(weight),
            BLOCK_COLS=next_power_of_2(n_cols),
            ROWS_PER_STEP=rows_per_step,
            num_warps=num_warps or default_warps,
        )
        # narrow programs, 16 columns each, reading 256 rows at a time: in an ad-hoc H100 timing (not kept as a
        # result) 10.3 us for (1056, 512) where torch's column reduction took 11.4 and 64 x 32 tiles 28.5; once per
        # norm of the step (62 in the base shape's)
        grad_weight = torch.empty_like(weight)
        _column_sum_kernel[(cdiv(n_cols, 16),)](
            partial_grad_weight, grad_weight, programs, n_cols, BLOCK_ROWS=256, BLOCK_COLS=16, num_warps=8
        )
    return grad_weight
