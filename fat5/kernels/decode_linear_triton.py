"""Triton kernels of the decoding step's projections; imported lazily by ``decode_linear.py``.

A decoding step multiplies a few rows (batch 1 to 128, one token each) by every weight of the decoder: the weights
are nearly all the bytes it reads, and the small kernels between the products (a norm, an activation, a residual add)
cost a launch each while moving almost nothing. These kernels take those into the product:

- ``rms_norm_linear``: T5's RMSNorm of the rows, then ``normed @ weight.T``; the rows' inverse RMS is computed in the
  same program (the rows are short: one pass over them before the product costs nothing next to the weight tile),
  and the norm's scale is applied while the row chunk is loaded. With an activation, ``act(normed @ weight.T)``, and
  with a second weight, the gated feed-forward's ``act(normed @ weight.T) * (normed @ linear_weight.T)``.
- ``linear_residual``: ``residual + hidden @ weight.T``, the output projections of attention and feed-forward.

Each program owns a (rows, columns) tile of the output and walks the whole reduction dimension itself, in order:
there is no split of K across programs and no atomic, so the result is deterministic. Inference only: no backward.
"""

try:
    import triton
    import triton.language as tl
except ImportError as error:  # decode_linear.py falls back to the reference
    raise ImportError("decode_linear_triton needs the `triton` package") from error

import torch

from .activation_triton import ACTIVATION_CODES, _activation_and_derivative
from .launch import CachedLauncher, cdiv, device_guard, next_power_of_2


@CachedLauncher
@triton.jit
def _rms_norm_linear_kernel(
    input_ptr, input_row_stride, norm_weight_ptr,
    weight_ptr, weight_row_stride, weight_col_stride,
    linear_weight_ptr, linear_weight_row_stride, linear_weight_col_stride,
    output_ptr, output_row_stride, n_rows, n_cols, n_inputs, eps,
    CAST_TO_NORM_WEIGHT_DTYPE: tl.constexpr, ACTIVATION: tl.constexpr, GATED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    input_rows = input_ptr + rows[:, None] * input_row_stride

    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, n_inputs, BLOCK_K):
        inputs = start + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (inputs < n_inputs)[None, :]
        x = tl.load(input_rows + inputs[None, :], mask=mask, other=0.0).to(tl.float32)
        squares += tl.sum(x * x, axis=1)
    inverse_rms = tl.rsqrt(squares / n_inputs + eps)

    accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    linear_accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, n_inputs, BLOCK_K):
        inputs = start + tl.arange(0, BLOCK_K)
        input_mask = inputs < n_inputs
        x = tl.load(input_rows + inputs[None, :], mask=row_mask[:, None] & input_mask[None, :], other=0.0)
        normalised = x.to(tl.float32) * inverse_rms[:, None]
        norm_weight = tl.load(norm_weight_ptr + inputs, mask=input_mask, other=0.0)
        if CAST_TO_NORM_WEIGHT_DTYPE:
            # T5 rounds the normalised x to the (half) norm weight's dtype before the multiply
            normalised = normalised.to(norm_weight.dtype).to(tl.float32)
        # the product of two halves is exact in fp32: one rounding here is T5's half multiply
        normed = (norm_weight.to(tl.float32)[None, :] * normalised).to(weight_ptr.dtype.element_ty)
        weight_mask = input_mask[:, None] & col_mask[None, :]
        weight = tl.load(
            weight_ptr + cols[None, :] * weight_row_stride + inputs[:, None] * weight_col_stride,
            mask=weight_mask, other=0.0,
        )
        accumulator = tl.dot(normed, weight, accumulator, input_precision=INPUT_PRECISION)
        if GATED:
            linear_weight_tile = linear_weight_ptr + cols[None, :] * linear_weight_row_stride
            linear_weight = tl.load(linear_weight_tile + inputs[:, None] * linear_weight_col_stride, mask=weight_mask,
                                    other=0.0)
            linear_accumulator = tl.dot(normed, linear_weight, linear_accumulator, input_precision=INPUT_PRECISION)

    output = accumulator
    if ACTIVATION >= 0:
        # the separate route activates the product rounded to the weights' dtype: so does this one
        gate = accumulator.to(weight_ptr.dtype.element_ty).to(tl.float32)
        output, _ = _activation_and_derivative(gate, ACTIVATION, False)
        if GATED:
            output = output * linear_accumulator.to(weight_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        output_ptr + rows[:, None] * output_row_stride + cols[None, :],
        output.to(output_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@CachedLauncher
@triton.jit
def _linear_residual_kernel(
    input_ptr, input_row_stride, weight_ptr, weight_row_stride, weight_col_stride,
    residual_ptr, residual_row_stride, output_ptr, output_row_stride, n_rows, n_cols, n_inputs,
    INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols

    accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, n_inputs, BLOCK_K):
        inputs = start + tl.arange(0, BLOCK_K)
        input_mask = inputs < n_inputs
        x = tl.load(input_ptr + rows[:, None] * input_row_stride + inputs[None, :],
                    mask=row_mask[:, None] & input_mask[None, :], other=0.0)
        weight = tl.load(
            weight_ptr + cols[None, :] * weight_row_stride + inputs[:, None] * weight_col_stride,
            mask=input_mask[:, None] & col_mask[None, :], other=0.0,
        )
        accumulator = tl.dot(x, weight, accumulator, input_precision=INPUT_PRECISION)

    mask = row_mask[:, None] & col_mask[None, :]
    residual = tl.load(residual_ptr + rows[:, None] * residual_row_stride + cols[None, :], mask=mask, other=0.0)
    # one rounding of product plus residual, as addmm gives it
    output = accumulator + residual.to(tl.float32)
    tl.store(output_ptr + rows[:, None] * output_row_stride + cols[None, :],
             output.to(output_ptr.dtype.element_ty), mask=mask)


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 weights get fp32 products (PyTorch's matmul default), not TF32's 10-bit mantissa
    return "ieee" if dtype == torch.float32 else "tf32"


# A first choice, not yet measured on a GPU: few rows make the weight tile the whole cost of a program, so narrow
# column blocks put more programs in flight on the weight's bytes at small batches (base shape at batch 1: 48 programs
# for a d_model-wide output, 144 for q, k and v). tl.dot needs 16 at least.
def block_sizes(n_rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for ``n_rows`` rows."""
    block_m = min(64, max(16, next_power_of_2(n_rows)))
    block_n = 16 if n_rows <= 16 else 32 if n_rows <= 32 else 64
    return block_m, block_n, 64


def rms_norm_linear_forward(
    rows: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, linear_weight: torch.Tensor | None,
    output: torch.Tensor, eps: float, activation: str | None,
) -> None:
    """Launch on 2-D ``rows`` (unit stride along the width) into ``output`` (unit stride along its width)."""
    n_rows, n_inputs = rows.shape
    n_cols = weight.shape[0]
    if n_rows == 0 or n_cols == 0:
        return
    block_m, block_n, block_k = block_sizes(n_rows)
    gated = linear_weight is not None
    linear_weight = linear_weight if gated else weight
    with device_guard(rows.device):
        _rms_norm_linear_kernel[(cdiv(n_cols, block_n), cdiv(n_rows, block_m))](
            rows, rows.stride(0), norm_weight,
            weight, weight.stride(0), weight.stride(1),
            linear_weight, linear_weight.stride(0), linear_weight.stride(1),
            output, output.stride(0), n_rows, n_cols, n_inputs, eps,
            CAST_TO_NORM_WEIGHT_DTYPE=norm_weight.dtype in (torch.float16, torch.bfloat16),
            ACTIVATION=-1 if activation is None else ACTIVATION_CODES[activation], GATED=gated,
            INPUT_PRECISION=_input_precision(weight.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=4,
        )


def linear_residual_forward(
    rows: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, output: torch.Tensor
) -> None:
    """Launch on 2-D ``rows`` and ``residual`` (unit stride along their widths) into ``output`` (likewise)."""
    n_rows, n_inputs = rows.shape
    n_cols = weight.shape[0]
    if n_rows == 0 or n_cols == 0:
        return
    block_m, block_n, block_k = block_sizes(n_rows)
    with device_guard(rows.device):
        _linear_residual_kernel[(cdiv(n_cols, block_n), cdiv(n_rows, block_m))](
            rows, rows.stride(0), weight, weight.stride(0), weight.stride(1),
            residual, residual.stride(0), output, output.stride(0), n_rows, n_cols, n_inputs,
            INPUT_PRECISION=_input_precision(weight.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=4,
        )
