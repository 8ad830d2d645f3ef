"""flash-attn-4 (FlashAttention-4, ``flash_attn.cute``) for the problems ``routes.py`` sends it: bias-free ones, and
T5's relative position bias through FAT5's Hopper T5 kernels (``attention_fa4_t5_kernels.py``), its table trained.

FA4 takes (batch, length, heads, head_dim) tensors, FAT5's (batch, heads, length, head_dim) ones transposed (for
the model's projections a free view), and packed (tokens, heads, head_dim) ones with int32 ``cu_seqlens``, as
``attention.attention_varlen`` does: segment ``s`` of the queries attends to segment ``s`` of the keys, and a query
whose key segment is empty outputs zeros, as FAT5 defines it. Two things differ from FAT5's definition, and the
routes keep them apart: FA4's causal mask lies on the bottom-right diagonal (query ``i`` sees keys
``j <= i + key_length - query_length``), FAT5's at ``query_offset`` (``routes.MASKINGS``); FA4's default scale is
``1/sqrt(head_dim)``, T5's 1, so the scale is always passed. The T5 bias is served with query offset 0 only (the
routes' T5 rows: training and prefill self-attention).

Eagerly, bias-free calls run FA4's own autograd.Function (``flash_attn_func``, ``flash_attn_varlen_func``) and T5
calls ``_EagerFA4Attention``. Under ``torch.compile`` two custom ops with fake implementations run instead, as for
the Triton attention, so that a ``fullgraph`` trace never enters the CuTe DSL: the forward calls FA4's forward
function for the output and its log-sum-exp, the backward ``interface._flash_attn_bwd``, the function FA4's
autograd.Function calls (FA4 exposes no public backward alone). With a T5 table, both go through ``_t5_kernels``,
which builds FA4's SM90 kernel objects from FAT5's subclasses, and the table's gradient is the backward's far sums
plus the band that ``attention_triton_launch.t5_band_table_gradient`` sums.
"""

import contextlib
import math
import threading

import torch

from .dispatch import op_namespace
from .position_bias import PositionBias

_NAMESPACE = op_namespace(__name__)
# FA4's interface reads its SM90 kernel classes from module globals when it compiles: one call swaps them at a time
_KERNEL_CLASS_LOCK = threading.Lock()
# the T5 backward adds its far sums to grad_by_distance[head, key block % GRAD_SLOTS]: the slots spread one head's
# atomics over separate addresses
GRAD_SLOTS = 32


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


@contextlib.contextmanager
def _t5_kernels(max_distance: int, table_grad: bool):
    """FA4's interface building FAT5's T5 kernel classes for the calls inside; yields the (score_mod, score_mod_bwd)
    stand-ins to pass it (they key its compile cache)."""
    from .attention_fa4_t5_kernels import t5_kernel_classes

    interface = _fa4_interface()
    forward_class, backward_class, score_mod, score_mod_bwd = t5_kernel_classes(max_distance, table_grad)
    with _KERNEL_CLASS_LOCK:
        saved = interface.FlashAttentionForwardSm90, interface.FlashAttentionBackwardSm90
        interface.FlashAttentionForwardSm90, interface.FlashAttentionBackwardSm90 = forward_class, backward_class
        try:
            yield score_mod, score_mod_bwd
        finally:
            interface.FlashAttentionForwardSm90, interface.FlashAttentionBackwardSm90 = saved


def _t5_bias_rows(table: torch.Tensor, bidirectional: bool, max_distance: int) -> torch.Tensor:
    """(heads, 2 * max_distance + 3) fp32: the bias at relative positions -(D+1) .. D+1, the kernels' row. The
    Triton kernels' rows, made in one launch, are in log2 units; FA4's score hooks add natural ones."""
    from .attention_triton_t5 import t5_bias_by_distance

    _, rows_log2 = t5_bias_by_distance(table.detach(), bidirectional, table.shape[0], max_distance)
    return rows_log2 * math.log(2)


def _varlen_arguments(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> dict:
    if cu_seqlens_q is None:
        return {}
    return {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
            "max_seqlen_k": max_seqlen_k}


def _forward(query, key, value, cu_seqlens_q, cu_seqlens_k, table, max_seqlen_q, max_seqlen_k, scale, causal,
             bidirectional=True, max_distance=128, *, return_lse=True):
    """(output, log-sum-exp), the log-sum-exp None when neither asked for nor needed by a backward; the arguments in
    the forward op's order. With a T5 ``table``, FAT5's T5 kernels."""
    interface = _fa4_interface()
    varlen = _varlen_arguments(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if table is None:
        function = interface.flash_attn_func if cu_seqlens_q is None else interface.flash_attn_varlen_func
        return function(query, key, value, softmax_scale=scale, causal=causal, return_lse=return_lse, **varlen)
    bias_rows = _t5_bias_rows(table, bidirectional, max_distance)
    with _t5_kernels(max_distance, table_grad=False) as (score_mod, _):
        out, lse, *_ = interface._flash_attn_fwd(query, key, value, softmax_scale=scale, causal=causal,
                                                 return_lse=True, score_mod=score_mod, aux_tensors=[bias_rows],
                                                 **varlen)
    return out, lse


def _t5_table_gradient(grad_out, query, key, value, out, lse, table, grad_by_distance, cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, max_seqlen_k, scale, causal, bidirectional, max_distance):
    """The table's gradient: the backward summed the far buckets into the ends of ``grad_by_distance`` (heads, slots,
    2D+3), the Triton band pass sums the rest. It takes FAT5's layouts: (batch, heads, length, head_dim) views, and
    the log-sum-exp in log2 units."""
    from .attention_triton_launch import t5_band_table_gradient

    if cu_seqlens_q is None:
        grad_out, query, key, value, out = (t.transpose(1, 2) for t in (grad_out, query, key, value, out))
    lse_log2 = torch.where(lse == float("-inf"), float("inf"), lse * (1 / math.log(2)))
    position = PositionBias.t5(table, bidirectional=bidirectional, max_distance=max_distance)
    return t5_band_table_gradient(grad_out, query, key, value, out, lse_log2, position, cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q, max_seqlen_k, scale, causal, grad_by_distance.sum(dim=1))


def _backward(grad_out, query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, table, max_seqlen_q, max_seqlen_k,
              scale, causal, bidirectional=True, max_distance=128, table_grad=False):
    """dq, dk, dv and the T5 table's gradient (None without ``table_grad``), through the backward that FA4's
    autograd.Function calls; the arguments in the backward op's order."""
    interface = _fa4_interface()
    varlen = _varlen_arguments(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    grad_out = grad_out.contiguous()
    if table is None:
        dq, dk, dv = interface._flash_attn_bwd(query, key, value, out, grad_out, lse, scale, causal, 0.0, **varlen)
        return dq, dk, dv, None
    bias_rows = _t5_bias_rows(table, bidirectional, max_distance)
    aux_tensors = [bias_rows]
    if table_grad:
        aux_tensors.append(torch.zeros(table.shape[1], GRAD_SLOTS, 2 * max_distance + 3, dtype=torch.float32,
                                       device=query.device))
    with _t5_kernels(max_distance, table_grad) as (score_mod, score_mod_bwd):
        dq, dk, dv = interface._flash_attn_bwd(query, key, value, out, grad_out, lse, scale, causal, 0.0,
                                               score_mod=score_mod, score_mod_bwd=score_mod_bwd,
                                               aux_tensors=aux_tensors, **varlen)
    table_gradient = None
    if table_grad:
        table_gradient = _t5_table_gradient(grad_out, query, key, value, out, lse, table, aux_tensors[1],
                                            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                                            bidirectional, max_distance)
    return dq, dk, dv, table_gradient


@torch.library.custom_op(f"{_NAMESPACE}::fa4_attention_forward", mutates_args=())
def fa4_attention_forward_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    table: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    bidirectional: bool,
    max_distance: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4's output and its row log-sum-exp: (batch, heads, query_length), or (heads, tokens) for packed rows."""
    return _forward(query, key, value, cu_seqlens_q, cu_seqlens_k, table, max_seqlen_q, max_seqlen_k, scale, causal,
                    bidirectional, max_distance)


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
    table: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    bidirectional: bool,
    max_distance: int,
    table_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and the table's gradient (empty without ``table_grad``)."""
    dq, dk, dv, table_gradient = _backward(grad_out, query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, table,
                                           max_seqlen_q, max_seqlen_k, scale, causal, bidirectional, max_distance,
                                           table_grad)
    return dq, dk, dv, query.new_empty(0) if table_gradient is None else table_gradient


@fa4_attention_backward_op.register_fake
def _fa4_attention_backward_fake(grad_out, query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, table, *rest):
    table_gradient = torch.empty_like(table) if rest[-1] else query.new_empty(0)
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), table_gradient


def _setup_context(ctx, inputs, output):
    query, key, value, cu_seqlens_q, cu_seqlens_k, table, *plain_values = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, table)
    ctx.plain_values = plain_values
    ctx.mark_non_differentiable(lse)


def _fa4_attention_backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, table = ctx.saved_tensors
    table_grad = table is not None and ctx.needs_input_grad[5]
    dq, dk, dv, table_gradient = fa4_attention_backward_op(grad_out, query, key, value, out, lse, cu_seqlens_q,
                                                           cu_seqlens_k, table, *ctx.plain_values, table_grad)
    # no gradient for cu_seqlens_q, cu_seqlens_k and the plain values
    return dq, dk, dv, None, None, table_gradient if table_grad else None, None, None, None, None, None, None


fa4_attention_forward_op.register_autograd(_fa4_attention_backward, setup_context=_setup_context)


class _EagerFA4Attention(torch.autograd.Function):
    """The custom ops' forward and backward for a T5 table, without their dispatch (its host time), eagerly."""

    @staticmethod
    def forward(ctx, query, key, value, cu_seqlens_q, cu_seqlens_k, table, *plain_values):
        out, lse = _forward(query, key, value, cu_seqlens_q, cu_seqlens_k, table, *plain_values)
        ctx.save_for_backward(query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, table)
        ctx.plain_values = plain_values
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, table = ctx.saved_tensors
        table_grad = ctx.needs_input_grad[5]
        dq, dk, dv, table_gradient = _backward(grad_out, query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k,
                                               table, *ctx.plain_values, table_grad)
        return dq, dk, dv, None, None, table_gradient, None, None, None, None, None, None


def _attention(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
               position_bias: PositionBias | None):
    """The custom op when traced by torch.compile (no graph break), an autograd.Function otherwise (FA4's own
    without a bias)."""
    table = None if position_bias is None else position_bias.tensor
    bidirectional = True if position_bias is None else position_bias.bidirectional
    max_distance = 128 if position_bias is None else position_bias.max_distance
    arguments = (query, key, value, cu_seqlens_q, cu_seqlens_k, table, max_seqlen_q, max_seqlen_k, float(scale),
                 causal, bidirectional, max_distance)
    if torch.compiler.is_compiling():
        return fa4_attention_forward_op(*arguments)[0]
    if table is not None:
        return _EagerFA4Attention.apply(*arguments)
    return _forward(query, key, value, cu_seqlens_q, cu_seqlens_k, None, max_seqlen_q, max_seqlen_k, float(scale),
                    causal, return_lse=False)[0]


def fa4_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float, causal: bool,
                  position_bias: PositionBias | None = None) -> torch.Tensor:
    """FA4 over (batch, heads, length, head_dim) tensors without a key padding mask; ``causal`` on FA4's
    bottom-right diagonal; ``position_bias`` None or a T5 one (query offset 0). Returns (batch, heads,
    query_length, head_dim)."""
    out = _attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None,
                     query.shape[2], key.shape[2], scale, causal, position_bias)
    return out.transpose(1, 2)


def fa4_attention_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, scale: float,
                         causal: bool, position_bias: PositionBias | None = None) -> torch.Tensor:
    """FA4 over packed (tokens, heads, head_dim) tensors; ``causal`` on each segment's bottom-right diagonal;
    ``position_bias`` None or a T5 one (positions restart at 0 in every segment). ``max_seqlen_*`` bound the
    segments' lengths (FA4 sizes its grid by them)."""
    return _attention(query, key, value, cu_seqlens_q.to(torch.int32).contiguous(),
                      cu_seqlens_k.to(torch.int32).contiguous(), max_seqlen_q, max_seqlen_k, scale, causal,
                      position_bias)
