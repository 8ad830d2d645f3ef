"""Cross-entropy + z-loss: the Triton kernels (through the interpreter on CPU) against an fp64 truth and torch."""

import pytest
import torch
import torch.nn.functional as F
from helpers import relative_error
from hypothesis import given, settings
from hypothesis import strategies as st

from fat5.kernels.cross_entropy import cross_entropy, cross_entropy_reference

# the kernels run on CPU tensors here (Triton's interpreter); gpu-marked tests run them on a GPU
pytestmark = pytest.mark.interpreter


def _truth(logits, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean", num_items=None):
    """fp64, written from the definitions: smoothed NLL of log_softmax and z_loss * logsumexp^2 per counted token."""
    logits = logits.double().reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    counted = labels != ignore_index
    log_probs = torch.log_softmax(logits, dim=-1)
    nll = -log_probs.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    per_token = (1 - label_smoothing) * nll
    if label_smoothing > 0:  # kept out otherwise: 0 * mean = NaN over a masked (-inf) vocabulary
        per_token = per_token - label_smoothing * log_probs.mean(dim=-1)
    z = z_loss * torch.logsumexp(logits, dim=-1).square()
    ce_sum = (per_token * counted).sum()
    z_sum = (z * counted).sum()
    if reduction == "sum":
        return ce_sum, z_sum
    normaliser = float(num_items) if num_items is not None else max(int(counted.sum()), 1)
    return ce_sum / normaliser, z_sum / normaliser


def _truth_grad(logits, labels, grad_ce=1.0, grad_z=1.0, **options):
    leaf = logits.detach().double().requires_grad_()
    ce, z = _truth(leaf, labels, **options)
    return torch.autograd.grad(grad_ce * ce + grad_z * z, leaf)[0]


def _run(logits, labels, grad_ce=1.0, grad_z=1.0, **options):
    leaf = logits.detach().clone().requires_grad_()
    ce, z = cross_entropy(leaf * 1.0, labels, backend="triton", **options)
    grad = torch.autograd.grad(grad_ce * ce + grad_z * z, leaf)[0]
    return ce, z, grad


def _labels(rows, vocab_size, ignored_fraction=0.25, seed=0):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab_size, (rows,), generator=generator)
    labels[torch.rand(rows, generator=generator) < ignored_fraction] = -100
    return labels


@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 9),
    vocab_size=st.sampled_from([1, 7, 100, 1000, 9001]),  # 9001: several blocks, not a power of two
    label_smoothing=st.sampled_from([0.0, 0.1]),
    z_loss=st.sampled_from([0.0, 1e-4, 1e-2]),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_fp64_truth(rows, vocab_size, label_smoothing, z_loss, reduction, seed):
    torch.manual_seed(seed)
    logits = torch.randn(rows, vocab_size) * 4.0
    labels = _labels(rows, vocab_size, seed=seed)
    options = {"label_smoothing": label_smoothing, "z_loss": z_loss, "reduction": reduction}
    ce, z, grad = _run(logits, labels, **options)
    expected_ce, expected_z = _truth(logits, labels, **options)
    assert ce.dtype == z.dtype == torch.float32 and ce.shape == z.shape == ()
    assert abs(ce.item() - expected_ce.item()) <= 1e-4 * abs(expected_ce.item()) + 1e-6
    assert abs(z.item() - expected_z.item()) <= 1e-4 * abs(expected_z.item()) + 1e-9
    expected_grad = _truth_grad(logits, labels, **options)
    counted = int((labels != -100).sum())
    if counted == 0:
        assert torch.equal(grad, torch.zeros_like(grad))
        return
    # Each counted row's gradient is made of terms of size 1/normaliser that cancel when one class dominates (a
    # vocabulary of 1): measure the error against that size as well as against the gradient's own norm.
    term_size = counted**0.5 / (counted if reduction == "mean" else 1)
    assert (grad.double() - expected_grad).norm() < 1e-4 * max(expected_grad.norm().item(), term_size)


@pytest.mark.parametrize("config", [{"programs_per_sm": 1, "eviction": True, "block_size": 1024}, {"block_size": 4096}])
def test_launch_configs_compute_the_same_function(config):
    # A grid smaller than the number of rows (each program walks several) and L2 eviction hints are tuning choices.
    from fat5.kernels import cross_entropy_triton

    logits = torch.randn(7, 3000) * 3.0
    labels = _labels(7, 3000)
    normaliser = torch.tensor(float((labels != -100).sum()))
    grad = torch.empty_like(logits)
    losses, _ = cross_entropy_triton.cross_entropy_forward(
        logits, labels, normaliser, grad, -100, 0.1, 1e-3, **config
    )
    expected_ce, expected_z = _truth(logits, labels, label_smoothing=0.1, z_loss=1e-3)
    assert abs(losses[0].item() - expected_ce.item()) <= 1e-5 * expected_ce.item()
    assert abs(losses[1].item() - expected_z.item()) <= 1e-5 * expected_z.item()
    expected_grad = _truth_grad(logits, labels, label_smoothing=0.1, z_loss=1e-3)
    assert relative_error(grad, expected_grad) < 1e-4


@pytest.mark.parametrize("vocab_size", [2500, 3072])  # a partial last block, and blocks that divide the vocabulary
def test_masked_vocabulary_and_labels_on_block_edges(vocab_size):
    # -inf logits (a masked or padded vocabulary) over a whole first block, a whole last block, or all but the label;
    # labels on the first and last column and on a block boundary, where the kernel's unmasked and masked blocks meet.
    from fat5.kernels import cross_entropy_triton

    logits = torch.randn(6, vocab_size) * 3.0
    logits[0, :1024] = -float("inf")
    logits[1, 2048:] = -float("inf")
    logits[2, :] = -float("inf")
    logits[2, 1024] = 0.5
    labels = torch.tensor([vocab_size - 1, 0, 1024, 1023, 2048, -100])
    expected_ce, expected_z = _truth(logits, labels, z_loss=1e-3)
    expected_grad = _truth_grad(logits, labels, z_loss=1e-3)
    normaliser = torch.tensor(5.0)
    for config in ({"block_size": 1024, "num_warps": 4}, {"block_size": 1024, "programs_per_sm": 1}, {}):
        grad = torch.full_like(logits, float("nan"))
        losses, _ = cross_entropy_triton.cross_entropy_forward(
            logits, labels, normaliser, grad, -100, 0.0, 1e-3, **config
        )
        assert abs(losses[0].item() - expected_ce.item()) <= 1e-5 * expected_ce.item()
        assert abs(losses[1].item() - expected_z.item()) <= 1e-5 * expected_z.item()
        assert torch.isfinite(grad).all() and torch.equal(grad[5], torch.zeros(vocab_size))
        assert relative_error(grad, expected_grad) < 1e-5


def test_matches_torch_cross_entropy_with_label_smoothing():
    logits = torch.randn(3, 5, 333) * 2.0
    labels = torch.randint(0, 333, (3, 5))
    labels[0, :2] = -100
    for label_smoothing in (0.0, 0.2):
        ce, z, grad = _run(logits, labels, label_smoothing=label_smoothing)
        leaf = logits.clone().requires_grad_()
        expected = F.cross_entropy(leaf.reshape(-1, 333), labels.reshape(-1), label_smoothing=label_smoothing)
        assert abs(ce.item() - expected.item()) <= 1e-4 * expected.item()
        assert z.item() == 0.0
        assert relative_error(grad, torch.autograd.grad(expected, leaf)[0]) < 1e-4


@pytest.mark.parametrize("grad_ce, grad_z", [(0.5, 2.0), (3.0, 0.0), (0.0, 1.0), (1.0, 1.0)])
def test_arbitrary_upstream_gradients(grad_ce, grad_z):
    # The forward stores the gradient for unit upstream gradients; the backward rescales it on the device.
    logits = torch.randn(8, 500) * 3.0
    labels = _labels(8, 500)
    options = {"label_smoothing": 0.1, "z_loss": 1e-2}
    _, _, grad = _run(logits, labels, grad_ce, grad_z, **options)
    assert relative_error(grad, _truth_grad(logits, labels, grad_ce, grad_z, **options)) < 1e-4


def test_only_the_ce_output_used():
    logits = torch.randn(6, 300)
    labels = _labels(6, 300)
    leaf = logits.clone().requires_grad_()
    ce, _ = cross_entropy(leaf * 1.0, labels, z_loss=1e-1, backend="triton")
    grad = torch.autograd.grad(ce, leaf)[0]
    assert relative_error(grad, _truth_grad(logits, labels, 1.0, 0.0, z_loss=1e-1)) < 1e-4


@pytest.mark.parametrize("num_items", [7, torch.tensor(7)])
def test_num_items_in_batch(num_items):
    logits = torch.randn(2, 6, 120)
    labels = torch.randint(0, 120, (2, 6))
    options = {"z_loss": 1e-3, "num_items_in_batch": num_items}
    ce, z, grad = _run(logits, labels, **options)
    expected_ce, expected_z = _truth(logits, labels, z_loss=1e-3, num_items=7)
    assert abs(ce.item() - expected_ce.item()) <= 1e-5 * expected_ce.item()
    assert abs(z.item() - expected_z.item()) <= 1e-5 * expected_z.item()
    assert relative_error(grad, _truth_grad(logits, labels, z_loss=1e-3, num_items=7)) < 1e-4


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_tokens_ignored_gives_zero_not_nan(reduction):
    logits = torch.randn(4, 9000)
    labels = torch.full((4,), -100)
    ce, z, grad = _run(logits, labels, z_loss=1e-4, label_smoothing=0.1, reduction=reduction)
    assert ce.item() == 0.0 and z.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))
    reference_ce, reference_z = cross_entropy_reference(logits, labels, z_loss=1e-4, reduction=reduction)
    assert reference_ce.item() == 0.0 and reference_z.item() == 0.0


def test_custom_ignore_index():
    logits = torch.randn(5, 50)
    labels = torch.tensor([3, 0, 0, 49, 7])
    ce, _, grad = _run(logits, labels, ignore_index=0)
    assert abs(ce.item() - _truth(logits, labels, ignore_index=0)[0].item()) < 1e-5
    assert relative_error(grad, _truth_grad(logits, labels, ignore_index=0)) < 1e-4


def test_huge_logits_do_not_overflow():
    logits = torch.randn(4, 9001) * 1e4
    # Near the fp32 maximum: exp, or a scaling by log2(e), overflows unless the max is subtracted first.
    logits[0, 17] = logits[1, 17] = logits[3, 9000] = 3e38
    labels = torch.tensor([17, 5, -100, 9000])
    ce, z, grad = _run(logits, labels)
    assert torch.isfinite(ce) and torch.isfinite(grad).all()
    expected = _truth(logits, labels)[0]
    assert abs(ce.item() - expected.item()) <= 1e-4 * expected.item()
    logits[0, 17] = logits[1, 17] = logits[3, 9000] = 5e4  # with z-loss: lse**2 must stay in fp32 range
    ce, z, grad = _run(logits, labels, z_loss=1e-4)
    assert abs(z.item() - _truth(logits, labels, z_loss=1e-4)[1].item()) <= 1e-4 * z.item()
    assert relative_error(grad, _truth_grad(logits, labels, z_loss=1e-4)) < 1e-4
    half = (torch.randn(3, 2000) * 2e4).clamp(-6e4, 6e4).to(torch.float16)
    half_labels = torch.tensor([1, 2, 3])
    ce, _, grad = _run(half, half_labels)
    expected = _truth(half, half_labels)[0]
    assert abs(ce.item() - expected.item()) <= 1e-4 * expected.item()
    assert grad.dtype == torch.float16 and torch.isfinite(grad).all()


def test_half_logits_and_leading_dimensions():
    logits = (torch.randn(2, 3, 777) * 3).to(torch.float16)
    labels = torch.randint(0, 777, (2, 3))
    labels[1, 1] = -100
    ce, z, grad = _run(logits, labels, z_loss=1e-3, label_smoothing=0.05)
    expected_ce, expected_z = _truth(logits, labels, z_loss=1e-3, label_smoothing=0.05)
    assert abs(ce.item() - expected_ce.item()) <= 1e-4 * expected_ce.item()
    assert abs(z.item() - expected_z.item()) <= 1e-4 * expected_z.item()
    assert grad.shape == logits.shape and grad.dtype == torch.float16
    assert relative_error(grad, _truth_grad(logits, labels, z_loss=1e-3, label_smoothing=0.05)) < 2e-3


def test_inplace_backward_writes_the_gradient_into_logits():
    weight = torch.randn(16, 400, requires_grad=True)
    hidden = torch.randn(10, 16)
    labels = _labels(10, 400)
    logits = hidden @ weight
    expected_logits = logits.detach().clone()
    ce, z = cross_entropy(logits, labels, z_loss=1e-2, inplace_backward=True, backend="triton")
    assert not torch.equal(logits.detach(), expected_logits)  # the buffer now holds the gradient
    (0.5 * (ce + z)).backward()
    expected_grad = hidden.T.double() @ _truth_grad(expected_logits, labels, 0.5, 0.5, z_loss=1e-2)
    assert relative_error(weight.grad, expected_grad) < 1e-4


def test_no_grad_forward_and_strided_logits():
    base = torch.randn(6, 256)
    logits = base[:, :200]  # rows strided wider than the vocabulary
    labels = _labels(6, 200)
    with torch.no_grad():
        ce, _ = cross_entropy(logits, labels, z_loss=1e-4, backend="triton")
    expected_ce, _ = _truth(logits, labels, z_loss=1e-4)
    assert abs(ce.item() - expected_ce.item()) <= 1e-5 * expected_ce.item()
    assert not ce.requires_grad


def test_reference_matches_truth():
    logits = torch.randn(2, 5, 64)
    labels = torch.randint(0, 64, (2, 5))
    labels[0, 0] = -100
    ce, z = cross_entropy_reference(logits, labels, label_smoothing=0.1, z_loss=1e-3, num_items_in_batch=4)
    expected_ce, expected_z = _truth(logits, labels, label_smoothing=0.1, z_loss=1e-3, num_items=4)
    assert abs(ce.item() - expected_ce.item()) < 1e-5 and abs(z.item() - expected_z.item()) < 1e-7
    assert cross_entropy(logits, labels)[0].item() == cross_entropy_reference(logits, labels)[0].item()


@pytest.mark.parametrize(
    "logits, labels, options, error, match",
    [
        (torch.randn(4, 10), torch.zeros(5, dtype=torch.long), {}, ValueError, "vocabulary dimension"),
        (torch.randn(4, 10), torch.zeros(4), {}, TypeError, "integer class indices"),
        (torch.zeros(4, 10, dtype=torch.long), torch.zeros(4, dtype=torch.long), {}, TypeError, "floating"),
        (torch.randn(4, 10), torch.zeros(4, dtype=torch.long), {"reduction": "none"}, ValueError, "reduction"),
        (torch.randn(4, 10), torch.zeros(4, dtype=torch.long), {"z_loss": -1.0}, ValueError, "z_loss"),
        (torch.randn(4, 10), torch.zeros(4, dtype=torch.long), {"label_smoothing": 1.5}, ValueError, "smoothing"),
        (torch.randn(4, 10), torch.zeros(4, dtype=torch.long), {"backend": "cuda"}, ValueError, "backend"),
        (torch.randn(4, 10, dtype=torch.float64), torch.zeros(4, dtype=torch.long), {}, TypeError, "fp32/fp16/bf16"),
    ],
)
def test_bad_input_raises_clear_errors(logits, labels, options, error, match):
    options = {"backend": "triton", **options}
    with pytest.raises(error, match=match):
        cross_entropy(logits, labels, **options)


@pytest.mark.parametrize(
    "backend, compiler", [("reference", "aot_eager"), ("triton", "aot_eager"), ("triton", "inductor")]
)
def test_compiles_without_graph_breaks(backend, compiler):
    from fat5.kernels.rms_norm import rms_norm

    def loss(hidden, norm_weight, lm_head, labels):
        logits = rms_norm(hidden, norm_weight, backend=backend) @ lm_head
        ce, z = cross_entropy(logits, labels, z_loss=1e-2, label_smoothing=0.1, backend=backend)
        return 2.0 * ce + z

    torch.manual_seed(0)
    inputs = [torch.randn(6, 16), torch.randn(16), torch.randn(16, 40)]
    labels = _labels(6, 40)
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend=compiler)
    leaves = [tensor.clone().requires_grad_() for tensor in inputs]
    value = compiled(*leaves, labels)
    grads = torch.autograd.grad(value, leaves)
    truth_leaves = [tensor.double().requires_grad_() for tensor in inputs]
    hidden, norm_weight, lm_head = truth_leaves
    logits = (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight) @ lm_head
    truth_ce, truth_z = _truth(logits, labels, z_loss=1e-2, label_smoothing=0.1)
    truth_value = 2.0 * truth_ce + truth_z
    truth_grads = torch.autograd.grad(truth_value, truth_leaves)
    assert abs(value.item() - truth_value.item()) <= 1e-5 * truth_value.item()
    for grad, truth_grad in zip(grads, truth_grads):
        assert relative_error(grad, truth_grad) < 1e-4


def test_custom_op_passes_opcheck():
    from fat5.kernels import cross_entropy as module

    logits = torch.randn(5, 40, requires_grad=True)
    labels = _labels(5, 40)
    normaliser = torch.tensor(4.0)
    torch.library.opcheck(module._cross_entropy_forward, (logits, labels, normaliser, -100, 0.1, 1e-3, True))
    torch.library.opcheck(module._cross_entropy_forward, (logits.detach(), labels, normaliser, -100, 0.0, 0.0, False))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, vocab_size", [(8192, 32128), (4096, 250112)])
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_gpu_bf16_real_sizes(rows, vocab_size, inplace_backward):
    torch.manual_seed(rows)
    logits = (torch.randn(rows, vocab_size, device="cuda") * 4.0).to(torch.bfloat16)
    labels = torch.randint(0, vocab_size, (rows,), device="cuda")
    labels[torch.rand(rows, device="cuda") < 0.1] = -100
    options = {"z_loss": 1e-4, "label_smoothing": 0.1}
    leaf = logits.clone().requires_grad_()
    torch.cuda.set_sync_debug_mode("error")  # no host synchronisation on the Triton path
    try:
        ce, z = cross_entropy(leaf * 1.0, labels, inplace_backward=inplace_backward, **options)
        grad = torch.autograd.grad(0.5 * ce + 0.5 * z, leaf)[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected_ce, expected_z = cross_entropy_reference(logits, labels, **options)
    assert abs(ce.item() - expected_ce.item()) <= 1e-4 * expected_ce.item()
    assert abs(z.item() - expected_z.item()) <= 1e-4 * expected_z.item()
    reference_leaf = logits.float().requires_grad_()
    reference_ce, reference_z = cross_entropy_reference(reference_leaf, labels, **options)
    expected_grad = torch.autograd.grad(0.5 * reference_ce + 0.5 * reference_z, reference_leaf)[0]
    assert relative_error(grad, expected_grad) < 1e-2


def test_modules_import_and_fall_back_without_triton():
    # CPU users load the model without triton installed: both modules must import and serve the reference.
    import subprocess
    import sys

    script = """
import sys
class BlockTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is blocked for this test")
sys.meta_path.insert(0, BlockTriton())
import torch
from fat5.kernels.cross_entropy import cross_entropy
from fat5.kernels.rms_norm import rms_norm
ce, z = cross_entropy(torch.randn(4, 10), torch.tensor([1, 2, -100, 3]), z_loss=1e-4)
assert torch.isfinite(ce) and torch.isfinite(z)
assert rms_norm(torch.randn(3, 8), torch.ones(8)).shape == (3, 8)
try:
    rms_norm(torch.randn(3, 8), torch.ones(8), backend="triton")
except RuntimeError as error:
    assert "triton" in str(error)
else:
    raise AssertionError("backend='triton' without triton must raise")
"""
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
