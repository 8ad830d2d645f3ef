"""The model-side position encoding, for the layers (`modeling_fat5`) and the graphed decoding step
(`graphed_decoding`) alike: which kinds carry parameters along a stack, FIRE's learned bias, each self-attention
layer's bias description (`PositionBias`) and rotation (RoPE), and T5's fp16 clamp after every sub-layer.

The kinds are `FAT5Config.position_encoding`'s (`POSITION_ENCODINGS`); the kernels evaluate the biases
(`kernels.position_bias`) and rotate q and k (`kernels.rotary`). Remote code: shipped with every Hub bundle.
"""

from typing import ClassVar

import torch
from torch import nn

from .configuration_fat5 import POSITION_ENCODINGS, FAT5Config
from .kernels.position_bias import NO_POSITION_BIAS, PositionBias, alibi_slopes
from .kernels.rotary import apply_rotary

# FIRE's bias is evaluated for the query and key lengths of each call; the others' descriptions hold for any length,
# so a decoding step can build them once
LENGTH_DEPENDENT_ENCODINGS = ("fire",)
LENGTH_FREE_ENCODINGS = tuple(kind for kind in POSITION_ENCODINGS if kind not in LENGTH_DEPENDENT_ENCODINGS)


def clamp_fp16(hidden_states: torch.Tensor) -> torch.Tensor:
    # T5 overflows in fp16; transformers clamps after each sub-layer and so do we, for identical outputs
    if hidden_states.dtype != torch.float16:
        return hidden_states
    clamp_value = torch.where(
        torch.isinf(hidden_states).any(),
        torch.finfo(hidden_states.dtype).max - 1000,
        torch.finfo(hidden_states.dtype).max,
    )
    return torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)


class FAT5FIRE(nn.Module):
    """FIRE (Li et al., 2024): a learned bias ``MLP(psi(|j - i|) / psi(max(L, i + 1)))``, ``psi(x) = log(c x + 1)``.

    ``c`` and the length threshold ``L`` are learned. Bidirectional attention feeds the distances before and after
    the query as two separate inputs, so the MLP can tell the directions apart.
    """

    # the order in which the first block hands these parameters on to the blocks that share them
    PARAMETER_NAMES = ("c", "threshold", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias")

    def __init__(self, config: FAT5Config, bidirectional: bool):
        super().__init__()
        self.bidirectional = bidirectional
        self.mlp = nn.Sequential(
            nn.Linear(2 if bidirectional else 1, config.fire_mlp_width),
            nn.ReLU(),
            nn.Linear(config.fire_mlp_width, config.num_heads),
        )
        # one-element vectors rather than scalars: FSDP cannot shard a 0-dimensional parameter
        self.c = nn.Parameter(torch.tensor([float(config.fire_init_c)]))
        self.threshold = nn.Parameter(torch.tensor([float(config.fire_init_threshold)]))

    def forward(self, query_length: int, key_length: int, query_offset: int = 0) -> torch.Tensor:
        """The (heads, query_length, key_length) bias."""
        return fire_bias(dict(self.named_parameters()), self.bidirectional, query_length, key_length, query_offset)


def fire_bias(parameters: dict, bidirectional: bool, query_length: int, key_length: int, query_offset: int = 0):
    """FIRE's (heads, query_length, key_length) bias from the parameters of a :class:`FAT5FIRE`, by name."""
    c = parameters["c"]
    query_position = torch.arange(query_length, device=c.device, dtype=torch.float32)[:, None] + query_offset
    relative = torch.arange(key_length, device=c.device, dtype=torch.float32)[None, :] - query_position
    c = c.float().abs()
    normaliser = torch.log(c * torch.maximum(query_position + 1, parameters["threshold"].float().abs()) + 1)
    distance = torch.log(c * relative.abs() + 1) / normaliser
    if bidirectional:
        features = torch.stack((distance * (relative <= 0), distance * (relative > 0)), dim=-1)
    else:
        features = distance[..., None]
    hidden = nn.functional.linear(
        features.to(parameters["mlp.0.weight"].dtype), parameters["mlp.0.weight"], parameters["mlp.0.bias"]
    )
    bias = nn.functional.linear(nn.functional.relu(hidden), parameters["mlp.2.weight"], parameters["mlp.2.bias"])
    return bias.permute(2, 0, 1)


class StackPositionEncoding:
    """A self-attention layer's position encoding, and the parameters of it that travel along the stack.

    T5's bucket table and FIRE's MLP belong to the first block's self-attention (to every block's with
    ``position_bias_per_layer``) and serve the later blocks too. They travel as the stack's *position parameters*: a
    tuple of tensors in the order of ``parameter_names``, which each block takes as arguments and gives back as
    outputs (``FAT5Block.forward`` says why), copies of the first block's parameters rather than the parameters (see
    ``FAT5Attention._position_bias``). ALiBi's slopes are fixed and RoPE rotates q and k before the kernel: neither
    has parameters that travel, and RoPE adds no bias. Cross-attention has no position encoding (``kind="none"``).
    """

    # by their names in the module that owns them (``relative_attention_bias`` or ``fire``)
    PARAMETER_NAMES: ClassVar[dict[str, tuple[str, ...]]] = {"t5": ("weight",), "fire": FAT5FIRE.PARAMETER_NAMES}

    def __init__(self, kind: str, num_heads: int, bidirectional: bool, max_distance: int, rope_theta: float,
                 backend: str):
        self.kind = kind
        self.num_heads = num_heads
        self.bidirectional = bidirectional
        self.max_distance = max_distance
        self.rope_theta = rope_theta
        self.backend = backend
        self.parameter_names = self.PARAMETER_NAMES.get(kind, ())
        self._alibi_slopes = None

    def parameters_of(self, owner: nn.Module) -> tuple[torch.Tensor, ...]:
        """The position parameters of ``owner`` (a ``relative_attention_bias`` or a ``fire``), in travelling order."""
        own = dict(owner.named_parameters())
        return tuple(own[name] for name in self.parameter_names)

    def bias(self, parameters: tuple[torch.Tensor, ...], query_length: int, key_length: int, query_offset: int,
             device: torch.device) -> PositionBias:
        """What the attention kernels add to the scores at these lengths: T5's bucket table, FIRE's bias evaluated
        for them, ALiBi's slopes, nothing for RoPE (applied to q and k beforehand) or without position encoding."""
        if len(parameters) != len(self.parameter_names):
            raise ValueError(
                f"{self.kind!r} position encoding needs its {len(self.parameter_names)} position parameters "
                f"{self.parameter_names} (a block that owns none receives the first block's), got {len(parameters)}"
            )
        if self.kind == "t5":
            return PositionBias.t5(parameters[0], bidirectional=self.bidirectional, max_distance=self.max_distance)
        if self.kind == "fire":
            named = dict(zip(self.parameter_names, parameters))
            return PositionBias.explicit(fire_bias(named, self.bidirectional, query_length, key_length, query_offset))
        if self.kind == "alibi":
            # made once per device: a host-to-device copy in every call would stall the step
            if self._alibi_slopes is None or self._alibi_slopes.device != device:
                self._alibi_slopes = alibi_slopes(self.num_heads).to(device)
            return PositionBias.alibi(self._alibi_slopes)
        return NO_POSITION_BIAS

    @property
    def rotates(self) -> bool:
        return self.kind == "rope"

    def rotate(self, states: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Queries or keys, (batch, heads, length, head_dim), rotated at ``position_ids`` (batch, length) under RoPE;
        as they are under every other kind."""
        if not self.rotates:
            return states
        return apply_rotary(states, position_ids, self.rope_theta, backend=self.backend)


def length_free_biases(encodings: list[StackPositionEncoding], own_parameters: list[tuple[torch.Tensor, ...]],
                       device: torch.device) -> list[PositionBias]:
    """Each self-attention layer's bias for a stack whose kind is in ``LENGTH_FREE_ENCODINGS``: a layer with
    position parameters of its own (``own_parameters[i]``) has its own bias, the others share the first layer's
    (the same object, so a kernel's per-bias tables are made once)."""
    if encodings[0].kind not in LENGTH_FREE_ENCODINGS:
        raise ValueError(f"{encodings[0].kind!r} position bias depends on the lengths (see LENGTH_FREE_ENCODINGS)")
    biases = []
    for encoding, own in zip(encodings, own_parameters):
        biases.append(encoding.bias(own, 0, 0, 0, device) if own or not biases else biases[0])
    return biases
