"""The decoding step's fused projections (``kernels.decode_linear``): the Triton kernels (through the interpreter on
CPU, fp32 and fp16; bf16 on a GPU) against the separate route's ops computed in fp32."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fat5.kernels.decode_linear import (
    linear_residual,
    linear_residual_reference,
    rms_norm_linear,
    rms_norm_linear_reference,
)

pytestmark = pytest.mark.interpreter

# (rows tolerance as a fraction of the output's norm) by dtype: fp32 differs by summation order only; half dtypes
# round the normed row and the product once each, as the separate route does, but may round a value the other way
_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _inputs(rows: int, width: int, outputs: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=generator) * 3.0
    norm_weight = 1.0 + 0.5 * torch.randn(width, generator=generator)
    weight = torch.randn(outputs, width, generator=generator) * width**-0.5
    linear_weight = torch.randn(outputs, width, generator=generator) * width**-0.5
    return [tensor.to(device, dtype) for tensor in (hidden, norm_weight, weight, linear_weight)]


def _close(output: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert output.shape == expected.shape
    error = (output.double() - expected.double()).norm()
    assert error <= _TOLERANCE[dtype] * expected.double().norm() + 1e-6, f"relative error {error / expected.norm()}"


def _fp32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [tensor.float() for tensor in tensors]


def _check_rms_norm_linear(rows, width, outputs, dtype, activation, gated, device="cpu", seed=0):
    hidden, norm_weight, weight, linear_weight = _inputs(rows, width, outputs, dtype, device, seed)
    linear_weight = linear_weight if gated else None
    output = rms_norm_linear(hidden, norm_weight, weight, 1e-6, activation, linear_weight, backend="triton")
    expected = rms_norm_linear_reference(
        *_fp32(hidden, norm_weight, weight), 1e-6, activation, None if linear_weight is None else linear_weight.float()
    )
    assert output.dtype == dtype
    _close(output, expected, dtype)


def _check_linear_residual(rows, width, outputs, dtype, device="cpu", seed=0):
    hidden, _, weight, _ = _inputs(rows, width, outputs, dtype, device, seed)
    residual = torch.randn(rows, outputs, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    output = linear_residual(hidden, weight, residual, backend="triton")
    assert output.dtype == dtype
    _close(output, linear_residual_reference(*_fp32(hidden, weight, residual)), dtype)


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 20), width=st.integers(1, 80), outputs=st.integers(1, 70),
    feed_forward=st.sampled_from([(None, False), ("gelu_new", True), ("relu", False), ("silu", True)]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
def test_rms_norm_linear_matches_the_separate_ops(rows, width, outputs, feed_forward, dtype):
    activation, gated = feed_forward
    _check_rms_norm_linear(rows, width, outputs, dtype, activation, gated, seed=rows + 7 * width + 31 * outputs)


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 20), width=st.integers(1, 80), outputs=st.integers(1, 70),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def test_linear_residual_matches_the_separate_ops(rows, width, outputs, dtype):
    _check_linear_residual(rows, width, outputs, dtype, seed=rows + 7 * width + 31 * outputs)


def test_rows_beyond_one_block_and_a_long_reduction():
    """More rows than one program's block (64), and a width of several K steps with a ragged last one."""
    _check_rms_norm_linear(70, 200, 40, torch.float32, "gelu_new", True)
    _check_linear_residual(70, 200, 40, torch.float32)


def test_strided_inputs_keep_their_layout():
    """A transposed weight (the graphed step keeps the gated input projection as (d_model, d_ff) views) and a
    leading batch dimension."""
    hidden, norm_weight, weight, linear_weight = _inputs(6, 24, 48, torch.float32)
    hidden = hidden.view(2, 3, 24)
    transposed = torch.stack((weight, linear_weight)).transpose(1, 2)
    output = rms_norm_linear(hidden, norm_weight, transposed[0].t(), 1e-6, "gelu_new", transposed[1].t(),
                             backend="triton")
    expected = rms_norm_linear_reference(hidden, norm_weight, weight, 1e-6, "gelu_new", linear_weight)
    assert output.shape == (2, 3, 48)
    _close(output, expected, torch.float32)


def test_the_result_is_the_same_at_every_call():
    hidden, norm_weight, weight, linear_weight = _inputs(5, 100, 33, torch.float32)
    first = rms_norm_linear(hidden, norm_weight, weight, 1e-6, "silu", linear_weight, backend="triton")
    assert torch.equal(first, rms_norm_linear(hidden, norm_weight, weight, 1e-6, "silu", linear_weight,
                                              backend="triton"))


def test_inputs_that_need_a_gradient_take_the_reference():
    hidden, _, weight, _ = _inputs(3, 16, 8, torch.float32)
    weight.requires_grad_()
    output = linear_residual(hidden, weight, torch.zeros(3, 8), backend="triton")
    assert output.requires_grad


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda h, n, w: rms_norm_linear(h, n, w, 1e-6, "gelu_new", w[:, :4]), "weights must be"),
        (lambda h, n, w: rms_norm_linear(h, n, w, 1e-6, None, w), "needs an activation"),
        (lambda h, n, w: rms_norm_linear(h, n, w, 1e-6, "tanh"), "activation must be one of"),
        (lambda h, n, w: rms_norm_linear(h, n[:3], w, 1e-6), "norm_weight must be"),
        (lambda h, n, w: linear_residual(h, w, torch.zeros(2, 5)), "the residual must be"),
    ],
)
def test_wrong_inputs_are_named(call, message):
    hidden, norm_weight, weight, _ = _inputs(2, 8, 6, torch.float32)
    with pytest.raises(ValueError, match=message):
        call(hidden, norm_weight, weight)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32, 128])
def test_bf16_kernels_on_the_gpu(rows):
    _check_rms_norm_linear(rows, 768, 2304, torch.bfloat16, None, False, device="cuda")
    _check_rms_norm_linear(rows, 768, 2048, torch.bfloat16, "gelu_new", True, device="cuda")
    _check_linear_residual(rows, 2048, 768, torch.bfloat16, device="cuda")
