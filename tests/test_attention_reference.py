"""The reference attention against a naive per-query softmax written here from the definition."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fat5.kernels.attention import attention, attention_varlen
from fat5.kernels.position_bias import PositionBias, alibi_slopes, t5_relative_bucket


def hand_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """T5's bucket for one integer distance, in plain Python floats (the test's own truth)."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if relative_position > 0:
            bucket += num_buckets
        distance = abs(relative_position)
    else:
        distance = max(-relative_position, 0)
    max_exact = num_buckets // 2
    if distance < max_exact:
        return bucket + distance
    large = max_exact + int(
        math.log(distance / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    )
    return bucket + min(large, num_buckets - 1)


def naive_attention(q, k, v, scale, causal, keep, offset, bias_of):
    """One query, one head at a time; bias_of(h, i_position, j) gives the additive bias."""
    batch, heads, query_length, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(query_length):
                position = offset + i
                scores, values = [], []
                for j in range(k.shape[2]):
                    if (causal and j > position) or (keep is not None and not keep[b, j]):
                        continue
                    scores.append(scale * float(q[b, h, i].double() @ k[b, h, j].double()) + bias_of(h, position, j))
                    values.append(v[b, h, j].double())
                if scores:
                    weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), dim=0)
                    out[b, h, i] = sum(w * value for w, value in zip(weights, values))
    return out


def test_buckets_match_the_definition_over_every_distance():
    for bidirectional in (True, False):
        for num_buckets, max_distance in ((32, 128), (8, 16), (64, 256), (6, 20)):
            distances = torch.arange(-600, 601)
            buckets = t5_relative_bucket(distances, bidirectional, num_buckets, max_distance)
            expected = [hand_bucket(d, bidirectional, num_buckets, max_distance) for d in distances.tolist()]
            assert buckets.tolist() == expected


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    query_length=st.integers(1, 7),
    key_length=st.integers(1, 9),
    head_dim=st.sampled_from([4, 8]),
    causal=st.booleans(),
    offset=st.integers(0, 5),
    encoding=st.sampled_from(["none", "t5", "alibi", "bias"]),
    padded=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_reference_matches_naive_softmax(
    batch, heads, query_length, key_length, head_dim, causal, offset, encoding, padded, seed
):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, query_length, head_dim, generator=generator)
    k = torch.randn(batch, heads, key_length, head_dim, generator=generator)
    v = torch.randn(batch, heads, key_length, head_dim, generator=generator)
    keep = torch.rand(batch, key_length, generator=generator) > 0.3 if padded else None
    table = torch.randn(8, heads, generator=generator)
    slopes = alibi_slopes(heads)
    full_bias = torch.randn(1, heads, query_length, key_length, generator=generator)
    bidirectional = not causal
    bias_of = {
        "none": lambda h, i, j: 0.0,
        "t5": lambda h, i, j: float(table[hand_bucket(j - i, bidirectional, 8, 12), h]),
        "alibi": lambda h, i, j: -float(slopes[h]) * abs(j - i),
        "bias": lambda h, i, j: float(full_bias[0, h, i - offset, j]),
    }[encoding]
    position_bias = {
        "none": PositionBias.none(),
        "t5": PositionBias.t5(table, bidirectional=bidirectional, max_distance=12),
        "alibi": PositionBias.alibi(slopes),
        "bias": PositionBias.explicit(full_bias),
    }[encoding]
    actual = attention(
        q, k, v, scale=0.5, causal=causal, key_padding_mask=keep, query_offset=offset, position_bias=position_bias,
        backend="reference",
    )
    expected = naive_attention(q, k, v, 0.5, causal, keep, offset, bias_of)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=4),
       causal=st.booleans(), seed=st.integers(0, 2**16))
def test_varlen_equals_each_segment_alone(lengths, causal, seed):
    generator = torch.Generator().manual_seed(seed)
    heads, head_dim = 2, 4
    table = torch.randn(8, heads, generator=generator)
    segments = [
        (torch.randn(lq, heads, head_dim, generator=generator), torch.randn(lk, heads, head_dim, generator=generator),
         torch.randn(lk, heads, head_dim, generator=generator))
        for lq, lk in lengths
    ]
    cu_q = torch.tensor([0] + [sum(lq for lq, _ in lengths[: s + 1]) for s in range(len(lengths))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(lk for _, lk in lengths[: s + 1]) for s in range(len(lengths))], dtype=torch.int32)
    options = {"causal": causal, "position_bias": PositionBias.t5(table, bidirectional=not causal, max_distance=12),
               "backend": "reference"}
    packed = attention_varlen(
        torch.cat([s[0] for s in segments]), torch.cat([s[1] for s in segments]), torch.cat([s[2] for s in segments]),
        cu_q, cu_k, max(lq for lq, _ in lengths), max(lk for _, lk in lengths), **options,
    )
    for index, (q, k, v) in enumerate(segments):
        alone = attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], **options)
        torch.testing.assert_close(packed[cu_q[index] : cu_q[index + 1]], alone[0].transpose(0, 1))


def test_a_query_that_sees_no_key_outputs_zeros():
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    out = attention(q, k, v, key_padding_mask=torch.zeros(1, 3, dtype=torch.bool), backend="reference")
    assert torch.equal(out, torch.zeros_like(out))


def test_bad_arguments_are_named():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="kind must be one of"):
        PositionBias("sinusoidal", q)
    with pytest.raises(ValueError, match="needs a tensor"):
        PositionBias("t5")
    with pytest.raises(ValueError, match=r"\(num_buckets, heads\)"):
        PositionBias.t5(torch.randn(8))
    with pytest.raises(TypeError, match="position_bias must be a PositionBias"):
        attention(q, q, q, position_bias="t5")
    with pytest.raises(ValueError, match="heads or head_dim"):
        attention(q, torch.randn(1, 3, 3, 4), torch.randn(1, 3, 3, 4))
    with pytest.raises(ValueError, match="key_padding_mask"):
        attention(q, q, q, key_padding_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="dtype"):
        attention(q, q.half(), q)
    with pytest.raises(ValueError, match="backend"):
        attention(q, q, q, backend="cuda")
