"""Triton kernels for cross-entropy with z-loss and label smoothing; imported lazily by ``cross_entropy.py``.

One program per row. It computes the row's logsumexp online in fp32 over blocks of the vocabulary, then, when a
gradient is wanted, walks the row again, backwards, so the blocks it read last (still in L2) come first, and writes
the gradient for unit upstream gradients, already divided by the normaliser:

    d(ce + z)/dx_j = softmax_j * (1 + 2 * z_loss * lse) - (1 - s) * [j == label] - s / V,   all / normaliser

A row whose label is ``ignore_index`` reads nothing and writes zeros. The rescale kernel, run by the backward,
turns that into the gradient for arbitrary upstream gradients (g_ce, g_z), reading both from the device and leaving
at once when they are 1, so no host synchronisation is ever needed.
"""

try:
    import triton
    import triton.language as tl
except ImportError as error:  # cross_entropy.py falls back to the reference
    raise ImportError("cross_entropy_triton needs the `triton` package") from error

import torch

from .launch import CachedLauncher, cdiv, device_guard, multiprocessors, next_power_of_2


@triton.jit
def _online_log_sum_exp_update(running_max, running_sum, x):
    """Fold the block ``x`` (fp32) into the running max and sum of exp(x - max), exp taken as exp2."""
    block_max = tl.maximum(running_max, tl.max(x, axis=0))
    # A row that is -inf so far (a masked vocabulary) shifts by 0 instead of -inf: exp2(-inf - -inf) would be NaN.
    shift = tl.where(block_max == -float("inf"), 0.0, block_max)
    # The shift is subtracted before scaling by log2(e) so that logits near the fp32 maximum do not overflow.
    running_sum = running_sum * tl.exp2((running_max - shift) * 1.4426950408889634) + tl.sum(
        tl.exp2((x - shift) * 1.4426950408889634), axis=0
    )
    return block_max, running_sum


@CachedLauncher
@triton.jit
def _cross_entropy_forward_kernel(
    logits_ptr, logits_row_stride, grad_ptr, grad_row_stride, labels_ptr, normaliser_ptr,
    ce_ptr, z_ptr, log_sum_exp_ptr,
    n_rows, vocab_size, ignore_index, label_smoothing, z_loss,
    COMPUTE_GRAD: tl.constexpr, LABEL_SMOOTHING: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    FIRST_PASS_EVICTION: tl.constexpr, SECOND_PASS_EVICTION: tl.constexpr,
):
    offsets = tl.arange(0, BLOCK_SIZE)
    # The blocks before the last are whole: loaded without a mask. The last, partial one is read first in the
    # logsumexp pass and last in the gradient pass, masked.
    FULL_BLOCKS: tl.constexpr = NUM_BLOCKS - 1
    tail_cols = FULL_BLOCKS * BLOCK_SIZE + offsets
    tail_mask = tail_cols < vocab_size
    # A grid smaller than n_rows makes each program walk several rows: fewer rows in flight, so more of each row is
    # still in L2 when the gradient pass reads it again.
    for row_index in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(row_index, tl.int64)
        label = tl.load(labels_ptr + row).to(tl.int64)
        logits_row = logits_ptr + row * logits_row_stride
        grad_row = grad_ptr + row * grad_row_stride

        if label == ignore_index:
            tl.store(ce_ptr + row, 0.0)
            tl.store(z_ptr + row, 0.0)
            tl.store(log_sum_exp_ptr + row, 0.0)
            if COMPUTE_GRAD:
                zeros = tl.zeros((BLOCK_SIZE,), dtype=grad_ptr.dtype.element_ty)
                for block in range(FULL_BLOCKS):
                    tl.store(grad_row + block * BLOCK_SIZE + offsets, zeros)
                tl.store(grad_row + tail_cols, zeros, mask=tail_mask)
        else:
            # Online logsumexp in fp32: running max and running sum of exp(x - max).
            x = tl.load(
                logits_row + tail_cols, mask=tail_mask, other=-float("inf"), eviction_policy=FIRST_PASS_EVICTION
            ).to(tl.float32)
            running_max, running_sum = _online_log_sum_exp_update(-float("inf"), 0.0, x)
            logit_sum = 0.0
            if LABEL_SMOOTHING:
                logit_sum = tl.sum(tl.where(tail_mask, x, 0.0), axis=0)
            for block in range(FULL_BLOCKS):
                x = tl.load(
                    logits_row + block * BLOCK_SIZE + offsets, eviction_policy=FIRST_PASS_EVICTION
                ).to(tl.float32)
                running_max, running_sum = _online_log_sum_exp_update(running_max, running_sum, x)
                if LABEL_SMOOTHING:
                    logit_sum += tl.sum(x, axis=0)
            log_sum_exp = running_max + tl.log(running_sum)

            label_in_range = (label >= 0) & (label < vocab_size)
            label_logit = tl.load(logits_row + label, mask=label_in_range, other=0.0).to(tl.float32)
            ce = log_sum_exp - label_logit
            if LABEL_SMOOTHING:
                mean_logit = logit_sum / vocab_size
                ce = (1.0 - label_smoothing) * ce + label_smoothing * (log_sum_exp - mean_logit)
            tl.store(ce_ptr + row, ce)
            tl.store(z_ptr + row, z_loss * log_sum_exp * log_sum_exp)
            tl.store(log_sum_exp_ptr + row, log_sum_exp)

            if COMPUTE_GRAD:
                inverse_normaliser = 1.0 / tl.load(normaliser_ptr)
                probability_scale = (1.0 + 2.0 * z_loss * log_sum_exp) * inverse_normaliser
                smoothing_term = label_smoothing / vocab_size * inverse_normaliser
                label_term = (1.0 - label_smoothing) * inverse_normaliser
                if NUM_BLOCKS == 1:
                    # The whole row was one block, still in registers: no second read.
                    grad = tl.exp2((x - log_sum_exp) * 1.4426950408889634) * probability_scale - smoothing_term
                    tl.store(grad_row + tail_cols, grad.to(grad_ptr.dtype.element_ty), mask=tail_mask)
                else:
                    # Backwards, so that the blocks read last by the first pass, the likeliest still in L2, come first.
                    for reverse_block in range(FULL_BLOCKS):
                        cols = (FULL_BLOCKS - 1 - reverse_block) * BLOCK_SIZE + offsets
                        x = tl.load(logits_row + cols, eviction_policy=SECOND_PASS_EVICTION).to(tl.float32)
                        grad = tl.exp2((x - log_sum_exp) * 1.4426950408889634) * probability_scale - smoothing_term
                        tl.store(
                            grad_row + cols, grad.to(grad_ptr.dtype.element_ty), eviction_policy=SECOND_PASS_EVICTION
                        )
                    x = tl.load(
                        logits_row + tail_cols, mask=tail_mask, other=0.0, eviction_policy=SECOND_PASS_EVICTION
                    ).to(tl.float32)
                    grad = tl.exp2((x - log_sum_exp) * 1.4426950408889634) * probability_scale - smoothing_term
                    tl.store(
                        grad_row + tail_cols, grad.to(grad_ptr.dtype.element_ty), mask=tail_mask,
                        eviction_policy=SECOND_PASS_EVICTION,
                    )
                # The label's entry is written once more, by one thread, rather than tested for in every element:
                # the barrier orders it after the block store that wrote the same address from another thread.
                tl.debug_barrier()
                label_grad = (
                    tl.exp2((label_logit - log_sum_exp) * 1.4426950408889634) * probability_scale
                    - smoothing_term - label_term
                )
                tl.store(grad_row + label, label_grad.to(grad_ptr.dtype.element_ty), mask=label_in_range)


@CachedLauncher
@triton.jit
def _cross_entropy_rescale_grad_kernel(
    grad_ptr, grad_row_stride, labels_ptr, log_sum_exp_ptr, normaliser_ptr, grad_ce_ptr, grad_z_ptr,
    vocab_size, ignore_index, label_smoothing, z_loss,
    BLOCK_SIZE: tl.constexpr, NUM_BLOCKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    grad_ce = tl.load(grad_ce_ptr).to(tl.float32)
    grad_z = tl.load(grad_z_ptr).to(tl.float32)
    label = tl.load(labels_ptr + row).to(tl.int64)
    # The stored gradient is already the one for unit upstream gradients; ignored rows hold zeros either way. The
    # z-loss term matters when grad_z != 1 and z_loss != 0, written as one product: Triton 3.3's interpreter cannot
    # combine a tensor condition with the Python bool that a float argument's comparison gives there.
    needs_rescale = (grad_ce != 1.0) | ((grad_z - 1.0) * z_loss != 0.0)
    if needs_rescale & (label != ignore_index):
        # stored = p * c / N - t with c = 1 + 2 z lse and t the label/smoothing target over N; the wanted gradient
        # g_ce * (p / N - t) + g_z * (c - 1) * p / N = (stored + t) * (g_ce + g_z * (c - 1)) / c - g_ce * t.
        log_sum_exp = tl.load(log_sum_exp_ptr + row)
        inverse_normaliser = 1.0 / tl.load(normaliser_ptr)
        c = 1.0 + 2.0 * z_loss * log_sum_exp
        probability_factor = (grad_ce + grad_z * (c - 1.0)) / c
        smoothing_term = label_smoothing / vocab_size * inverse_normaliser
        label_term = (1.0 - label_smoothing) * inverse_normaliser
        grad_row = grad_ptr + row * grad_row_stride
        for block in range(NUM_BLOCKS):
            cols = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
            col_mask = cols < vocab_size
            stored = tl.load(grad_row + cols, mask=col_mask, other=0.0).to(tl.float32)
            target = tl.where(cols == label, smoothing_term + label_term, smoothing_term)
            grad = (stored + target) * probability_factor - grad_ce * target
            tl.store(grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=col_mask)


@CachedLauncher
@triton.jit
def _cross_entropy_grad_from_lse_kernel(
    logits_ptr, row_stride, labels_ptr, log_sum_exp_ptr, normaliser_ptr, grad_ce_ptr, grad_z_ptr,
    n_cols, first_col, vocab_size, ignore_index, label_smoothing, z_loss,
    BLOCK_SIZE: tl.constexpr,
):
    # One block of one row of a slice of the vocabulary (its first column is first_col); the row's logsumexp over the
    # whole vocabulary was computed before, so the slice's gradient needs nothing beyond its own columns.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    col_mask = cols < n_cols
    pointers = logits_ptr + row * row_stride + cols
    label = tl.load(labels_ptr + row).to(tl.int64)
    if label == ignore_index:
        tl.store(pointers, tl.zeros((BLOCK_SIZE,), dtype=logits_ptr.dtype.element_ty), mask=col_mask)
    else:
        log_sum_exp = tl.load(log_sum_exp_ptr + row)
        inverse_normaliser = 1.0 / tl.load(normaliser_ptr)
        grad_ce = tl.load(grad_ce_ptr).to(tl.float32)
        grad_z = tl.load(grad_z_ptr).to(tl.float32)
        # g_ce * (p - target) / N + g_z * 2 z lse * p / N
        probability_scale = (grad_ce + grad_z * 2.0 * z_loss * log_sum_exp) * inverse_normaliser
        smoothing_term = grad_ce * label_smoothing / vocab_size * inverse_normaliser
        label_term = grad_ce * (1.0 - label_smoothing) * inverse_normaliser
        x = tl.load(pointers, mask=col_mask, other=0.0).to(tl.float32)
        grad = tl.exp2((x - log_sum_exp) * 1.4426950408889634) * probability_scale - smoothing_term
        grad = tl.where(cols + first_col == label, grad - label_term, grad)
        tl.store(pointers, grad.to(logits_ptr.dtype.element_ty), mask=col_mask)


# Measured on an H100 (benchmarks/results/cross_entropy.json, forward_kernel_sweep): at a 32k vocabulary two blocks
# of 16k beat one of 32k held in registers; at 250k the row's second read misses L2 unless the first pass marks its
# lines evict-last, the second evict-first, and a persistent grid keeps fewer rows in flight; 32 warps a program
# there keep more loads in flight than 16 (1.79 against 1.91 ms).
def forward_config(vocab_size: int) -> dict:
    """Launch parameters of the forward at this vocabulary size."""
    if vocab_size <= 65536:
        block_size = min(16384, next_power_of_2(vocab_size))
        num_warps = 16 if block_size >= 16384 else 8 if block_size >= 4096 else 4
        return {"block_size": block_size, "num_warps": num_warps, "programs_per_sm": None, "eviction": True}
    return {"block_size": 32768, "num_warps": 32, "programs_per_sm": 2, "eviction": True}


def _multiprocessors(device: torch.device) -> int:
    # 2 on the interpreter: a grid smaller than the rows still exercises the row loop
    return multiprocessors(device, interpreter_count=2)


def cross_entropy_forward(logits, labels, normaliser, grad_logits, ignore_index, label_smoothing, z_loss, **config):
    """Launch the forward on 2-D ``logits`` (unit stride along the vocabulary).

    Writes the unit-upstream gradient into ``grad_logits`` when it is given (it may be ``logits`` itself) and
    returns ``(losses, log_sum_exp)``: the cross-entropy and z-loss sums divided by ``normaliser`` as one fp32
    tensor of two elements, and the per-row logsumexp the rescale kernel needs. ``config`` overrides
    ``forward_config`` (block_size, num_warps, programs_per_sm, eviction) for tuning.
    """
    n_rows, vocab_size = logits.shape
    per_row_losses = torch.empty((2, n_rows), dtype=torch.float32, device=logits.device)
    log_sum_exp = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows > 0:
        config = {**forward_config(vocab_size), **config}
        programs = n_rows
        if config["programs_per_sm"]:
            programs = min(n_rows, config["programs_per_sm"] * _multiprocessors(logits.device))
        compute_grad = grad_logits is not None
        with device_guard(logits.device):
            _cross_entropy_forward_kernel[(programs,)](
                logits, logits.stride(0), grad_logits if compute_grad else logits,
                grad_logits.stride(0) if compute_grad else 0, labels, normaliser,
                per_row_losses[0], per_row_losses[1], log_sum_exp,
                n_rows, vocab_size, ignore_index, label_smoothing, z_loss,
                COMPUTE_GRAD=compute_grad, LABEL_SMOOTHING=label_smoothing > 0.0,
                BLOCK_SIZE=config["block_size"], NUM_BLOCKS=cdiv(vocab_size, config["block_size"]),
                FIRST_PASS_EVICTION="evict_last" if config["eviction"] else "",
                SECOND_PASS_EVICTION="evict_first" if config["eviction"] else "",
                num_warps=config["num_warps"],
            )
    return per_row_losses.sum(dim=1) / normaliser, log_sum_exp


def cross_entropy_rescale_grad(
    grad_logits, labels, log_sum_exp, normaliser, grad_ce, grad_z, ignore_index, label_smoothing, z_loss
):
    """Rescale the stored unit-upstream gradient in place for upstream gradients ``grad_ce`` and ``grad_z``."""
    n_rows, vocab_size = grad_logits.shape
    if n_rows == 0:
        return
    block_size = min(8192, next_power_of_2(vocab_size))
    with device_guard(grad_logits.device):
        _cross_entropy_rescale_grad_kernel[(n_rows,)](
            grad_logits, grad_logits.stride(0), labels, log_sum_exp, normaliser, grad_ce, grad_z,
            vocab_size, ignore_index, label_smoothing, z_loss,
            BLOCK_SIZE=block_size, NUM_BLOCKS=cdiv(vocab_size, block_size),
            num_warps=8 if block_size >= 4096 else 4,
        )


def cross_entropy_grad_from_lse(
    logits, labels, log_sum_exp, normaliser, grad_ce, grad_z, first_col, vocab_size, ignore_index, label_smoothing,
    z_loss,
):
    """Overwrite ``logits`` (rows x a slice of the vocabulary starting at ``first_col``) with their gradient, given
    each row's logsumexp over the whole vocabulary and the upstream gradients ``grad_ce`` and ``grad_z``."""
    n_rows, n_cols = logits.shape
    if n_rows == 0 or n_cols == 0:
        return
    block_size = min(4096, next_power_of_2(n_cols))
    with device_guard(logits.device):
        _cross_entropy_grad_from_lse_kernel[(n_rows, cdiv(n_cols, block_size))](
            logits, logits.stride(0), labels, log_sum_exp, normaliser, grad_ce, grad_z,
            n_cols, first_col, vocab_size, ignore_index, label_smoothing, z_loss,
            BLOCK_SIZE=block_size, num_warps=8 if block_size >= 4096 else 4,
        )
