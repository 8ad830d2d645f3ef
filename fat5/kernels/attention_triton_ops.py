"""The torch.library custom ops of FAT5's Triton attention (with fake implementations and autograd), so that
``torch.compile(fullgraph=True)`` traces through attention without a graph break, and the same forward and backward as
an autograd.Function for eager calls."""

from dataclasses import fields

import torch

from .attention_triton_launch import CallOptions, launch_backward, launch_forward
from .dispatch import op_namespace

_NAMESPACE = op_namespace(__name__)


@torch.library.custom_op(f"{_NAMESPACE}::attention_forward", mutates_args=())
def attention_forward_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    position_tensor: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    query_offset: int,
    position_kind: str,
    bidirectional: bool,
    num_buckets: int,
    max_distance: int,
    query_offset_tensor: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and its row log-sum-exp (log2 units, +inf for rows that see no key). The plain values
    after the tensors are the fields of ``CallOptions``."""
    options = CallOptions(max_seqlen_q, max_seqlen_k, scale, causal, query_offset, position_kind, bidirectional,
                          num_buckets, max_distance)
    return launch_forward(query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k, options,
                          query_offset_tensor)


@attention_forward_op.register_fake
def _attention_forward_fake(query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, *_):
    if cu_seqlens_q is None:
        lse = query.new_empty(query.shape[:3], dtype=torch.float32)
    else:
        lse = query.new_empty((query.shape[1], query.shape[0]), dtype=torch.float32)
    return torch.empty_like(query), lse


@torch.library.custom_op(f"{_NAMESPACE}::attention_backward", mutates_args=())
def attention_backward_op(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    position_tensor: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    query_offset: int,
    position_kind: str,
    bidirectional: bool,
    num_buckets: int,
    max_distance: int,
    position_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and the gradient of the position tensor (the T5 table or the explicit bias; empty otherwise)."""
    options = CallOptions(max_seqlen_q, max_seqlen_k, scale, causal, query_offset, position_kind, bidirectional,
                          num_buckets, max_distance)
    return launch_backward(grad_out, query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q,
                           cu_seqlens_k, options, position_grad)


@attention_backward_op.register_fake
def _attention_backward_fake(grad_out, query, key, value, out, lse, key_padding_mask, position_tensor, *rest):
    *plain_values, position_grad = rest[2:]
    if position_grad and CallOptions(*plain_values).differentiable_position:
        position_gradient = torch.empty_like(position_tensor, memory_format=torch.contiguous_format)
    else:
        position_gradient = query.new_empty(0)
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), position_gradient


def _setup_context(ctx, inputs, output):
    query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k, *plain_values, _ = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k)
    ctx.options = CallOptions(*plain_values)
    ctx.mark_non_differentiable(lse)


def _attention_backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    position_grad = ctx.needs_input_grad[4] and ctx.options.differentiable_position
    dq, dk, dv, position_gradient = attention_backward_op(
        grad_out, query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k,
        *ctx.options.flat(), position_grad,
    )
    # no gradient for cu_seqlens_q, cu_seqlens_k, the plain values and query_offset_tensor
    unused = (None,) * (3 + len(fields(CallOptions)))
    return (dq, dk, dv, None, position_gradient if position_grad else None) + unused


attention_forward_op.register_autograd(_attention_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The same forward and backward as the custom ops, without their dispatch: outside ``torch.compile`` the
    custom-op machinery costs more host time than a short attention call takes on the GPU."""

    @staticmethod
    def forward(ctx, query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k,
                options: CallOptions, query_offset_tensor):
        out, lse = launch_forward(query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k,
                                  options, query_offset_tensor)
        ctx.save_for_backward(query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q,
                              cu_seqlens_k)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        position_grad = ctx.needs_input_grad[4] and ctx.options.differentiable_position
        dq, dk, dv, position_gradient = launch_backward(
            grad_out, query, key, value, out, lse, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k,
            ctx.options, position_grad,
        )
        return dq, dk, dv, None, position_gradient if position_grad else None, None, None, None, None


def triton_attention_call(query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k,
                          options: CallOptions, query_offset_tensor) -> torch.Tensor:
    """The custom op when traced by torch.compile (no graph break), the autograd.Function otherwise."""
    tensors = (query, key, value, key_padding_mask, position_tensor, cu_seqlens_q, cu_seqlens_k)
    if torch.compiler.is_compiling():
        return attention_forward_op(*tensors, *options.flat(), query_offset_tensor)[0]
    return _EagerAttention.apply(*tensors, options, query_offset_tensor)
