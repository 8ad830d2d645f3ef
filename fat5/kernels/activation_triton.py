"""Triton kernels for T5's feed-forward activation, gated or not; imported lazily by ``activation.py``.

Forward: ``act(gate) * linear`` (or ``act(gate)``) in fp32, rounded once to the output dtype. Backward: recomputes
``act(gate)`` from the saved input and writes ``d gate`` and ``d linear`` in the same pass. Both are element-wise
over flat, contiguous buffers, so each costs one read of its inputs and one write of its outputs: eager PyTorch runs
T5's tanh-GELU as about eight kernels forward and twice that backward, each over the (tokens, d_ff) tensor.
"""

try:
    import triton
    import triton.language as tl
except ImportError as error:  # activation.py falls back to the reference
    raise ImportError("activation_triton needs the `triton` package") from error

import torch

from .launch import CachedLauncher, cdiv, device_guard

# The activation codes the kernels understand, by the names transformers' ACT2FN gives them.
ACTIVATION_CODES = {"gelu_new": 0, "gelu_pytorch_tanh": 0, "gelu": 1, "relu": 2, "silu": 3, "swish": 3}

# constexpr: a jitted function may read module globals only when they are
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_INVERSE_SQRT_2 = tl.constexpr(0.7071067811865476)
_INVERSE_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _activation_and_derivative(x, ACTIVATION: tl.constexpr, NEED_DERIVATIVE: tl.constexpr):
    """act(x) and, when asked, act'(x), both fp32 (the derivative is 0.0 when not asked)."""
    derivative = 0.0
    if ACTIVATION == 0:
        # tanh-approximated GELU; tanh(u) = 2 sigmoid(2u) - 1 keeps to what the interpreter supports too
        inner = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
        tanh_inner = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        value = 0.5 * x * (1.0 + tanh_inner)
        if NEED_DERIVATIVE:
            derivative = 0.5 * (1.0 + tanh_inner) + 0.5 * x * (1.0 - tanh_inner * tanh_inner) * _SQRT_2_OVER_PI * (
                1.0 + 3.0 * 0.044715 * x * x
            )
    elif ACTIVATION == 1:
        cdf = 0.5 * (1.0 + tl.erf(x * _INVERSE_SQRT_2))
        value = x * cdf
        if NEED_DERIVATIVE:
            derivative = cdf + x * tl.exp(-0.5 * x * x) * _INVERSE_SQRT_2PI
    elif ACTIVATION == 2:
        value = tl.maximum(x, 0.0)
        if NEED_DERIVATIVE:
            derivative = tl.where(x > 0.0, 1.0, 0.0)
    else:
        sigmoid = tl.sigmoid(x)
        value = x * sigmoid
        if NEED_DERIVATIVE:
            derivative = sigmoid * (1.0 + x * (1.0 - sigmoid))
    return value, derivative


@CachedLauncher
@triton.jit
def _activation_forward_kernel(
    gate_ptr, linear_ptr, output_ptr, n_elements,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    output, _ = _activation_and_derivative(gate, ACTIVATION, False)
    if GATED:
        output = output * tl.load(linear_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(output_ptr + offsets, output.to(output_ptr.dtype.element_ty), mask=mask)


@CachedLauncher
@triton.jit
def _activation_backward_kernel(
    grad_output_ptr, gate_ptr, linear_ptr, grad_gate_ptr, grad_linear_ptr, n_elements,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    grad_output = tl.load(grad_output_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    activated, derivative = _activation_and_derivative(gate, ACTIVATION, True)
    if GATED:
        linear = tl.load(linear_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(grad_linear_ptr + offsets, (grad_output * activated).to(grad_linear_ptr.dtype.element_ty), mask=mask)
        grad_output = grad_output * linear
    tl.store(grad_gate_ptr + offsets, (grad_output * derivative).to(grad_gate_ptr.dtype.element_ty), mask=mask)


_BLOCK_SIZE = 2048
_NUM_WARPS = 8


def activation_forward(gate: torch.Tensor, linear: torch.Tensor | None, output: torch.Tensor, activation: str) -> None:
    """Write ``act(gate) * linear`` (``act(gate)`` when ``linear`` is None) into ``output``; all contiguous."""
    n_elements = gate.numel()
    if n_elements == 0:
        return
    with device_guard(gate.device):
        _activation_forward_kernel[(cdiv(n_elements, _BLOCK_SIZE),)](
            gate, gate if linear is None else linear, output, n_elements,
            ACTIVATION=ACTIVATION_CODES[activation], GATED=linear is not None, BLOCK_SIZE=_BLOCK_SIZE,
            num_warps=_NUM_WARPS,
        )


def activation_backward(
    grad_output: torch.Tensor,
    gate: torch.Tensor,
    linear: torch.Tensor | None,
    grad_gate: torch.Tensor,
    grad_linear: torch.Tensor | None,
    activation: str,
) -> None:
    """Write the gradients of ``gate`` (and of ``linear`` when gated) for ``grad_output``; all contiguous."""
    n_elements = gate.numel()
    if n_elements == 0:
        return
    gated = linear is not None
    with device_guard(gate.device):
        _activation_backward_kernel[(cdiv(n_elements, _BLOCK_SIZE),)](
            grad_output, gate, linear if gated else gate, grad_gate, grad_linear if gated else grad_gate, n_elements,
            ACTIVATION=ACTIVATION_CODES[activation], GATED=gated, BLOCK_SIZE=_BLOCK_SIZE, num_warps=_NUM_WARPS,
        )
