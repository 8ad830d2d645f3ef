"""The flash-attn-4 route on a Hopper GPU against the fp32 reference, with the Triton attention tests' tolerance
(``pytest -m gpu`` after ``pip install "fat5[hopper]"``): what attention() and attention_varlen() run when the
routing table sends a problem to FA4, bias-free or with T5's bias in FAT5's Hopper T5 kernels, forward and dq, dk,
dv, and the T5 table's gradient."""

import pytest
import torch
from helpers import check_against_fp32_reference, cuda_leaf, relative_error

from fat5.kernels import routes
from fat5.kernels.attention import attention, attention_varlen
from fat5.kernels.attention_fa4 import fa4_attention, fa4_attention_varlen
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
    problem = packed_problem(query, cu_seqlens, cu_seqlens, max(lengths), max(lengths), "none", causal, 0, 0.0)
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


def test_alibi_an_unaligned_causal_problem_or_a_decoding_step_stays_on_triton():
    query = torch.zeros(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    biased = padded_problem(query, query, "alibi", False, None, 0, 0.0)
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


def assert_replays_from_a_cuda_graph(step):
    """``step()`` run once eagerly on a side stream (the kernels compile there), then captured and replayed: the same
    tensors."""
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


def test_forward_and_backward_replay_from_a_cuda_graph():
    """A training step captured once (FA4 compiles its kernels on the first, eager, call) replays the eager
    results."""
    torch.manual_seed(6)
    query, key, value = (cuda_leaf(2, 4, 512, 64, std=0.35) for _ in range(3))
    grad_out = torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        out = attention(query, key, value)
        return (out, *torch.autograd.grad(out, (query, key, value), grad_out))

    assert_replays_from_a_cuda_graph(step)


# ------------------------------------------------------------------------------------------------------------------
# T5's bias in FAT5's Hopper T5 kernels, through the adapter whatever the routes choose at each length


def t5_leaves(batch_shape, head_dim, heads, dtype=torch.bfloat16):
    std = head_dim**-0.25  # unit-variance scores with T5's scale of 1
    return (cuda_leaf(*batch_shape, std=std, dtype=dtype), cuda_leaf(*batch_shape, std=std, dtype=dtype),
            cuda_leaf(*batch_shape, dtype=dtype), cuda_leaf(32, heads, std=2.0, dtype=torch.float32))


def t5_padded(causal, max_distance=128):
    """``run(backend, q, k, v, table)``: the Hopper T5 kernels for "auto", FAT5's reference for "reference"."""
    def run(backend, q, k, v, table):
        position_bias = PositionBias.t5(table, bidirectional=not causal, max_distance=max_distance)
        if backend == "reference":
            return attention(q, k, v, causal=causal, position_bias=position_bias, backend="reference")
        return fa4_attention(q, k, v, scale=1.0, causal=causal, position_bias=position_bias)
    return run


@pytest.mark.parametrize("dtype, head_dim, causal, length", [
    (torch.bfloat16, 64, False, 1531), (torch.bfloat16, 64, False, 128), (torch.bfloat16, 64, True, 2048),
    (torch.bfloat16, 64, True, 777), (torch.float16, 64, False, 4096), (torch.bfloat16, 128, False, 1100),
    (torch.bfloat16, 128, True, 1024),
])
def test_t5_padded_rows_against_the_fp32_reference(dtype, head_dim, causal, length):
    """The encoder's bidirectional buckets and the decoder's causal ones, the table trained: output, dq, dk, dv and
    the table's gradient; lengths that leave partial tiles, and one whose every tile is near. (Each new dtype, head
    dim or mask compiles two CuTe kernels, seconds each: the cases share them.)"""
    torch.manual_seed(10)
    inputs = t5_leaves((2, 4, length, head_dim), head_dim, 4, dtype)
    check_against_fp32_reference(t5_padded(causal), list(inputs), backend="auto")


@pytest.mark.parametrize("head_dim, causal", [(64, False), (64, True), (128, False)])
def test_t5_packed_rows_against_the_fp32_reference(head_dim, causal):
    """Segments shorter than max_distance, longer than several tiles, of one token and empty: positions restart
    at 0 in each."""
    torch.manual_seed(11)
    heads = 6
    lengths = [1000, 37, 0, 513, 2048, 1, 129]
    cu_seqlens = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    inputs = t5_leaves((sum(lengths), heads, head_dim), head_dim, heads)

    def run(backend, q, k, v, table):
        position_bias = PositionBias.t5(table, bidirectional=not causal)
        if backend == "reference":
            return attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max(lengths), max(lengths), causal=causal,
                                    backend="reference", position_bias=position_bias)
        return fa4_attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max(lengths), max(lengths), scale=1.0,
                                    causal=causal, position_bias=position_bias)

    check_against_fp32_reference(run, list(inputs), backend="auto")


def test_t5_frozen_table():
    """No far sums, no band pass: dq, dk, dv alone."""
    torch.manual_seed(12)
    query, key, value, table = t5_leaves((2, 4, 1500, 64), 64, 4)
    run = t5_padded(causal=False)
    check_against_fp32_reference(lambda backend, q, k, v: run(backend, q, k, v, table.detach()),
                                 [query, key, value], backend="auto")


def test_t5_a_band_narrower_than_a_tile():
    """max_distance 32: tiles that hold both far sides and the band at once."""
    torch.manual_seed(15)
    inputs = t5_leaves((2, 4, 700, 64), 64, 4)
    check_against_fp32_reference(t5_padded(causal=False, max_distance=32), list(inputs), backend="auto")


def test_the_routes_send_long_t5_problems_to_the_hopper_kernels():
    query = torch.zeros(1, 4, 4096, 64, device="cuda", dtype=torch.bfloat16)
    for causal in (False, True):
        problem = padded_problem(query, query, "t5", causal, None, 0, 0.0)
        assert attention_kernel("auto", query, lambda problem=problem: problem) == "fa4"
    prefill = padded_problem(query[:, :, :2048], query, "t5", True, None, 2048, 0.0)
    assert attention_kernel("auto", query, lambda: prefill) == "triton"


def test_t5_table_gradient_varies_only_by_fp32_rounding():
    """The far buckets' sums are added with fp32 atomics in an order that varies: runs agree to rounding."""
    torch.manual_seed(13)
    query, key, value, table = t5_leaves((4, 12, 2048, 64), 64, 12)
    gradients = []
    for _ in range(3):
        out = attention(query, key, value, position_bias=PositionBias.t5(table))
        gradients.append(torch.autograd.grad(out, table, torch.ones_like(out))[0])
    assert all(relative_error(g, gradients[0]) < 1e-5 for g in gradients[1:])


def test_t5_torch_compile_fullgraph():
    """The custom ops: no graph break, the same loss and gradients as eagerly (the pretraining job's compiled step in
    CUDA graphs ran on them: benchmarks/README.md)."""
    torch.manual_seed(14)
    query, key, value, table = t5_leaves((2, 4, 4096, 64), 64, 4)

    def step(q, k, v, t):
        return attention(q * 1.0, k, v, causal=True, position_bias=PositionBias.t5(t, bidirectional=False))

    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(query, key, value, table).float().square().mean()
    grads = torch.autograd.grad(loss, (query, key, value, table))
    expected = step(query, key, value, table).float().square().mean()
    expected_grads = torch.autograd.grad(expected, (query, key, value, table))
    assert torch.allclose(loss, expected, rtol=1e-3)
    assert all(relative_error(g, e) < 1e-3 for g, e in zip(grads, expected_grads))


def test_t5_eager_step_replays_from_a_cuda_graph():
    """A training step captured once (the CuTe kernels compile on the first, eager, call) replays the eager results."""
    torch.manual_seed(16)
    query, key, value, table = t5_leaves((2, 4, 1024, 64), 64, 4)
    grad_out = torch.randn(2, 4, 1024, 64, device="cuda", dtype=torch.bfloat16)

    def training_step():
        out = fa4_attention(query, key, value, scale=1.0, causal=True,
                            position_bias=PositionBias.t5(table, bidirectional=False))
        return (out, *torch.autograd.grad(out, (query, key, value, table), grad_out))

    assert_replays_from_a_cuda_graph(training_step)
