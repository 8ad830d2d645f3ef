"""The fused rotary kernel (TRITON_INTERPRET=1 on CPU) against transformers' own RoPE and the cos/sin reference."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from fat5.kernels.rotary import _rotary_op, apply_rotary, rotary_cos_sin, rotary_inverse_frequency

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def truth(states, position_ids, base):
    """transformers' Llama rotation (rotate-half) with fp64 cos/sin: an implementation independent of fat5's."""
    inverse_frequency = 1.0 / (base ** (torch.arange(0, states.shape[-1], 2, dtype=torch.float64) / states.shape[-1]))
    angles = position_ids.double().cpu()[..., None] * inverse_frequency
    angles = torch.cat((angles, angles), dim=-1)
    rotated, _ = apply_rotary_pos_emb(states.double().cpu(), states.double().cpu(), angles.cos(), angles.sin())
    return rotated


def test_kernel_matches_transformers_rope():
    torch.manual_seed(0)
    states = torch.randn(2, 3, 37, 16, device=DEVICE)
    position_ids = torch.randint(0, 500, (2, 37), device=DEVICE)
    out = apply_rotary(states, position_ids, 10000.0, backend="triton")
    torch.testing.assert_close(out.double().cpu(), truth(states, position_ids, 10000.0), rtol=0, atol=2e-4)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 3), heads=st.integers(1, 3), length=st.integers(1, 40),
    head_dim=st.sampled_from([2, 6, 16, 34]), shared_positions=st.booleans(), restarts=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float16]), transposed=st.booleans(),
)
def test_forward_and_backward_match_the_reference(batch, heads, length, head_dim, shared_positions, restarts, dtype,
                                                  transposed):
    """Odd lengths, head dims whose halves are not powers of two, positions shared by the batch or restarting in
    packed segments, states that are a transposed view: output and gradient as the cos/sin reference's."""
    generator = torch.Generator().manual_seed(batch * 1000 + length * 10 + head_dim)
    shape = (batch, length, heads, head_dim) if transposed else (batch, heads, length, head_dim)
    states = torch.randn(shape, generator=generator).to(DEVICE, dtype)
    if transposed:
        states = states.transpose(1, 2)
    positions = torch.arange(length) % 7 if restarts else torch.arange(length) + 3
    position_ids = (positions[None] if shared_positions else positions.expand(batch, length) + 0).to(DEVICE)
    grad = torch.randn(batch, heads, length, head_dim, generator=generator).to(DEVICE, dtype)

    results = []
    for backend in ("triton", "reference"):
        leaf = states.detach().clone().requires_grad_()
        out = apply_rotary(leaf, position_ids, 500.0, backend=backend)
        out.backward(grad)
        results.append((out.float(), leaf.grad.float()))
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-3, "atol": 1e-3}
    torch.testing.assert_close(results[0][0], results[1][0], **tolerance)
    torch.testing.assert_close(results[0][1], results[1][1], **tolerance)


def test_backward_is_the_inverse_rotation():
    """A rotation's gradient is the opposite rotation: rotating back recovers the input."""
    states = torch.randn(1, 2, 9, 8, device=DEVICE)
    position_ids = torch.arange(9, device=DEVICE)[None] * 11
    inverse_frequency = rotary_inverse_frequency(8, 10000.0, DEVICE)
    there = _rotary_op(states, position_ids.expand(1, 9), inverse_frequency, False)
    back = _rotary_op(there, position_ids.expand(1, 9), inverse_frequency, True)
    torch.testing.assert_close(back, states, rtol=1e-5, atol=1e-5)


def test_custom_op_passes_opcheck():
    states = torch.randn(2, 2, 5, 8, device=DEVICE, requires_grad=True)
    position_ids = torch.arange(5, device=DEVICE).expand(2, 5)
    arguments = (states, position_ids, rotary_inverse_frequency(8, 10000.0, DEVICE), False)
    torch.library.opcheck(_rotary_op, arguments, test_utils=("test_schema", "test_autograd_registration",
                                                             "test_faketensor"))


def test_reference_tables_are_the_kernel_angles():
    cos, sin = rotary_cos_sin(torch.tensor([[0, 1, 5]]), 4, 100.0)
    assert cos.shape == (1, 3, 4)
    torch.testing.assert_close(cos[0, 2], torch.tensor([5.0, 0.5, 5.0, 0.5]).cos())
    torch.testing.assert_close(sin[0, 2], torch.tensor([5.0, 0.5, 5.0, 0.5]).sin())


@pytest.mark.parametrize(
    "states, position_ids, error, match",
    [
        (torch.zeros(1, 2, 3, 5), torch.zeros(1, 3, dtype=torch.long), ValueError, "even head dimension"),
        (torch.zeros(2, 3, 4), torch.zeros(1, 3, dtype=torch.long), ValueError, r"\(batch, heads, length, head_dim\)"),
        (torch.zeros(2, 2, 3, 4), torch.zeros(2, 4, dtype=torch.long), ValueError, "position_ids must be"),
        (torch.zeros(2, 2, 3, 4), torch.zeros(3, 3, dtype=torch.long), ValueError, "position_ids must be"),
        (torch.zeros(2, 2, 3, 4), torch.zeros(2, 3), TypeError, "must be integers"),
    ],
)
def test_bad_inputs_raise_clear_errors(states, position_ids, error, match):
    with pytest.raises(error, match=match):
        apply_rotary(states, position_ids, backend="reference")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bf16_at_model_size_on_gpu():
    torch.manual_seed(0)
    states = torch.randn(4, 12, 2048, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.arange(2048, device="cuda").expand(4, 2048)
    grad = torch.randn_like(states)
    out = apply_rotary(states, position_ids, backend="triton")
    out.backward(grad)
    reference_leaf = states.detach().clone().requires_grad_()
    reference = apply_rotary(reference_leaf, position_ids, backend="reference")
    reference.backward(grad)
    torch.testing.assert_close(out, reference, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(states.grad, reference_leaf.grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.float().cpu().double(), truth(states.detach().float(), position_ids, 10000.0),
                               rtol=0, atol=3e-2)
