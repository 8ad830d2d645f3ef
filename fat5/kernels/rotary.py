"""Rotary position embedding (RoPE), rotate-half convention, applied to queries and keys before attention."""

import torch

from .dispatch import use_triton


def rotary_cos_sin(
    position_ids: torch.Tensor, head_dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (*position_ids.shape, head_dim) for integer positions (which may restart per segment)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    angles = position_ids.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos.float() + rotated.float() * sin.float()).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Rotate ``x`` (..., length, head_dim) by ``cos``/``sin`` broadcastable to it."""
    use_triton(backend, x)  # validates the backend name; the fused kernel is not wired yet
    return apply_rotary_reference(x, cos, sin)
