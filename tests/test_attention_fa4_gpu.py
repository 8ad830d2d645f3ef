"""The flash-attn-4 route on a Hopper GPU against the fp32 reference, with the Triton attention tests' tolerance
(``pytest -m gpu`` after ``pip install "fat5[hopper]"``): what attention() and attention_varlen() run when the
routing table sends a bias-free problem to FA4, forward and dq, dk, dv."""

import pytest
import torch
from helpers import check_against_fp32_reference, cuda_leaf, relative_error

from fat5.kernels import routes
from fat5.kernels.attention import attention, attention_varlen
from fat5.kernels.position_bias import PositionBias
from fat5.kernels.routes import attention_kernel, packed_problem, padded_problem

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(routes.FA4_UNUSABLE_REASON is not None, reason=f"{routes.FA4_UNUSABLE_REASON}"),
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="the FA4 route is measured and enabled on sm90 (H100 / H200) only"),
    pytest.mark.skipif(routes.FORCED_KERNEL != "fa4" and not any(
        route.enabled for route in routes.ATTENTION_ROUTES if route.kernel == "fa4"),
        reason="the FA4 rows are off until these tests pass: run them with FAT5_ATTENTION_ROUTE=fa4"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "causal, query_length, key_length",
    [(False, 1531, 1531), (False, 256, 1024), (False, 128, 777), (True, 2048, 2048), (True, 777, 2100),
     (True, 128, 900)],
)
def test_padded_rows_against_the_fp32_reference(dtype, causal, query_length, key_length):
    """Self-attention, cross-attention (fewer queries than keys) and a prefill after cached keys: a causal query
    block sits at the end of the keys (query_offset = key_length - query_length, FA4's diagonal)."""
    torch.manual_seed(0)
    batch, heads, head_dim = 2, 4, 64
    std = head_dim**-0.25  # unit-variance scores with T5's scale of 1
    query = cuda_leaf(batch, heads, query_length, head_dim, std=std, dtype=dtype)
    key = cuda_leaf(batch, heads, key_length, head_dim, std=std, dtype=dtype)
    value = cuda_leaf(batch, heads, key_length, head_dim, dtype=dtype)
    offset = key_length - query_length if causal else 0
    problem = padded_problem(query, key, "none", causal, None, offset, 0.0)
    assert attention_kernel("auto", query, lambda: problem) == "fa4"

    def run(backend, q, k, v):
        return attention(q, k, v, causal=causal, query_offset=offset, backend=backend)

    check_against_fp32_reference(run, [query, key, value], backend="auto")


@pytest.mark.parametrize("causal", [False, True])
def test_packed_rows_against_the_fp32_reference(causal):
    """Segments of every size, an empty one (a row with fewer examples than the batch's slots) included."""
    torch.manual_seed(1)
    heads, head_dim = 6, 64
    lengths = [1000, 37, 0, 513, 2048, 1]
    cu_seqlens = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    total = sum(lengths)
    query, key = cuda_leaf(total, heads, head_dim, std=0.35), cuda_leaf(total, heads, head_dim, std=0.35)
    value = cuda_leaf(total, heads, head_dim)
    problem = packed_problem(query, cu_seqlens, cu_seqlens, max(lengths), "none", causal, 0, 0.0)
    assert attention_kernel("auto", query, lambda: problem) == "fa4"

    def run(backend, q, k, v):
        return attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max(lengths), max(lengths), causal=causal,
                                backend=backend)

    check_against_fp32_reference(run, [query, key, value], backend="auto")


def test_packed_cross_attention_with_an_empty_key_segment_gives_zeros():
    """A decoder's padding tail against a full encoder row sees no key: zeros, as FAT5 defines it, and gradients
    that match the reference's."""
    torch.manual_seed(2)
    heads, head_dim = 4, 64
    query_lengths, key_lengths = [300, 40, 100], [1024, 0, 512]
    cu_seqlens_q = torch.tensor([0, 300, 340, 440], dtype=torch.int32, device="cuda")
    cu_seqlens_k = torch.tensor([0, 1024, 1024, 1536], dtype=torch.int32, device="cuda")
    query = cuda_leaf(sum(query_lengths), heads, head_dim, std=0.35)
    key, value = cuda_leaf(sum(key_lengths), heads, head_dim, std=0.35), cuda_leaf(sum(key_lengths), heads, head_dim)

    def run(backend, q, k, v):
        return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max(query_lengths), max(key_lengths),
                                backend=backend)

    check_against_fp32_reference(run, [query, key, value], backend="auto")
    assert not run("auto", query, key, value)[300:340].any()


def test_a_bias_an_unaligned_causal_problem_or_a_decoding_step_stays_on_triton():
    query = torch.zeros(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    table = torch.zeros(32, 2, device="cuda")
    biased = padded_problem(query, query, PositionBias.t5(table).kind, False, None, 0, 0.0)
    assert attention_kernel("auto", query, lambda: biased) == "triton"
    key = torch.zeros(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    unaligned = padded_problem(query, key, "none", True, None, 0, 0.0)
    assert attention_kernel("auto", query, lambda: unaligned) == "triton"
    step = query[:, :, :1]
    decoding = padded_problem(step, key, "none", True, None, 255, 0.0)
    assert attention_kernel("auto", step, lambda: decoding) == "triton"


def test_torch_compile_fullgraph_with_inductor():
    """The custom ops: no graph break, the same loss and gradients as FA4's own autograd.Function eagerly."""
    torch.manual_seed(5)
    query, key, value = (cuda_leaf(2, 4, 1024, 64, std=0.35) for _ in range(3))

    def step(q, k, v):
        return attention(q * 1.0, k, v, causal=True).float().square().mean()

    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(query, key, value)
    grads = torch.autograd.grad(loss, (query, key, value))
    expected = step(query, key, value)
    expected_grads = torch.autograd.grad(expected, (query, key, value))
    assert torch.allclose(loss, expected, rtol=1e-3)
    assert all(relative_error(g, e) < 1e-3 for g, e in zip(grads, expected_grads))


def test_forward_and_backward_replay_from_a_cuda_graph():
    """A training step captured once (FA4 compiles its kernels on the first, eager, call) replays the eager
    results."""
    torch.manual_seed(6)
    query, key, value = (cuda_leaf(2, 4, 512, 64, std=0.35) for _ in range(3))
    grad_out = torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        out = attention(query, key, value)
        return (out, *torch.autograd.grad(out, (query, key, value), grad_out))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(relative_error(c, e) < 1e-3 for c, e in zip(captured, eager))
