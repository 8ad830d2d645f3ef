"""Relative position encodings that the attention kernels compute in place: T5 buckets and ALiBi slopes.

Both are functions of the distance ``key_position - query_position`` alone; the kernels evaluate them per tile
instead of reading an (L, L) bias, and these PyTorch versions are the truth they are tested against.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

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


@dataclass(frozen=True, eq=False)  # compared by identity: its tensors have no single truth value
class PositionBias:
    """What attention adds to ``scale * q·k`` before the softmax, described rather than materialised.

    Build one with a constructor: ``PositionBias.t5(table, bidirectional=..., max_distance=...)`` (T5's bucket table,
    (num_buckets, heads), which receives a gradient), ``PositionBias.alibi(slopes)`` ((heads,) slopes, no gradient),
    ``PositionBias.explicit(bias)`` (an additive tensor broadcastable to (batch, heads, query_length, key_length);
    (heads, max_seqlen_q, max_seqlen_k) for varlen inputs; FAT5's FIRE evaluates its MLP into one) or
    ``PositionBias.none()``. RoPE is no bias: it rotates q and k before the attention call.
    """

    kind: str = "none"
    tensor: torch.Tensor | None = None
    bidirectional: bool = True
    num_buckets: int = 32
    max_distance: int = 128

    KINDS: ClassVar[tuple[str, ...]] = ("none", "t5", "alibi", "bias")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"PositionBias kind must be one of {self.KINDS}, got {self.kind!r}")
        if (self.tensor is None) != (self.kind == "none"):
            raise ValueError(f"a {self.kind!r} PositionBias needs a tensor" if self.tensor is None
                             else "PositionBias.none() takes no tensor")

    @classmethod
    def none(cls) -> "PositionBias":
        return cls()

    @classmethod
    def t5(cls, table: torch.Tensor, *, bidirectional: bool = True, max_distance: int = 128) -> "PositionBias":
        """T5's relative position buckets; ``num_buckets`` is the table's first dimension."""
        if table.dim() != 2:
            raise ValueError(f"the T5 table must be (num_buckets, heads), got shape {tuple(table.shape)}")
        return cls("t5", table, bool(bidirectional), int(table.shape[0]), int(max_distance))

    @classmethod
    def alibi(cls, slopes: torch.Tensor) -> "PositionBias":
        return cls("alibi", slopes)

    @classmethod
    def explicit(cls, bias: torch.Tensor) -> "PositionBias":
        return cls("bias", bias)

    def materialise(self, query_length: int, key_length: int, query_offset=0) -> torch.Tensor | None:
        """The additive bias as a tensor (None for ``none``): what the kernels compute in place."""
        if self.kind == "t5":
            return t5_position_bias(self.tensor, query_length, key_length, query_offset, self.bidirectional,
                                    self.num_buckets, self.max_distance)
        if self.kind == "alibi":
            return alibi_position_bias(self.tensor, query_length, key_length, query_offset)
        return self.tensor


NO_POSITION_BIAS = PositionBias.none()
