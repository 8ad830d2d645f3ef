"""Attention with the position bias computed inside the kernel: the public entry points and their reference.

``attention`` takes (batch, heads, length, head_dim) tensors, ``attention_varlen`` packed (tokens, heads, head_dim)
tensors with ``cu_seqlens`` (as flash-attention's ``flash_attn_varlen_func``). Instead of a bias tensor they take a
``PositionBias`` that describes it: T5's bucket table, ALiBi's slopes, an explicit additive tensor (FIRE's) or none.
The reference below materialises the scores in fp32; it is the CPU path and the truth the Triton kernels are tested
against. ``attention_with_probabilities`` is that reference alone, for what the kernels cannot give: it returns the
probabilities too and takes transformers' custom 4-D masks.

Semantics shared by every backend: query row ``i`` sits at position ``query_offset + i`` and key ``j`` at ``j``
(positions restart at 0 in every varlen segment); ``causal`` hides keys after the query; ``key_padding_mask`` is
True where a key may be attended; a query that sees no key outputs zeros.
"""

import torch

from .position_bias import NO_POSITION_BIAS, PositionBias
from .routes import attention_kernel, packed_problem, padded_problem


def _check_inputs(query, key, value, query_offset, position_bias, dropout_p):
    if not isinstance(position_bias, PositionBias):
        raise TypeError(f"position_bias must be a PositionBias (PositionBias.t5(...), ...), got {type(position_bias)}")
    if key.shape != value.shape:
        raise ValueError(f"key and value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}")
    heads_dim = -2 if query.dim() == 3 else 1
    if query.dim() != key.dim() or query.shape[-1] != key.shape[-1] or query.shape[heads_dim] != key.shape[heads_dim]:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} disagree on heads or head_dim")
    if not query.dtype.is_floating_point or query.dtype != key.dtype or key.dtype != value.dtype:
        raise TypeError(
            f"query, key and value must share one floating dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}")
    if isinstance(query_offset, torch.Tensor):
        if query_offset.numel() != 1 or query_offset.dtype.is_floating_point or query_offset.dtype == torch.bool:
            raise ValueError(
                f"query_offset must be an int or a one-element integer tensor, got a {query_offset.dtype} tensor of "
                f"shape {tuple(query_offset.shape)}"
            )
        if query_offset.device != query.device:
            raise ValueError(f"query_offset is on {query_offset.device} but the query on {query.device}")


def _check_padded_inputs(query, key, value, key_padding_mask, query_offset, position_bias, dropout_p):
    """The checks of the (batch, heads, length, head_dim) entry points, ``attention`` and its probabilities path."""
    if query.dim() != 4:
        raise ValueError(f"attention expects (batch, heads, length, head_dim) tensors, got query {tuple(query.shape)}")
    _check_inputs(query, key, value, query_offset, position_bias, dropout_p)
    if key_padding_mask is not None and key_padding_mask.shape != (key.shape[0], key.shape[2]):
        raise ValueError(
            f"key_padding_mask must be (batch, key_length) = {(key.shape[0], key.shape[2])}, "
            f"got {tuple(key_padding_mask.shape)}"
        )


def visible_keys(query_length: int, key_length: int, causal: bool, query_offset, key_padding_mask, device):
    """True where a query may attend a key: (query_length, key_length), or (batch, 1, query_length, key_length)
    with a (batch, key_length) ``key_padding_mask``; causality counts query positions from ``query_offset``."""
    visible = torch.ones(query_length, key_length, dtype=torch.bool, device=device)
    if causal:
        query_position = torch.arange(query_length, device=device)[:, None] + query_offset
        visible = torch.arange(key_length, device=device)[None, :] <= query_position
    if key_padding_mask is not None:
        visible = visible & key_padding_mask.bool()[:, None, None, :]
    return visible


def _reference(query, key, value, *, scale, causal, key_padding_mask, query_offset, position_bias, dropout_p,
               attention_mask=None):
    """The attention output in the query's dtype and the probabilities (fp32), from materialised fp32 scores."""
    query_length, key_length = query.shape[-2], key.shape[-2]
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    bias = position_bias.materialise(query_length, key_length, query_offset)
    if bias is not None:
        scores = scores + bias.float()

    if attention_mask is not None:
        # transformers' custom masks: False (bool) or a large negative (float) hides a key; a row that hides every
        # key spreads evenly over them, as in transformers' T5, instead of giving zeros
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(torch.float32).min)
        else:
            scores = scores + attention_mask.float()
        probs = torch.softmax(scores, dim=-1)
    else:
        visible = visible_keys(query_length, key_length, causal, query_offset, key_padding_mask, query.device)
        visible = visible.expand(*scores.shape[:-2], query_length, key_length)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = torch.where(visible.any(dim=-1, keepdim=True), probs, torch.zeros_like(probs))
    if dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout_p)
    return torch.matmul(probs, value.float()).to(query.dtype), probs


def _fa4_bias(position_bias: PositionBias) -> PositionBias | None:
    """What the FA4 route takes: a T5 bias, or None (the routes send it no other kind)."""
    return position_bias if position_bias.kind == "t5" else None


def attention(
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
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over (batch, heads, length, head_dim) tensors; returns (batch, heads, query_length, head_dim).

    Args:
        position_bias: what is added to the scores (``PositionBias.t5(table, ...)``, ``.alibi(slopes)``,
            ``.explicit(bias)``; none by default). A T5 table or an explicit bias receives a gradient.
        scale: multiplies ``q·k`` (T5: 1.0, its scaling lives in the initialisation).
        causal: hide keys after the query position.
        key_padding_mask: (batch, key_length) bool, True where the key may be attended.
        query_offset: position of the first query (the cache length when decoding step by step): an int, or a
            one-element integer tensor on the query's device, which the Triton kernel reads in place (no host
            synchronisation; a CUDA graph of a decoding step stays valid as the position advances).
        dropout_p: dropout on the attention probabilities.
        backend: ``"auto"``, ``"reference"`` or ``"triton"`` (see ``dispatch``); ``"auto"`` on a GPU takes the kernel
            that ``routes.ATTENTION_ROUTES`` names for the problem (flash-attn-4 for some bias-free ones on Hopper).
    """
    _check_padded_inputs(query, key, value, key_padding_mask, query_offset, position_bias, dropout_p)
    arguments = {
        "position_bias": position_bias, "scale": scale, "causal": causal, "key_padding_mask": key_padding_mask,
        "query_offset": query_offset, "dropout_p": dropout_p,
    }
    kernel = attention_kernel(backend, query, lambda: padded_problem(query, key, position_bias.kind, causal,
                                                                     key_padding_mask, query_offset, dropout_p))
    if kernel == "fa4":
        from .attention_fa4 import fa4_attention

        return fa4_attention(query, key, value, scale=scale, causal=causal, position_bias=_fa4_bias(position_bias))
    if kernel == "triton":
        from .attention_triton import triton_attention

        return triton_attention(query, key, value, **arguments)
    return _reference(query, key, value, **arguments)[0]


def attention_with_probabilities(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    position_bias: PositionBias = NO_POSITION_BIAS,
    scale: float = 1.0,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    query_offset: int | torch.Tensor = 0,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference attention over (batch, heads, length, head_dim) tensors, returning the output and the
    attention probabilities, (batch, heads, query_length, key_length) in the query's dtype: the path for what the
    fused kernels cannot do, transformers' ``output_attentions=True`` and its custom 4-D masks.

    Args:
        attention_mask: a custom mask broadcastable to (batch, heads, query_length, key_length), transformers' 4-D
            ``(batch, 1, query_length, key_length)``: bool (True where the key may be attended) or float, added to
            the scores (0 or a large negative). It is the whole mask, as in transformers: neither ``causal`` nor
            ``key_padding_mask`` may come with it.
        Others as in :func:`attention`; with them, the output is the one :func:`attention` gives.
    """
    _check_padded_inputs(query, key, value, key_padding_mask, query_offset, position_bias, dropout_p)
    if attention_mask is not None:
        if causal or key_padding_mask is not None:
            raise ValueError("a custom attention_mask is the whole mask: give it without causal or key_padding_mask")
        if attention_mask.dim() != 4 or not (
            attention_mask.dtype == torch.bool or attention_mask.dtype.is_floating_point
        ):
            raise ValueError(
                "attention_mask must be a 4-D bool or float tensor, (batch, 1, query_length, key_length), got "
                f"{attention_mask.dtype} {tuple(attention_mask.shape)}"
            )
    output, probs = _reference(
        query, key, value, position_bias=position_bias, scale=scale, causal=causal,
        key_padding_mask=key_padding_mask, attention_mask=attention_mask, query_offset=query_offset,
        dropout_p=dropout_p,
    )
    return output, probs.to(query.dtype)


def attention_varlen(
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
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over packed sequences: (total_tokens, heads, head_dim) tensors, segment ``s`` of the queries being
    rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and attending only to keys ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``.

    Positions restart at 0 in every segment. An explicit bias is (heads, max_seqlen_q, max_seqlen_k), shared by all
    segments. Other arguments as in :func:`attention`.
    """
    if query.dim() != 3:
        raise ValueError(f"attention_varlen expects (tokens, heads, head_dim) tensors, got query {tuple(query.shape)}")
    _check_inputs(query, key, value, query_offset, position_bias, dropout_p)
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} must be 1-D "
            "and of the same length (one entry per segment, plus one)"
        )
    arguments = {
        "position_bias": position_bias, "scale": scale, "causal": causal, "query_offset": query_offset,
        "dropout_p": dropout_p,
    }
    kernel = attention_kernel(backend, query, lambda: packed_problem(
        query, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, position_bias.kind, causal, query_offset,
        dropout_p))
    if kernel == "fa4":
        from .attention_fa4 import fa4_attention_varlen

        return fa4_attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    scale=scale, causal=causal, position_bias=_fa4_bias(position_bias))
    if kernel == "triton":
        from .attention_triton import triton_attention_varlen

        return triton_attention_varlen(
            query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **arguments
        )
    return _varlen_reference(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **arguments)


def _varlen_reference(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **arguments):
    """Scatter the segments into a padded (segments, heads, length, head_dim) batch and run the dense reference."""

    def padded(tensor, cu_seqlens, max_seqlen):
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=tensor.device), lengths)
        position = torch.arange(tensor.shape[0], device=tensor.device) - cu_seqlens[:-1].long()[segment]
        batch = tensor.new_zeros(lengths.numel(), max_seqlen, *tensor.shape[1:])
        batch[segment, position] = tensor
        return batch.transpose(1, 2), segment, position, lengths

    q, segment, position, _ = padded(query, cu_seqlens_q, max_seqlen_q)
    k, _, _, key_lengths = padded(key, cu_seqlens_k, max_seqlen_k)
    v, _, _, _ = padded(value, cu_seqlens_k, max_seqlen_k)
    key_padding_mask = torch.arange(max_seqlen_k, device=key.device)[None, :] < key_lengths[:, None]
    bias = arguments["position_bias"]
    if bias.kind == "bias":
        arguments = dict(arguments, position_bias=PositionBias.explicit(bias.tensor[..., :max_seqlen_q, :max_seqlen_k]))
    output, _ = _reference(q, k, v, key_padding_mask=key_padding_mask, **arguments)
    return output.transpose(1, 2)[segment, position]
