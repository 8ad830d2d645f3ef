"""RMSNorm with T5LayerNorm semantics: the public entry point, its reference and the custom-op wiring.

T5's norm (``transformers.models.t5.modeling_t5.T5LayerNorm``) computes the variance of ``x`` in fp32, multiplies
``x`` by ``rsqrt(variance + eps)`` in fp32, casts that to the weight's dtype when the weight is fp16/bf16, and only
then multiplies by the weight. Every backend here reproduces that order, so a converted checkpoint gives the same
activations. ``output_dtype`` rounds that product once into another dtype (the model passes autocast's for the norms
whose output only feeds projections: the value autocast would have cast it to, without an fp32 tensor in between).
The Triton kernels (``rms_norm_triton.py``) run from an autograd.Function in eager mode and, when asked for by name
(``backend="triton"``), as ``torch.library`` custom ops with fake implementations under
``torch.compile(fullgraph=True)``; under ``torch.compile``, ``"auto"`` takes the reference, which Inductor fuses.
"""

import torch

from .dispatch import as_rows, op_namespace, use_triton

# `from .module import name` (not `from . import module`): transformers only ships the remote-code files it finds
# imported that way.
try:
    from .rms_norm_triton import MAX_WIDTH as _TRITON_MAX_WIDTH
    from .rms_norm_triton import rms_norm_backward as _triton_backward
    from .rms_norm_triton import rms_norm_forward as _triton_forward
except ImportError:  # no triton: the reference serves every call
    _TRITON_MAX_WIDTH = _triton_backward = _triton_forward = None

_NAMESPACE = op_namespace(__name__)
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rms_norm_reference(
    hidden_states: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """T5LayerNorm's forward, line for line, in pure PyTorch: the CPU path and the truth the kernels are tested on."""
    variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    if weight.dtype in _HALF_DTYPES:
        hidden_states = hidden_states.to(weight.dtype)
    output = weight * hidden_states
    return output if output_dtype is None else output.to(output_dtype)


def _output_dtype(input_dtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
    # The reference's dtype: the normalised x is fp32 (or wider), cast to the weight's dtype if that is half.
    if weight_dtype in _HALF_DTYPES:
        return weight_dtype
    return torch.promote_types(torch.promote_types(input_dtype, torch.float32), weight_dtype)


def _check_inputs(hidden_states: torch.Tensor, weight: torch.Tensor, output_dtype: torch.dtype | None) -> None:
    if not isinstance(hidden_states, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("rms_norm expects tensors for hidden_states and weight")
    if output_dtype is not None and not (isinstance(output_dtype, torch.dtype) and output_dtype.is_floating_point):
        raise TypeError(f"rms_norm: output_dtype must be a floating torch.dtype or None, got {output_dtype!r}")
    if not hidden_states.dtype.is_floating_point or not weight.dtype.is_floating_point:
        raise TypeError(
            f"rms_norm needs floating tensors, got hidden_states {hidden_states.dtype} and weight {weight.dtype}"
        )
    if weight.dim() != 1:
        raise ValueError(f"rms_norm weight must be 1-D (hidden_size,), got shape {tuple(weight.shape)}")
    if hidden_states.dim() == 0 or hidden_states.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"rms_norm: the last dimension of hidden_states {tuple(hidden_states.shape)} must equal the size of "
            f"weight ({weight.shape[0]})"
        )
    if hidden_states.device != weight.device:
        raise ValueError(f"hidden_states is on {hidden_states.device} but weight on {weight.device}")


@torch.library.custom_op(f"{_NAMESPACE}::rms_norm_forward", mutates_args=())
def _rms_norm_forward(
    hidden_states: torch.Tensor, weight: torch.Tensor, eps: float, output_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward: returns the normalised output and the fp32 inverse RMS of each row (kept for backward)."""
    rows = as_rows(hidden_states)
    output = torch.empty(rows.shape, dtype=output_dtype, device=rows.device)
    inverse_rms = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
    _triton_forward(rows, weight, output, inverse_rms, eps)
    return output.view(hidden_states.shape), inverse_rms


@_rms_norm_forward.register_fake
def _(hidden_states, weight, eps, output_dtype):
    rows = hidden_states.numel() // hidden_states.shape[-1]
    output = hidden_states.new_empty(hidden_states.shape, dtype=output_dtype)
    return output, hidden_states.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op(f"{_NAMESPACE}::rms_norm_backward", mutates_args=())
def _rms_norm_backward(
    grad_output: torch.Tensor, hidden_states: torch.Tensor, weight: torch.Tensor, inverse_rms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton backward: the input gradient, and the weight gradient reduced in fp32 per program then summed."""
    rows = as_rows(hidden_states)
    grad_rows = as_rows(grad_output)
    grad_input = torch.empty(rows.shape, dtype=hidden_states.dtype, device=rows.device)
    grad_weight = _triton_backward(grad_rows, rows, weight, inverse_rms, grad_input)
    return grad_input.view(hidden_states.shape), grad_weight


@_rms_norm_backward.register_fake
def _(grad_output, hidden_states, weight, inverse_rms):
    return torch.empty_like(hidden_states), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    hidden_states, weight, _, _ = inputs
    _, inverse_rms = output
    ctx.mark_non_differentiable(inverse_rms)
    ctx.save_for_backward(hidden_states, weight, inverse_rms)


def _backward(ctx, grad_output, _grad_inverse_rms):
    hidden_states, weight, inverse_rms = ctx.saved_tensors
    grad_input, grad_weight = _rms_norm_backward(grad_output, hidden_states, weight, inverse_rms)
    return grad_input, grad_weight, None, None


_rms_norm_forward.register_autograd(_backward, setup_context=_setup_context)


class _RMSNormFunction(torch.autograd.Function):
    """Eager path: the kernels launched straight from an autograd.Function.

    Dispatching through torch.library costs tens of microseconds of host time per call, more than the kernels take
    at T5's widths; ``torch.compile`` traces the custom ops above instead.
    """

    @staticmethod
    def forward(ctx, hidden_states, weight, eps, output_dtype):
        rows = as_rows(hidden_states)
        output = torch.empty(rows.shape, dtype=output_dtype, device=rows.device)
        inverse_rms = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        _triton_forward(rows, weight, output, inverse_rms, eps)
        ctx.save_for_backward(rows, weight, inverse_rms)
        ctx.input_shape = hidden_states.shape
        return output.view(hidden_states.shape)

    @staticmethod
    def backward(ctx, grad_output):
        rows, weight, inverse_rms = ctx.saved_tensors
        grad_rows = as_rows(grad_output)
        grad_input = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
        grad_weight = _triton_backward(grad_rows, rows, weight, inverse_rms, grad_input)
        return grad_input.view(ctx.input_shape), grad_weight, None, None


def rms_norm(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    backend: str = "auto",
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Root-mean-square norm over the last dimension, with T5LayerNorm's semantics exactly.

    Args:
        hidden_states: ``(..., hidden_size)``, any leading shape, fp32/fp16/bf16 on the Triton path.
        weight: ``(hidden_size,)`` scale.
        eps: added to the mean of squares before the reciprocal square root.
        backend: ``"auto"`` (Triton on CUDA in eager mode, the reference elsewhere and under ``torch.compile``,
            whose Inductor fuses it with its neighbours), ``"reference"`` or ``"triton"``.
        output_dtype: the result's dtype; None keeps T5LayerNorm's (the weight's when it is fp16/bf16, else fp32 or
            wider). The product is rounded into it once; the gradients are those of the unrounded product.

    Returns:
        ``weight * (hidden_states * rsqrt(mean(hidden_states**2) + eps))``, the normalised term computed in fp32
        and cast to ``weight.dtype`` before the multiply when the weight is fp16/bf16, as T5 does.
    """
    _check_inputs(hidden_states, weight, output_dtype)
    # Under torch.compile, "auto" leaves the norm to Inductor, which fuses it with the residual add before it and the
    # casts around it; the kernel, opaque to Inductor, cost a pass more each way (UL2 pretraining, base shape in CUDA
    # graphs on an H100: 24.3% -> 26.2% MFU, benchmarks/results/archive/pretrain_base_inductor_norm.json).
    if not use_triton(backend, hidden_states) or (backend == "auto" and torch.compiler.is_compiling()):
        return rms_norm_reference(hidden_states, weight, eps, output_dtype)
    if _triton_forward is None:
        raise RuntimeError("rms_norm: the Triton kernels could not be imported; use backend='reference'")
    if hidden_states.dtype not in _TRITON_DTYPES or weight.dtype not in _TRITON_DTYPES:
        raise TypeError(
            f"rms_norm's Triton path takes fp32/fp16/bf16, got hidden_states {hidden_states.dtype} and weight "
            f"{weight.dtype}; use backend='reference' for other dtypes"
        )
    if hidden_states.shape[-1] > _TRITON_MAX_WIDTH:
        # A row wider than one program's registers: the reference is the better kernel there.
        return rms_norm_reference(hidden_states, weight, eps, output_dtype)
    if output_dtype is None:
        output_dtype = _output_dtype(hidden_states.dtype, weight.dtype)
    if torch.compiler.is_compiling():
        output, _ = _rms_norm_forward(hidden_states, weight, float(eps), output_dtype)
        return output
    return _RMSNormFunction.apply(hidden_states, weight, float(eps), output_dtype)
