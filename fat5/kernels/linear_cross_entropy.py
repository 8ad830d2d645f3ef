"""The output layer and the cross-entropy in one op, chunked: the full logits are never materialised.

At mT5's 250k vocabulary the logits of a 8192-token decoder batch take 4 GB in bf16, their gradient as much again.
``linear_cross_entropy(hidden, weight, labels)`` equals ``cross_entropy(hidden @ weight.T, labels)`` and keeps one
chunk of logits at a time. The forward walks chunks of rows and keeps each row's losses and logsumexp. The backward
walks slices of the vocabulary instead: a slice's logits for every row, turned in place into their gradient from the
saved logsumexp and the real upstream gradients (of the cross-entropy and of the z-loss, separately), give the
slice's rows of the weight gradient in one product, written once, and add their share to the hidden states'
gradient (rows x d, small). Recomputing costs one more ``hidden @ weight.T`` than the unfused op; an evaluation
forward computes no gradient at all.
"""

import torch

from .cross_entropy import _TRITON_DTYPES, _check_inputs, _normaliser, cross_entropy_reference
from .dispatch import use_triton

try:
    from .cross_entropy_triton import cross_entropy_forward as _triton_forward
    from .cross_entropy_triton import cross_entropy_grad_from_lse as _triton_grad_from_lse
except ImportError:  # no triton: the reference serves every call
    _triton_forward = _triton_grad_from_lse = None

# One chunk's logits at most this many bytes (in the compute dtype): 512 MiB is 1073 rows at a 250k vocabulary.
_CHUNK_BYTES = 2**29
# mm/addmm writing fp32 from bf16/fp16 operands (PyTorch >= 2.8, CUDA): a product summed into, or kept in, fp32
# without being rounded to the operands' dtype first.
_MM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype")


def default_chunk_rows(vocab_size: int, element_size: int) -> int:
    """Rows per chunk: the most whose logits fit in ``_CHUNK_BYTES``, at least 1."""
    return max(1, _CHUNK_BYTES // (vocab_size * element_size))


def _matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """``out (+)= a @ b`` in ``out``'s dtype, without rounding the product to ``a``'s dtype where possible."""
    beta = 1.0 if accumulate else 0.0  # beta 0: out's old contents (uninitialised here) are never read
    if out.dtype == a.dtype:
        torch.addmm(out, a, b, beta=beta, out=out)
    elif out.is_cuda and _MM_OUT_DTYPE and out.dtype == torch.float32:
        torch.addmm(out, a, b, beta=beta, out_dtype=torch.float32, out=out)
    elif accumulate:
        out += (a @ b).to(out.dtype)
    else:
        out.copy_(a @ b)


def _runs_triton(backend: str, tensor: torch.Tensor) -> bool:
    """Whether the kernels serve this call: the forward and the backward must take the same path."""
    return use_triton(backend, tensor) and _triton_forward is not None and tensor.dtype in _TRITON_DTYPES


def _losses_and_log_sum_exp(logits, labels, normaliser, options):
    """The chunk's (ce, z) sums over the normaliser, and each row's logsumexp (fp32)."""
    ignore_index, label_smoothing, z_loss, reduction, backend = options
    if _runs_triton(backend, logits):
        losses, log_sum_exp = _triton_forward(logits, labels, normaliser, None, ignore_index, label_smoothing, z_loss)
        return losses[0], losses[1], log_sum_exp
    ce, z = cross_entropy_reference(
        logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
        reduction=reduction, num_items_in_batch=normaliser,
    )
    return ce, z, torch.logsumexp(logits.float(), dim=-1)


def _grad_from_lse_reference(
    logits, labels, log_sum_exp, normaliser, grad_ce, grad_z, first_col, vocab_size, ignore_index, label_smoothing,
    z_loss,
):
    probability_scale = (grad_ce + grad_z * 2.0 * z_loss * log_sum_exp) / normaliser
    grad = torch.exp(logits.float() - log_sum_exp[:, None]) * probability_scale[:, None]
    grad -= grad_ce * label_smoothing / vocab_size / normaliser
    column = labels - first_col
    labelled = (labels != ignore_index) & (column >= 0) & (column < logits.shape[1])
    rows = torch.arange(logits.shape[0], device=logits.device)[labelled]
    grad[rows, column[labelled]] -= grad_ce * (1.0 - label_smoothing) / normaliser
    grad[labels == ignore_index] = 0.0
    logits.copy_(grad)


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, normaliser, options, chunk_rows, compute_dtype):
        hidden_c, weight_c = hidden.to(compute_dtype), weight.to(compute_dtype)
        ce = torch.zeros((), dtype=torch.float32, device=hidden.device)
        z = torch.zeros((), dtype=torch.float32, device=hidden.device)
        log_sum_exp = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            logits = hidden_c[start : start + chunk_rows] @ weight_c.T
            chunk_ce, chunk_z, log_sum_exp[start : start + chunk_rows] = _losses_and_log_sum_exp(
                logits, labels[start : start + chunk_rows], normaliser, options
            )
            ce += chunk_ce
            z += chunk_z
        ctx.save_for_backward(hidden, weight, labels, normaliser, log_sum_exp)
        ctx.options, ctx.chunk_rows, ctx.compute_dtype = options, chunk_rows, compute_dtype
        return ce, z

    @staticmethod
    def backward(ctx, grad_ce, grad_z):
        hidden, weight, labels, normaliser, log_sum_exp = ctx.saved_tensors
        ignore_index, label_smoothing, z_loss, _, backend = ctx.options
        # An output the loss did not use has no upstream gradient: zero.
        grad_ce, grad_z = (
            torch.zeros((), dtype=torch.float32, device=hidden.device) if grad is None else grad.to(torch.float32)
            for grad in (grad_ce, grad_z)
        )
        hidden_c, weight_c = hidden.to(ctx.compute_dtype), weight.to(ctx.compute_dtype)
        n_rows, vocab_size = hidden.shape[0], weight.shape[0]
        grad_hidden = (
            torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if ctx.needs_input_grad[0] else None
        )
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        # slices of the vocabulary holding as many logits as a forward chunk
        slice_cols = max(1, ctx.chunk_rows * vocab_size // max(n_rows, 1))
        grad_from_lse = _triton_grad_from_lse if _runs_triton(backend, hidden_c) else _grad_from_lse_reference
        for first in range(0, vocab_size, slice_cols):
            weight_slice = weight_c[first : first + slice_cols]
            logits = hidden_c @ weight_slice.T
            grad_from_lse(
                logits, labels, log_sum_exp, normaliser, grad_ce, grad_z, first, vocab_size, ignore_index,
                label_smoothing, z_loss,
            )
            if grad_weight is not None:
                _matmul_into(grad_weight[first : first + slice_cols], logits.T, hidden_c, accumulate=False)
            if grad_hidden is not None:
                _matmul_into(grad_hidden, logits, weight_slice, accumulate=True)
        grad_hidden = grad_hidden.to(hidden.dtype) if grad_hidden is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_rows: int | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cross_entropy(hidden @ weight.T, labels, ...)`` without materialising the logits.

    Args:
        hidden: ``(..., d)`` the output layer's input.
        weight: ``(vocab_size, d)`` the output layer's weight (no bias), as ``nn.Linear`` holds it.
        labels: ``(...)`` integer class indices, ``hidden``'s leading shape.
        chunk_rows: rows per chunk of the forward (the backward's vocabulary slices hold as many logits); by
            default as many as fit in 512 MiB.
        The other arguments are ``cross_entropy``'s. Under autocast the products run in its dtype, as
        ``nn.Linear`` would.

    Returns:
        ``(ce_loss, z_loss_term)``, fp32 scalars, both differentiable (to ``hidden`` and ``weight``).
    """
    _check_arguments(hidden, weight, labels, chunk_rows)
    vocab_size = weight.shape[0]
    # cross_entropy's own checks (dtypes, options), on the logits' shape, before any product is computed
    _check_inputs(
        hidden.new_empty((*hidden.shape[:-1], vocab_size), device="meta"), labels.to("meta"), ignore_index,
        label_smoothing, z_loss, reduction,
    )
    compute_dtype = _product_dtype(hidden, weight)
    rows = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(vocab_size, torch.empty((), dtype=compute_dtype).element_size())
    normaliser = _normaliser(flat_labels, ignore_index, reduction, num_items_in_batch, hidden.device)
    options = (int(ignore_index), float(label_smoothing), float(z_loss), reduction, backend)
    # autocast is off inside: the products are cast to compute_dtype by hand, and the kernels see the logits as made
    with torch.autocast(hidden.device.type, enabled=False):
        return _LinearCrossEntropyFunction.apply(rows, weight, flat_labels, normaliser, options, chunk_rows,
                                                 compute_dtype)


def _check_arguments(hidden, weight, labels, chunk_rows) -> None:
    """What cross_entropy cannot check on the logits' shape: the tensors' types, shapes and device, and chunk_rows."""
    if not all(isinstance(tensor, torch.Tensor) for tensor in (hidden, weight, labels)):
        raise TypeError("linear_cross_entropy expects tensors for hidden, weight and labels")
    if weight.dim() != 2 or hidden.dim() == 0 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)} must be (..., d) and weight {tuple(weight.shape)} "
            "(vocab_size, d) with the same d"
        )
    if tuple(hidden.shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)} must be labels {tuple(labels.shape)} plus d"
        )
    if not hidden.device == weight.device == labels.device:
        raise ValueError(
            f"hidden, weight and labels must be on one device, got {hidden.device}, {weight.device}, {labels.device}"
        )
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")


def _product_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``nn.Linear`` would compute ``hidden @ weight.T`` in: autocast's, else the promoted one."""
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return torch.promote_types(hidden.dtype, weight.dtype)
