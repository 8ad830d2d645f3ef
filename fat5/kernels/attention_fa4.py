"""flash-attn-4 (FlashAttention-4, ``flash_attn.cute``) for the bias-free problems that ``routes.py`` sends it.

FA4 takes (batch, length, heads, head_dim) tensors, FAT5's (batch, heads, length, head_dim) ones transposed (for
the model's projections a free view), and packed (tokens, heads, head_dim) ones with int32 ``cu_seqlens``, as
``attention.attention_varlen`` does: segment ``s`` of the queries attends to segment ``s`` of the keys, and a query
whose key segment is empty outputs zeros, as FAT5 defines it. Two things differ from FAT5's definition, and the
routes keep them apart: FA4's causal mask lies on the bottom-right diagonal (query ``i`` sees keys
``j <= i + key_length - query_length``), FAT5's at ``query_offset`` (``routes.MASKINGS``); FA4's default scale is
``1/sqrt(head_dim)``, T5's 1, so the scale is always passed.

Eagerly, FA4's own autograd.Function runs (``flash_attn_func``, ``flash_attn_varlen_func``). Under
``torch.compile`` two custom ops with fake implementations run instead, as for the Triton attention, so that a
``fullgraph`` trace never enters the CuTe DSL: the forward calls the same public functions for the output and its
log-sum-exp, the backward ``interface._flash_attn_bwd``, the function FA4's autograd.Function calls (FA4 exposes no
public backward alone).
"""

import torch

from .dispatch import op_namespace

_NAMESPACE = op_namespace(__name__)


def _fa4_interface():
    """FA4's interface module, imported on the first FA4 call (the CuTe DSL takes seconds to import). The import
    stands inside ``try``, where transformers' ``check_imports`` does not look: a Hub bundle of FAT5 carries this
    file and must load where flash-attn-4 is not installed."""
    try:
        from flash_attn.cute import interface
    except ImportError as error:
        raise RuntimeError(
            f"the FA4 attention route needs flash-attn-4 (pip install 'fat5[hopper]'): {error}"
        ) from error
    return interface


def _forward(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, return_lse):
    """(output, log-sum-exp) from FA4's public functions, the log-sum-exp None when neither asked for nor needed by
    a backward."""
    interface = _fa4_interface()
    if cu_seqlens_q is None:
        return interface.flash_attn_func(query, key, value, softmax_scale=scale, causal=causal, return_lse=return_lse)
    return interface.flash_attn_varlen_func(
        query, key, value, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=scale, causal=causal, return_lse=return_lse,
    )


@torch.library.custom_op(f"{_NAMESPACE}::fa4_attention_forward", mutates_args=())
def fa4_attention_forward_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4's output and its row log-sum-exp: (batch, heads, query_length), or (heads, tokens) for packed rows."""
    return _forward(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, True)


@fa4_attention_forward_op.register_fake
def _fa4_attention_forward_fake(query, key, value, cu_seqlens_q, *_):
    if cu_seqlens_q is None:
        lse = query.new_empty((query.shape[0], query.shape[2], query.shape[1]), dtype=torch.float32)
    else:
        lse = query.new_empty((query.shape[1], query.shape[0]), dtype=torch.float32)
    # FA4 allocates its output afresh, contiguous, whatever the query's strides (a transposed view here)
    return query.new_empty(query.shape), lse


@torch.library.custom_op(f"{_NAMESPACE}::fa4_attention_backward", mutates_args=())
def fa4_attention_backward_op(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, through the backward that FA4's autograd.Function calls, with the same arguments."""
    varlen = {}
    if cu_seqlens_q is not None:
        varlen = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
                  "max_seqlen_k": max_seqlen_k}
    dq, dk, dv = _fa4_interface()._flash_attn_bwd(query, key, value, out, grad_out.contiguous(), lse, scale, causal,
                                                  0.0, **varlen)
    return dq, dk, dv


@fa4_attention_backward_op.register_fake
def _fa4_attention_backward_fake(grad_out, query, key, value, *_):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    query, key, value, cu_seqlens_q, cu_seqlens_k, *plain_values = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.plain_values = plain_values
    ctx.mark_non_differentiable(lse)


def _fa4_attention_backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = fa4_attention_backward_op(grad_out, query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k,
                                           *ctx.plain_values)
    # no gradient for cu_seqlens_q, cu_seqlens_k and the plain values
    return dq, dk, dv, None, None, None, None, None, None


fa4_attention_forward_op.register_autograd(_fa4_attention_backward, setup_context=_setup_context)


def _attention(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal):
    """The custom op when traced by torch.compile (no graph break), FA4's own autograd.Function otherwise."""
    arguments = (query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(scale), causal)
    if torch.compiler.is_compiling():
        return fa4_attention_forward_op(*arguments)[0]
    return _forward(*arguments, False)[0]


def fa4_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float,
                  causal: bool) -> torch.Tensor:
    """FA4 over (batch, heads, length, head_dim) tensors, bias-free and without a key padding mask; ``causal`` on
    FA4's bottom-right diagonal. Returns (batch, heads, query_length, head_dim)."""
    out = _attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None,
                     query.shape[2], key.shape[2], scale, causal)
    return out.transpose(1, 2)


def fa4_attention_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, scale: float,
                         causal: bool) -> torch.Tensor:
    """FA4 over packed (tokens, heads, head_dim) tensors, bias-free; ``causal`` on each segment's bottom-right
    diagonal. ``max_seqlen_*`` bound the segments' lengths (FA4 sizes its grid by them)."""
    return _attention(query, key, value, cu_seqlens_q.to(torch.int32).contiguous(),
                      cu_seqlens_k.to(torch.int32).contiguous(), max_seqlen_q, max_seqlen_k, scale, causal)
