"""Attention with a position bias: FAT5's Triton kernels against their peers, in one process on one GPU.

bf16, heads 12, batch x length = 32768 tokens, length 512..16384: the encoder's self-attention (bidirectional
buckets, no mask), the decoder's (causal, T5's unidirectional buckets) and cross-attention (L / 4 queries against L
keys, no bias); the bucket table (32 x heads) receives its gradient wherever there is one.

Peers: SDPA's cuDNN backend with no bias (the H100's ceiling: what attention costs without a position bias, about
1.6x FlashAttention-2 up to L 2048), SDPA's FlashAttention-2 with no bias, FlexAttention with the same bias as a
``score_mod`` (compiled), SDPA (default backend choice, and cuDNN) with the bias materialised as a (1, heads, L, L)
tensor whose gradient reaches the table through the gather. Tables: T5 at head_dim 64 and 128, ALiBi at 64,
cross-attention at 64 and 128, self-attention without bias (RoPE, no position) at 64; a decoding step (1 query
against a 4k..32k cache) against memory bandwidth. The bias-free tables also time flash-attn-4 (``fa4``, the route
fat5/kernels/routes.py has for them on Hopper, off until measured; ``pip install "fat5[hopper]"``), called through
FAT5's adapter whatever the table decides, beside FAT5's Triton kernel forced by ``backend="triton"``.

Method: every variant is first checked against the fp32 reference (relative error of the output and of every
gradient); times are ``triton.testing.do_bench`` medians; FLOPs are 4·B·H·Lq·Lk·D for the forward (halved when
causal) and 3.5 times that for forward+backward; peak memory is ``max_memory_allocated`` during forward+backward
minus what was allocated before (the inputs).

Compilation (Triton kernels, FlexAttention) happens first, in parallel worker processes that fill the on-disk
caches; the timing itself runs in this process, one variant at a time.

    python benchmarks/attention.py --out benchmarks/results/attention.json
    python benchmarks/attention.py --tables cross_d64 none_d64 cross_d128 --skip-decoding \
        --out benchmarks/results/attention_fa4.json
    python benchmarks/attention.py --sweep --out benchmarks/results/attention_sweep.json
    python benchmarks/attention.py --breakdown --out benchmarks/results/attention_breakdown.json
    python benchmarks/attention.py --sweep-short --out benchmarks/results/attention_sweep_short.json
    python benchmarks/attention.py --plot-only benchmarks/results/attention.json
"""

import argparse
import concurrent.futures
import math
import multiprocessing
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (
    cold_graph_ms,
    copy_bandwidth_gbs,
    draw_beside,
    markdown_table,
    parse_or_plot,
    save_png,
    write_result,
)

DEVICE = "cuda"
TOKENS = 32768
HEADS = 12
NUM_BUCKETS = 32
MAX_DISTANCE = 128
LENGTHS = [512, 1024, 2048, 4096, 8192, 16384]
DECODE_CACHES = [4096, 8192, 16384, 32768]
DECODE_BATCH = 8
# the materialised bias costs O(L^2) memory and its table gradient is an index backward over L^2 elements
# (0.1 TFLOP/s at 8192 on an H100): measured only where it fits in a few seconds
MATERIALISED_MAX_LENGTH = {"forward": 4096, "forward_backward": 2048}
BREAKDOWN_TOKENS = 32768  # the base-shape training step's encoder: 32 x 1024, 4 x 8192
BREAKDOWN_LENGTHS = [1024, 8192]
CEILINGS = ("sdpa_cudnn_no_bias", "sdpa_flash_no_bias")  # bias-free peers, compared with the bias-free reference
BIASED_PEERS = ("fat5", "flex", "sdpa_materialised", "sdpa_cudnn_materialised")
# The routes issue 24 names for short lengths, where T5 shares one (1, heads, L, L) bias across a stack's layers:
# the table frozen (LoRA finetuning, inference), FAT5's kernels reading the bias materialised once, cuDNN handed the
# materialised bias (it has no kernel for a bias that takes a gradient). The bias is materialised outside the
# timed call: a stack pays it once for all its layers.
FROZEN_ROUTES = ("fat5_frozen", "fat5_explicit_frozen", "sdpa_cudnn_frozen_bias")
# FAT5's Hopper T5 kernels (flash-attn-4's SM90 kernels with the bias in FAT5's hooks), the table trained and frozen,
# beside FA4 without bias, FAT5's Triton kernel and cuDNN without bias
HOPPER_T5 = ("fa4_t5", "fa4_t5_frozen")
HOPPER_T5_PEERS = ("sdpa_cudnn_no_bias", "fa4", "fat5") + HOPPER_T5
# timed from a CUDA graph too (FlexAttention's compiled code and the materialised bias's index backward are not)
GRAPHED = CEILINGS + ("fat5", "fa4") + FROZEN_ROUTES + HOPPER_T5
# flash-attn-4, for the problems without a bias (its score_mod route for T5's bias measured 0.40-0.49x cuDNN, issue 42)
BIAS_FREE_PEERS = CEILINGS + ("fat5", "fa4")
# what runs without the table's bias whatever the table: compared with the bias-free reference
WITHOUT_BIAS = CEILINGS + ("fa4",)
TABLES = [  # (name, position encoding, head_dim, peers, L / queries for cross-attention, None for self-attention)
    ("t5_d64", "t5", 64, CEILINGS + BIASED_PEERS, None),
    ("cross_d64", "none", 64, BIAS_FREE_PEERS, 4),
    ("t5_d128", "t5", 128, CEILINGS + BIASED_PEERS, None),
    ("alibi_d64", "alibi", 64, CEILINGS + ("fat5", "flex"), None),
    ("t5_routes_d64", "t5", 64, ("sdpa_cudnn_no_bias", "fat5") + FROZEN_ROUTES, None),
    ("none_d64", "none", 64, BIAS_FREE_PEERS, None),
    ("cross_d128", "none", 128, BIAS_FREE_PEERS, 4),
    ("t5_hopper_d64", "t5", 64, HOPPER_T5_PEERS, None),
    ("t5_hopper_d128", "t5", 128, HOPPER_T5_PEERS, None),
]
DEFAULT_TABLES = ("t5_d64", "cross_d64")
SWEEP = {  # head_dim 64; (block_m, block_n, warps, stages[, max registers])
    "forward": [(64, 64, 4, 3, 128), (64, 64, 4, 3), (64, 64, 4, 2, 128), (128, 64, 8, 3), (128, 128, 8, 2),
                (64, 128, 4, 3, 128), (128, 64, 4, 3, 128), (64, 32, 4, 3, 128)],
    "dkdv": [(64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 8, 3), (32, 64, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2),
             (64, 64, 8, 3), (128, 128, 8, 2)],
    "decode": [(16, 64, 4, 4), (16, 128, 4, 4), (16, 64, 4, 3), (16, 32, 4, 4), (16, 64, 4, 6), (16, 128, 4, 3)],
}
SWEEP_D128 = {
    "forward": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 4, 3), (64, 32, 4, 3), (128, 128, 8, 2)],
    "dkdv": [(64, 128, 8, 2), (64, 64, 8, 3), (32, 128, 8, 2), (32, 64, 4, 3), (32, 64, 4, 2), (64, 64, 4, 2)],
}
SWEEP_KINDS = ("forward", "dkdv", "decode", "dq")  # the kernels a sweep entry can configure


# ----------------------------------------------------------------------------------------------------------------
# The implementations


def position_bias(position_encoding, position, causal, max_distance=MAX_DISTANCE):
    """FAT5's description of the bias: the T5 table (the decoder's buckets when causal) or the ALiBi slopes."""
    from fat5.kernels.position_bias import PositionBias

    if position_encoding == "t5":
        return PositionBias.t5(position, bidirectional=not causal, max_distance=max_distance)
    if position_encoding == "alibi":
        return PositionBias.alibi(position)
    return PositionBias.none()


def implementation(name, position_encoding, causal, length, head_dim):
    """fn(q, k, v, position) -> out for one peer, where position is the T5 table or the ALiBi slopes (None for
    cross-attention, which has no position bias). ``length`` is the keys' length."""
    torch._dynamo.config.recompile_limit = 64  # FlexAttention compiles once per shape of the run
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fat5.kernels.attention import attention

    bidirectional = not causal
    if name in CEILINGS:
        backend = SDPBackend.CUDNN_ATTENTION if name == "sdpa_cudnn_no_bias" else SDPBackend.FLASH_ATTENTION

        def run(q, k, v, position):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0)
        return run
    if name == "fat5":
        def run(q, k, v, position):
            return attention(
                q, k, v, causal=causal, position_bias=position_bias(position_encoding, position, causal),
                backend="triton",
            )
        return run
    if name == "fa4":
        from fat5.kernels.attention_fa4 import fa4_attention

        def run(q, k, v, position):
            return fa4_attention(q, k, v, scale=1.0, causal=causal)
        return run
    if name in HOPPER_T5:
        from fat5.kernels.attention_fa4 import fa4_attention

        def run(q, k, v, position):
            table = position.detach() if name == "fa4_t5_frozen" else position
            return fa4_attention(q, k, v, scale=1.0, causal=causal,
                                 position_bias=position_bias(position_encoding, table, causal))
        return run
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        block_mask = None
        if causal:
            block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, length, length, device=DEVICE)
        compiled = _compiled_flex(position_encoding, bidirectional)

        def run(q, k, v, position):
            return compiled(q, k, v, position, block_mask)
        return run
    if name in FROZEN_ROUTES:
        return _frozen_route(name, causal, length)
    if name in ("sdpa_materialised", "sdpa_cudnn_materialised"):
        from fat5.kernels.position_bias import t5_position_bias

        def run(q, k, v, position):
            bias = t5_position_bias(position, length, length, 0, bidirectional, NUM_BUCKETS, MAX_DISTANCE)
            if causal:
                hidden = torch.ones(length, length, dtype=torch.bool, device=DEVICE).triu(1)
                bias = bias.masked_fill(hidden, float("-inf"))
            if name == "sdpa_materialised":  # SDPA's own choice of backend
                return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None].to(q.dtype), scale=1.0)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None].to(q.dtype), scale=1.0)
        return run
    raise ValueError(name)


def _frozen_route(name, causal, length):
    """A route of FROZEN_ROUTES: the table takes no gradient; the materialised bias is made on the first call and
    kept (the causal mask folded into it for cuDNN, which then runs without ``is_causal``)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fat5.kernels.attention import attention
    from fat5.kernels.position_bias import PositionBias, t5_position_bias

    materialised = {}

    def bias_of(position):
        if "bias" not in materialised:
            bias = t5_position_bias(position.detach(), length, length, 0, not causal, NUM_BUCKETS, MAX_DISTANCE)
            if name == "sdpa_cudnn_frozen_bias":
                if causal:
                    hidden = torch.ones(length, length, dtype=torch.bool, device=DEVICE).triu(1)
                    bias = bias.masked_fill(hidden, float("-inf"))
                bias = bias.to(torch.bfloat16)
            materialised["bias"] = bias[None].contiguous()
        return materialised["bias"]

    def run(q, k, v, position):
        if name == "fat5_frozen":
            return attention(q, k, v, causal=causal, backend="triton",
                             position_bias=position_bias("t5", position.detach(), causal))
        if name == "fat5_explicit_frozen":
            return attention(q, k, v, causal=causal, backend="triton",
                             position_bias=PositionBias.explicit(bias_of(position)))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias_of(position).to(q.dtype), scale=1.0)
    return run


_FLEX = {}


def _compiled_flex(position_encoding, bidirectional):
    """One compiled function per bias kind, with the score_mod defined inside it (a new closure per call would make
    torch.compile recompile on every call and fall back to the unfused path).

    The T5 score_mod reads a per-head bias by relative position, gathered from the table once per call (the table's
    gradient then flows through that gather): the bucket function per score inside the score_mod, and the
    gradient of 32 x heads entries accumulated by the fused backward, were measured at 1-7 TFLOP/s.
    """
    key = (position_encoding, bidirectional)
    if key not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        def flex_with_bias(q, k, v, position, block_mask):
            length = q.shape[-2]
            if position_encoding == "t5":
                from fat5.kernels.position_bias import t5_relative_bucket

                relative = torch.arange(-length + 1, length, device=q.device)
                buckets = t5_relative_bucket(relative, bidirectional, NUM_BUCKETS, MAX_DISTANCE)
                by_distance = position[buckets].t().to(q.dtype)  # (heads, 2L-1)

                def score_mod(score, b, h, q_idx, kv_idx):
                    return score + by_distance[h, kv_idx - q_idx + length - 1]
            else:
                def score_mod(score, b, h, q_idx, kv_idx):
                    return score - position[h] * (kv_idx - q_idx).abs().to(score.dtype)
            return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=1.0)

        _FLEX[key] = torch.compile(flex_with_bias, dynamic=False)
    return _FLEX[key]


def make_inputs(batch, length, head_dim, position_encoding, seed=0, dtype=torch.bfloat16, query_divisor=1):
    """q of length ``length // query_divisor``, k and v of ``length``, and the T5 table or the ALiBi slopes."""
    from fat5.kernels.position_bias import alibi_slopes

    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    std = head_dim**-0.25  # unit-variance scores with T5's scale of 1

    def tensor(scale, rows=length):
        x = torch.randn(batch, HEADS, rows, head_dim, device=DEVICE, generator=generator) * scale
        return x.to(dtype).requires_grad_()

    q, k, v = tensor(std, length // query_divisor), tensor(std), tensor(1.0)
    if position_encoding == "t5":
        position = (torch.randn(NUM_BUCKETS, HEADS, device=DEVICE, generator=generator) * 2).requires_grad_()
    else:
        position = alibi_slopes(HEADS).to(DEVICE) * 8  # large slopes make the bias matter at the unit scores used
    return q, k, v, position


# ----------------------------------------------------------------------------------------------------------------
# Measurements


def flops(batch, length, head_dim, causal, forward_backward, query_divisor=1):
    forward = 4 * batch * HEADS * (length // query_divisor) * length * head_dim / (2 if causal else 1)
    return forward * (3.5 if forward_backward else 1.0)


def correctness(name, position_encoding, causal, head_dim, length=1024, batch=TOKENS // 1024, query_divisor=1):
    """Relative errors of the output and every gradient against the fp32 reference (the bias-free ceilings are
    compared with the bias-free reference)."""
    from fat5.conversion.verify import relative_error
    from fat5.kernels.attention import attention

    q, k, v, position = make_inputs(batch, length, head_dim, position_encoding, seed=1, query_divisor=query_divisor)
    run = implementation(name, position_encoding, causal, length, head_dim)
    out = run(q, k, v, position)
    grad_out = torch.randn_like(out)
    frozen = name in WITHOUT_BIAS or name in FROZEN_ROUTES or name.endswith("_frozen")
    differentiable = [q, k, v] + ([position] if position.requires_grad and not frozen else [])
    grads = torch.autograd.grad(out, differentiable, grad_out)
    reference = [t.detach().float().requires_grad_() for t in (q, k, v, position)]
    expected = attention(
        *reference[:3], causal=causal, backend="reference",
        position_bias=position_bias("none" if name in WITHOUT_BIAS else position_encoding, reference[3], causal),
    )
    expected_grads = torch.autograd.grad(expected, reference[: len(differentiable)], grad_out.float())
    errors = {"output": relative_error(out, expected)}
    for label, grad, expected_grad in zip(("dq", "dk", "dv", "dtable"), grads, expected_grads):
        errors[label] = relative_error(grad, expected_grad)
    return errors


def timed(name, position_encoding, causal, length, head_dim, forward_backward, query_divisor=1):
    import triton.testing

    batch = TOKENS // length
    q, k, v, position = make_inputs(batch, length, head_dim, position_encoding, query_divisor=query_divisor)
    run = implementation(name, position_encoding, causal, length, head_dim)
    work = flops(batch, length, head_dim, causal, forward_backward, query_divisor)
    if not forward_backward:
        ms = triton.testing.do_bench(lambda: run(q, k, v, position), warmup=25, rep=100, return_mode="median")
        graphed = _graph_timing(lambda: run(q, k, v, position), [], work) if name in GRAPHED else {}
        return {"ms": ms, "tflops": work / ms / 1e9, **graphed}
    grad_out = torch.randn_like(q)
    leaves = [q, k, v] + ([position] if position.requires_grad else [])

    def step():
        run(q, k, v, position).backward(grad_out)

    step()
    torch.cuda.synchronize()
    for leaf in leaves:
        leaf.grad = None
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak_mib = (torch.cuda.max_memory_allocated() - before) / 2**20
    ms = triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")
    graphed = _graph_timing(step, leaves, work) if name in GRAPHED else {}
    return {"ms": ms, "tflops": work / ms / 1e9, "peak_mib": peak_mib, **graphed}


def _graph_timing(function, leaves, work):
    """The same call replayed from a CUDA graph (``graph_ms``, ``graph_tflops``), as a training step in CUDA graphs
    runs it: short problems' eager figures carry the host's launches and the autograd engine's hand-off, which a
    graph leaves out for every implementation alike. A peer that cannot be captured gets ``graph_error``."""
    try:
        graph_ms = cold_graph_ms(function, leaves)
    except RuntimeError as error:
        torch.cuda.synchronize()
        return {"graph_error": f"{type(error).__name__}: {str(error)[:200]}"}
    return {"graph_ms": graph_ms, "graph_tflops": work / graph_ms / 1e9}


def decoding(cache, name):
    """One decoding step (1 query per sequence against a cache of ``cache`` keys), as bandwidth.

    ``ms`` is the eager call (L2 flushed by do_bench, launch overheads included); ``graph_ms`` replays a CUDA graph
    of steps over enough different caches that they cannot stay in L2, per step: the kernels' own time.
    """
    import torch.nn.functional as F
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fat5.conversion.verify import relative_error
    from fat5.kernels.attention import attention

    generator = torch.Generator(device=DEVICE).manual_seed(2)
    q = torch.randn(DECODE_BATCH, HEADS, 1, 64, device=DEVICE, generator=generator, dtype=torch.bfloat16)
    cache_bytes = 2 * DECODE_BATCH * HEADS * cache * 64 * 2
    copies = max(1, math.ceil(4 * 50e6 / cache_bytes))  # 4x the H100's 50 MB of L2
    caches = [tuple(torch.randn(DECODE_BATCH, HEADS, cache, 64, device=DEVICE, generator=generator,
                                dtype=torch.bfloat16) for _ in range(2)) for _ in range(copies)]
    table = torch.randn(NUM_BUCKETS, HEADS, device=DEVICE, generator=generator)

    def step(k, v):
        if name == "fat5":
            return attention(q, k, v, causal=True, query_offset=cache - 1,
                             position_bias=position_bias("t5", table, causal=True), backend="triton")
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, scale=1.0)

    k, v = caches[0]
    if name == "fat5":
        expected = attention(q.float(), k.float(), v.float(), causal=True, query_offset=cache - 1,
                             position_bias=position_bias("t5", table, causal=True), backend="reference")
    else:
        expected = attention(q.float(), k.float(), v.float(), backend="reference")
    error = relative_error(step(k, v), expected)
    ms = triton.testing.do_bench(lambda: step(k, v), warmup=25, rep=100, return_mode="median")
    graph_ms = triton.testing.do_bench_cudagraph(lambda: [step(*kv) for kv in caches], rep=100,
                                                 return_mode="median") / copies
    moved = cache_bytes + 2 * q.numel() * q.element_size()
    return {"ms": ms, "gb_per_s": moved / ms / 1e6, "graph_ms": graph_ms, "graph_gb_per_s": moved / graph_ms / 1e6,
            "output_rel_error": error}


# ----------------------------------------------------------------------------------------------------------------
# Parallel compilation


def _apply_overrides(overrides):
    """Set the tuning overrides of a sweep entry: ((kind, config), ...) with kinds from SWEEP_KINDS."""
    from fat5.kernels import attention_triton_config

    attention_triton_config.CONFIG_OVERRIDES.clear()
    torch.use_deterministic_algorithms(False)
    for kind, config in overrides:
        if kind == "deterministic":  # the backward's separate dq kernel instead of atomics
            torch.use_deterministic_algorithms(True, warn_only=True)
            continue
        attention_triton_config.CONFIG_OVERRIDES[kind] = attention_triton_config.LaunchConfig(*config)


def _warm(task):
    """Run one variant once (forward+backward) so its kernels land in the on-disk caches."""
    name, position_encoding, causal, length, head_dim, overrides, *query_divisor = task

    _apply_overrides(overrides)
    started = time.time()
    try:
        if name == "decode":
            q = torch.randn(DECODE_BATCH, HEADS, 1, head_dim, device=DEVICE, dtype=torch.bfloat16)
            kv = torch.randn(DECODE_BATCH, HEADS, length, head_dim, device=DEVICE, dtype=torch.bfloat16)
            table = torch.randn(NUM_BUCKETS, HEADS, device=DEVICE)
            from fat5.kernels.attention import attention

            attention(q, kv, kv, causal=True, query_offset=length - 1,
                      position_bias=position_bias("t5", table, causal=True), backend="triton")
        else:
            batch = TOKENS // length  # FlexAttention compiles per shape: warm the timed shapes
            q, k, v, position = make_inputs(batch, length, head_dim, position_encoding,
                                            query_divisor=query_divisor[0] if query_divisor else 1)
            out = implementation(name, position_encoding, causal, length, head_dim)(q, k, v, position)
            out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        return task, time.time() - started, None
    except Exception as error:  # noqa: BLE001 - any compile or launch failure drops the config; the parent reports it
        return task, time.time() - started, f"{type(error).__name__}: {str(error)[:300]}"


def warm_caches(tasks, jobs):
    if not tasks:
        return {}
    started = time.time()
    failures = {}
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        for task, _seconds, error in pool.map(_warm, tasks):
            if error:
                failures[task] = error
                print(f"  warm-up failed {task}: {error}", flush=True)
    print(f"compiled {len(tasks)} variants in {time.time() - started:.0f} s with {jobs} processes", flush=True)
    return failures


# ----------------------------------------------------------------------------------------------------------------
# Runs


def _forward_ms(q, k, v, options):
    import triton.testing

    from fat5.kernels.attention import attention

    return triton.testing.do_bench(lambda: attention(q, k, v, **options), warmup=25, rep=100, return_mode="median")


def _backward_ms(q, k, v, differentiated, options):
    """The backward alone: one forward, then its graph differentiated again and again with respect to the tensors in
    ``differentiated``."""
    import triton.testing

    from fat5.kernels.attention import attention

    out = attention(q, k, v, **options)
    grad_out = torch.randn_like(out)
    return triton.testing.do_bench(lambda: torch.autograd.grad(out, differentiated, grad_out, retain_graph=True),
                                   warmup=25, rep=100, return_mode="median")


def _slice_error(q, k, v, options):
    """The largest relative error of the output and of q, k, v's gradients on a 1 x 1024 slice of the inputs,
    against the fp32 reference with the same options."""
    from fat5.conversion.verify import relative_error
    from fat5.kernels.attention import attention

    sliced = [t.detach()[:1, :, :1024].clone().requires_grad_() for t in (q, k, v)]
    reference = [t.detach()[:1, :, :1024].float().requires_grad_() for t in (q, k, v)]
    out = attention(*sliced, **options)
    grads = torch.autograd.grad(out, sliced, torch.ones_like(out))
    expected = attention(*reference, **dict(options, backend="reference"))
    expected_grads = torch.autograd.grad(expected, reference, torch.ones_like(expected))
    return max([relative_error(out, expected)] + [relative_error(g, e) for g, e in zip(grads, expected_grads)])


def sweep(args):
    """Time each launch configuration of each kernel on the bidirectional T5 bias at L = 4096 (the causal case and
    the peers are timed at the defaults), checking each configuration against the fp32 reference first."""
    length = 4096
    tasks = []
    for head_dim, table in ((64, SWEEP), (128, SWEEP_D128)):
        for kind, configs in table.items():
            for config in configs:
                if kind == "decode":
                    tasks.append(("decode", "t5", True, 16384, head_dim, ((kind, config),)))
                else:
                    tasks.append(("fat5", "t5", False, length, head_dim, ((kind, config),)))
        for causal in (False, True):
            tasks.append(("fat5", "t5", causal, length, head_dim, ()))
            tasks.append(("fat5", "t5", causal, length, head_dim, (("deterministic", None),)))
    failures = warm_caches(tasks, args.jobs)
    results = []
    for head_dim, table in ((64, SWEEP), (128, SWEEP_D128)):
        batch = TOKENS // length
        q, k, v, table_tensor = make_inputs(batch, length, head_dim, "t5")
        options = {"causal": False, "position_bias": position_bias("t5", table_tensor, causal=False),
                   "backend": "triton"}
        for kind, configs in table.items():
            if kind == "decode":
                continue
            for config in configs:
                task = ("fat5", "t5", False, length, head_dim, ((kind, config),))
                if task in failures:
                    results.append({"kind": kind, "config": config, "head_dim": head_dim, "error": failures[task]})
                    continue
                _apply_overrides(((kind, config),))
                error = _slice_error(q, k, v, options)
                if kind == "forward":
                    ms = _forward_ms(q, k, v, options)
                else:
                    ms = _backward_ms(q, k, v, (q, k, v, table_tensor), options)
                row = {"kind": kind, "config": config, "head_dim": head_dim, "ms": ms, "max_rel_error": error}
                results.append(row)
                print(row, flush=True)
        _apply_overrides(())
        for causal in (False, True):
            for phase in (False, True):
                for name, variant in (("sdpa_flash_no_bias", None), ("fat5", None), ("fat5", "deterministic")):
                    if variant == "deterministic":
                        _apply_overrides((("deterministic", None),))
                    row = {"kind": "peer", "implementation": name, "variant": variant, "head_dim": head_dim,
                           "causal": causal, "forward_backward": phase,
                           **timed(name, "t5", causal, length, head_dim, phase)}
                    _apply_overrides(())
                    results.append(row)
                    print(row, flush=True)
    for config in SWEEP["decode"]:
        _apply_overrides((("decode", config),))
        for cache in (4096, 16384):
            row = {"kind": "decode", "config": config, "head_dim": 64, "cache": cache, **decoding(cache, "fat5")}
            results.append(row)
            print(row, flush=True)
    _apply_overrides(())
    best = {}
    for row in results:
        if "config" not in row or "ms" not in row or row.get("max_rel_error", 0) > 1e-2:
            continue
        key = (row["kind"], row["head_dim"], row.get("cache"))
        time_ms = row.get("graph_ms", row["ms"])
        if key not in best or time_ms < best[key].get("graph_ms", best[key]["ms"]):
            best[key] = row
    print("\nbest per (kind, head_dim, cache):")
    for key, row in sorted(best.items(), key=str):
        print(key, row["config"], f"{row.get('graph_ms', row['ms']):.3f} ms")
    return {"sweep": results}


# The attention problems of a packed pretraining step at T5 v1.1-base (benchmarks/pretrain.py): encoder rows of 1024,
# decoders of 232 to 1024 positions, cross-attention from those decoder positions to 1024 encoder keys.
# (position encoding, causal, L, query divisor)
SHORT_PROBLEMS = [("t5", False, 512, 1), ("t5", False, 1024, 1), ("t5", True, 256, 1), ("t5", True, 512, 1),
                  ("t5", True, 1024, 1), ("none", False, 1024, 4), ("none", False, 1024, 2), ("none", False, 1024, 1)]


def sweep_short(args):
    """Each launch configuration of SWEEP (head dim 64), and the separate dq kernel, on SHORT_PROBLEMS: forward
    configurations timed forward, dk/dv configurations and the separate dq kernel forward+backward, each against the
    defaults of the same problem, each checked against the fp32 reference first."""
    variants = [()] + [((kind, config),) for kind in ("forward", "dkdv") for config in SWEEP[kind]]
    variants.append((("deterministic", None),))
    tasks = [("fat5", position, causal, length, 64, overrides, divisor)
             for position, causal, length, divisor in SHORT_PROBLEMS for overrides in variants]
    failures = warm_caches(tasks, args.jobs)
    results, defaults, best = [], {}, {}
    for task in tasks:
        _, position, causal, length, _, overrides, divisor = task
        kind = overrides[0][0] if overrides else "default"
        # a forward configuration changes the forward alone, the others the backward
        phases = {"default": ("forward", "forward_backward"), "forward": ("forward",)}.get(kind, ("forward_backward",))
        problem = (position, causal, length, length // divisor)
        row = {"position": position, "causal": causal, "length": length, "queries": problem[3],
               "variant": kind, "config": overrides[0][1] if overrides else None}
        if task in failures:
            results.append(dict(row, error=failures[task]))
            continue
        _apply_overrides(overrides)
        errors = correctness("fat5", position, causal, 64, length, TOKENS // length, divisor)
        row["max_rel_error"] = max(errors.values())
        if row["max_rel_error"] <= 1e-2:
            for phase in phases:
                row[phase] = timed("fat5", position, causal, length, 64, phase == "forward_backward", divisor)
                key = problem + (phase,)
                if kind == "default":
                    defaults[key] = row
                if key not in best or row[phase]["ms"] < best[key][phase]["ms"]:
                    best[key] = row
        _apply_overrides(())
        results.append(row)
        print(row, flush=True)
    summary = []
    for (position, causal, length, queries, phase), row in sorted(best.items(), key=str):
        default = defaults[position, causal, length, queries, phase]
        summary.append({"position": position, "causal": causal, "length": length, "queries": queries, "phase": phase,
                        "best": [row["variant"], row["config"]], "ms": round(row[phase]["ms"], 4),
                        "default_ms": round(default[phase]["ms"], 4),
                        "speedup": round(default[phase]["ms"] / row[phase]["ms"], 3)})
    print(markdown_table(summary, ["position", "causal", "length", "queries", "phase", "best", "ms", "default_ms",
                                   "speedup"]))
    return {"sweep_short": results, "summary": summary}


def breakdown(args):
    """Where the encoder's T5 attention time goes, at the whole model's encoder shapes (32k tokens): the forward
    and the backward alone with the table gradient and without it (a frozen table), with a narrower and a wider
    band of near tiles (max_distance 32 and 512 instead of 128), and with ALiBi and no bias as the floor."""
    variants = [
        ("t5, max_distance 128", "t5", {"max_distance": 128}, True),
        ("t5, max_distance 128, frozen table", "t5", {"max_distance": 128}, False),
        ("t5, max_distance 32", "t5", {"max_distance": 32}, True),
        ("t5, max_distance 32, frozen table", "t5", {"max_distance": 32}, False),
        ("t5, max_distance 512", "t5", {"max_distance": 512}, True),
        ("t5, max_distance 512, frozen table", "t5", {"max_distance": 512}, False),
        ("alibi", "alibi", {}, False),
        ("no bias", "none", {}, False),
    ]
    rows = []
    for length in args.lengths:
        batch = BREAKDOWN_TOKENS // length
        for name, position_encoding, extra, table_grad in variants:
            q, k, v, position = make_inputs(batch, length, 64, "t5" if position_encoding == "t5" else "alibi")
            if not table_grad:
                position = position.detach()
            options = {"causal": False, "backend": "triton",
                       "position_bias": position_bias(position_encoding, position, causal=False, **extra)}
            differentiated = (q, k, v, position) if table_grad else (q, k, v)
            row = {"variant": name, "length": length, "batch": batch, "max_rel_error": _slice_error(q, k, v, options),
                   "forward_ms": _forward_ms(q, k, v, options),
                   "backward_ms": _backward_ms(q, k, v, differentiated, options)}
            row["backward_tflops"] = flops(batch, length, 64, False, True) / 3.5 * 2.5 / row["backward_ms"] / 1e9
            rows.append(row)
            print(row, flush=True)
    return {"breakdown": rows}


def benchmark(args):
    """All tables and the decoding step; the result file is rewritten after each table (a cut-off run keeps what
    it measured)."""
    lengths = args.lengths
    tables = [table for table in TABLES if table[0] in args.tables]
    tasks = []
    for _, position_encoding, head_dim, peers, query_divisor in tables:
        for causal in _modes(query_divisor):
            for length in lengths:
                for name in peers:
                    if name in ("fat5", "flex") or name.startswith("fat5_"):
                        tasks.append((name, position_encoding, causal, length, head_dim, (), query_divisor or 1))
    decode_caches = [] if args.skip_decoding else DECODE_CACHES
    tasks += [("decode", "t5", True, cache, 64, ()) for cache in decode_caches]
    warm_caches(tasks, args.jobs)

    results = {"copy_gb_per_s": copy_bandwidth_gbs(), "tables": {}, "decoding": [], "summary": []}
    for cache in decode_caches:
        for name in ("fat5", "sdpa_flash_no_bias"):
            row = {"implementation": name, "cache": cache, "batch": DECODE_BATCH, **decoding(cache, name)}
            row["fraction_of_copy_bandwidth"] = row["graph_gb_per_s"] / results["copy_gb_per_s"]
            results["decoding"].append(row)
            print(row, flush=True)
    for table_name, position_encoding, head_dim, peers, query_divisor in tables:
        rows = []
        for causal in _modes(query_divisor):
            for name in peers:
                try:
                    errors = correctness(name, position_encoding, causal, head_dim, query_divisor=query_divisor or 1)
                except Exception as error:  # noqa: BLE001 - a peer that cannot run is recorded, not fatal
                    errors = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                print(f"{table_name} causal={causal} {name} errors {errors}", flush=True)
                for length in lengths:
                    row = {"implementation": name, "causal": causal, "length": length, "batch": TOKENS // length,
                           "query_length": length // (query_divisor or 1), "errors": errors}
                    for phase in ("forward", "forward_backward"):
                        if "error" in errors or (name.endswith("_materialised")
                                                 and length > MATERIALISED_MAX_LENGTH[phase]):
                            continue
                        try:
                            row[phase] = timed(name, position_encoding, causal, length, head_dim,
                                               phase == "forward_backward", query_divisor or 1)
                        except torch.OutOfMemoryError:
                            row[phase] = {"error": "out of memory"}
                        except RuntimeError as error:  # a backend that refuses a shape or a bias gradient
                            row[phase] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                        torch.cuda.empty_cache()
                    rows.append(row)
                    print(table_name, {k: v for k, v in row.items() if k != "errors"}, flush=True)
        results["tables"][table_name] = rows
        results["summary"] += _ratios(table_name, rows)
        write_result(args.out, results, heads=HEADS, tokens=TOKENS, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE)
    print()
    print(markdown_table(results["summary"], list(results["summary"][0].keys())))
    return results


def _modes(query_divisor):
    """Causal settings a table runs: encoder and decoder for self-attention, non-causal for cross-attention."""
    return (False,) if query_divisor else (False, True)


def _ratios(table_name, rows):
    """FAT5 (and its routes, FA4's included) against the no-bias ceilings (cuDNN, FlashAttention-2), FlexAttention
    and FAT5's Triton kernel, per length and mode; the frozen routes too, where the table takes no gradient."""
    index = {(r["implementation"], r["causal"], r["length"]): r for r in rows}
    summary = []
    for (name, causal, length), row in sorted(index.items(), key=lambda item: (item[0][1], item[0][2])):
        if name not in ("fat5", "fa4") + FROZEN_ROUTES + HOPPER_T5 or "tflops" not in row.get("forward_backward", {}):
            continue
        cudnn = index.get(("sdpa_cudnn_no_bias", causal, length), {})
        fa4 = index.get(("fa4", causal, length), {})
        flash = index.get(("sdpa_flash_no_bias", causal, length), {})
        flex = index.get(("flex", causal, length), {})
        triton = index.get(("fat5", causal, length), {})

        def ratio(a, b, phase, field="tflops"):
            try:
                return round(a[phase][field] / b[phase][field], 3)
            except (KeyError, TypeError, ZeroDivisionError):
                return None

        summary.append({
            "table": table_name, "implementation": name, "causal": causal, "L": length,
            "fwd TFLOP/s": round(row["forward"]["tflops"], 1),
            "fwd+bwd TFLOP/s": round(row["forward_backward"]["tflops"], 1),
            "fwd / cuDNN": ratio(row, cudnn, "forward"),
            "fwd+bwd / cuDNN": ratio(row, cudnn, "forward_backward"),
            "fwd+bwd / cuDNN, graphs": ratio(row, cudnn, "forward_backward", "graph_tflops"),
            "fwd+bwd / FA2": ratio(row, flash, "forward_backward"),
            "fwd+bwd / flex": ratio(row, flex, "forward_backward"),
            "fwd+bwd / FAT5 Triton": ratio(row, triton, "forward_backward"),
            "fwd+bwd / FAT5 Triton, graphs": ratio(row, triton, "forward_backward", "graph_tflops"),
            "fwd+bwd / FA4 no bias": ratio(row, fa4, "forward_backward"),
            "mem / FA2": ratio(row, flash, "forward_backward", "peak_mib"),
        })
    return summary


def plot(document, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = document["results"]["tables"]
    panels = [(name, causal) for name in tables for causal in dict.fromkeys(r["causal"] for r in tables[name])]
    figure, axes = plt.subplots(2, len(panels), figsize=(4 * len(panels), 7), squeeze=False)
    for column, (name, causal) in enumerate(panels):
        rows = [r for r in tables[name] if r["causal"] == causal]
        for line, phase in enumerate(("forward", "forward_backward")):
            axis = axes[line][column]
            for implementation_name in dict.fromkeys(r["implementation"] for r in rows):
                points = [(r["length"], r[phase]["tflops"]) for r in rows
                          if r["implementation"] == implementation_name and "tflops" in r.get(phase, {})]
                if points:
                    axis.plot(*zip(*points), marker="o", label=implementation_name)
            axis.set_xscale("log", base=2)
            role = "cross (L/4 queries)" if name.startswith("cross") else "decoder (causal)" if causal else "encoder"
            axis.set_title(f"{name} {role} {phase.replace('_', '+')}", fontsize=9)
            axis.set_xlabel("sequence length (keys)")
            axis.set_ylabel("TFLOP/s")
            axis.grid(True, alpha=0.3)
            axis.legend(fontsize=7)
    save_png(figure, path, document, f"attention, bf16, {HEADS} heads, {TOKENS} tokens per batch", dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/attention.json")
    parser.add_argument("--skip-decoding", action="store_true", help="leave out the decoding step's table")
    parser.add_argument("--sweep", action="store_true", help="time the kernels' launch configurations instead")
    parser.add_argument("--sweep-short", action="store_true",
                        help="time the launch configurations on a pretraining step's short problems instead")
    parser.add_argument("--breakdown", action="store_true",
                        help="time the T5 encoder's forward and backward without parts of the bias instead")
    parser.add_argument("--lengths", type=int, nargs="+",
                        help=f"default {LENGTHS} ({BREAKDOWN_LENGTHS} with --breakdown)")
    parser.add_argument("--tables", nargs="+", default=list(DEFAULT_TABLES), choices=[table[0] for table in TABLES],
                        help=f"which tables (default {' '.join(DEFAULT_TABLES)})")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compilation processes")
    args = parse_or_plot(parser, plot)
    if args is None:
        return
    if args.lengths is None:
        args.lengths = BREAKDOWN_LENGTHS if args.breakdown else LENGTHS
    if args.sweep_short:
        results = sweep_short(args)
    elif args.sweep:
        results = sweep(args)
    elif args.breakdown:
        results = breakdown(args)
    else:
        results = benchmark(args)
    document = write_result(args.out, results, heads=HEADS, tokens=TOKENS, num_buckets=NUM_BUCKETS,
                            max_distance=MAX_DISTANCE)
    if not (args.sweep or args.sweep_short or args.breakdown):
        draw_beside(plot, document, args.out)


if __name__ == "__main__":
    main()
