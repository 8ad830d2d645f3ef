"""The attention routing table (which kernel serves which problem) and what the FA4 route relies on, on the CPU:
packed rows cut into cu_seqlens as the segment ids say, and FA4's bottom-right causal diagonal equal to FAT5's
positions wherever the routes call a causal problem aligned."""

import dataclasses
import importlib.metadata

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fat5.kernels import attention as attention_module
from fat5.kernels import routes
from fat5.kernels.attention import attention, attention_varlen
from fat5.kernels.routes import (
    ATTENTION_ROUTES,
    MASKINGS,
    POSITIONS,
    AttentionProblem,
    attention_kernel,
    forced_kernel_from,
    packed_problem,
    padded_problem,
    table_kernel,
)
from fat5.token_layout import TokenLayout

HOPPER = (9, 0)
FA4_PROBLEM = AttentionProblem(HOPPER, torch.bfloat16, 64, "none", "none", False, False, 1024, 1024)


def every_kernel(kernel):
    return True


def no_fa4(kernel):
    return kernel != "fa4"


def first_value(values, default):
    return default if values is None else min(values, key=repr)


def problem_of(route) -> AttentionProblem:
    """A problem that ``route`` covers (its first value of every set)."""
    return AttentionProblem(
        first_value(route.capabilities, HOPPER), first_value(route.dtypes, torch.bfloat16),
        first_value(route.head_dims, 64), first_value(route.positions, "t5"), first_value(route.maskings, "none"),
        first_value(route.packed, False), False, max(route.min_queries, 1), max(route.min_keys, 1), True,
    )


@pytest.mark.parametrize("index", range(len(ATTENTION_ROUTES)))
def test_every_row_serves_a_problem_once_enabled_and_its_kernel_installed(index):
    route = ATTENTION_ROUTES[index]
    problem = problem_of(route)
    assert route.covers(problem)
    enabled = dataclasses.replace(route, enabled=True)
    table = ATTENTION_ROUTES[:index] + (enabled,) + ATTENTION_ROUTES[index + 1:]
    earlier = [r for r in table[:index] if r.enabled and r.covers(problem)]
    assert not earlier, f"row {index} is shadowed by {earlier}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(routes, "ATTENTION_ROUTES", table)
        assert table_kernel(problem, forced=None, available=every_kernel) == route.kernel


def test_the_last_row_covers_every_problem():
    last = ATTENTION_ROUTES[-1]
    assert last.enabled and last.kernel == "triton"
    for position in POSITIONS:
        for masking in MASKINGS:
            for packed in (False, True):
                if packed and masking == "key_padding":
                    continue
                problem = AttentionProblem(None, torch.float32, 8, position, masking, packed, True, 1)
                assert last.covers(problem)


def test_head_dim_128_takes_fa4_from_the_key_length_it_was_measured_ahead():
    problem = dataclasses.replace(FA4_PROBLEM, head_dim=128, keys=2048)
    assert table_kernel(problem, forced=None, available=every_kernel) == "fa4"
    shorter = dataclasses.replace(problem, keys=1024)
    assert table_kernel(shorter, forced=None, available=every_kernel) == "triton"


def test_fa4_serves_the_bias_free_hopper_problems():
    for dtype in (torch.bfloat16, torch.float16):
        for masking in ("none", "causal_aligned"):
            for packed in (False, True):
                problem = dataclasses.replace(FA4_PROBLEM, dtype=dtype, masking=masking, packed=packed)
                assert table_kernel(problem, forced=None, available=every_kernel) == "fa4"


@pytest.mark.parametrize("head_dim, masking, shortest", [(64, "none", 1024), (64, "causal_aligned", 4096),
                                                         (128, "none", 128), (128, "causal_aligned", 1024)])
def test_the_hopper_t5_kernels_serve_training_problems_from_the_lengths_they_won_at(head_dim, masking, shortest):
    for packed in (False, True):
        problem = dataclasses.replace(FA4_PROBLEM, position="t5", head_dim=head_dim, masking=masking, packed=packed,
                                      queries=shortest, keys=shortest)
        assert table_kernel(problem, forced=None, available=every_kernel) == "fa4"
        if shortest > 128:
            shorter = dataclasses.replace(problem, keys=shortest // 2, queries=shortest // 2)
            assert table_kernel(shorter, forced=None, available=every_kernel) == "triton"
        # a prefill after cached keys (the bias would need the query offset), a decoding step, another mask, head
        # dim or dtype stays on Triton
        for change in ({"offset_zero": False}, {"queries": 1}, {"masking": "causal_offset"}, {"head_dim": 32},
                       {"dtype": torch.float32}):
            assert table_kernel(dataclasses.replace(problem, **change), forced="fa4", available=every_kernel) == (
                "triton")


def test_the_problems_say_whether_the_first_query_sits_at_position_zero():
    query, key = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 6, 8)
    assert padded_problem(query, key, "t5", False, None, 0, 0.0).offset_zero
    assert not padded_problem(query, key, "t5", True, None, 2, 0.0).offset_zero
    assert not padded_problem(query, key, "t5", True, None, torch.tensor(0), 0.0).offset_zero
    assert padded_problem(query, key, "t5", False, None, 0, 0.0).keys == 6
    cu_seqlens = torch.tensor([0, 2, 6], dtype=torch.int32)
    packed = packed_problem(query[0, 0], cu_seqlens, cu_seqlens, 4, 5, "t5", True, 0, 0.0)
    assert packed.offset_zero and packed.keys == 5


@pytest.mark.parametrize("change", [
    {"capability": None}, {"capability": (8, 0)}, {"capability": (8, 9)}, {"capability": (10, 0)},
    {"capability": (12, 0)}, {"position": "alibi"}, {"position": "bias"},
    {"dtype": torch.float32}, {"head_dim": 32}, {"head_dim": 80}, {"masking": "causal_offset"},
    {"masking": "key_padding"}, {"dropout": True}, {"queries": 1}, {"queries": 127},
])
def test_fa4_never_serves_what_it_cannot_compute_or_was_not_measured_on(change):
    # FAT5_ATTENTION_ROUTE=fa4: every FA4 row on, the most FA4 can be asked to serve
    problem = dataclasses.replace(FA4_PROBLEM, **change)
    assert table_kernel(problem, forced="fa4", available=every_kernel) == "triton"


def test_without_flash_attn_4_installed_triton_serves():
    assert table_kernel(FA4_PROBLEM, forced="fa4", available=no_fa4) == "triton"


def test_the_environment_forces_triton():
    assert table_kernel(FA4_PROBLEM, forced="triton", available=every_kernel) == "triton"
    assert forced_kernel_from({}) is None
    assert forced_kernel_from({"FAT5_ATTENTION_ROUTE": "auto"}) is None
    assert forced_kernel_from({"FAT5_ATTENTION_ROUTE": " Triton "}) == "triton"
    assert forced_kernel_from({"FAT5_ATTENTION_ROUTE": "FA4"}) == "fa4"
    with pytest.raises(ValueError, match="FAT5_ATTENTION_ROUTE must be 'auto', 'triton' or 'fa4'"):
        forced_kernel_from({"FAT5_ATTENTION_ROUTE": "cudnn"})


def test_only_flash_attn_4s_own_distribution_of_the_4_0_series_counts():
    def installed(version):
        def lookup(name):
            assert name == "flash-attn-4"
            if version is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return version
        return lookup

    assert routes.fa4_unusable_reason(installed("4.0.0b36")) is None
    assert routes.fa4_unusable_reason(installed("4.0.2")) is None
    assert routes.fa4_unusable_reason(installed("4.1.0")) == (
        "flash-attn-4 4.1.0 is installed; FAT5's adapter is written against its 4.0 releases"
    )
    assert routes.fa4_unusable_reason(installed(None)) == "flash-attn-4 is not installed (pip install 'fat5[hopper]')"


@pytest.mark.skipif(routes.FA4_UNUSABLE_REASON is None, reason="flash-attn-4 is installed here")
def test_this_machine_has_no_fa4_route():
    """The CPU suite's environment has no flash-attn-4: the table is only ever asked on a GPU anyway."""
    assert routes.FA4_UNUSABLE_REASON == "flash-attn-4 is not installed (pip install 'fat5[hopper]')"
    assert not routes.kernel_available("fa4") and routes.kernel_available("triton")


def test_cpu_tensors_take_the_reference_or_the_asked_backend(monkeypatch):
    query = torch.zeros(1, 2, 3, 64, dtype=torch.bfloat16)
    problem = padded_problem(query, query, "none", False, None, 0, 0.0)
    assert problem.capability is None
    assert attention_kernel("auto", query, lambda: problem) == "reference"
    assert attention_kernel("reference", query, lambda: problem) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attention_kernel("triton", query, lambda: problem) == "triton"
    with pytest.raises(ValueError, match="backend must be one of"):
        attention_kernel("fa4", query, lambda: problem)


def test_where_only_triton_can_serve_no_problem_is_described(monkeypatch):
    """Without flash-attn-4 (or with its rows off) a GPU call goes to Triton without building its problem: an eager
    step's host time is what a small model waits on."""
    monkeypatch.setattr(routes, "TABLE_DECIDES", False)
    monkeypatch.setattr(routes, "use_triton", lambda backend, tensor: True)

    def describe():
        raise AssertionError("the problem was described")

    assert attention_kernel("auto", torch.zeros(1), describe) == "triton"
    monkeypatch.setattr(routes, "TABLE_DECIDES", True)
    monkeypatch.setattr(routes, "table_kernel", lambda problem: problem)
    assert attention_kernel("auto", torch.zeros(1), lambda: "asked") == "asked"


def test_problem_descriptions_are_checked():
    with pytest.raises(ValueError, match="masking must be one of"):
        dataclasses.replace(FA4_PROBLEM, masking="sliding")
    with pytest.raises(ValueError, match="position must be one of"):
        dataclasses.replace(FA4_PROBLEM, position="rope")
    with pytest.raises(ValueError, match="packed rows carry their padding in cu_seqlens"):
        dataclasses.replace(FA4_PROBLEM, masking="key_padding", packed=True)


def test_padded_masking():
    query, key = torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 5, 8)
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert padded_problem(query, key, "none", False, None, 7, 0.0).masking == "none"
    assert padded_problem(query, key, "none", False, mask, 0, 0.0).masking == "key_padding"
    assert padded_problem(query, key, "none", True, None, 2, 0.0).masking == "causal_aligned"
    assert padded_problem(query, key, "none", True, None, 0, 0.0).masking == "causal_offset"
    assert padded_problem(query, key, "none", True, None, torch.tensor(2), 0.0).masking == "causal_offset"
    assert padded_problem(query, key, "none", True, mask, 2, 0.0).masking == "key_padding"
    assert padded_problem(query, key, "t5", False, None, 0, 0.1).dropout
    assert padded_problem(query, key, "none", False, None, 0, 0.0).queries == 3


def test_packed_masking():
    query = torch.zeros(6, 4, 8)
    cu_seqlens = torch.tensor([0, 2, 6], dtype=torch.int32)
    assert packed_problem(query, cu_seqlens, cu_seqlens.clone(), 4, 4, "none", False, 0, 0.0).masking == "none"
    assert packed_problem(query, cu_seqlens, cu_seqlens, 4, 4, "none", True, 0, 0.0).masking == "causal_aligned"
    assert packed_problem(query, cu_seqlens, cu_seqlens, 4, 4, "none", True, 0, 0.0).queries == 4
    # equal values in another tensor: telling them equal would read the device, so they count as unaligned
    assert packed_problem(query, cu_seqlens, cu_seqlens.clone(), 4, 4, "none", True, 0, 0.0).masking == "causal_offset"
    assert packed_problem(query, cu_seqlens, cu_seqlens, 4, 4, "none", True, 1, 0.0).masking == "causal_offset"
    assert packed_problem(query, cu_seqlens, cu_seqlens, 4, 4, "none", True, torch.tensor(0), 0.0).masking == (
        "causal_offset"
    )


# ------------------------------------------------------------------------------------------------------------------
# What the FA4 route computes, written in PyTorch: FA4's masks on FA4's arguments


def fa4_semantics(query, key, value, scale, causal):
    """FlashAttention's definition on (batch, heads, length, head_dim) tensors: causal on the bottom-right
    diagonal, a row that sees no key gives zeros."""
    query_length, key_length = query.shape[-2], key.shape[-2]
    scores = (query.float() @ key.float().transpose(-1, -2)) * scale
    visible = torch.ones(query_length, key_length, dtype=torch.bool)
    if causal:
        visible = torch.ones_like(visible).tril(key_length - query_length)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return probs @ value.float()


def fa4_varlen_semantics(query, key, value, cu_seqlens_q, cu_seqlens_k, scale, causal):
    out = torch.zeros(query.shape, dtype=torch.float32)
    bounds = zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(), cu_seqlens_k[:-1].tolist(),
                 cu_seqlens_k[1:].tolist())
    for q_start, q_end, k_start, k_end in bounds:
        if q_end == q_start:
            continue
        segment = [t[start:end].transpose(0, 1) for t, start, end in
                   ((query, q_start, q_end), (key, k_start, k_end), (value, k_start, k_end))]
        out[q_start:q_end] = fa4_semantics(*segment, scale, causal).transpose(0, 1)
    return out


@pytest.mark.parametrize("query_length, key_length", [(5, 5), (3, 7), (1, 6)])
@pytest.mark.parametrize("causal", [False, True])
def test_fa4_padded_semantics_match_fat5_on_aligned_problems(query_length, key_length, causal):
    torch.manual_seed(0)
    query, key, value = (torch.randn(2, 3, n, 8) for n in (query_length, key_length, key_length))
    offset = key_length - query_length
    assert padded_problem(query, key, "none", causal, None, offset, 0.0).masking in ("none", "causal_aligned")
    expected = attention(query, key, value, causal=causal, query_offset=offset, backend="reference")
    torch.testing.assert_close(fa4_semantics(query, key, value, 1.0, causal), expected)


def test_the_routes_keep_fa4_from_unaligned_causal_problems():
    """Where the two diagonals differ, the problem is never called aligned."""
    query, key, value = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    assert padded_problem(query, key, "none", True, None, 0, 0.0).masking == "causal_offset"
    expected = attention(query, key, value, causal=True, query_offset=0, backend="reference")
    assert not torch.allclose(fa4_semantics(query, key, value, 1.0, True), expected)


@st.composite
def packings(draw):
    """(batch, length) segment ids as FAT5's collators write them: per row, examples 1, 2, ... in contiguous runs,
    then a padding tail of zeros (an empty row, a full row and one-token examples included)."""
    batch = draw(st.integers(1, 3))
    length = draw(st.integers(1, 12))
    rows = []
    for _ in range(batch):
        lengths = draw(st.lists(st.integers(1, length), max_size=4))
        row = [example + 1 for example, size in enumerate(lengths) for _ in range(size)][:length]
        rows.append(row + [0] * (length - len(row)))
    return torch.tensor(rows)


def cu_seqlens_by_hand(segment_ids):
    """TokenLayout's cut, counted in Python: each row's example slots (empty where the row holds fewer examples),
    then its padding tail, row after row."""
    slots = int(segment_ids.max()) + 1
    offsets = [0]
    for row in segment_ids.tolist():
        for slot in list(range(1, slots)) + [0]:
            offsets.append(offsets[-1] + row.count(slot))
    return offsets


@settings(max_examples=60, deadline=None)
@given(packings(), st.booleans())
def test_packed_rows_through_fa4s_arguments_attend_within_their_example(segment_ids, causal):
    """Segment ids -> cu_seqlens (TokenLayout.packed, the model's cut) -> FA4's varlen definition equals attention
    masked by the segment ids themselves (a token sees the tokens of its row with its id, the earlier ones only
    when causal), and FAT5's varlen reference. Both stacks hand the kernel one cu_seqlens tensor for the queries
    and the keys, so a causal problem is aligned."""
    layout = TokenLayout.packed(segment_ids)
    assert layout.cu_seqlens.tolist() == cu_seqlens_by_hand(segment_ids)
    assert int((layout.cu_seqlens[1:] - layout.cu_seqlens[:-1]).max()) == layout.max_seqlen
    batch, length = segment_ids.shape
    generator = torch.Generator().manual_seed(int(segment_ids.sum()))
    query, key, value = (torch.randn(batch * length, 2, 8, generator=generator) for _ in range(3))
    cu_seqlens = layout.cu_seqlens

    same_example = (segment_ids[:, :, None] == segment_ids[:, None, :])
    if causal:
        same_example = same_example & torch.ones(length, length, dtype=torch.bool).tril()
    dense = [t.view(batch, length, 2, 8).transpose(1, 2) for t in (query, key, value)]
    scores = (dense[0] @ dense[1].transpose(-1, -2)).masked_fill(~same_example[:, None], float("-inf"))
    expected = (torch.softmax(scores, dim=-1) @ dense[2]).transpose(1, 2).reshape(batch * length, 2, 8)

    problem = packed_problem(query, cu_seqlens, cu_seqlens, layout.max_seqlen, layout.max_seqlen, "none", causal, 0,
                             0.0)
    assert problem.masking in ("none", "causal_aligned")
    through_fa4 = fa4_varlen_semantics(query, key, value, cu_seqlens, cu_seqlens, 1.0, causal)
    torch.testing.assert_close(through_fa4, expected)
    fat5 = attention_varlen(query, key, value, cu_seqlens, cu_seqlens, layout.max_seqlen, layout.max_seqlen,
                            causal=causal, backend="reference")
    torch.testing.assert_close(fat5, expected)


def test_an_empty_key_segment_gives_zeros_in_both_definitions():
    """A decoder's padding tail against a full encoder row: its queries see no key."""
    query, key, value = torch.randn(4, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cu_seqlens_q, cu_seqlens_k = torch.tensor([0, 2, 4]), torch.tensor([0, 3, 3])
    through_fa4 = fa4_varlen_semantics(query, key, value, cu_seqlens_q, cu_seqlens_k, 1.0, False)
    fat5 = attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, 2, 3, backend="reference")
    torch.testing.assert_close(through_fa4, fat5)
    assert not through_fa4[2:].any()


def test_the_model_describes_its_attention_problems(monkeypatch):
    """A packed seq2seq step asks the table about the encoder's T5 self-attention, the decoder's causal one (one
    cu_seqlens tensor for both sides: aligned) and the bias-free cross-attention; a RoPE stack has no bias."""
    from fat5 import FAT5Config, FAT5ForConditionalGeneration

    asked = []

    def recording(backend, tensor, describe):
        asked.append(describe())
        return attention_kernel(backend, tensor, describe)

    monkeypatch.setattr(attention_module, "attention_kernel", recording)
    segment_ids = torch.tensor([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    decoder_segment_ids = torch.tensor([[1, 1, 2, 2, 0, 0], [1, 1, 1, 0, 0, 0]])
    for position_encoding in ("t5", "rope"):
        asked.clear()
        config = FAT5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                            num_heads=2, dropout_rate=0.0, decoder_start_token_id=0,
                            position_encoding=position_encoding)
        model = FAT5ForConditionalGeneration(config).eval()
        with torch.no_grad():
            model(input_ids=torch.ones(2, 6, dtype=torch.long), segment_ids=segment_ids,
                  decoder_input_ids=torch.ones(2, 6, dtype=torch.long), decoder_segment_ids=decoder_segment_ids)
        self_position = "t5" if position_encoding == "t5" else "none"
        assert [(p.position, p.masking, p.packed) for p in asked] == [
            (self_position, "none", True), (self_position, "causal_aligned", True), ("none", "none", True),
        ]


# ------------------------------------------------------------------------------------------------------------------
# The adapter's conversions (FA4 itself needs a Hopper GPU: tests/test_attention_fa4_gpu.py)


def test_the_adapter_hands_fa4_its_layout_and_t5s_scale(monkeypatch):
    from fat5.kernels import attention_fa4

    calls = []

    def recording(query, key, value, cu_seqlens_q, cu_seqlens_k, table, max_seqlen_q, max_seqlen_k, scale, causal,
                  bidirectional=True, max_distance=128, *, return_lse=True):
        calls.append((query, key, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal))
        return query * 2, None

    monkeypatch.setattr(attention_fa4, "_forward", recording)
    query, key = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 5, 8)
    out = attention_fa4.fa4_attention(query, key, key, scale=1, causal=True)
    fa4_query, fa4_key, cu_q, cu_k, max_q, max_k, scale, causal = calls[-1]
    assert fa4_query.shape == (2, 3, 4, 8) and torch.equal(fa4_query, query.transpose(1, 2))
    assert fa4_key.shape == (2, 5, 4, 8)
    assert (cu_q, cu_k, max_q, max_k, causal) == (None, None, 3, 5, True)
    assert scale == 1.0 and isinstance(scale, float)  # FA4 would take None as 1/sqrt(head_dim)
    torch.testing.assert_close(out, query * 2)

    tokens = torch.randn(6, 4, 8)
    cu_seqlens = torch.tensor([0, 2, 6])
    attention_fa4.fa4_attention_varlen(tokens, tokens, tokens, cu_seqlens, cu_seqlens, 4, 4, scale=1.0, causal=False)
    _, _, cu_q, cu_k, max_q, max_k, _, causal = calls[-1]
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.tolist() == [0, 2, 6]
    assert (max_q, max_k, causal) == (4, 4, False)


def test_without_flash_attn_4_the_adapter_says_what_to_install():
    from fat5.kernels.attention_fa4 import fa4_attention

    query = torch.zeros(1, 2, 3, 64, dtype=torch.bfloat16)
    expected = r"the FA4 attention route needs flash-attn-4 \(pip install 'fat5\[hopper\]'\)"
    with pytest.raises(RuntimeError, match=expected):
        fa4_attention(query, query, query, scale=1.0, causal=False)


def test_the_custom_ops_fake_shapes_are_fa4s():
    """What torch.compile traces: FA4's output layout and its log-sum-exp, (batch, heads, query_length) or (heads,
    tokens) for packed rows (flash_attn.cute.interface.flash_attn_varlen_func's docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fat5.kernels.attention_fa4 import fa4_attention_backward_op, fa4_attention_forward_op

    with FakeTensorMode():
        query, key = torch.empty(2, 3, 4, 64, dtype=torch.bfloat16), torch.empty(2, 5, 4, 64, dtype=torch.bfloat16)
        out, lse = fa4_attention_forward_op(query, key, key, None, None, None, 3, 5, 1.0, False, True, 128)
        assert out.shape == query.shape and out.dtype == torch.bfloat16
        # a (batch, heads, length, head_dim)-contiguous query reaches FA4 as a transposed view; FA4's output is
        # contiguous all the same, and Inductor reads it with the strides the fake gives
        transposed = torch.empty(2, 4, 3, 64, dtype=torch.bfloat16).transpose(1, 2)
        out, _ = fa4_attention_forward_op(transposed, key, key, None, None, None, 3, 5, 1.0, False, True, 128)
        assert out.shape == transposed.shape and out.is_contiguous()
        assert lse.shape == (2, 4, 3) and lse.dtype == torch.float32
        grads = fa4_attention_backward_op(out, query, key, key, out, lse, None, None, None, 3, 5, 1.0, False, True,
                                          128, False)
        assert [g.shape for g in grads] == [query.shape, key.shape, key.shape, (0,)]
        table = torch.empty(32, 4)
        grads = fa4_attention_backward_op(out, query, key, key, out, lse, None, None, table, 3, 5, 1.0, False, True,
                                          128, True)
        assert grads[3].shape == table.shape

        tokens = torch.empty(7, 4, 64, dtype=torch.bfloat16)
        cu_seqlens = torch.empty(3, dtype=torch.int32)
        out, lse = fa4_attention_forward_op(tokens, tokens, tokens, cu_seqlens, cu_seqlens, None, 4, 4, 1.0, True,
                                            True, 128)
        assert out.shape == tokens.shape and lse.shape == (4, 7)
