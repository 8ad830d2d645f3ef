"""Relative position encodings that the attention kernels compute in place: T5 buckets and ALiBi slopes.

Both are functions of the distance ``key_position - query_position`` alone; the kernels evaluate them per tile
instead of reading an (L, L) bias, and these PyTorch versions are the truth they are tested against.
"""

import math

import torch


def t5_relative_bucket(
    relative_position: torch.Tensor, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """T5's bucket of ``relative_position = key_position - query_position`` (Mesh TensorFlow's definition).

    Half of the buckets (per direction when ``bidirectional``) are exact distances, the rest are logarithmically
    wider up to ``max_distance``; every distance beyond it shares the last bucket of its direction. With
    ``bidirectional=False`` (the decoder) keys after the query all fall in bucket 0.
    """
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.long) * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # float32 log, as in T5: the kernels must reproduce these buckets bit for bit
    log_ratio = torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
    distance_if_large = max_exact + (log_ratio * (num_buckets - max_exact)).to(torch.long)
    distance_if_large = torch.clamp(distance_if_large, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, distance_if_large)


def t5_position_bias(
    table: torch.Tensor,
    query_length: int,
    key_length: int,
    query_offset: int = 0,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> torch.Tensor:
    """The materialised (heads, query_length, key_length) T5 bias from a (num_buckets, heads) table."""
    query_position = torch.arange(query_length, device=table.device)[:, None] + query_offset
    key_position = torch.arange(key_length, device=table.device)[None, :]
    buckets = t5_relative_bucket(key_position - query_position, bidirectional, num_buckets, max_distance)
    return table[buckets].permute(2, 0, 1)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al.): a geometric sequence from 2^(-8/n), extended for non powers of two."""
    closest_power = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / closest_power)
    slopes = [base ** (i + 1) for i in range(closest_power)]
    if closest_power < num_heads:
        extra_base = 2.0 ** (-4.0 / closest_power)
        slopes += [extra_base ** (2 * i + 1) for i in range(num_heads - closest_power)]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_position_bias(
    slopes: torch.Tensor, query_length: int, key_length: int, query_offset: int = 0
) -> torch.Tensor:
    """The materialised (heads, query_length, key_length) ALiBi bias ``-slope * |key - query|``."""
    query_position = torch.arange(query_length, device=slopes.device)[:, None] + query_offset
    key_position = torch.arange(key_length, device=slopes.device)[None, :]
    distance = (key_position - query_position).abs().float()
    return -slopes.float()[:, None, None] * distance
