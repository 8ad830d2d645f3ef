"""Rotary position embedding (RoPE), rotate-half convention, applied to queries and keys before attention.

``apply_rotary`` rotates (batch, heads, length, head_dim) states at per-token positions (which may restart in every
packed segment). The Triton path (``rotary_triton.py``) computes the angles inside the kernel; the reference below
builds the cos/sin tables. Both use the same fp32 angles ``position * inverse_frequency``.
"""

import functools

import torch

from .dispatch import op_namespace, use_triton

try:
    from .rotary_triton import rotate as _triton_rotate
except ImportError:  # no triton: the reference serves every call
    _triton_rotate = None

_NAMESPACE = op_namespace(__name__)
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rotary_inverse_frequency(head_dim: int, base: float, device: torch.device | str) -> torch.Tensor:
    """The (head_dim // 2,) fp32 inverse frequencies ``base ** (-2i / head_dim)``."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


@functools.lru_cache(maxsize=64)
def _cached_inverse_frequency(head_dim: int, base: float, device: torch.device) -> torch.Tensor:
    # made once per device: recomputing it costs three small launches per call
    return rotary_inverse_frequency(head_dim, base, device)


def rotary_cos_sin(
    position_ids: torch.Tensor, head_dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (*position_ids.shape, head_dim) for integer positions (which may restart per segment)."""
    inverse_frequency = rotary_inverse_frequency(head_dim, base, position_ids.device)
    angles = position_ids.to(torch.float32)[..., None] * inverse_frequency
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos.float() + rotated.float() * sin.float()).to(x.dtype)


def _unit_stride(states: torch.Tensor) -> torch.Tensor:
    return states if states.stride(-1) == 1 else states.contiguous()


@torch.library.custom_op(f"{_NAMESPACE}::rotary", mutates_args=())
def _rotary_op(
    states: torch.Tensor, position_ids: torch.Tensor, inverse_frequency: torch.Tensor, inverse: bool
) -> torch.Tensor:
    """Triton rotation of (batch, heads, length, head_dim) states; ``inverse`` rotates by the opposite angles."""
    return _triton_rotate(_unit_stride(states), position_ids, inverse_frequency, inverse)


@_rotary_op.register_fake
def _(states, position_ids, inverse_frequency, inverse):
    return states.new_empty(states.shape)


def _setup_context(ctx, inputs, output):
    _, position_ids, inverse_frequency, inverse = inputs
    ctx.save_for_backward(position_ids, inverse_frequency)
    ctx.inverse = inverse


def _backward(ctx, grad_output):
    position_ids, inverse_frequency = ctx.saved_tensors
    return _rotary_op(grad_output, position_ids, inverse_frequency, not ctx.inverse), None, None, None


_rotary_op.register_autograd(_backward, setup_context=_setup_context)


class _RotaryFunction(torch.autograd.Function):
    """Eager path: the kernel launched straight from an autograd.Function (torch.library dispatch costs host time
    that the kernel does not); ``torch.compile`` traces the custom op above instead."""

    @staticmethod
    def forward(ctx, states, position_ids, inverse_frequency):
        ctx.save_for_backward(position_ids, inverse_frequency)
        return _triton_rotate(_unit_stride(states), position_ids, inverse_frequency)

    @staticmethod
    def backward(ctx, grad_output):
        position_ids, inverse_frequency = ctx.saved_tensors
        return _triton_rotate(_unit_stride(grad_output), position_ids, inverse_frequency, inverse=True), None, None


def _check_inputs(states: torch.Tensor, position_ids: torch.Tensor) -> None:
    if states.dim() != 4:
        raise ValueError(f"apply_rotary expects (batch, heads, length, head_dim) states, got {tuple(states.shape)}")
    if states.shape[-1] % 2:
        raise ValueError(f"RoPE needs an even head dimension, got {states.shape[-1]}")
    if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must be integers, got {position_ids.dtype}")
    batch, _, length, _ = states.shape
    if position_ids.dim() != 2 or position_ids.shape[1] != length or position_ids.shape[0] not in (1, batch):
        raise ValueError(
            f"position_ids must be (batch, length) = ({batch}, {length}) or (1, {length}), "
            f"got {tuple(position_ids.shape)}"
        )
    if position_ids.device != states.device:
        raise ValueError(f"states are on {states.device} but position_ids on {position_ids.device}")


def apply_rotary(
    states: torch.Tensor, position_ids: torch.Tensor, base: float = 10000.0, backend: str = "auto"
) -> torch.Tensor:
    """Rotate ``states`` (batch, heads, length, head_dim) by RoPE at ``position_ids`` (batch or 1, length).

    Args:
        base: the frequency base (``rope_theta``).
        backend: ``"auto"`` (Triton on CUDA, the reference elsewhere), ``"reference"`` or ``"triton"``.
    """
    _check_inputs(states, position_ids)
    if not use_triton(backend, states):
        cos, sin = rotary_cos_sin(position_ids, states.shape[-1], base)
        return apply_rotary_reference(states, cos[:, None], sin[:, None])
    if _triton_rotate is None:
        raise RuntimeError("apply_rotary: the Triton kernel could not be imported; use backend='reference'")
    if states.dtype not in _TRITON_DTYPES:
        raise TypeError(f"apply_rotary's Triton path takes fp32/fp16/bf16 states, got {states.dtype}")
    position_ids = position_ids.expand(states.shape[0], states.shape[2])
    if torch.compiler.is_compiling():
        inverse_frequency = rotary_inverse_frequency(states.shape[-1], base, states.device)
        return _rotary_op(states, position_ids, inverse_frequency, False)
    inverse_frequency = _cached_inverse_frequency(states.shape[-1], float(base), states.device)
    return _RotaryFunction.apply(states, position_ids, inverse_frequency)
