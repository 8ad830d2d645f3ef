"""The output layer and the cross-entropy in one op, chunked over rows: the full logits are never materialised.

At mT5's 250k vocabulary the logits of a 8192-token decoder batch take 4 GB in bf16, their gradient as much again.
``linear_cross_entropy(hidden, weight, labels)`` equals ``cross_entropy(hidden @ weight.T, labels)`` and keeps one
chunk of rows' logits at a time: the forward reduces each chunk to its losses; the backward computes each chunk's
logits again, lets ``cross_entropy`` write their gradient in place (the fused kernel, or the reference) and turns
it into the chunk's share of the hidden states' and the weight's gradients. Recomputing costs one more
``hidden @ weight.T`` than the unfused op, and in exchange the backward sees the real upstream gradients (of the
cross-entropy and of the z-loss, separately) and an evaluation forward computes no gradient at all.
"""

import torch

from .cross_entropy import _check_inputs, _normaliser, cross_entropy

# One chunk's logits at most this many bytes (in the compute dtype): 512 MiB is 1073 rows at a 250k vocabulary. Each
# chunk adds its share into the fp32 weight gradient (vocab x d), a read and a write of it: on an H100 at 250k x 768
# and 8192 rows, 8 ms of accumulation with 1072-row chunks, 13.6 with 536, 5.7 with 2048.
_CHUNK_BYTES = 2**29
# addmm writing fp32 from bf16/fp16 operands (PyTorch >= 2.8, CUDA): the chunk's product is added to the fp32
# gradient inside the matrix product, not rounded to the operands' dtype first.
_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype")


def default_chunk_rows(vocab_size: int, element_size: int) -> int:
    """Rows per chunk: the most whose logits fit in ``_CHUNK_BYTES``, at least 1."""
    return max(1, _CHUNK_BYTES // (vocab_size * element_size))


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` into the fp32 ``total``, without rounding the product to ``a``'s dtype where possible."""
    if a.dtype == torch.float32:
        total.addmm_(a, b)
    elif total.is_cuda and _ADDMM_OUT_DTYPE:
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    else:
        total += (a @ b).float()


def _chunk_losses(logits, labels, normaliser, options, inplace_backward=False):
    ignore_index, label_smoothing, z_loss, reduction, backend = options
    return cross_entropy(
        logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, reduction=reduction,
        num_items_in_batch=normaliser, inplace_backward=inplace_backward, backend=backend,
    )


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, normaliser, options, chunk_rows, compute_dtype):
        hidden_c, weight_c = hidden.to(compute_dtype), weight.to(compute_dtype)
        ce = torch.zeros((), dtype=torch.float32, device=hidden.device)
        z = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            logits = hidden_c[start : start + chunk_rows] @ weight_c.T
            chunk_ce, chunk_z = _chunk_losses(logits, labels[start : start + chunk_rows], normaliser, options)
            ce += chunk_ce
            z += chunk_z
        ctx.save_for_backward(hidden, weight, labels, normaliser)
        ctx.options, ctx.chunk_rows, ctx.compute_dtype = options, chunk_rows, compute_dtype
        return ce, z

    @staticmethod
    def backward(ctx, grad_ce, grad_z):
        hidden, weight, labels, normaliser = ctx.saved_tensors
        # An output the loss did not use has no upstream gradient: zero, not the 1 autograd.grad would assume.
        upstream = [
            torch.zeros((), dtype=torch.float32, device=hidden.device) if grad is None else grad
            for grad in (grad_ce, grad_z)
        ]
        hidden_c, weight_c = hidden.to(ctx.compute_dtype), weight.to(ctx.compute_dtype)
        grad_hidden = torch.empty_like(hidden_c) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        for start in range(0, hidden.shape[0], ctx.chunk_rows):
            rows = hidden_c[start : start + ctx.chunk_rows]
            with torch.enable_grad():
                logits = (rows @ weight_c.T).requires_grad_()
                chunk_losses = _chunk_losses(
                    logits, labels[start : start + ctx.chunk_rows], normaliser, ctx.options, inplace_backward=True
                )
                (grad_logits,) = torch.autograd.grad(chunk_losses, logits, upstream)
            if grad_hidden is not None:
                torch.mm(grad_logits, weight_c, out=grad_hidden[start : start + ctx.chunk_rows])
            if grad_weight is not None:
                _accumulate(grad_weight, grad_logits.T, rows)
        grad_hidden = grad_hidden.to(hidden.dtype) if grad_hidden is not None else None
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
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
        chunk_rows: rows whose logits exist at once; by default as many as fit in 512 MiB.
        The other arguments are ``cross_entropy``'s. Under autocast the products run in its dtype, as
        ``nn.Linear`` would.

    Returns:
        ``(ce_loss, z_loss_term)``, fp32 scalars, both differentiable (to ``hidden`` and ``weight``).
    """
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
    vocab_size = weight.shape[0]
    # cross_entropy's own checks (dtypes, options), on the logits' shape, before any product is computed
    _check_inputs(
        hidden.new_empty((*hidden.shape[:-1], vocab_size), device="meta"), labels.to("meta"), ignore_index,
        label_smoothing, z_loss, reduction,
    )
    compute_dtype = (
        torch.get_autocast_dtype(hidden.device.type)
        if torch.is_autocast_enabled(hidden.device.type)
        else torch.promote_types(hidden.dtype, weight.dtype)
    )
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

