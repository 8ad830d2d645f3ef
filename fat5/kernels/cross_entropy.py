"""Cross-entropy with z-loss and label smoothing over large vocabularies: public entry point, reference, wiring.

``cross_entropy`` returns two fp32 scalars, the cross-entropy and the z-loss term (``z_loss * logsumexp**2``),
reduced the same way, so the trainer can log both and backpropagate their sum. The Triton path
(``cross_entropy_triton.py``) computes each row's logsumexp online in fp32 and, when a gradient is needed, writes
it during the forward (at a 32k vocabulary the row's second read comes from L2 or registers), so the backward only
rescales it when the upstream gradients are not 1 - a test the kernel makes on the device, never on the host. With
``inplace_backward=True`` the gradient overwrites the logits buffer, so no logits-sized buffer is allocated.

Eager calls launch the kernels from an autograd.Function; under ``torch.compile`` the same kernels run as
``torch.library`` custom ops with fake implementations, so the graph has no break.
"""

import torch

from .dispatch import as_rows, op_namespace, use_triton

# `from .module import name` (not `from . import module`): transformers only ships the remote-code files it finds
# imported that way.
try:
    from .cross_entropy_triton import cross_entropy_forward as _triton_forward
    from .cross_entropy_triton import cross_entropy_rescale_grad as _triton_rescale_grad
except ImportError:  # no triton: the reference serves every call
    _triton_forward = _triton_rescale_grad = None

_NAMESPACE = op_namespace(__name__)
REDUCTIONS = ("mean", "sum")
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _normaliser(labels, ignore_index, reduction, num_items_in_batch, device) -> torch.Tensor:
    """The fp32 0-d tensor the sums are divided by, built on the device without reading anything back to the host."""
    if reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=device)
    if num_items_in_batch is None:
        return (labels != ignore_index).sum(dtype=torch.float32).clamp_min(1.0)
    if isinstance(num_items_in_batch, torch.Tensor):
        return num_items_in_batch.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(num_items_in_batch), dtype=torch.float32, device=device)


def cross_entropy_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch cross-entropy and z-loss term in fp32: the CPU path and the truth the kernels are tested on.

    Per non-ignored token: ``ce = (1 - s) * (lse - x[label]) + s * (lse - mean(x))`` (label smoothing ``s`` as
    ``torch.nn.functional.cross_entropy`` defines it) and ``z = z_loss * lse**2``; ignored tokens contribute 0.
    """
    _check_inputs(logits, labels, ignore_index, label_smoothing, z_loss, reduction)
    logits = logits.float().reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    valid = labels != ignore_index
    log_sum_exp = torch.logsumexp(logits, dim=-1)
    label_logits = logits.gather(-1, torch.where(valid, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    ce = log_sum_exp - label_logits
    if label_smoothing > 0.0:
        ce = (1.0 - label_smoothing) * ce + label_smoothing * (log_sum_exp - logits.mean(dim=-1))
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    ce = torch.where(valid, ce, zero).sum()
    z = torch.where(valid, z_loss * log_sum_exp.square(), zero).sum()
    normaliser = _normaliser(labels, ignore_index, reduction, num_items_in_batch, logits.device)
    return ce / normaliser, z / normaliser


def _check_inputs(logits, labels, ignore_index, label_smoothing, z_loss, reduction) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("cross_entropy expects tensors for logits and labels")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"cross_entropy logits must be floating point, got {logits.dtype}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"cross_entropy labels must be integer class indices (int64/int32), got {labels.dtype}")
    if logits.dim() == 0 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"cross_entropy: logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} plus a vocabulary "
            "dimension"
        )
    if logits.shape[-1] == 0:
        raise ValueError("cross_entropy: the vocabulary dimension of logits is empty")
    if logits.device != labels.device:
        raise ValueError(f"logits are on {logits.device} but labels on {labels.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing}")
    if z_loss < 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


@torch.library.custom_op(f"{_NAMESPACE}::cross_entropy_forward", mutates_args=())
def _cross_entropy_forward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    normaliser: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton forward: (ce, z-loss term, per-row logsumexp, gradient for unit upstream gradients or an empty tensor)."""
    rows = as_rows(logits)
    grad_logits = torch.empty_like(rows) if compute_grad else None
    losses, log_sum_exp = _triton_forward(
        rows, labels.reshape(-1), normaliser, grad_logits, ignore_index, label_smoothing, z_loss
    )
    grad_logits = grad_logits.view(logits.shape) if compute_grad else logits.new_empty((0,))
    # Separate tensors: a custom op's outputs may not alias one another.
    return losses[0].clone(), losses[1].clone(), log_sum_exp, grad_logits


@_cross_entropy_forward.register_fake
def _(logits, labels, normaliser, ignore_index, label_smoothing, z_loss, compute_grad):
    scalar = logits.new_empty((), dtype=torch.float32)
    log_sum_exp = logits.new_empty((labels.numel(),), dtype=torch.float32)
    grad_logits = torch.empty_like(logits) if compute_grad else logits.new_empty((0,))
    return scalar, scalar.clone(), log_sum_exp, grad_logits


@torch.library.custom_op(f"{_NAMESPACE}::cross_entropy_rescale_grad", mutates_args=())
def _cross_entropy_rescale_grad(
    grad_logits: torch.Tensor,
    labels: torch.Tensor,
    log_sum_exp: torch.Tensor,
    normaliser: torch.Tensor,
    grad_ce: torch.Tensor,
    grad_z: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
) -> torch.Tensor:
    """The gradient for upstream gradients (grad_ce, grad_z) from the unit-upstream one the forward stored."""
    rescaled = grad_logits.clone()
    _triton_rescale_grad(
        rescaled.view(-1, rescaled.shape[-1]), labels.reshape(-1), log_sum_exp, normaliser, grad_ce, grad_z,
        ignore_index, label_smoothing, z_loss,
    )
    return rescaled


@_cross_entropy_rescale_grad.register_fake
def _(grad_logits, labels, log_sum_exp, normaliser, grad_ce, grad_z, ignore_index, label_smoothing, z_loss):
    return torch.empty_like(grad_logits)


def _rescaled(grad_logits, labels, log_sum_exp, normaliser, grad_ce, grad_z, options):
    """The gradient for upstream gradients (grad_ce, grad_z), from the unit-upstream one stored by the forward.

    Eagerly the stored buffer is rescaled in place (the kernel returns at once, on the device, for unit upstream
    gradients). A traced backward (AOTAutograd hands it functional/fake tensor subclasses) gets the out-of-place op:
    AOTAutograd cannot partition a backward that mutates a tensor saved by the forward.
    """
    grad_ce = _upstream(grad_ce, grad_logits)
    grad_z = _upstream(grad_z, grad_logits)
    if type(grad_logits) is not torch.Tensor:
        return _cross_entropy_rescale_grad(grad_logits, labels, log_sum_exp, normaliser, grad_ce, grad_z, *options)
    _triton_rescale_grad(
        grad_logits.view(-1, grad_logits.shape[-1]), labels.reshape(-1), log_sum_exp, normaliser, grad_ce, grad_z,
        *options,
    )
    return grad_logits


def _upstream(grad, reference):
    if grad is None:
        return torch.zeros((), dtype=torch.float32, device=reference.device)
    return grad.to(torch.float32)


def _setup_context(ctx, inputs, output):
    _, labels, normaliser, ignore_index, label_smoothing, z_loss, compute_grad = inputs
    ce, z, log_sum_exp, grad_logits = output
    ctx.compute_grad = compute_grad
    ctx.mark_non_differentiable(log_sum_exp, grad_logits)
    if not compute_grad:
        # No gradient was stored, so the losses are constants for autograd.
        ctx.mark_non_differentiable(ce, z)
    ctx.options = (ignore_index, label_smoothing, z_loss)
    ctx.save_for_backward(labels, normaliser, log_sum_exp, grad_logits)


def _backward(ctx, grad_ce, grad_z, _grad_log_sum_exp, _grad_grad_logits):
    if not ctx.compute_grad:
        raise RuntimeError("cross_entropy ran its forward without a gradient (compute_grad=False) and cannot backward")
    labels, normaliser, log_sum_exp, grad_logits = ctx.saved_tensors
    grad_logits = _rescaled(grad_logits, labels, log_sum_exp, normaliser, grad_ce, grad_z, ctx.options)
    return grad_logits, None, None, None, None, None, None


_cross_entropy_forward.register_autograd(_backward, setup_context=_setup_context)


class _CrossEntropyFunction(torch.autograd.Function):
    """Eager path: the kernels launched straight from an autograd.Function.

    Dispatching through torch.library costs tens of microseconds of host time per call, as much as the kernels take
    at T5's sizes; ``torch.compile`` traces the custom ops above instead. With ``inplace`` the gradient overwrites
    the caller's logits; their version counter is bumped, so autograd raises if anything else saved them.
    """

    @staticmethod
    def forward(ctx, logits, labels, normaliser, ignore_index, label_smoothing, z_loss, inplace):
        rows = as_rows(logits)
        inplace = inplace and logits.is_contiguous()
        grad_rows = rows if inplace else torch.empty_like(rows)
        flat_labels = labels.reshape(-1)
        losses, log_sum_exp = _triton_forward(
            rows, flat_labels, normaliser, grad_rows, ignore_index, label_smoothing, z_loss
        )
        if inplace:
            torch.autograd.graph.increment_version(logits)
        ctx.options = (ignore_index, label_smoothing, z_loss)
        ctx.logits_shape = logits.shape
        ctx.save_for_backward(grad_rows.detach(), flat_labels, normaliser, log_sum_exp)
        return losses.unbind()

    @staticmethod
    def backward(ctx, grad_ce, grad_z):
        grad_rows, labels, normaliser, log_sum_exp = ctx.saved_tensors
        grad_rows = _rescaled(grad_rows, labels, log_sum_exp, normaliser, grad_ce, grad_z, ctx.options)
        return grad_rows.view(ctx.logits_shape), None, None, None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    inplace_backward: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy and z-loss term over the last dimension of ``logits``.

    Args:
        logits: ``(..., vocab_size)``; any float dtype (fp32/fp16/bf16 on the Triton path), any vocabulary size.
        labels: ``(...)`` integer class indices; ``ignore_index`` marks tokens that do not count.
        label_smoothing: as ``torch.nn.functional.cross_entropy(label_smoothing=...)``.
        z_loss: coefficient of ``logsumexp(logits)**2`` per token (PaLM's z-loss); 0 gives a zero term.
        reduction: ``"mean"`` divides both sums by ``num_items_in_batch`` when given, else by the number of
            non-ignored tokens (a batch with none gives 0, not NaN); ``"sum"`` returns the sums.
        num_items_in_batch: explicit normaliser for ``"mean"`` (e.g. the token count over gradient accumulation).
        inplace_backward: allow writing the gradient into the logits buffer; the caller must not read ``logits``
            after this call.
        backend: ``"auto"``, ``"reference"`` or ``"triton"`` (see ``dispatch.use_triton``).

    Returns:
        ``(ce_loss, z_loss_term)``, fp32 scalars, both differentiable; the training loss is their sum.
    """
    _check_inputs(logits, labels, ignore_index, label_smoothing, z_loss, reduction)
    if not use_triton(backend, logits):
        return cross_entropy_reference(
            logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
            reduction=reduction, num_items_in_batch=num_items_in_batch,
        )
    if _triton_forward is None:
        raise RuntimeError("cross_entropy: the Triton kernels could not be imported; use backend='reference'")
    if logits.dtype not in _TRITON_DTYPES:
        raise TypeError(
            f"cross_entropy's Triton path takes fp32/fp16/bf16 logits, got {logits.dtype}; use backend='reference'"
        )
    normaliser = _normaliser(labels, ignore_index, reduction, num_items_in_batch, logits.device)
    options = (int(ignore_index), float(label_smoothing), float(z_loss))
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    if torch.compiler.is_compiling():
        ce, z, _, _ = _cross_entropy_forward(logits, labels, normaliser, *options, compute_grad)
        return ce, z
    if compute_grad:
        return _CrossEntropyFunction.apply(logits, labels, normaliser, *options, inplace_backward)
    losses, _ = _triton_forward(as_rows(logits), labels.reshape(-1), normaliser, None, *options)
    return losses.unbind()
