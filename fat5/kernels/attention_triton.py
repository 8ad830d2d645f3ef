"""FAT5's Triton attention: the entry points ``triton_attention`` and ``triton_attention_varlen``, with the signatures
(and the semantics) of ``attention.attention`` and ``attention.attention_varlen``, which dispatch here for
``backend="triton"`` (or ``"auto"`` where the routes choose Triton); ``decode_attention`` and ``t5_bias_rows`` for a
decoding step replayed from a CUDA graph.

The house: ``attention_triton_kernels.py`` holds the kernels (its docstring says how the T5 bias is computed in them),
``attention_triton_config.py`` their launch configurations, ``attention_triton_t5.py`` T5's buckets and bias rows,
``attention_triton_launch.py`` the launchers, ``attention_triton_ops.py`` the custom ops and autograd.
"""

import torch

from .attention_triton_config import padded_head_dim
from .attention_triton_launch import CallOptions, launch_forward
from .attention_triton_ops import triton_attention_call
from .attention_triton_t5 import check_t5_buckets, t5_bias_by_distance
from .position_bias import NO_POSITION_BIAS, PositionBias

try:
    import triton
except ImportError:  # CPU-only installs: attention.py only calls in here when triton is importable
    triton = None

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_MAX_T5_DISTANCE = 2048  # the table-gradient kernel holds a head's 2 * max_distance + 3 sums in one program

def _check_triton_arguments(query, position_bias: PositionBias, num_heads, dropout_p):
    if triton is None:
        raise RuntimeError("the Triton attention needs the `triton` package, which is not installed")
    if query.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"the Triton attention supports float16, bfloat16 and float32 inputs, got {query.dtype}")
    if query.shape[-1] > _MAX_HEAD_DIM:
        raise ValueError(f"the Triton attention supports head_dim up to {_MAX_HEAD_DIM}, got {query.shape[-1]}")
    if dropout_p > 0.0:
        raise ValueError(
            "the Triton attention does not implement attention dropout: pass dropout_p=0.0, or backend='reference' "
            "to train with dropout on the attention probabilities"
        )
    if position_bias.kind == "t5":
        if position_bias.tensor.shape[1] != num_heads:
            raise ValueError(
                f"the T5 table must be (num_buckets, heads) with {num_heads} heads, "
                f"got {tuple(position_bias.tensor.shape)}"
            )
        if position_bias.max_distance > _MAX_T5_DISTANCE:
            raise ValueError(
                f"the Triton attention supports T5 max_distance up to {_MAX_T5_DISTANCE}, "
                f"got {position_bias.max_distance}"
            )
        check_t5_buckets(position_bias.bidirectional, position_bias.num_buckets, position_bias.max_distance)
    if position_bias.kind == "alibi" and position_bias.tensor.shape != (num_heads,):
        raise ValueError(f"alibi slopes must be (heads,) = ({num_heads},), got {tuple(position_bias.tensor.shape)}")


def _prepare(tensors, head_dim):
    """Pad the head dim to the kernels' power of two (zeros leave q·k and p·v unchanged); last dim contiguous."""
    padded = padded_head_dim(head_dim)
    prepared = []
    for tensor in tensors:
        if padded != head_dim:
            tensor = torch.nn.functional.pad(tensor, (0, padded - head_dim))
        elif tensor.stride(-1) != 1:
            tensor = tensor.contiguous()
        prepared.append(tensor)
    return prepared


def _query_offset_arguments(query_offset, tensors) -> tuple[int, torch.Tensor | None]:
    """(offset as an int, offset tensor for the kernel to read). A tensor offset stays on the device when autograd
    records nothing: no host synchronisation, and one CUDA graph of a decoding step serves every position. The
    backward kernels take the offset as an int, so a recorded call reads it back to the host."""
    if not isinstance(query_offset, torch.Tensor):
        return int(query_offset), None
    if torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in tensors):
        return int(query_offset), None
    return 0, query_offset.reshape(1)


def _position_tensor(position_bias: PositionBias) -> torch.Tensor | None:
    """The tensor the kernels read: ALiBi's slopes as fp32 constants (they receive no gradient)."""
    if position_bias.kind == "alibi":
        return position_bias.tensor.detach().float().contiguous()
    return position_bias.tensor


def triton_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    position_bias: PositionBias = NO_POSITION_BIAS,
    scale: float = 1.0,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    query_offset: int | torch.Tensor = 0,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Triton attention over (batch, heads, length, head_dim) tensors; see ``attention.attention``.

    ALiBi slopes receive no gradient; ``dropout_p > 0`` raises (use the reference backend).
    """
    batch, num_heads, query_length, head_dim = query.shape
    key_length = key.shape[2]
    _check_triton_arguments(query, position_bias, num_heads, dropout_p)
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be a bool tensor (True = attend), got {key_padding_mask.dtype}")
        if key_padding_mask.stride(-1) != 1:
            key_padding_mask = key_padding_mask.contiguous()
    if position_bias.kind == "bias":
        try:
            torch.broadcast_shapes(position_bias.tensor.shape, (batch, num_heads, query_length, key_length))
        except RuntimeError as error:
            raise ValueError(
                f"the explicit bias {tuple(position_bias.tensor.shape)} does not broadcast to (batch, heads, "
                f"query_length, key_length) = {(batch, num_heads, query_length, key_length)}"
            ) from error
    position_tensor = _position_tensor(position_bias)
    query_offset, query_offset_tensor = _query_offset_arguments(query_offset, (query, key, value, position_tensor))
    options = CallOptions.of(position_bias, query_length, key_length, scale, causal, query_offset)
    query, key, value = _prepare((query, key, value), head_dim)
    out = triton_attention_call(query, key, value, key_padding_mask, position_tensor, None, None, options,
                                query_offset_tensor)
    return out if out.shape[-1] == head_dim else out[..., :head_dim]


def triton_attention_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    position_bias: PositionBias = NO_POSITION_BIAS,
    scale: float = 1.0,
    causal: bool = False,
    query_offset: int | torch.Tensor = 0,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Triton attention over packed (tokens, heads, head_dim) tensors; see ``attention.attention_varlen``."""
    _, num_heads, head_dim = query.shape
    _check_triton_arguments(query, position_bias, num_heads, dropout_p)
    if position_bias.kind == "bias" and position_bias.tensor.shape[-2:] != (max_seqlen_q, max_seqlen_k):
        raise ValueError(
            f"an explicit bias for varlen attention is (heads, max_seqlen_q, max_seqlen_k) = "
            f"{(num_heads, max_seqlen_q, max_seqlen_k)}, got {tuple(position_bias.tensor.shape)}"
        )
    position_tensor = _position_tensor(position_bias)
    query_offset, query_offset_tensor = _query_offset_arguments(query_offset, (query, key, value, position_tensor))
    options = CallOptions.of(position_bias, max_seqlen_q, max_seqlen_k, scale, causal, query_offset)
    query, key, value = _prepare((query, key, value), head_dim)
    out = triton_attention_call(
        query, key, value, None, position_tensor, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32),
        options, query_offset_tensor,
    )
    return out if out.shape[-1] == head_dim else out[..., :head_dim]


def t5_bias_rows(position_bias: PositionBias) -> torch.Tensor:
    """The (heads, 2 * max_distance + 3) fp32 rows of a T5 ``position_bias`` by relative position, which every
    forward launch of the kernels otherwise makes again: for :func:`decode_attention`, that makes them once while
    the table does not change."""
    if position_bias.kind != "t5":
        raise ValueError(f"t5_bias_rows needs a T5 PositionBias, got a {position_bias.kind!r} one")
    return t5_bias_by_distance(
        position_bias.tensor, position_bias.bidirectional, position_bias.num_buckets, position_bias.max_distance
    )[1]


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    position_bias: PositionBias = NO_POSITION_BIAS,
    t5_bias_rows: torch.Tensor | None = None,
    scale: float = 1.0,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    query_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """The forward of :func:`triton_attention` alone, for inference (nothing recorded for autograd): a decoding step
    replayed from a CUDA graph. ``query_offset``: a one-element integer tensor on the device, read in place, or
    None for 0; ``t5_bias_rows``: :func:`t5_bias_rows` of ``position_bias``, made once instead of at every call."""
    _, num_heads, query_length, head_dim = query.shape
    _check_triton_arguments(query, position_bias, num_heads, 0.0)
    if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor (True = attend), got {key_padding_mask.dtype}")
    options = CallOptions.of(position_bias, query_length, key.shape[2], scale, causal, 0)
    query, key, value = _prepare((query, key, value), head_dim)
    offset = None if query_offset is None else query_offset.reshape(1)
    out, _ = launch_forward(query, key, value, key_padding_mask, _position_tensor(position_bias), None, None, options,
                            offset, t5_bias_rows)
    return out if out.shape[-1] == head_dim else out[..., :head_dim]
