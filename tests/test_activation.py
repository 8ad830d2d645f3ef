"""The fused feed-forward activation: Triton kernels (through the interpreter on CPU) against transformers' ACT2FN
in fp64, the reference against ACT2FN exactly, and the model wired to it."""

import pytest
import torch
from helpers import relative_error
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.activations import ACT2FN

from fat5.kernels.activation import ACTIVATIONS, activation_reference, gated_activation

# the kernels run on CPU tensors here (Triton's interpreter); gpu-marked tests run them on a GPU
pytestmark = pytest.mark.interpreter


def _float64_truth(gate, linear, activation, grad_output):
    """transformers' activation in fp64 (no intermediate rounding), its output and gradients."""
    gate = gate.detach().double().requires_grad_()
    inputs = [gate]
    output = ACT2FN[activation](gate)
    if linear is not None:
        linear = linear.detach().double().requires_grad_()
        inputs.append(linear)
        output = output * linear
    return output, torch.autograd.grad(output, inputs, grad_output.double())


@settings(max_examples=16, deadline=None)
@given(
    shape=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    activation=st.sampled_from(sorted(ACTIVATIONS)),
    gated=st.booleans(),
)
def test_triton_matches_transformers_activation_fp32(shape, activation, gated):
    torch.manual_seed(sum(shape) + 100 * len(shape))  # hypothesis replays a failing example with the same inputs
    gate = (torch.randn(*shape) * 3.0).requires_grad_()
    linear = torch.randn(*shape).requires_grad_() if gated else None
    grad_output = torch.randn(*shape)

    output = gated_activation(gate, linear, activation, backend="triton")
    inputs = [gate] + ([linear] if gated else [])
    grads = torch.autograd.grad(output, inputs, grad_output)
    expected, expected_grads = _float64_truth(gate, linear, activation, grad_output)
    assert output.shape == gate.shape and output.dtype == torch.float32
    # fp32 evaluates GELU's tail as x * (1 + erf(x)) - about |x| * 6e-8 of cancellation error, which torch's own
    # fp32 GELU shares: the bound allows that much beside the 1e-5 relative error
    error = (output.double() - expected.double()).norm()
    assert error <= 1e-5 * expected.double().norm() + 1e-7 * gate.detach().double().norm()
    cancellation = 1e-7 * (grad_output.double() * (1.0 + gate.detach().double().abs())).norm()
    for grad, expected_grad in zip(grads, expected_grads):
        assert (grad.double() - expected_grad).norm() <= 1e-5 * expected_grad.norm() + cancellation


@pytest.mark.parametrize("activation", ["gelu_new", "silu"])
def test_half_precision_rounds_once(activation):
    """fp16 in, fp16 out, within one rounding of the fp64 value (eager rounds after every operation)."""
    gate = torch.randn(33, 65).half()
    linear = torch.randn(33, 65).half()
    grad_output = torch.randn(33, 65).half()
    g, lin = gate.clone().requires_grad_(), linear.clone().requires_grad_()
    output = gated_activation(g, lin, activation, backend="triton")
    grad_gate, grad_linear = torch.autograd.grad(output, (g, lin), grad_output)
    expected, (expected_gate, expected_linear) = _float64_truth(gate, linear, activation, grad_output)
    assert output.dtype == torch.float16
    assert torch.allclose(output.double(), expected, rtol=2**-10, atol=1e-4)
    assert torch.allclose(grad_gate.double(), expected_gate, rtol=2**-10, atol=1e-3)
    assert torch.allclose(grad_linear.double(), expected_linear, rtol=2**-10, atol=1e-4)


def test_non_contiguous_inputs():
    gate = torch.randn(20, 40)[:, ::2]
    linear = torch.randn(20, 20).t()
    output = gated_activation(gate, linear, "gelu_new", backend="triton")
    expected, _ = _float64_truth(gate, linear, "gelu_new", torch.ones_like(gate))
    assert relative_error(output, expected) < 1e-5


def test_empty_input():
    gate = torch.randn(0, 8, requires_grad=True)
    output = gated_activation(gate, torch.randn(0, 8), "gelu_new", backend="triton")
    assert output.shape == (0, 8)
    output.sum().backward()
    assert gate.grad.shape == (0, 8)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_transformers_exactly(activation, dtype):
    gate = torch.randn(16, 24, dtype=dtype) * 4
    linear = torch.randn(16, 24, dtype=dtype)
    assert torch.equal(activation_reference(gate, linear, activation), ACT2FN[activation](gate) * linear)
    assert torch.equal(activation_reference(gate, None, activation), ACT2FN[activation](gate))


@pytest.mark.parametrize(
    "gate, linear, activation, error, match",
    [
        (torch.randn(4, 8), torch.randn(4, 8), "tanh", ValueError, "activation must be one of"),
        (torch.randn(4, 8), torch.randn(4, 9), "gelu_new", ValueError, "one shape"),
        (torch.randn(4, 8), torch.randn(4, 8).half(), "gelu_new", TypeError, "one dtype"),
        (torch.arange(8), None, "relu", TypeError, "floating-point"),
    ],
)
def test_bad_input_raises_clear_errors(gate, linear, activation, error, match):
    with pytest.raises(error, match=match):
        gated_activation(gate, linear, activation, backend="reference")


@pytest.mark.parametrize("gated", [True, False])
def test_compiles_without_graph_breaks(gated):
    def block(gate, linear):
        return gated_activation(gate, linear if gated else None, "gelu_new", backend="triton").square().sum()

    gate = torch.randn(5, 24, requires_grad=True)
    linear = torch.randn(5, 24, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(gate, linear)
    inputs = (gate, linear) if gated else (gate,)
    compiled_grads = torch.autograd.grad(compiled, inputs)
    eager_grads = torch.autograd.grad(block(gate, linear), inputs)
    torch.testing.assert_close(compiled, block(gate, linear))
    for compiled_grad, eager_grad in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(compiled_grad, eager_grad)


def test_custom_ops_pass_opcheck():
    from fat5.kernels import activation as module

    gate = torch.randn(5, 16, requires_grad=True)
    linear = torch.randn(5, 16, requires_grad=True)
    torch.library.opcheck(module._activation_forward, (gate, linear, "gelu_new"))
    torch.library.opcheck(module._activation_backward, (torch.randn(5, 16), gate.detach(), linear.detach(), "gelu_new"))
    torch.library.opcheck(module._activation_forward, (gate, None, "relu"))
    torch.library.opcheck(module._activation_backward, (torch.randn(5, 16), gate.detach(), None, "relu"))


@pytest.mark.parametrize("feed_forward_proj", ["gated-gelu", "relu", "gated-silu"])
def test_model_with_fused_activation_matches_transformers_activation(feed_forward_proj):
    """The same FAT5 weights with the fused activation on and off: same loss and gradients (fp32)."""
    from fat5 import FAT5Config, FAT5ForConditionalGeneration

    losses, grads = {}, {}
    for fused in (True, False):
        config = FAT5Config(vocab_size=64, d_model=32, d_ff=48, num_layers=1, num_heads=2, d_kv=16,
                            feed_forward_proj=feed_forward_proj, dropout_rate=0.0, attention_backend="triton",
                            use_fused_activation=fused)
        torch.manual_seed(0)
        model = FAT5ForConditionalGeneration(config)
        input_ids = torch.randint(2, 64, (2, 9))
        labels = torch.randint(2, 64, (2, 5))
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        losses[fused] = loss.detach()
        grads[fused] = model.encoder.block[0].layer[-1].DenseReluDense.wo.weight.grad
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu_new", "gelu", "relu", "silu"])
def test_gpu_bf16_real_sizes(activation):
    torch.manual_seed(0)
    gate = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16) * 2
    linear = torch.randn_like(gate)
    grad_output = torch.randn_like(gate)
    g, lin = gate.clone().requires_grad_(), linear.clone().requires_grad_()
    torch.cuda.set_sync_debug_mode("error")  # the Triton path must never wait on the device
    try:
        output = gated_activation(g, lin, activation)
        grad_gate, grad_linear = torch.autograd.grad(output, (g, lin), grad_output)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected, (expected_gate, expected_linear) = _float64_truth(gate, linear, activation, grad_output)
    assert relative_error(output, expected) < 1e-2
    assert relative_error(grad_gate, expected_gate) < 1e-2
    assert relative_error(grad_linear, expected_linear) < 1e-2
