"""The Triton attention in bf16 at real sizes on a GPU, against the fp32 reference (``pytest -m gpu``)."""

import pytest
import torch
from helpers import GPU_TOLERANCE, check_against_fp32_reference, cuda_leaf, relative_error

from fat5.kernels import attention_triton_config
from fat5.kernels.attention import attention, attention_varlen
from fat5.kernels.attention_triton_t5 import t5_relative_buckets
from fat5.kernels.position_bias import PositionBias, alibi_slopes, t5_relative_bucket

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (64, 256), (32, 64), (24, 100), (128, 1024)])
def test_buckets_match_the_cuda_reference_bit_for_bit(bidirectional, num_buckets, max_distance):
    length = 16384
    buckets, _ = t5_relative_buckets(-length, 2 * length + 1, bidirectional, num_buckets, max_distance, "cuda")
    expected = t5_relative_bucket(torch.arange(-length, length + 1, device="cuda"), bidirectional, num_buckets,
                                  max_distance)
    assert torch.equal(buckets.long(), expected)


@pytest.mark.parametrize(
    "position_encoding, causal, head_dim, query_length, key_length, query_offset",
    [
        ("t5", False, 64, 1531, 1531, 0),
        ("t5", True, 64, 2048, 2048, 0),
        ("t5", False, 128, 1000, 1703, 0),
        ("t5", True, 128, 777, 2100, 1323),
        ("t5", False, 32, 512, 640, 0),
        ("t5", True, 256, 600, 700, 100),
        ("alibi", True, 64, 1500, 1500, 0),
        ("alibi", False, 128, 1024, 1100, 0),
        ("none", False, 128, 999, 2049, 0),
        ("bias", True, 64, 700, 900, 200),
    ],
)
def test_bf16_against_the_fp32_reference(position_encoding, causal, head_dim, query_length, key_length, query_offset):
    torch.manual_seed(0)
    batch, heads = 2, 4
    std = head_dim**-0.25  # unit-variance scores with T5's scale of 1
    query = cuda_leaf(batch, heads, query_length, head_dim, std=std)
    key = cuda_leaf(batch, heads, key_length, head_dim, std=std)
    value = cuda_leaf(batch, heads, key_length, head_dim)
    mask = torch.rand(batch, key_length, device="cuda") > 0.1
    table = cuda_leaf(32, heads, std=2.0, dtype=torch.float32)
    slopes = alibi_slopes(heads).cuda()
    bias = cuda_leaf(1, heads, query_length, key_length, std=2.0, dtype=torch.float32)
    position = {"t5": [table], "bias": [bias]}.get(position_encoding, [])

    def run(backend, q, k, v, *position_tensor):
        position_bias = {
            "t5": lambda: PositionBias.t5(position_tensor[0], bidirectional=not causal),
            "alibi": lambda: PositionBias.alibi(slopes),
            "bias": lambda: PositionBias.explicit(position_tensor[0]),
            "none": PositionBias.none,
        }[position_encoding]()
        return attention(q, k, v, causal=causal, key_padding_mask=mask, query_offset=query_offset,
                         position_bias=position_bias, backend=backend)

    check_against_fp32_reference(run, [query, key, value, *position])


@pytest.mark.parametrize("architecture", ["sm80", "sm90"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_every_architectures_tiles_against_the_fp32_reference(monkeypatch, architecture, head_dim, causal):
    """Each architecture's launch-config table (tile shapes, warps, stages) run on this GPU: the Ampere tables are
    otherwise never executed here. It proves the tiles' logic, not that they fit an A100's shared memory."""
    monkeypatch.setattr(attention_triton_config, "_architecture", lambda device_index: architecture)
    torch.manual_seed(2)
    batch, heads = 2, 3
    query_length, key_length, query_offset = (300, 1100, 800) if causal else (1000, 1100, 0)
    std = head_dim**-0.25
    query = cuda_leaf(batch, heads, query_length, head_dim, std=std)
    key = cuda_leaf(batch, heads, key_length, head_dim, std=std)
    value = cuda_leaf(batch, heads, key_length, head_dim)
    mask = torch.rand(batch, key_length, device="cuda") > 0.1
    table = cuda_leaf(32, heads, std=2.0, dtype=torch.float32)

    def run(backend, q, k, v, position_table):
        return attention(q, k, v, causal=causal, key_padding_mask=mask, query_offset=query_offset,
                         position_bias=PositionBias.t5(position_table, bidirectional=not causal), backend=backend)

    check_against_fp32_reference(run, [query, key, value, table])


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_bf16_several_segments(causal):
    torch.manual_seed(1)
    heads, head_dim = 6, 64
    lengths = [1000, 37, 513, 2048, 1]
    cu_seqlens = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    total = sum(lengths)
    query, key = cuda_leaf(total, heads, head_dim, std=0.35), cuda_leaf(total, heads, head_dim, std=0.35)
    value = cuda_leaf(total, heads, head_dim)
    table = cuda_leaf(32, heads, std=2.0, dtype=torch.float32)

    def run(backend, q, k, v, t):
        return attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max(lengths), max(lengths), causal=causal,
                                position_bias=PositionBias.t5(t, bidirectional=not causal), backend=backend)

    check_against_fp32_reference(run, [query, key, value, table])


@pytest.mark.parametrize("cache", [4096, 32768])
def test_decoding_against_a_long_cache(cache):
    torch.manual_seed(2)
    batch, heads, head_dim = 2, 12, 64
    query = cuda_leaf(batch, heads, 1, head_dim, std=0.35)
    key, value = cuda_leaf(batch, heads, cache, head_dim, std=0.35), cuda_leaf(batch, heads, cache, head_dim)
    table = cuda_leaf(32, heads, std=2.0, dtype=torch.float32)

    def run(backend, q, k, v, t):
        return attention(q, k, v, causal=True, query_offset=cache - 1,
                         position_bias=PositionBias.t5(t, bidirectional=False), backend=backend)

    check_against_fp32_reference(run, [query, key, value, table])


def test_one_cuda_graph_decodes_every_position():
    """A decoding step captured once, the position a device tensor advanced between replays (a static KV cache)."""
    torch.manual_seed(7)
    batch, heads, buffer, head_dim = 4, 12, 160, 64
    key, value = (torch.randn(batch, heads, buffer, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.randn(32, heads, device="cuda")
    query = torch.randn(batch, heads, 1, head_dim, device="cuda", dtype=torch.bfloat16)
    position = torch.zeros(1, dtype=torch.long, device="cuda")
    options = {"causal": True, "position_bias": PositionBias.t5(table, bidirectional=False)}

    def step():
        return attention(query, key, value, query_offset=position, **options)

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compiles the kernel outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for current in (0, 1, 63, 64, 100, buffer - 1):
            position.fill_(current)
            graph.replay()
            expected = attention(query.float(), key.float(), value.float(), query_offset=current, backend="reference",
                                 **options)
            assert relative_error(out, expected) < GPU_TOLERANCE, current


@pytest.mark.parametrize("deterministic_algorithms", [False, True])
def test_gradients_are_bitwise_reproducible(deterministic_algorithms):
    """dk, dv and the table gradient never depend on scheduling; dq does (fp32 atomics, as FlashAttention-2)
    unless PyTorch is asked for deterministic algorithms, which gives dq its own kernel."""
    torch.manual_seed(3)
    query, key, value = (cuda_leaf(2, 12, 2048, 64, std=0.35) for _ in range(3))
    table = cuda_leaf(32, 12, dtype=torch.float32)
    torch.use_deterministic_algorithms(deterministic_algorithms)
    try:
        grads = []
        for _ in range(3):
            out = attention(query, key, value, position_bias=PositionBias.t5(table), backend="triton")
            grads.append(torch.autograd.grad(out, (query, key, value, table), torch.ones_like(out)))
    finally:
        torch.use_deterministic_algorithms(False)
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0][1:], other[1:]))
        if deterministic_algorithms:
            assert torch.equal(grads[0][0], other[0])
        else:
            assert relative_error(grads[0][0], other[0]) < 1e-3


def test_fp32_inputs_are_accepted():
    torch.manual_seed(4)
    query, key, value = (cuda_leaf(1, 2, 300, 64, std=0.35, dtype=torch.float32) for _ in range(3))
    table = cuda_leaf(32, 2, dtype=torch.float32)

    def run(backend, q, k, v, t):
        return attention(q, k, v, position_bias=PositionBias.t5(t), backend=backend)

    errors = check_against_fp32_reference(run, [query, key, value, table], tolerance=1e-4)
    assert max(errors) <= 1e-4


def test_torch_compile_fullgraph_with_inductor():
    torch.manual_seed(5)
    query, key, value = (cuda_leaf(2, 4, 1024, 64, std=0.35) for _ in range(3))
    table = cuda_leaf(32, 4, dtype=torch.float32)

    def step(q, k, v, t):
        out = attention(q * 1.0, k, v, position_bias=PositionBias.t5(t, bidirectional=False), causal=True,
                        backend="triton")
        return out.float().square().mean()

    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(query, key, value, table)
    grads = torch.autograd.grad(loss, (query, key, value, table))
    expected = step(query, key, value, table)
    expected_grads = torch.autograd.grad(expected, (query, key, value, table))
    assert torch.allclose(loss, expected, rtol=1e-3)
    assert all(relative_error(g, e) < 1e-3 for g, e in zip(grads, expected_grads))
