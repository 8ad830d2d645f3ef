"""T5's feed-forward activation, ``act(wi_0(x)) * wi_1(x)`` (gated) or ``act(wi(x))``: entry point, reference, wiring.

Eager PyTorch spends more time in T5 v1.1's tanh-GELU than in the matmuls around it at long inputs: the formula
runs as a chain of element-wise kernels over the (tokens, d_ff) tensor, and autograd keeps most of the
intermediates. The Triton path (``activation_triton.py``) does the forward in one read of ``gate`` and ``linear``
and one write, keeps only those two inputs for the backward, and recomputes the activation there. It runs from an
autograd.Function in eager mode and as ``torch.library`` custom ops with fake implementations under
``torch.compile(fullgraph=True)``.
"""

import math

import torch

from .dispatch import op_namespace, use_triton

# `from .module import name` (not `from . import module`): transformers only ships the remote-code files it finds
# imported that way.
try:
    from .activation_triton import activation_backward as _triton_backward
    from .activation_triton import activation_forward as _triton_forward
except ImportError:  # no triton: the reference serves every call
    _triton_backward = _triton_forward = None

_NAMESPACE = op_namespace(__name__)
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # transformers' NewGELUActivation, operation for operation, so the reference path gives its exact values
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# the activations with a fused kernel, by their names in transformers' ACT2FN
ACTIVATIONS = {
    "gelu_new": _gelu_new,
    "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "gelu": torch.nn.functional.gelu,
    "relu": torch.nn.functional.relu,
    "silu": torch.nn.functional.silu,
    "swish": torch.nn.functional.silu,
}


def activation_reference(gate: torch.Tensor, linear: torch.Tensor | None, activation: str) -> torch.Tensor:
    """``act(gate) * linear`` (or ``act(gate)``) in eager PyTorch, as transformers' T5 computes it."""
    activated = ACTIVATIONS[activation](gate)
    return activated if linear is None else activated * linear


def _check_inputs(gate, linear, activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if not isinstance(gate, torch.Tensor) or not gate.dtype.is_floating_point:
        raise TypeError("the activation's gate must be a floating-point tensor")
    if linear is not None:
        if not isinstance(linear, torch.Tensor) or linear.dtype != gate.dtype:
            raise TypeError(
                f"gate and linear must be tensors of one dtype, got {gate.dtype} and "
                f"{getattr(linear, 'dtype', type(linear).__name__)}"
            )
        if linear.shape != gate.shape or linear.device != gate.device:
            raise ValueError(
                f"gate {tuple(gate.shape)} on {gate.device} and linear {tuple(linear.shape)} on {linear.device} must "
                "have one shape and one device"
            )


def _forward(gate: torch.Tensor, linear: torch.Tensor | None, activation: str) -> torch.Tensor:
    gate = gate.contiguous()
    output = torch.empty_like(gate)
    _triton_forward(gate, None if linear is None else linear.contiguous(), output, activation)
    return output


def _backward(
    grad_output: torch.Tensor, gate: torch.Tensor, linear: torch.Tensor | None, activation: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    grad_output, gate = grad_output.contiguous(), gate.contiguous()
    linear = None if linear is None else linear.contiguous()
    grad_gate = torch.empty_like(gate)
    grad_linear = None if linear is None else torch.empty_like(linear)
    _triton_backward(grad_output, gate, linear, grad_gate, grad_linear, activation)
    return grad_gate, grad_linear


@torch.library.custom_op(f"{_NAMESPACE}::activation_forward", mutates_args=())
def _activation_forward(gate: torch.Tensor, linear: torch.Tensor | None, activation: str) -> torch.Tensor:
    return _forward(gate, linear, activation)


@_activation_forward.register_fake
def _(gate, linear, activation):
    return torch.empty_like(gate)


@torch.library.custom_op(f"{_NAMESPACE}::activation_backward", mutates_args=())
def _activation_backward(
    grad_output: torch.Tensor, gate: torch.Tensor, linear: torch.Tensor | None, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate's gradient and the linear input's (an empty tensor when ungated: an op returns tensors only)."""
    grad_gate, grad_linear = _backward(grad_output, gate, linear, activation)
    return grad_gate, gate.new_empty(0) if grad_linear is None else grad_linear


@_activation_backward.register_fake
def _(grad_output, gate, linear, activation):
    return torch.empty_like(gate), gate.new_empty(0) if linear is None else torch.empty_like(linear)


def _setup_context(ctx, inputs, output):
    gate, linear, activation = inputs
    ctx.activation = activation
    ctx.gated = linear is not None
    ctx.save_for_backward(gate, linear)


def _op_backward(ctx, grad_output):
    gate, linear = ctx.saved_tensors
    grad_gate, grad_linear = _activation_backward(grad_output, gate, linear, ctx.activation)
    return grad_gate, grad_linear if ctx.gated else None, None


_activation_forward.register_autograd(_op_backward, setup_context=_setup_context)


class _ActivationFunction(torch.autograd.Function):
    """Eager path: the kernels launched straight from an autograd.Function (torch.library's dispatch costs host
    time on every call); ``torch.compile`` traces the custom ops above instead."""

    @staticmethod
    def forward(ctx, gate, linear, activation):
        ctx.activation = activation
        ctx.save_for_backward(gate, linear)
        return _forward(gate, linear, activation)

    @staticmethod
    def backward(ctx, grad_output):
        gate, linear = ctx.saved_tensors
        return (*_backward(grad_output, gate, linear, ctx.activation), None)


def gated_activation(
    gate: torch.Tensor, linear: torch.Tensor | None = None, activation: str = "gelu_new", backend: str = "auto"
) -> torch.Tensor:
    """T5's feed-forward activation: ``act(gate) * linear``, or ``act(gate)`` when ``linear`` is None.

    Args:
        gate: ``wi_0(x)`` (gated) or ``wi(x)``, any shape, fp32/fp16/bf16 on the Triton path.
        linear: ``wi_1(x)``, the gate's shape and dtype, or None for T5 v1.0's plain activation.
        activation: a transformers ACT2FN name: ``"gelu_new"`` (T5 v1.1, FLAN-T5, mT5), ``"gelu_pytorch_tanh"``,
            ``"gelu"``, ``"relu"``, ``"silu"``/``"swish"``.
        backend: ``"auto"`` (Triton on CUDA, the reference elsewhere), ``"reference"`` or ``"triton"``.

    The Triton path computes in fp32 and rounds once, where eager PyTorch rounds after every operation of the
    formula: outputs differ by at most a unit in the last place of the half dtype.
    """
    _check_inputs(gate, linear, activation)
    if not use_triton(backend, gate):
        return activation_reference(gate, linear, activation)
    if _triton_forward is None:
        raise RuntimeError("gated_activation: the Triton kernels could not be imported; use backend='reference'")
    if gate.dtype not in _TRITON_DTYPES:
        raise TypeError(
            f"gated_activation's Triton path takes fp32/fp16/bf16, got {gate.dtype}; use backend='reference'"
        )
    if torch.compiler.is_compiling():
        return _activation_forward(gate, linear, activation)
    return _ActivationFunction.apply(gate, linear, activation)
