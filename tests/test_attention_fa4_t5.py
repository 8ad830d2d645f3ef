"""The Hopper T5 route's host side on the CPU: FAT5's adapter (attention_fa4.py) with FA4's interface replaced by
a PyTorch model of what FAT5's CuTe hooks compute (attention_fa4_t5_kernels.py: the bias read from the head's row of
relative positions, the score gradient's far sums added to the ends of ``grad_by_distance``). The adapter's
layouts, its log-sum-exp units, the band pass (Triton's interpreter) and the table gradient's assembly are checked
against FAT5's fp32 reference; the hooks themselves run on a Hopper GPU (tests/test_attention_fa4_gpu.py)."""

import contextlib
import math

import pytest
import torch
from helpers import relative_error
from transformers.models.t5.modeling_t5 import T5Attention

from fat5.kernels import attention_fa4
from fat5.kernels.attention import attention, attention_varlen
from fat5.kernels.position_bias import PositionBias


def hooked_scores(query, key, bias_rows, scale, causal):
    """(heads, Lq, Lk) fp32 scores of one segment ((length, heads, head_dim) tensors) as the hooks make them."""
    max_distance = (bias_rows.shape[1] - 3) // 2
    length_q, length_k = query.shape[0], key.shape[0]
    relative = torch.arange(length_k)[None, :] - torch.arange(length_q)[:, None]
    index = relative.clamp(-(max_distance + 1), max_distance + 1) + max_distance + 1
    scores = torch.einsum("qhd,khd->hqk", query.float(), key.float()) * scale + bias_rows[:, index]
    if causal:
        scores = scores.masked_fill(relative > length_k - length_q, float("-inf"))
    return scores, relative, max_distance


def segments(cu_seqlens_q, cu_seqlens_k, tensors_q, tensors_k, padded):
    """(query-side tensors, key-side tensors) of each segment, in (length, heads, ...) layout."""
    if padded:
        for index in range(tensors_q[0].shape[0]):
            yield [t[index] for t in tensors_q], [t[index] for t in tensors_k]
        return
    for s in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = (int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1]), int(cu_seqlens_k[s]),
                          int(cu_seqlens_k[s + 1]))
        yield [t[q0:q1] for t in tensors_q], [t[k0:k1] for t in tensors_k]


class HookedFA4:
    """FA4's interface as the adapter calls it for a T5 table, computing what FAT5's hooks compute."""

    @staticmethod
    def _flash_attn_fwd(query, key, value, softmax_scale, causal, return_lse, score_mod, aux_tensors,
                        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
        padded = cu_seqlens_q is None
        out = torch.zeros_like(query)
        lse = torch.empty(query.shape[0], query.shape[2], query.shape[1]) if padded else torch.empty(
            query.shape[1], query.shape[0])
        start = 0
        for index, ((q,), (k, v)) in enumerate(segments(cu_seqlens_q, cu_seqlens_k, [query], [key, value], padded)):
            scores, _, _ = hooked_scores(q, k, aux_tensors[0], softmax_scale, causal)
            probabilities = torch.softmax(scores, dim=-1)
            result = torch.einsum("hqk,khd->qhd", probabilities, v.float()).to(query.dtype)
            if padded:
                out[index], lse[index] = result, torch.logsumexp(scores, dim=-1)
            else:
                out[start:start + q.shape[0]], lse[:, start:start + q.shape[0]] = result, torch.logsumexp(scores, -1)
            start += q.shape[0]
        return out, lse, None, None, None

    @staticmethod
    def _flash_attn_bwd(query, key, value, out, grad_out, lse, softmax_scale, causal, softcap, score_mod,
                        score_mod_bwd, aux_tensors, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                        max_seqlen_k=None):
        padded = cu_seqlens_q is None
        grads = [torch.zeros_like(t) for t in (query, key, value)]
        starts = [0, 0]
        pieces = segments(cu_seqlens_q, cu_seqlens_k, [query, grad_out], [key, value], padded)
        for index, ((q, do), (k, v)) in enumerate(pieces):
            # attention's gradient written out (the custom ops' backward runs where autograd records nothing)
            q, do, k, v = (t.float() for t in (q, do, k, v))
            scores, relative, max_distance = hooked_scores(q, k, aux_tensors[0], softmax_scale, causal)
            probabilities = torch.softmax(scores, dim=-1).nan_to_num(0.0)
            grad_probabilities = torch.einsum("qhd,khd->hqk", do, v)
            score_grad = probabilities * (grad_probabilities - (probabilities * grad_probabilities).sum(-1, True))
            leaf_grads = (torch.einsum("hqk,khd->qhd", score_grad, k) * softmax_scale,
                          torch.einsum("hqk,qhd->khd", score_grad, q) * softmax_scale,
                          torch.einsum("hqk,qhd->khd", probabilities, do))
            if len(aux_tensors) > 1:  # the far buckets' sums, at the ends of a slot's row (any slot would do)
                slot = aux_tensors[1][:, index % aux_tensors[1].shape[1]]
                slot[:, 0] += score_grad[:, relative < -max_distance].sum(dim=-1)
                slot[:, -1] += score_grad[:, relative > max_distance].sum(dim=-1)
            if padded:
                for grad, leaf_grad in zip(grads, leaf_grads):
                    grad[index] = leaf_grad
            else:
                q_rows, k_rows = slice(starts[0], starts[0] + q.shape[0]), slice(starts[1], starts[1] + k.shape[0])
                grads[0][q_rows], grads[1][k_rows], grads[2][k_rows] = leaf_grads
                starts = [starts[0] + q.shape[0], starts[1] + k.shape[0]]
        return tuple(grads)


@pytest.fixture
def hooked_fa4(monkeypatch):
    monkeypatch.setattr(attention_fa4, "_fa4_interface", lambda: HookedFA4)
    monkeypatch.setattr(attention_fa4, "_t5_kernels",
                        lambda max_distance, table_grad: contextlib.nullcontext(("score_mod", "score_mod_bwd")))


def test_the_kernels_bias_row_is_transformers_t5_bias_by_relative_position():
    table = torch.randn(32, 3)
    for bidirectional in (True, False):
        rows = attention_fa4._t5_bias_rows(table, bidirectional, 128)
        relative = torch.arange(-129, 130)
        buckets = T5Attention._relative_position_bucket(relative, bidirectional, 32, 128)
        assert rows.shape == (3, 259) and rows.dtype == torch.float32
        torch.testing.assert_close(rows, table[buckets].t())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("train_table", [True, False])
@pytest.mark.parametrize("custom_ops", [False, True])
def test_the_route_matches_the_fp32_reference(hooked_fa4, monkeypatch, causal, packed, train_table, custom_ops):
    """Output, dq, dk, dv and the table's gradient (or none, frozen) of the adapter's T5 path: eagerly, and through
    the custom ops and their registered autograd, which a torch.compile trace calls."""
    torch.manual_seed(0)
    heads, head_dim, max_distance = 2, 16, 8
    table = torch.randn(8, heads, requires_grad=train_table)
    position = PositionBias.t5(table, bidirectional=not causal, max_distance=max_distance)
    if packed:
        lengths = [37, 5, 0, 20]
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v = (torch.randn(sum(lengths), heads, head_dim, requires_grad=True) for _ in range(3))

        def run(fa4, *inputs):
            if fa4:
                return attention_fa4.fa4_attention_varlen(*inputs[:3], cu_seqlens, cu_seqlens, 37, 37, scale=1.0,
                                                          causal=causal, position_bias=inputs[3])
            return attention_varlen(*inputs[:3], cu_seqlens, cu_seqlens, 37, 37, causal=causal,
                                    position_bias=inputs[3], backend="reference")
    else:
        q, k, v = (torch.randn(2, heads, 29, head_dim, requires_grad=True) for _ in range(3))

        def run(fa4, *inputs):
            if fa4:
                return attention_fa4.fa4_attention(*inputs[:3], scale=1.0, causal=causal, position_bias=inputs[3])
            return attention(*inputs[:3], causal=causal, position_bias=inputs[3], backend="reference")

    differentiable = [q, k, v] + ([table] if train_table else [])
    with monkeypatch.context() as patch:
        if custom_ops:
            patch.setattr(torch.compiler, "is_compiling", lambda: True)
        out = run(True, q, k, v, position)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, differentiable, grad_out)
    expected = run(False, q, k, v, position)
    expected_grads = torch.autograd.grad(expected, differentiable, grad_out)
    assert relative_error(out, expected) < 1e-5
    for grad, expected_grad in zip(grads, expected_grads):
        assert relative_error(grad, expected_grad) < 1e-4


def test_the_lse_reaches_the_band_pass_in_log2_units_and_empty_rows_as_plus_infinity(monkeypatch):
    seen = {}

    def band(grad_out, query, key, value, out, lse_log2, *rest):
        seen["lse_log2"] = lse_log2
        return torch.zeros(8, 2)

    monkeypatch.setattr("fat5.kernels.attention_triton_launch.t5_band_table_gradient", band)
    lse = torch.tensor([[0.5, float("-inf")]])
    tensors = [torch.zeros(2, 2, 4)] * 5
    attention_fa4._t5_table_gradient(*tensors, lse, torch.zeros(8, 2), torch.zeros(2, 32, 19),
                                     torch.tensor([0, 2]), torch.tensor([0, 2]), 2, 2, 1.0, False, True, 8)
    torch.testing.assert_close(seen["lse_log2"], torch.tensor([[0.5 / math.log(2), float("inf")]]))
