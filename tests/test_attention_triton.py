"""The Triton attention kernels against an fp32 PyTorch truth, on tiny shapes (TRITON_INTERPRET=1 on CPU).

The truth is written here, independently of fat5's reference: the scores are materialised with the T5 bias built
from transformers' own ``T5Attention._relative_position_bucket``.
"""

import math

import pytest
import torch
from helpers import relative_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.models.t5.modeling_t5 import T5Attention

from fat5.kernels import attention_triton_config, attention_triton_launch, attention_triton_ops, attention_triton_t5
from fat5.kernels.attention import attention, attention_varlen
from fat5.kernels.position_bias import PositionBias

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HYPOTHESIS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def hf_bucket(relative_position, bidirectional, num_buckets, max_distance):
    return T5Attention._relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance)


def truth(query, key, value, *, scale=1.0, causal=False, key_padding_mask=None, query_offset=0,
          position_encoding="none", table=None, bidirectional=True, num_buckets=32, max_distance=128,
          slopes=None, bias=None):
    """fp32 attention with every score materialised: the definition the kernels must reproduce."""
    query, key, value = query.float(), key.float(), value.float()
    query_length, key_length = query.shape[-2], key.shape[-2]
    scores = scale * query @ key.transpose(-1, -2)
    relative = torch.arange(key_length, device=query.device)[None, :] - (
        torch.arange(query_length, device=query.device)[:, None] + query_offset
    )
    if position_encoding == "t5":
        scores = scores + table.float()[hf_bucket(relative, bidirectional, num_buckets, max_distance)].permute(2, 0, 1)
    elif position_encoding == "alibi":
        scores = scores - slopes.float()[:, None, None] * relative.abs().float()
    elif position_encoding == "bias":
        scores = scores + bias.float()
    visible = torch.ones_like(scores, dtype=torch.bool)
    if causal:
        visible = visible & (relative <= 0)
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    probabilities = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows without a visible key give 0
    return probabilities @ value


def position_bias_of(position_encoding, table=None, slopes=None, bias=None, bidirectional=True, max_distance=128):
    """The kernels' description of what ``truth`` adds for the same keyword arguments."""
    if position_encoding == "t5":
        return PositionBias.t5(table, bidirectional=bidirectional, max_distance=max_distance)
    if position_encoding == "alibi":
        return PositionBias.alibi(slopes)
    if position_encoding == "bias":
        return PositionBias.explicit(bias)
    return PositionBias.none()


def _split_position_options(options):
    """(PositionBias, the other attention options) from ``truth``'s keyword arguments (num_buckets is the table's)."""
    options = dict(options)
    options.pop("num_buckets", None)
    position = {name: options.pop(name) for name in ("position_encoding", "table", "slopes", "bias", "bidirectional",
                                                     "max_distance") if name in options}
    return position_bias_of(**position), options


def fat5_attention(q, k, v, **truth_options):
    """fat5's Triton attention called with ``truth``'s keyword arguments."""
    position_bias, options = _split_position_options(truth_options)
    return attention(q, k, v, position_bias=position_bias, backend="triton", **options)


def fat5_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **truth_options):
    position_bias, options = _split_position_options(truth_options)
    return attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, position_bias=position_bias, backend="triton",
                            **options)


def make_leaf(*shape, dtype=torch.float32, transposed=False):
    """A random leaf tensor; ``transposed`` gives (B, H, L, D) as a view of a (B, L, H, D) buffer, as models do."""
    if transposed:
        buffer = torch.randn(shape[0], shape[2], shape[1], shape[3], device=DEVICE, dtype=dtype)
        return buffer.transpose(1, 2).requires_grad_()
    return torch.randn(*shape, device=DEVICE, dtype=dtype).requires_grad_()


def compare(inputs, kernel_fn, truth_fn, out_tolerance, grad_tolerance):
    out = kernel_fn(*inputs)
    expected = truth_fn(*inputs)
    assert torch.isfinite(out).all()
    assert relative_error(out, expected) <= out_tolerance
    grad_out = torch.randn_like(out)
    differentiable = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(out, differentiable, grad_out)
    expected_grads = torch.autograd.grad(expected, differentiable, grad_out.float())
    for index, (grad, expected_grad) in enumerate(zip(grads, expected_grads)):
        assert grad.shape == expected_grad.shape and grad.dtype == differentiable[index].dtype
        assert torch.isfinite(grad).all()
        # sums that cancel to ~0 (a table row whose keys all share one bucket: softmax rows sum to zero) need a
        # floor besides the relative tolerance
        difference = (grad.float() - expected_grad.float()).norm()
        floor = 1e-5 * expected_grad.numel() ** 0.5
        assert difference <= grad_tolerance * expected_grad.float().norm() + floor, f"gradient {index}"


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(
    "num_buckets, max_distance", [(32, 128), (64, 256), (16, 64), (32, 64), (24, 100), (8, 9), (128, 1024), (32, 200)]
)
def test_t5_buckets_match_transformers_bit_for_bit(bidirectional, num_buckets, max_distance):
    length = 2 * max_distance + 40
    buckets, _ = attention_triton_t5.t5_relative_buckets(
        -length, 2 * length + 1, bidirectional, num_buckets, max_distance, DEVICE
    )
    relative = torch.arange(-length, length + 1, device=DEVICE)
    expected = hf_bucket(relative, bidirectional, num_buckets, max_distance)
    assert torch.equal(buckets.long(), expected)
    # the kernels clamp relative positions to +-(max_distance + 1): everything beyond shares that bucket
    clamped = relative.clamp(-(max_distance + 1), max_distance + 1)
    assert torch.equal(hf_bucket(clamped, bidirectional, num_buckets, max_distance), expected)


@pytest.mark.parametrize("position_encoding", ["none", "t5", "alibi", "bias"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("query_length", [37, 32])  # 32: whole query blocks, the backward's unmasked row loads
def test_every_encoding_with_padding_and_offset(position_encoding, causal, query_length):
    torch.manual_seed(0)
    batch, heads, key_length, head_dim = 2, 2, 45, 16
    query, key, value = (make_leaf(batch, heads, n, head_dim) for n in (query_length, key_length, key_length))
    table = torch.randn(8, heads, device=DEVICE, requires_grad=True)
    slopes = torch.rand(heads, device=DEVICE)
    bias = torch.randn(1, heads, query_length, key_length, device=DEVICE, requires_grad=True)
    mask = torch.rand(batch, key_length, device=DEVICE) > 0.25
    options = {"scale": 0.3, "causal": causal, "key_padding_mask": mask, "query_offset": 5, "num_buckets": 8,
               "max_distance": 9}
    position = {"t5": table, "bias": bias}.get(position_encoding)
    inputs = (query, key, value) + ((position,) if position is not None else ())

    def kernel(q, k, v, *position_tensor):
        return fat5_attention(q, k, v, position_encoding=position_encoding, table=table, slopes=slopes, bias=bias,
                              **options)

    def reference(q, k, v, *position_tensor):
        return truth(q, k, v, position_encoding=position_encoding, table=table, slopes=slopes, bias=bias, **options)

    compare(inputs, kernel, reference, 1e-4, 1e-3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("query_length", [64, 53])
def test_t5_table_gradient_with_key_tiles_wider_than_query_tiles(monkeypatch, causal, query_length):
    """The GPU's head-dim-128 backward runs 64 x 128 tiles: each near tile's skewed reduction then wraps rows of
    unequal length. The same shape of tiles, scaled down."""
    # the interpreter's one-warp tiles, or a GPU shape the compiler takes (Triton 3.6 fails on one warp there)
    tiles = (attention_triton_config.LaunchConfig(16, 32, 1, 1) if DEVICE == "cpu"
             else attention_triton_config.LaunchConfig(32, 64, 4, 2))
    monkeypatch.setitem(attention_triton_config.CONFIG_OVERRIDES, "dkdv", tiles)
    torch.manual_seed(2)
    batch, heads, key_length, head_dim = 2, 2, 70, 16
    query, key, value = (make_leaf(batch, heads, n, head_dim) for n in (query_length, key_length, key_length))
    table = torch.randn(8, heads, device=DEVICE, requires_grad=True)
    mask = torch.rand(batch, key_length, device=DEVICE) > 0.2
    # max_distance 8: some tiles lie wholly beyond it (far), the others are near or masked
    options = {"causal": causal, "key_padding_mask": mask, "query_offset": 3, "num_buckets": 8, "max_distance": 8}

    def kernel(q, k, v, position_table):
        return fat5_attention(q, k, v, position_encoding="t5", table=position_table, **options)

    def reference(q, k, v, position_table):
        return truth(q, k, v, position_encoding="t5", table=position_table, **options)

    compare((query, key, value, table), kernel, reference, 1e-4, 1e-3)



@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_t5_band_table_gradient_plus_the_far_sums_is_the_table_gradient(causal, packed):
    """The Hopper T5 route's table gradient: the band |rel| <= max_distance summed here, the far sums (taken by the
    route's backward, here from the truth) added to the end buckets, equals the gradient of the whole table."""
    torch.manual_seed(4)
    heads, head_dim, max_distance = 2, 16, 8
    lengths = [45, 9, 33] if packed else [41, 41]
    position = PositionBias.t5(torch.randn(8, heads, device=DEVICE), bidirectional=not causal,
                               max_distance=max_distance)
    segments = []
    for length in lengths:  # each segment's truth: output, log-sum-exp, score gradient and table gradient
        q, k, v = (torch.randn(1, heads, length, head_dim, device=DEVICE) for _ in range(3))
        relative = torch.arange(length, device=DEVICE)[None, :] - torch.arange(length, device=DEVICE)[:, None]
        bias = position.tensor[hf_bucket(relative, not causal, 8, max_distance)].permute(2, 0, 1).requires_grad_()
        scores = (q @ k.transpose(-1, -2) + bias).masked_fill(causal & (relative > 0), float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        grad_out = torch.randn_like(out)
        (score_grad,) = torch.autograd.grad(out, bias, grad_out)
        segments.append((q, k, v, out.detach(), torch.logsumexp(scores, dim=-1).detach() / math.log(2), grad_out,
                         score_grad, relative))
    # what the backward that ran elsewhere summed: the far ends of the row of relative positions
    far_sums = torch.zeros(heads, 2 * max_distance + 3, device=DEVICE)
    far_sums[:, 0] = sum(g[:, r < -max_distance].sum(dim=-1) for *_, g, r in segments)
    far_sums[:, -1] = sum(g[:, r > max_distance].sum(dim=-1) for *_, g, r in segments)
    table_truth = sum(torch.zeros(8, heads, device=DEVICE).index_put_(
        (hf_bucket(r, not causal, 8, max_distance).flatten()[:, None], torch.arange(heads, device=DEVICE)[None, :]),
        g.flatten(1).T, accumulate=True) for *_, g, r in segments)
    if packed:
        q, k, v, out, grad_out = (torch.cat([s[index][0].transpose(0, 1) for s in segments]) for index in (0, 1, 2,
                                                                                                         3, 5))
        lse = torch.cat([s[4][0] for s in segments], dim=1)
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0)], dtype=torch.int32, device=DEVICE)
        packing = (cu_seqlens, cu_seqlens, max(lengths), max(lengths))
    else:
        q, k, v, out, lse, grad_out = (torch.cat([s[index] for s in segments]) for index in range(6))
        packing = (None, None, lengths[0], lengths[0])
    table_grad = attention_triton_launch.t5_band_table_gradient(grad_out, q, k, v, out, lse, position, *packing, 1.0,
                                                                causal, far_sums)
    assert relative_error(table_grad, table_truth) <= 1e-5


@st.composite
def dense_problems(draw):
    position_encoding = draw(st.sampled_from(["none", "t5", "t5", "alibi", "bias"]))
    heads = draw(st.integers(1, 2))
    query_length, key_length = draw(st.integers(1, 40)), draw(st.integers(1, 48))
    bias_shape = draw(st.sampled_from([(1, heads, query_length, key_length), (query_length, key_length),
                                       (2, 1, query_length, key_length)]))
    return {
        "position_encoding": position_encoding,
        "batch": 2 if bias_shape[0] == 2 else draw(st.integers(1, 2)),
        "heads": heads,
        "query_length": query_length,
        "key_length": key_length,
        "head_dim": draw(st.sampled_from([16, 32, 24])),
        "causal": draw(st.booleans()),
        "query_offset": draw(st.sampled_from([0, 0, 3, key_length - query_length, -2])),
        "padding": draw(st.booleans()),
        "bidirectional": draw(st.booleans()),
        "max_distance": draw(st.integers(5, 24)),
        "bias_shape": bias_shape,
        "transposed": draw(st.booleans()),
        "scale": draw(st.sampled_from([1.0, 0.25])),
    }


@HYPOTHESIS
@given(problem=dense_problems())
def test_dense_random_shapes(problem):
    torch.manual_seed(1)
    p = problem
    query = make_leaf(p["batch"], p["heads"], p["query_length"], p["head_dim"], transposed=p["transposed"])
    key, value = (make_leaf(p["batch"], p["heads"], p["key_length"], p["head_dim"], transposed=p["transposed"])
                  for _ in range(2))
    table = torch.randn(8, p["heads"], device=DEVICE, requires_grad=True)
    slopes = torch.rand(p["heads"], device=DEVICE)
    bias = torch.randn(p["bias_shape"], device=DEVICE, requires_grad=True)
    mask = (torch.rand(p["batch"], p["key_length"], device=DEVICE) > 0.3) if p["padding"] else None
    options = {"scale": p["scale"], "causal": p["causal"], "key_padding_mask": mask, "query_offset": p["query_offset"],
                   "bidirectional": p["bidirectional"], "num_buckets": 8, "max_distance": p["max_distance"]}
    position = {"t5": table, "bias": bias}.get(p["position_encoding"])
    inputs = (query, key, value) + ((position,) if position is not None else ())

    def kernel(q, k, v, *position_tensor):
        return fat5_attention(q, k, v, position_encoding=p["position_encoding"], table=table, slopes=slopes, bias=bias,
                              **options)

    def reference(q, k, v, *position_tensor):
        return truth(q, k, v, position_encoding=p["position_encoding"], table=table, slopes=slopes, bias=bias,
                     **options)

    compare(inputs, kernel, reference, 1e-4, 1e-3)


@HYPOTHESIS
@given(
    lengths=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 34)), min_size=1, max_size=4),
    position_encoding=st.sampled_from(["none", "t5", "alibi", "bias"]),
    causal=st.booleans(),
    query_offset=st.sampled_from([0, 2]),
    bidirectional=st.booleans(),
)
def test_varlen_random_segments(lengths, position_encoding, causal, query_offset, bidirectional):
    torch.manual_seed(2)
    heads, head_dim = 2, 16
    query_lengths, key_lengths = [q for q, _ in lengths], [k for _, k in lengths]
    max_q, max_k = max(max(query_lengths), 1), max(key_lengths)
    cu_q = torch.tensor([0] + list(torch.tensor(query_lengths).cumsum(0)), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + list(torch.tensor(key_lengths).cumsum(0)), dtype=torch.int32, device=DEVICE)
    query = make_leaf(sum(query_lengths), heads, head_dim)
    key, value = make_leaf(sum(key_lengths), heads, head_dim), make_leaf(sum(key_lengths), heads, head_dim)
    table = torch.randn(8, heads, device=DEVICE, requires_grad=True)
    slopes = torch.rand(heads, device=DEVICE)
    bias = torch.randn(heads, max_q, max_k, device=DEVICE, requires_grad=True)
    options = {"causal": causal, "query_offset": query_offset, "bidirectional": bidirectional, "num_buckets": 8,
               "max_distance": 7}
    position = {"t5": table, "bias": bias}.get(position_encoding)
    inputs = (query, key, value) + ((position,) if position is not None else ())

    def kernel(q, k, v, *position_tensor):
        return fat5_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, position_encoding=position_encoding,
                                     table=table, slopes=slopes, bias=bias, **options)

    def reference(q, k, v, *position_tensor):
        outputs = []
        for segment, (query_length, key_length) in enumerate(lengths):
            qs = q[cu_q[segment]: cu_q[segment + 1]].transpose(0, 1)[None]
            ks = k[cu_k[segment]: cu_k[segment + 1]].transpose(0, 1)[None]
            vs = v[cu_k[segment]: cu_k[segment + 1]].transpose(0, 1)[None]
            outputs.append(truth(qs, ks, vs, position_encoding=position_encoding, table=table, slopes=slopes,
                                 bias=bias[:, :query_length, :key_length], **options)[0].transpose(0, 1))
        return torch.cat(outputs)

    if sum(query_lengths) == 0:
        assert kernel(*inputs).shape == (0, heads, head_dim)
        return
    compare(inputs, kernel, reference, 1e-4, 1e-3)


class _Spy:
    """Records the launches of a Triton kernel (to prove that a code path ran)."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("query_length", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decoding_splits_the_cache(monkeypatch, query_length, dtype):
    """One or a few queries against a long cache: the keys are split over programs and the partials merged."""
    spy = _Spy(attention_triton_launch._split_combine_kernel)
    monkeypatch.setattr(attention_triton_launch, "_split_combine_kernel", spy)
    monkeypatch.setattr(attention_triton_launch, "kernel_multiprocessors", lambda device: 16)
    torch.manual_seed(3)
    # long enough to split into 2-block splits: 10 of the interpreter's 16-key tiles, 10 of the GPU's 64-key decoding
    # tiles (150 keys made 3 blocks there: no split); keys 64 to 95 (the interpreter's third split) are all padding
    batch, heads, head_dim = 1, 2, 32
    cache, padding = (600, slice(40, 300)) if DEVICE == "cuda" else (160, slice(40, 100))
    query = make_leaf(batch, heads, query_length, head_dim, dtype=dtype)
    key = make_leaf(batch, heads, cache, head_dim, dtype=dtype)
    value = make_leaf(batch, heads, cache, head_dim, dtype=dtype)
    table = torch.randn(32, heads, device=DEVICE, requires_grad=True)
    mask = torch.ones(batch, cache, dtype=torch.bool, device=DEVICE)
    mask[:, padding] = False  # whole splits see only padding
    options = {"causal": True, "query_offset": cache - query_length, "key_padding_mask": mask, "bidirectional": False,
                   "num_buckets": 32, "max_distance": 128}

    def kernel(q, k, v, t):
        return fat5_attention(q, k, v, position_encoding="t5", table=t, **options)

    def reference(q, k, v, t):
        return truth(q, k, v, position_encoding="t5", table=t, **options)

    tolerance = 1e-4 if dtype == torch.float32 else 5e-3
    compare((query, key, value, table), kernel, reference, tolerance, 10 * tolerance)
    assert spy.grids and spy.grids[0][0] == batch * heads


def _t5_output_and_gradients(query, key, value, table, grad_out, varlen, causal):
    """(out, dq, dk, dv, and the table's gradient where it takes one) of one T5 call through the public entry."""
    options = {"position_encoding": "t5", "table": table, "causal": causal, "bidirectional": not causal,
               "max_distance": 12}
    if varlen:
        cu_seqlens, max_length = varlen
        out = fat5_attention_varlen(query, key, value, cu_seqlens, cu_seqlens, max_length, max_length, **options)
    else:
        out = fat5_attention(query, key, value, **options)
    inputs = (query, key, value, table) if table.requires_grad else (query, key, value)
    return (out.detach(), *torch.autograd.grad(out, inputs, grad_out))


@pytest.mark.parametrize(
    "layout, deterministic_algorithms, dtype, wide_tiles",  # deterministic algorithms: dq by its own kernel
    [(layout, deterministic, torch.float32, False) for layout in ("dense", "varlen") for deterministic in (False, True)]
    + [("dense", False, torch.float16, False)]
    + [(layout, False, torch.float32, True) for layout in ("dense", "varlen")],
)
def test_t5_bias_bank_matches_the_gather_bit_for_bit(monkeypatch, layout, deterministic_algorithms, dtype, wide_tiles):
    """The dk/dv kernel's near tiles reading their bias whole from the bank give every output and gradient of the
    per-score gather exactly (a frozen table, a non-causal call), with far tiles on both sides of the near ones
    (max_distance 12, 16 x 16 tiles), partial blocks and varlen segments of odd lengths. ``wide_tiles``: key tiles
    twice the query tiles (as the GPU's head-dim-128 dk/dv kernel)."""
    if wide_tiles:  # the interpreter's one-warp tiles, or a GPU shape the compiler takes
        queries, keys, warps = (16, 32, 1) if DEVICE == "cpu" else (32, 64, 4)
        monkeypatch.setitem(attention_triton_config.CONFIG_OVERRIDES, "dkdv", attention_triton_config.LaunchConfig(
            queries, keys, warps, 1))
    torch.manual_seed(9)
    heads, head_dim = 2, 16
    if layout == "varlen":
        lengths = [37, 70, 5, 53]
        varlen = (torch.tensor([0, *torch.tensor(lengths).cumsum(0)], dtype=torch.int32, device=DEVICE), max(lengths))
        query, key, value = (make_leaf(sum(lengths), heads, head_dim, dtype=dtype) for _ in range(3))
    else:
        varlen = None
        query = make_leaf(2, heads, 64, head_dim, dtype=dtype)
        key, value = make_leaf(2, heads, 75, head_dim, dtype=dtype), make_leaf(2, heads, 75, head_dim, dtype=dtype)
    frozen = torch.randn(8, heads, device=DEVICE)
    grad_out = torch.randn_like(query)
    spy = _Spy(attention_triton_t5._t5_bias_bank_kernel)
    monkeypatch.setattr(attention_triton_t5, "_t5_bias_bank_kernel", spy)
    results = {}
    torch.use_deterministic_algorithms(deterministic_algorithms)
    try:
        for bank in (True, False):
            monkeypatch.setattr(attention_triton_config, "T5_BIAS_BANK", bank)
            results[bank] = _t5_output_and_gradients(query, key, value, frozen, grad_out, varlen, causal=False)
        assert len(spy.grids) == 1  # the bank path's dk/dv kernel
    finally:
        torch.use_deterministic_algorithms(False)
    for name, with_bank, gathered in zip(("out", "dq", "dk", "dv"), results[True], results[False]):
        if name == "dq" and DEVICE == "cuda" and not deterministic_algorithms:
            # the dk/dv kernel adds dq by atomics, in an order that varies from run to run on a GPU
            torch.testing.assert_close(with_bank, gathered)
        else:
            assert torch.equal(with_bank, gathered), name


@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_t5_bias_bank_is_made_for_a_frozen_table_in_a_non_causal_call_only(monkeypatch, layout):
    """A trained table (the near tiles also sum its gradient) and a causal call gather their bias per score. Which
    path a call takes does not depend on its size: a few tokens tell."""
    torch.manual_seed(9)
    heads, head_dim, length = 2, 16, 20
    if layout == "varlen":
        varlen = (torch.tensor([0, 7, length], dtype=torch.int32, device=DEVICE), length - 7)
        query, key, value = (make_leaf(length, heads, head_dim) for _ in range(3))
    else:
        varlen = None
        query, key, value = (make_leaf(1, heads, length, head_dim) for _ in range(3))
    frozen = torch.randn(8, heads, device=DEVICE)
    grad_out = torch.randn_like(query)
    spy = _Spy(attention_triton_t5._t5_bias_bank_kernel)
    monkeypatch.setattr(attention_triton_t5, "_t5_bias_bank_kernel", spy)
    _t5_output_and_gradients(query, key, value, frozen, grad_out, varlen, causal=False)
    assert len(spy.grids) == 1  # the frozen table in a non-causal call: the bank
    _t5_output_and_gradients(query, key, value, frozen.clone().requires_grad_(), grad_out, varlen, causal=False)
    _t5_output_and_gradients(query, key, value, frozen, grad_out, varlen, causal=True)
    assert len(spy.grids) == 1


def test_t5_bias_bank_holds_the_row_values_of_each_diagonal_offset():
    """Each bank tile (the dk/dv kernel's (keys, queries) tiles) against T5's bias written out per score, for every
    diagonal offset of the near loop."""
    rows = torch.randn(3, 2 * 12 + 3, device=DEVICE)
    for tile_rows, tile_columns in ((32, 16), (16, 16)):
        bank, left_tiles = attention_triton_t5.t5_bias_bank(rows, tile_rows, tile_columns, 12)
        assert left_tiles == 1  # ceil(12 / 16): the near blocks start at most one block before the row block
        assert bank.shape == (3, 1 + math.ceil((tile_rows + 12) / tile_columns), tile_rows, tile_columns)
        for tile in range(bank.shape[1]):
            for i in range(tile_rows):
                for j in range(tile_columns):
                    relative = i - j - (tile - left_tiles) * tile_columns
                    assert torch.equal(bank[:, tile, i, j], rows[:, min(max(relative, -13), 13) + 13])


def test_rows_without_visible_keys_give_zeros():
    torch.manual_seed(4)
    query, key, value = make_leaf(2, 2, 20, 16), make_leaf(2, 2, 25, 16), make_leaf(2, 2, 25, 16)
    mask = torch.ones(2, 25, dtype=torch.bool, device=DEVICE)
    mask[1] = False
    out = attention(query, key, value, causal=True, query_offset=-5, key_padding_mask=mask, backend="triton")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0, :, :5], torch.zeros_like(out[0, :, :5]))  # positions -5..-1 precede every key
    grads = torch.autograd.grad(out.sum(), (query, key, value))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("deterministic_algorithms", [False, True])
def test_table_gradient_is_deterministic(deterministic_algorithms):
    """The table gradient never depends on scheduling; with deterministic algorithms dq has its own kernel."""
    torch.use_deterministic_algorithms(deterministic_algorithms)
    try:
        _check_table_gradient_is_deterministic()
    finally:
        torch.use_deterministic_algorithms(False)


def _check_table_gradient_is_deterministic():
    torch.manual_seed(5)
    query, key, value = make_leaf(2, 2, 40, 16), make_leaf(2, 2, 40, 16), make_leaf(2, 2, 40, 16)
    table = torch.randn(8, 2, device=DEVICE, requires_grad=True)
    grads = []
    for _ in range(2):
        out = fat5_attention(query, key, value, position_encoding="t5", table=table, max_distance=6)
        grads.append(torch.autograd.grad(out.square().sum(), (query, table)))
    assert torch.equal(grads[0][1], grads[1][1])
    expected = truth(query, key, value, position_encoding="t5", table=table, num_buckets=8, max_distance=6)
    expected_grads = torch.autograd.grad(expected.square().sum(), (query, table))
    assert all(relative_error(g, e) < 1e-4 for g, e in zip(grads[0], expected_grads))


@pytest.mark.parametrize("position_encoding", ["none", "t5", "alibi"])
@pytest.mark.parametrize("query_length", [1, 3])
def test_query_offset_read_from_a_tensor(position_encoding, query_length):
    """Decoding into a static cache: the offset is a device tensor the kernel reads, the keys the whole buffer."""
    torch.manual_seed(8)
    heads, buffer, position = 2, 40, 17
    query = torch.randn(2, heads, query_length, 16, device=DEVICE)
    key, value = torch.randn(2, heads, buffer, 16, device=DEVICE), torch.randn(2, heads, buffer, 16, device=DEVICE)
    key[:, :, position + query_length :] = 0.0  # the unwritten slots of a static cache
    position_arguments = {
        "none": {},
        "t5": {"table": torch.randn(8, heads, device=DEVICE), "num_buckets": 8, "max_distance": 6,
               "bidirectional": False},
        "alibi": {"slopes": torch.tensor([0.5, 0.25], device=DEVICE)},
    }[position_encoding]
    offset = torch.tensor([position], device=DEVICE)
    with torch.no_grad():
        out = fat5_attention(query, key, value, causal=True, query_offset=offset, position_encoding=position_encoding,
                             **position_arguments)
    expected = truth(query, key, value, causal=True, query_offset=position, position_encoding=position_encoding,
                     **position_arguments)
    assert relative_error(out, expected) < 1e-5
    # with autograd recording, the offset is read back to the host: the backward kernels take an int
    leaves = [tensor.clone().requires_grad_() for tensor in (query, key, value)]
    recorded = fat5_attention(*leaves, causal=True, query_offset=offset, position_encoding=position_encoding,
                              **position_arguments)
    assert relative_error(recorded, expected) < 1e-5
    assert all(torch.isfinite(grad).all() for grad in torch.autograd.grad(recorded.sum(), leaves))


@pytest.mark.parametrize("offset", [torch.tensor([1.0]), torch.tensor([1, 2]), torch.tensor(True)])
def test_bad_query_offset_tensors_are_refused(offset):
    query = torch.randn(1, 2, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="query_offset"):
        attention(query, query, query, query_offset=offset.to(DEVICE), backend="triton")


def test_torch_compile_fullgraph_traces_through_attention():
    torch.manual_seed(6)
    query, key, value = make_leaf(1, 2, 24, 16), make_leaf(1, 2, 24, 16), make_leaf(1, 2, 24, 16)
    table = torch.randn(8, 2, device=DEVICE, requires_grad=True)

    def step(q, k, v, t):
        out = attention(q, k, v, position_bias=PositionBias.t5(t, max_distance=6), causal=True,
                        backend="triton")
        return (out * out).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    loss = compiled(query, key, value, table)
    grads = torch.autograd.grad(loss, (query, key, value, table))
    expected_loss = step(query, key, value, table)
    expected_grads = torch.autograd.grad(expected_loss, (query, key, value, table))
    assert torch.allclose(loss, expected_loss, rtol=1e-5)
    for grad, expected in zip(grads, expected_grads):
        assert torch.allclose(grad, expected, rtol=1e-4, atol=1e-5)


def test_custom_ops_pass_opcheck():
    torch.manual_seed(7)
    query, key, value = (torch.randn(1, 2, 20, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    table = torch.randn(8, 2, device=DEVICE, requires_grad=True)
    arguments = (query, key, value, None, table, None, None, 20, 20, 1.0, True, 0, "t5", True, 8, 6, None)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(attention_triton_ops.attention_forward_op, arguments, test_utils=checks)
    out, lse = attention_triton_ops.attention_forward_op(*arguments)
    backward_arguments = (torch.randn_like(out), query, key, value, out, lse, *arguments[3:-1], True)
    torch.library.opcheck(attention_triton_ops.attention_backward_op, backward_arguments, test_utils=checks)
    with torch.no_grad():  # the decoding form: the offset as a tensor the kernel reads
        decoding = (query[:, :, :1].detach(), key.detach(), value.detach(), *arguments[3:11], 0, *arguments[12:16],
                    torch.tensor([19], device=DEVICE))
        torch.library.opcheck(attention_triton_ops.attention_forward_op, decoding,
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize(
    "arguments, error",
    [
        ({"dropout_p": 0.1}, ValueError),
        ({"position_bias": PositionBias.t5(torch.zeros(8, 3))}, ValueError),
        ({"position_bias": PositionBias.t5(torch.zeros(4, 2), max_distance=1)}, ValueError),
        ({"position_bias": PositionBias.alibi(torch.zeros(3))}, ValueError),
        ({"position_bias": PositionBias.explicit(torch.zeros(3, 1, 1))}, ValueError),
        ({"key_padding_mask": torch.ones(1, 8)}, TypeError),
    ],
)
def test_bad_arguments_raise_clear_errors(arguments, error):
    query = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(error):
        attention(query, query, query, backend="triton", **arguments)


def test_unsupported_dtype_and_head_dim():
    with pytest.raises(TypeError, match="float16, bfloat16 and float32"):
        attention(*(torch.zeros(1, 1, 4, 16, dtype=torch.float64, device=DEVICE),) * 3, backend="triton")
    with pytest.raises(ValueError, match="head_dim up to"):
        attention(*(torch.zeros(1, 1, 4, 320, device=DEVICE),) * 3, backend="triton")


def test_head_dim_is_padded_to_the_kernel_width():
    torch.manual_seed(8)
    query, key, value = make_leaf(1, 2, 19, 8), make_leaf(1, 2, 23, 8), make_leaf(1, 2, 23, 8)
    compare((query, key, value), lambda q, k, v: attention(q, k, v, scale=1 / math.sqrt(8), backend="triton"),
            lambda q, k, v: truth(q, k, v, scale=1 / math.sqrt(8)), 1e-4, 1e-3)
