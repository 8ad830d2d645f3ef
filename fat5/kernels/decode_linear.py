"""The decoding step's fused projections: RMSNorm into the following projection, and the output projection with its
residual add. Their references compose the separate route's ops (``rms_norm_reference``, ``F.linear``,
``activation_reference``) in its order and roundings; the Triton kernels (``decode_linear_triton.py``) compute the
same in one launch each, for the few rows of a decoding step. Inference only: neither takes a gradient.
"""

import torch
from torch.nn import functional

from .activation import ACTIVATIONS, activation_reference
from .dispatch import use_triton
from .rms_norm import rms_norm_reference

# `from .module import name` (not `from . import module`): transformers only ships the remote-code files it finds
# imported that way.
try:
    from .decode_linear_triton import linear_residual_forward as _triton_linear_residual
    from .decode_linear_triton import rms_norm_linear_forward as _triton_rms_norm_linear
except ImportError:  # no triton: the reference serves every call
    _triton_linear_residual = _triton_rms_norm_linear = None

_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rms_norm_linear_reference(
    hidden_states: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float,
    activation: str | None = None, linear_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(norm(x) @ weight.T) * (norm(x) @ linear_weight.T)`` as the separate route computes it (the activation
    and the second product only when given)."""
    normed = rms_norm_reference(hidden_states, norm_weight, eps).to(weight.dtype)
    output = functional.linear(normed, weight)
    if activation is None:
        return output
    return activation_reference(output, None if linear_weight is None else functional.linear(normed, linear_weight),
                                activation)


def linear_residual_reference(
    hidden_states: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor:
    return residual + functional.linear(hidden_states, weight)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    rows = tensor.reshape(-1, tensor.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check(hidden_states: torch.Tensor, weights: list[torch.Tensor], name: str) -> None:
    width = hidden_states.shape[-1]
    for weight in weights:
        if weight.dim() != 2 or weight.shape[1] != width or weight.shape[0] != weights[0].shape[0]:
            raise ValueError(f"{name}: the weights must be (outputs, {width}), got {[tuple(w.shape) for w in weights]}")
        if weight.dtype != weights[0].dtype or weight.device != hidden_states.device:
            raise ValueError(f"{name}: the weights must share one dtype and the input's device")


def _kernel_runs(backend: str, tensors: list[torch.Tensor]) -> bool:
    # the kernels have no backward: an input that needs a gradient takes the reference, whatever the backend; nor are
    # they custom ops that torch.compile could trace, and Inductor fuses the reference's norm and add itself
    needs_gradient = torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)
    if needs_gradient or torch.compiler.is_compiling():
        return False
    return use_triton(backend, tensors[0]) and all(tensor.dtype in _TRITON_DTYPES for tensor in tensors)


def rms_norm_linear(
    hidden_states: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float,
    activation: str | None = None, linear_weight: torch.Tensor | None = None, backend: str = "auto",
) -> torch.Tensor:
    """T5's RMSNorm of ``hidden_states`` (..., K) with ``norm_weight`` (K,), times ``weight`` (N, K) transposed:
    (..., N) in ``weight``'s dtype. ``activation`` (a name of ``kernels.activation.ACTIVATIONS``) activates the
    product; ``linear_weight`` (N, K), with an activation, multiplies it by a second product (the gated feed-forward).
    ``backend="auto"`` runs the kernel for CUDA tensors, the reference elsewhere and for inputs that need a gradient."""
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(
            f"rms_norm_linear: activation must be one of {sorted(ACTIVATIONS)} or None, got {activation!r}"
        )
    if linear_weight is not None and activation is None:
        raise ValueError("rms_norm_linear: a linear_weight (gated product) needs an activation")
    weights = [weight] if linear_weight is None else [weight, linear_weight]
    _check(hidden_states, weights, "rms_norm_linear")
    if norm_weight.shape != (hidden_states.shape[-1],):
        raise ValueError(
            f"rms_norm_linear: norm_weight must be ({hidden_states.shape[-1]},), got {tuple(norm_weight.shape)}"
        )
    if not _kernel_runs(backend, [hidden_states, norm_weight, *weights]):
        return rms_norm_linear_reference(hidden_states, norm_weight, weight, eps, activation, linear_weight)
    rows = _rows(hidden_states)
    output = torch.empty(rows.shape[0], weight.shape[0], dtype=weight.dtype, device=rows.device)
    _triton_rms_norm_linear(rows, norm_weight, weight, linear_weight, output, eps, activation)
    return output.view(*hidden_states.shape[:-1], weight.shape[0])


def linear_residual(
    hidden_states: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, backend: str = "auto"
) -> torch.Tensor:
    """``residual + hidden_states @ weight.T``, rounded once, in ``residual``'s dtype: ``hidden_states`` (..., K),
    ``weight`` (N, K), ``residual`` (..., N). Backends as for ``rms_norm_linear``."""
    _check(hidden_states, [weight], "linear_residual")
    if residual.shape != (*hidden_states.shape[:-1], weight.shape[0]):
        raise ValueError(f"linear_residual: the residual must be {(*hidden_states.shape[:-1], weight.shape[0])}, got "
                         f"{tuple(residual.shape)}")
    if hidden_states.dtype != weight.dtype or not _kernel_runs(backend, [hidden_states, weight, residual]):
        return linear_residual_reference(hidden_states, weight, residual)
    rows = _rows(hidden_states)
    output = torch.empty(rows.shape[0], weight.shape[0], dtype=residual.dtype, device=rows.device)
    _triton_linear_residual(rows, weight, _rows(residual), output)
    return output.view(residual.shape)
