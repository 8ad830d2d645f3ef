"""Kernel launching: CachedLauncher must reuse the compiled kernel Triton itself would pick for the arguments, and
the Triton version gate must name what is missing."""

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st

from fat5.kernels.launch import CachedLauncher, _ArgumentLayout, cdiv, next_power_of_2


@CachedLauncher
@triton.jit
def _strided_axpy_kernel(x_ptr, y_ptr, out_ptr, n, x_stride, alpha, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets * x_stride, mask=mask, other=0.0)
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, alpha * x + y, mask=mask)


def _axpy(x, y, alpha, block=64):
    """alpha * x[::stride] + y through the launcher; ``x`` may be a strided or offset view."""
    out = torch.empty_like(y)
    _strided_axpy_kernel[(triton.cdiv(y.numel(), block),)](x, y, out, y.numel(), x.stride(0), alpha, BLOCK=block)
    return out


def _key(layout, *args):
    return layout.key(args)


def test_key_tells_apart_what_triton_specialises_on():
    names = ["x_ptr", "n", "seqlen"]
    tensor = torch.zeros(64, dtype=torch.float16)
    layout = _ArgumentLayout((torch.Tensor, int, int), {"seqlen"}, names)
    base = _key(layout, tensor, 32, 100)
    # an address off the 16-byte grid, another dtype, an integer of another value: another compiled kernel
    assert _key(layout, tensor[1:], 32, 100) != base
    assert _key(layout, tensor.float(), 32, 100) != base
    assert _key(layout, tensor, 1, 100) != base
    assert _key(layout, tensor, 33, 100) != base
    # unspecialised integers count only by width
    assert _key(layout, tensor, 32, 7) == base
    assert _key(layout, tensor, 32, 2**31) != base
    assert _key(layout, tensor, 32, 2**63) != _key(layout, tensor, 32, 2**31)


def test_specialisation_groups_integers_as_triton_does():
    """Triton compiles an integer argument for its width, == 1 and divisibility by 16 (hand-listed classes)."""
    layout = _ArgumentLayout((int, int), {"seqlen"}, ["n", "seqlen"])
    classes = [[0, 16, 48, 4096, -32], [1], [2, 3, 17, 4095, -1], [2**31, 2**40], [2**31 + 1], [2**63]]
    keys = [{layout.specialisation((value, 5)) for value in group} for group in classes]
    assert all(len(group_keys) == 1 for group_keys in keys)
    assert len(set.union(*keys)) == len(classes)
    # the fast key still tells values apart; an unspecialised integer counts by width in both keys
    assert layout.key((16, 5)) != layout.key((48, 5))
    assert layout.specialisation((16, 5)) == layout.specialisation((16, 900))


@given(st.integers(0, 2**40), st.integers(1, 2**20))
def test_host_arithmetic_equals_tritons(value, divisor):
    """The launchers' own cdiv and next_power_of_2 (Triton's cost microseconds a call) give Triton's results."""
    assert cdiv(value, divisor) == triton.cdiv(value, divisor)
    assert next_power_of_2(value) == triton.next_power_of_2(value)


def test_key_refuses_arguments_it_cannot_describe():
    with pytest.raises(TypeError, match="cannot key an argument of type str"):
        _ArgumentLayout((torch.Tensor, str), set(), ["x_ptr", "name"])


@pytest.mark.interpreter
def test_interpreter_launches_the_plain_way():
    """Under TRITON_INTERPRET=1 (the CPU suite) nothing is cached and the kernel computes the right thing."""
    x, y = torch.randn(300), torch.randn(100)
    torch.testing.assert_close(_axpy(x[::3], y, 0.5), 0.5 * x[::3] + y)
    assert _strided_axpy_kernel.compiled == {} and _strided_axpy_kernel.specialisations == {}


@pytest.mark.interpreter
def test_the_interpreter_keeps_the_plain_launch_whatever_is_asked(monkeypatch):
    """``set_plain_launch(False)`` (what benchmarks/launch_overhead.py alternates) cannot send an interpreted kernel
    down the cached path, which needs a GPU."""
    from fat5.kernels import launch

    monkeypatch.setattr(launch, "_plain_launch", True)
    launch.set_plain_launch(False)
    x, y = torch.randn(100), torch.randn(100)
    torch.testing.assert_close(_axpy(x, y, 2.0), 2.0 * x + y)
    assert _strided_axpy_kernel.compiled == {}


@pytest.mark.gpu
def test_plain_launch_switch_bypasses_the_cache(monkeypatch):
    from fat5.kernels import launch

    monkeypatch.setattr(launch, "_plain_launch", False)
    monkeypatch.setattr(_strided_axpy_kernel, "compiled", {})
    monkeypatch.setattr(_strided_axpy_kernel, "specialisations", {})
    x, y = torch.randn(500, device="cuda"), torch.randn(500, device="cuda")
    launch.set_plain_launch(True)
    torch.testing.assert_close(_axpy(x, y, 3.0), 3.0 * x + y)
    assert _strided_axpy_kernel.compiled == {}
    launch.set_plain_launch(False)
    torch.testing.assert_close(_axpy(x, y, 3.0), 3.0 * x + y)
    assert len(_strided_axpy_kernel.compiled) == 1


@pytest.mark.gpu
def test_cached_launches_match_torch_for_every_specialisation():
    """Cached launches after a first one with other strides, alignments, sizes and dtypes stay exact."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(1000, device="cuda", dtype=dtype)
        y = torch.randn(300, device="cuda", dtype=dtype)
        cases = [(x[:257], y[:257]), (x[::3][:257], y[:257]), (x[1:258], y[:257]), (x[:1], y[:1]),
                 (x[:256], y[1:257])]
        same_specialisation = [(x[:273], y[:273]), (x[::5][:100], y[:100])]  # as the first two cases
        for _ in range(2):  # the second pass runs every case from the cache
            for x_view, y_view in cases + same_specialisation:
                torch.testing.assert_close(_axpy(x_view, y_view, 2.0), 2.0 * x_view + y_view)
    # each (dtype, case) differs in one thing Triton specialises on, so each has its own compiled kernel; the other
    # sizes and strides of the same classes reuse them
    assert len(_strided_axpy_kernel.specialisations) == 2 * len(cases)
    assert len(_strided_axpy_kernel.compiled) == 2 * len(cases + same_specialisation)


def test_triton_older_than_the_kernels_need_is_refused_by_name(monkeypatch):
    from fat5.kernels import dispatch

    monkeypatch.setattr(triton, "__version__", "3.2.0")
    reason = dispatch._triton_unusable_reason()
    assert "triton >= 3.3" in reason and "3.2.0" in reason
    monkeypatch.setattr(dispatch, "TRITON_UNUSABLE_REASON", reason)
    assert not dispatch.triton_available()
    with pytest.raises(RuntimeError, match="triton >= 3.3"):
        dispatch.use_triton("triton", torch.zeros(2))
    assert dispatch.use_triton("auto", torch.zeros(2)) is False
    monkeypatch.setattr(triton, "__version__", "3.3.0")
    assert dispatch._triton_unusable_reason() is None


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_kernels_run_on_their_tensors_device_not_the_current_one():
    # A model split over GPUs (device_map="auto") calls the kernels with tensors on a device other than the current
    # one: each launch must go to the tensors' device, as the eager references do.
    from fat5.kernels.activation import activation_reference, gated_activation
    from fat5.kernels.cross_entropy import cross_entropy, cross_entropy_reference
    from fat5.kernels.linear_cross_entropy import linear_cross_entropy
    from fat5.kernels.rms_norm import rms_norm, rms_norm_reference

    torch.cuda.set_device(0)
    device = torch.device("cuda", 1)
    torch.manual_seed(0)
    x = torch.randn(64, 512, device=device, requires_grad=True)
    weight = torch.rand(512, device=device) + 0.5
    normed = rms_norm(x, weight, backend="triton")
    assert torch.allclose(normed, rms_norm_reference(x, weight), rtol=1e-5, atol=1e-5)
    gate, linear = torch.randn(2, 64, 512, device=device, requires_grad=True)
    activated = gated_activation(gate, linear, "gelu_new", backend="triton")
    assert torch.allclose(activated, activation_reference(gate, linear, "gelu_new"), rtol=1e-5, atol=1e-5)
    (normed.sum() + activated.sum()).backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(gate.grad).all()

    logits = torch.randn(32, 1000, device=device, requires_grad=True)
    labels = torch.randint(0, 1000, (32,), device=device)
    ce, z = cross_entropy(logits, labels, z_loss=1e-4, backend="triton")
    (ce + z).backward()
    reference = logits.detach().clone().requires_grad_()
    sum(cross_entropy_reference(reference, labels, z_loss=1e-4)).backward()
    assert torch.allclose(ce + z, sum(cross_entropy_reference(logits, labels, z_loss=1e-4)), rtol=1e-5)
    assert torch.allclose(logits.grad, reference.grad, rtol=1e-4, atol=1e-7)

    hidden = torch.randn(32, 64, device=device, requires_grad=True)
    output_weight = torch.randn(1000, 64, device=device)
    sum(linear_cross_entropy(hidden, output_weight, labels, chunk_rows=8, backend="triton")).backward()
    expected = hidden.detach().clone().requires_grad_()
    cross_entropy_reference(expected @ output_weight.T, labels)[0].backward()
    assert torch.allclose(hidden.grad, expected.grad, rtol=1e-4, atol=1e-6)
