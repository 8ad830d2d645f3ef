"""RMSNorm: the Triton kernels (through the interpreter on CPU) against T5LayerNorm and an fp64 truth."""

import pytest
import torch
from helpers import relative_error
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.t5.modeling_t5 import T5LayerNorm

from fat5.kernels.rms_norm import rms_norm, rms_norm_reference

# the kernels run on CPU tensors here (Triton's interpreter); gpu-marked tests run them on a GPU
pytestmark = pytest.mark.interpreter


def _t5_layer_norm(weight: torch.Tensor, eps: float) -> T5LayerNorm:
    module = T5LayerNorm(weight.shape[0], eps=eps).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module


def _float64_grads(hidden_states, weight, grad_output, eps):
    """Gradients of the T5 formula in fp64 (no intermediate rounding): the truth for the fp32 kernels."""
    x = hidden_states.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    output = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    return torch.autograd.grad(output, (x, w), grad_output.double())


@settings(max_examples=12, deadline=None)
@given(
    leading=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    width=st.sampled_from([1, 3, 64, 100, 257, 768]),
    eps=st.sampled_from([1e-6, 1e-5]),
)
def test_triton_matches_t5_layer_norm_fp32(leading, width, eps):
    hidden_states = torch.randn(*leading, width) * 3.0
    weight = torch.randn(width)
    grad_output = torch.randn(*leading, width)
    x = hidden_states.clone().requires_grad_()
    w = weight.clone().requires_grad_()

    output = rms_norm(x, w, eps, backend="triton")
    expected = _t5_layer_norm(weight, eps)(hidden_states)
    assert output.dtype == expected.dtype == torch.float32
    assert relative_error(output, expected) < 1e-5

    grad_input, grad_weight = torch.autograd.grad(output, (x, w), grad_output)
    expected_input, expected_weight = _float64_grads(hidden_states, weight, grad_output, eps)
    # dx = r * (dy - y * mean(dy * y)) cancels to ~0 when the width is 1: measure it against the size of r * dy.
    inverse_rms = torch.rsqrt(hidden_states.double().pow(2).mean(-1, keepdim=True) + eps)
    scale = (grad_output.double() * weight.double() * inverse_rms).norm()
    assert (grad_input.double() - expected_input).norm() < 1e-4 * max(expected_input.norm(), scale)
    assert relative_error(grad_weight, expected_weight) < 1e-4


@pytest.mark.parametrize(
    "input_dtype, weight_dtype",
    [
        (torch.float16, torch.float16),
        (torch.float32, torch.float16),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_triton_follows_t5_dtype_rules(input_dtype, weight_dtype):
    # T5 casts the normalised x to a half weight's dtype before the multiply; with an fp32 weight it stays fp32.
    hidden_states = torch.randn(9, 48).to(input_dtype)
    weight = (1.0 + 0.2 * torch.randn(48)).to(weight_dtype)
    output = rms_norm(hidden_states, weight, backend="triton")
    expected = _t5_layer_norm(weight, 1e-6)(hidden_states)
    assert output.dtype == expected.dtype
    tolerance = 1e-2 if expected.dtype == torch.bfloat16 else 2e-3
    assert relative_error(output, expected) < tolerance


def test_half_gradients_close_to_fp64():
    hidden_states = torch.randn(33, 200, dtype=torch.float16)
    weight = (1.0 + 0.2 * torch.randn(200)).to(torch.float16)
    grad_output = torch.randn(33, 200, dtype=torch.float16)
    x = hidden_states.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    grad_input, grad_weight = torch.autograd.grad(rms_norm(x, w, backend="triton"), (x, w), grad_output)
    assert grad_input.dtype == grad_weight.dtype == torch.float16
    expected_input, expected_weight = _float64_grads(hidden_states, weight, grad_output, 1e-6)
    assert relative_error(grad_input, expected_input) < 2e-3
    assert relative_error(grad_weight, expected_weight) < 2e-3


def test_weight_gradient_spans_many_programs_and_is_deterministic():
    # More rows than programs: each program reduces a slab, the partial sums are then added.
    hidden_states = torch.randn(203, 40)
    weight = torch.randn(40, requires_grad=True)
    grad_output = torch.randn(203, 40)
    first = torch.autograd.grad(rms_norm(hidden_states, weight, backend="triton"), weight, grad_output)[0]
    second = torch.autograd.grad(rms_norm(hidden_states, weight, backend="triton"), weight, grad_output)[0]
    assert torch.equal(first, second)
    _, expected = _float64_grads(hidden_states, weight, grad_output, 1e-6)
    assert relative_error(first, expected) < 1e-5


@pytest.mark.parametrize("output_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_output_dtype_is_t5s_product_rounded_once(backend, output_dtype):
    """What autocast hands the next projection: T5LayerNorm's fp32 output cast to its dtype, with that cast's
    gradients (the incoming half-precision gradient widened)."""
    hidden_states, weight = torch.randn(6, 48) * 2, torch.randn(48)
    grad_output = torch.randn(6, 48).to(output_dtype)
    module = _t5_layer_norm(weight, 1e-6)
    expected_x = hidden_states.clone().requires_grad_()
    expected = module(expected_x).to(output_dtype)
    expected.backward(grad_output)
    x, w = hidden_states.clone().requires_grad_(), weight.clone().requires_grad_()
    output = rms_norm(x, w, backend=backend, output_dtype=output_dtype)
    output.backward(grad_output)
    assert output.dtype == output_dtype and x.grad.dtype == w.grad.dtype == torch.float32
    # the kernel's fp32 product may differ from torch's in its last bit, which can move the rounding by one step
    torch.testing.assert_close(output, expected, rtol=torch.finfo(output_dtype).eps, atol=1e-6)
    assert relative_error(x.grad, expected_x.grad) < 1e-5
    assert relative_error(w.grad, module.weight.grad) < 1e-5


def test_strided_input_and_large_values():
    # A view with a row stride wider than the width, and values whose squares overflow fp16 if not upcast.
    base = torch.randn(12, 80) * 1e3
    hidden_states = base[:, :64]
    weight = torch.randn(64)
    expected = _t5_layer_norm(weight, 1e-6)(hidden_states)
    assert relative_error(rms_norm(hidden_states, weight, backend="triton"), expected) < 1e-5
    half = (torch.randn(7, 64).clamp(-3, 3) * 2e4).to(torch.float16)
    half_weight = torch.ones(64, dtype=torch.float16)
    output = rms_norm(half, half_weight, backend="triton")
    assert torch.isfinite(output).all()
    assert relative_error(output, _t5_layer_norm(half_weight, 1e-6)(half)) < 2e-3


def test_empty_batch():
    weight = torch.randn(16, requires_grad=True)
    hidden_states = torch.randn(0, 16, requires_grad=True)
    output = rms_norm(hidden_states, weight, backend="triton")
    output.sum().backward()
    assert output.shape == (0, 16)
    assert torch.equal(weight.grad, torch.zeros(16))


def test_reference_is_t5_layer_norm():
    hidden_states = torch.randn(4, 6, 32, dtype=torch.bfloat16)
    weight = torch.randn(32, dtype=torch.bfloat16)
    assert torch.equal(rms_norm_reference(hidden_states, weight, 1e-6), _t5_layer_norm(weight, 1e-6)(hidden_states))
    assert torch.equal(rms_norm(hidden_states, weight), _t5_layer_norm(weight, 1e-6)(hidden_states))


@pytest.mark.parametrize(
    "hidden_states, weight, error, match",
    [
        (torch.randn(3, 8), torch.randn(9), ValueError, "last dimension"),
        (torch.randn(3, 8), torch.randn(2, 8), ValueError, "1-D"),
        (torch.ones(3, 8, dtype=torch.int64), torch.randn(8), TypeError, "floating"),
        (torch.randn(3, 8, dtype=torch.float64), torch.randn(8), TypeError, "fp32/fp16/bf16"),
    ],
)
def test_bad_input_raises_clear_errors(hidden_states, weight, error, match):
    with pytest.raises(error, match=match):
        rms_norm(hidden_states, weight, backend="triton")


def test_output_dtype_must_be_a_floating_dtype():
    with pytest.raises(TypeError, match="output_dtype"):
        rms_norm(torch.randn(3, 8), torch.ones(8), output_dtype=torch.int32)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        rms_norm(torch.randn(2, 4), torch.ones(4), backend="cuda")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_compiles_without_graph_breaks(backend):
    def block(hidden_states, weight):
        return rms_norm(hidden_states, weight, backend=backend).sum()

    hidden_states = torch.randn(5, 24, requires_grad=True)
    weight = torch.randn(24, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(hidden_states, weight)
    compiled_grads = torch.autograd.grad(compiled, (hidden_states, weight))
    eager = block(hidden_states, weight)
    eager_grads = torch.autograd.grad(eager, (hidden_states, weight))
    torch.testing.assert_close(compiled, eager)
    for compiled_grad, eager_grad in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(compiled_grad, eager_grad)


def test_custom_op_passes_opcheck():
    from fat5.kernels import rms_norm as module

    hidden_states = torch.randn(5, 16, requires_grad=True)
    weight = torch.randn(16, requires_grad=True)
    torch.library.opcheck(module._rms_norm_forward, (hidden_states, weight, 1e-6, torch.float32))
    torch.library.opcheck(module._rms_norm_forward, (hidden_states, weight, 1e-6, torch.bfloat16))
    torch.library.opcheck(module._rms_norm_backward, (torch.randn(5, 16), hidden_states.detach(), weight.detach(),
                                                      torch.rand(5) + 0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("width", [512, 768, 1024, 4096])
def test_gpu_bf16_real_sizes(width):
    torch.manual_seed(width)
    hidden_states = torch.randn(32768, width, device="cuda", dtype=torch.bfloat16)
    weight = (1.0 + 0.1 * torch.randn(width, device="cuda")).to(torch.bfloat16)
    grad_output = torch.randn_like(hidden_states)
    x = hidden_states.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    torch.cuda.set_sync_debug_mode("error")  # the Triton path must never wait on the device
    try:
        output = rms_norm(x, w)
        grad_input, grad_weight = torch.autograd.grad(output, (x, w), grad_output)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = _t5_layer_norm(weight, 1e-6)(hidden_states)
    assert torch.equal(output, expected) or relative_error(output, expected) < 1e-2
    expected_input, expected_weight = _float64_grads(hidden_states, weight, grad_output, 1e-6)
    assert relative_error(grad_input, expected_input) < 1e-2
    assert relative_error(grad_weight, expected_weight) < 1e-2


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_compiled_auto_leaves_the_norm_to_inductor(backend, monkeypatch):
    """Under torch.compile "auto" traces the reference's operations (Inductor fuses them with their neighbours);
    "triton" keeps the kernel's custom op. The kernel is made to look usable, as on a GPU."""
    from fat5.kernels import rms_norm as module

    monkeypatch.setattr(module, "use_triton", lambda backend, tensor: True)
    targets = []

    def recording_backend(graph_module, example_inputs):
        targets.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    hidden_states, weight = torch.randn(5, 24), torch.randn(24)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: rms_norm(x, w, backend=backend), fullgraph=True, backend=recording_backend)
    torch.testing.assert_close(compiled(hidden_states, weight), rms_norm_reference(hidden_states, weight))
    assert any("rms_norm_forward" in target for target in targets) == (backend == "triton")
