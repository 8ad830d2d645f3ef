"""FAT5: T5 whose attention, RMSNorm and loss run in fused kernels.

The modules keep T5's names (``SelfAttention.q``, ``DenseReluDense.wi_0``, ``relative_attention_bias``...) so a T5
checkpoint converts by renaming nothing and PEFT's LoRA finds its usual targets. What differs from transformers'
``modeling_t5.py``: the position bias is never materialised (the attention kernel reads the bucket table), padded
batches and packed batches (several examples per row, ``segment_ids``) share one code path, and the loss is a fused
cross-entropy with z-loss.
"""

import copy
import sys
import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    QuestionAnsweringModelOutput,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
    Seq2SeqQuestionAnsweringModelOutput,
    Seq2SeqSequenceClassifierOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils import logging

from .configuration_fat5 import FAT5Config
from .kernels.activation import ACTIVATIONS, gated_activation
from .kernels.attention import attention, attention_varlen, attention_with_probabilities
from .kernels.cross_entropy import cross_entropy
from .kernels.linear_cross_entropy import linear_cross_entropy
from .kernels.position_bias import PositionBias
from .kernels.rms_norm import rms_norm
from .position_encoding import FAT5FIRE, StackPositionEncoding, clamp_fp16
from .token_layout import TokenLayout

logger = logging.get_logger(__name__)


# transformers 5.24 renamed its models' KV-cache argument and output field from `past_key_values` to `cache` (the old
# name is deprecated until 5.40): FAT5's forwards take either, and their outputs carry it under the installed name
_CACHE_FIELD = (
    "cache" if "cache" in BaseModelOutputWithPastAndCrossAttentions.__dataclass_fields__ else "past_key_values"
)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """autocast's dtype while it is on for this device type, else None."""
    # meta tensors (shape and FLOP inference) have no autocast state: asking for theirs raises
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _given_cache(cache, past_key_values, owner):
    """The KV cache of a call that may name one twice. transformers' name, ``cache``, wins, as in T5, except while it
    is still empty: PEFT's prefix tuning hands its prefix as ``past_key_values`` to every step of ``generate`` (it
    takes each for the first, the cache being named ``cache`` now), next to generate's own cache, empty at the first
    step. T5 reads the empty one there, so its generation ignores the prefix that its training used; FAT5 starts
    from the prefix, and then goes on with the cache that grew from it. The old name is deprecated where the
    installed transformers has the new one, and says so as T5 does (``owner``: the module called)."""
    if past_key_values is not None and _CACHE_FIELD == "cache" and not torch.compiler.is_compiling():
        warnings.warn(
            f"`past_key_values` is deprecated and will be removed in version 5.40.0 for `{type(owner).__name__}."
            "forward`. Use `cache` instead.", FutureWarning, stacklevel=3,
        )
    if cache is None or (past_key_values is not None and cache.get_seq_length() == 0):
        return past_key_values if past_key_values is not None else cache
    return cache


class FAT5LayerNorm(nn.Module):
    """T5's RMS norm (no mean, no bias, variance in fp32), through the fused kernel when the config allows.

    ``autocast_output``: under autocast, give the output in autocast's dtype. For the norms at the head of a sub-layer,
    whose output only enters projections: autocast would cast it to that dtype at each of them (q, k and v: three
    casts of an fp32 tensor, and three back in the backward); made there directly, it is the same value (the fp32
    product rounded once) and the step does none of those casts. The projections' input gradients then add up in
    that dtype, as in pure bf16 training. The stacks' final norms keep T5's dtype: their output is the encoder's or
    the decoder's hidden states (the decoder casts the encoder's once for all its cross-attention layers).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, backend: str = "auto", autocast_output: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.backend = backend
        self.autocast_output = autocast_output

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output_dtype = _autocast_dtype(hidden_states.device.type) if self.autocast_output else None
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, backend=self.backend,
                        output_dtype=output_dtype)


def _fused_activation_backend(config: FAT5Config) -> str | None:
    """The backend of the fused activation, or None where transformers' own ACT2FN module serves."""
    if config.use_fused_activation and config.dense_act_fn in ACTIVATIONS:
        return config.attention_backend
    return None


def _output_projection_input(hidden_states: torch.Tensor, wo: nn.Linear) -> torch.Tensor:
    """The feed-forward's activations in ``wo``'s dtype, as transformers' T5 gives them (checkpoints that keep ``wo``
    in fp32 under fp16 weights), except under autocast: the product runs in the autocast dtype whatever its input's,
    so the cast would only be two passes over d_ff-wide activations there and two more in the backward (the values
    are the same: bf16 to fp32 and back is exact). Integer (quantised) weights take no cast, as in transformers."""
    if (
        hidden_states.dtype == wo.weight.dtype
        or not wo.weight.dtype.is_floating_point
        or _autocast_dtype(hidden_states.device.type) is not None
    ):
        return hidden_states
    return hidden_states.to(wo.weight.dtype)


class FAT5DenseActDense(nn.Module):
    def __init__(self, config: FAT5Config):
        super().__init__()
        self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout_rate)
        self.act = ACT2FN[config.dense_act_fn]
        self.activation_name = config.dense_act_fn
        self.activation_backend = _fused_activation_backend(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.activation_backend is None:
            hidden_states = self.act(self.wi(hidden_states))
        else:
            hidden_states = gated_activation(
                self.wi(hidden_states), None, self.activation_name, self.activation_backend
            )
        hidden_states = self.dropout(hidden_states)
        return self.wo(_output_projection_input(hidden_states, self.wo))


class FAT5DenseGatedActDense(nn.Module):
    def __init__(self, config: FAT5Config):
        super().__init__()
        self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout_rate)
        self.act = ACT2FN[config.dense_act_fn]
        self.activation_name = config.dense_act_fn
        self.activation_backend = _fused_activation_backend(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.activation_backend is None:
            hidden_states = self.act(self.wi_0(hidden_states)) * self.wi_1(hidden_states)
        else:
            hidden_states = gated_activation(
                self.wi_0(hidden_states), self.wi_1(hidden_states), self.activation_name, self.activation_backend
            )
        hidden_states = self.dropout(hidden_states)
        return self.wo(_output_projection_input(hidden_states, self.wo))


class FAT5LayerFF(nn.Module):
    def __init__(self, config: FAT5Config):
        super().__init__()
        self.DenseReluDense = FAT5DenseGatedActDense(config) if config.is_gated_act else FAT5DenseActDense(config)
        self.layer_norm = _layer_norm(config, autocast_output=True)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.dropout(self.DenseReluDense(self.layer_norm(hidden_states)))


def _layer_norm(config: FAT5Config, autocast_output: bool = False) -> FAT5LayerNorm:
    backend = config.attention_backend if config.use_fused_rms_norm else "reference"
    return FAT5LayerNorm(
        config.d_model, eps=config.layer_norm_epsilon, backend=backend, autocast_output=autocast_output
    )


class FAT5Attention(nn.Module):
    """Self- or cross-attention with T5's projections; the position encoding is applied inside the kernel."""

    def __init__(
        self,
        config: FAT5Config,
        has_relative_attention_bias: bool = False,
        is_decoder: bool = False,
        is_cross_attention: bool = False,
        layer_idx: int | None = None,
    ):
        super().__init__()
        self.n_heads = config.num_heads
        self.key_value_proj_dim = config.d_kv
        self.inner_dim = self.n_heads * self.key_value_proj_dim
        self.is_decoder = is_decoder
        self.is_cross_attention = is_cross_attention
        self.causal = is_decoder and not is_cross_attention
        self.layer_idx = layer_idx
        self.position_encoding = "none" if is_cross_attention else config.position_encoding
        self.relative_attention_num_buckets = config.relative_attention_num_buckets
        self.relative_attention_max_distance = config.relative_attention_max_distance
        self.scale = config.effective_attention_scale
        self.dropout = config.attention_dropout_rate
        self.backend = config.attention_backend
        self.has_relative_attention_bias = (
            has_relative_attention_bias and self.position_encoding in StackPositionEncoding.PARAMETER_NAMES
        )
        self.stack_position_encoding = StackPositionEncoding(
            self.position_encoding, self.n_heads, not is_decoder, self.relative_attention_max_distance,
            config.rope_theta, self.backend,
        )

        self.q = nn.Linear(config.d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(config.d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(config.d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, config.d_model, bias=False)
        if self.has_relative_attention_bias and self.position_encoding == "t5":
            self.relative_attention_bias = nn.Embedding(self.relative_attention_num_buckets, self.n_heads)
        if self.has_relative_attention_bias and self.position_encoding == "fire":
            self.fire = FAT5FIRE(config, bidirectional=not is_decoder)

    def _static_cache(self, past_key_values) -> bool:
        """Whether this self-attention layer decodes into a fixed-size cache buffer (transformers' StaticCache)."""
        if past_key_values is None or self.is_cross_attention:
            return False
        layers = past_key_values.self_attention_cache.layers
        return self.layer_idx < len(layers) and getattr(layers[self.layer_idx], "is_compileable", False)

    def own_position_parameters(self) -> tuple[torch.Tensor, ...]:
        """The stack's position parameters when this layer owns them (see :class:`StackPositionEncoding`), else ()."""
        if not self.has_relative_attention_bias:
            return ()
        owner = self.relative_attention_bias if self.position_encoding == "t5" else self.fire
        return self.stack_position_encoding.parameters_of(owner)

    def forward(
        self,
        hidden_states: torch.Tensor,
        layout: TokenLayout,
        key_value_states: torch.Tensor | None = None,
        key_value_layout: TokenLayout | None = None,
        position_parameters: tuple[torch.Tensor, ...] = (),
        past_key_values: EncoderDecoderCache | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None]:
        """Returns the output, the stack's position parameters for the later layers (see
        :class:`StackPositionEncoding`: copies of this layer's own when it has some, else ``position_parameters``,
        the first layer's, passed on) and, with ``output_attentions``, the attention probabilities (batch, heads,
        query, key), else None."""
        batch_size, query_length, _ = hidden_states.shape
        key_value_layout = layout if key_value_layout is None else key_value_layout
        query = self.q(hidden_states).view(batch_size, query_length, self.n_heads, self.key_value_proj_dim)
        query = query.transpose(1, 2)
        query = self.stack_position_encoding.rotate(query, layout.position_ids)
        key, value = self._keys_values(hidden_states, key_value_states, key_value_layout, past_key_values)

        query_offset = 0 if self.is_cross_attention else layout.query_offset
        if layout.is_packed:
            position_lengths = (layout.max_seqlen, key_value_layout.max_seqlen, 0)
        else:
            position_lengths = (query_length, key.shape[2], query_offset)
        position_bias, position_parameters = self._position_bias(position_parameters, position_lengths, query.device)

        dropout_p = self.dropout if self.training else 0.0
        if layout.is_packed:
            output, probabilities = self._attend_packed(
                query, key, value, layout, key_value_layout, position_bias, dropout_p
            ), None
        else:
            output, probabilities = self._attend(
                query, key, value, key_value_layout, query_offset, position_bias, dropout_p, past_key_values,
                output_attentions,
            )
        # reshape: below the kernels' smallest head dim the output is a slice of a padded one (not contiguous)
        return self.o(output.reshape(batch_size, query_length, self.inner_dim)), position_parameters, probabilities

    def _keys_values(self, hidden_states, key_value_states, key_value_layout, past_key_values):
        """The keys and values that the queries attend to, through the KV cache when there is one (a cross-attention
        layer projects the encoder's states once and reads them back at every later step)."""
        if self.is_cross_attention and past_key_values is not None and past_key_values.is_updated.get(self.layer_idx):
            cached = past_key_values.cross_attention_cache.layers[self.layer_idx]
            return cached.keys, cached.values
        source = key_value_states if self.is_cross_attention else hidden_states
        kv_shape = (source.shape[0], source.shape[1], self.n_heads, self.key_value_proj_dim)
        key = self.k(source).view(kv_shape).transpose(1, 2)
        value = self.v(source).view(kv_shape).transpose(1, 2)
        key = self.stack_position_encoding.rotate(key, key_value_layout.position_ids)
        if past_key_values is None:
            return key, value
        if self.is_cross_attention:
            key, value = past_key_values.cross_attention_cache.update(key, value, self.layer_idx)
            past_key_values.is_updated[self.layer_idx] = True
            return key, value
        return past_key_values.self_attention_cache.update(key, value, self.layer_idx)

    def _position_bias(self, position_parameters, position_lengths, device) -> tuple[PositionBias, tuple]:
        """This layer's PositionBias, and the position parameters that it passes on to the later layers: copies of
        its own when it owns some, else those it received (``position_parameters``)."""
        encoding = self.stack_position_encoding
        own = self.own_position_parameters()
        if not own:
            return encoding.bias(position_parameters, *position_lengths, device), position_parameters
        # copies, not the parameters: under FSDP this block's parameters are sharded again once it has run, and a
        # copy's backward needs no parameter values, only adds its gradient to them
        return encoding.bias(own, *position_lengths, device), tuple(parameter.clone() for parameter in own)

    def _attend_packed(self, query, key, value, layout, key_value_layout, position_bias, dropout_p):
        """The varlen attention over packed rows: (tokens, heads, head_dim)."""
        # the segments follow the tokens' row-major order (TokenLayout): the batch viewed as one row of tokens
        flat_shape = (-1, self.n_heads, self.key_value_proj_dim)
        return attention_varlen(
            query.transpose(1, 2).reshape(flat_shape), key.transpose(1, 2).reshape(flat_shape),
            value.transpose(1, 2).reshape(flat_shape), layout.cu_seqlens, key_value_layout.cu_seqlens,
            layout.max_seqlen, key_value_layout.max_seqlen, position_bias=position_bias, scale=self.scale,
            causal=self.causal, dropout_p=dropout_p, backend=self._backend(dropout_p),
        )

    def _attend(self, query, key, value, key_value_layout, query_offset, position_bias, dropout_p, past_key_values,
                output_attentions):
        """Attention over padded rows, (batch, query, heads, head_dim), and the probabilities when asked for: the
        fused kernels take the causal flag and a key padding mask; a custom 4-D mask or the probabilities take the
        materialising reference, for this call only (the numerics are the kernels')."""
        arguments = {"position_bias": position_bias, "scale": self.scale, "query_offset": query_offset,
                     "dropout_p": dropout_p}
        custom_mask = key_value_layout.attention_mask
        if custom_mask is not None:
            self._check_custom_mask(custom_mask, query.shape[2], key.shape[2])
            output, probabilities = attention_with_probabilities(query, key, value, attention_mask=custom_mask,
                                                                 **arguments)
        else:
            arguments.update(causal=self.causal,
                             key_padding_mask=self._key_padding_mask(key_value_layout, key.shape[2], past_key_values))
            if output_attentions:
                output, probabilities = attention_with_probabilities(query, key, value, **arguments)
            else:
                output = attention(query, key, value, **arguments, backend=self._backend(dropout_p))
                probabilities = None
        return output.transpose(1, 2), probabilities if output_attentions else None

    def _backend(self, dropout_p: float) -> str:
        # the fused kernels do not drop attention probabilities: training with attention dropout takes the reference
        return "reference" if dropout_p > 0 else self.backend

    def _key_padding_mask(self, key_value_layout, key_length, past_key_values):
        key_padding_mask = key_value_layout.padding_mask
        narrow_mask = key_padding_mask is not None and key_padding_mask.shape[1] < key_length
        if narrow_mask and self._static_cache(past_key_values):
            # a static cache's keys are its whole buffer; the slots after the written ones are hidden (causal)
            key_padding_mask = nn.functional.pad(key_padding_mask, (0, key_length - key_padding_mask.shape[1]))
        if key_padding_mask is not None and key_padding_mask.shape[1] != key_length:
            raise ValueError(
                f"the attention mask covers {key_padding_mask.shape[1]} positions but attention sees {key_length} "
                "keys (a decoder mask wider than the static cache it decodes into, or a cache filled for other "
                "inputs)"
            )
        return key_padding_mask

    def _check_custom_mask(self, mask, query_length, key_length):
        if mask.shape[2] in (1, query_length) and mask.shape[3] == key_length:
            return
        if self.is_cross_attention:
            raise ValueError(
                f"the encoder's 4-D attention mask {tuple(mask.shape)} also masks the decoder's cross-attention, as in "
                f"T5, which has {query_length} queries and {key_length} keys: its query dimension must be 1 or "
                f"{query_length} (give the encoder's outputs and a 2-D mask, or a (batch, 1, 1, {key_length}) mask)"
            )
        raise ValueError(
            f"a 4-D attention mask is (batch, 1, query_length or 1, key_length) = (batch, 1, {query_length}, "
            f"{key_length}) here (the keys include the cached ones), got {tuple(mask.shape)}"
        )


class FAT5LayerSelfAttention(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False, is_decoder=False, layer_idx=None):
        super().__init__()
        self.SelfAttention = FAT5Attention(
            config, has_relative_attention_bias=has_relative_attention_bias, is_decoder=is_decoder, layer_idx=layer_idx
        )
        self.layer_norm = _layer_norm(config, autocast_output=True)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, layout, position_parameters=(), past_key_values=None, output_attentions=False):
        attention_output, position_parameters, probabilities = self.SelfAttention(
            self.layer_norm(hidden_states), layout, position_parameters=position_parameters,
            past_key_values=past_key_values, output_attentions=output_attentions,
        )
        return hidden_states + self.dropout(attention_output), position_parameters, probabilities


class FAT5LayerCrossAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.EncDecAttention = FAT5Attention(config, is_decoder=True, is_cross_attention=True, layer_idx=layer_idx)
        self.layer_norm = _layer_norm(config, autocast_output=True)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, layout, key_value_states, key_value_layout, past_key_values=None,
                output_attentions=False):
        attention_output, _, probabilities = self.EncDecAttention(
            self.layer_norm(hidden_states),
            layout,
            key_value_states=key_value_states,
            key_value_layout=key_value_layout,
            past_key_values=past_key_values,
            output_attentions=output_attentions,
        )
        return hidden_states + self.dropout(attention_output), probabilities


class FAT5Block(GradientCheckpointingLayer):
    def __init__(self, config, has_relative_attention_bias=False, is_decoder=False, layer_idx=None):
        super().__init__()
        self.is_decoder = is_decoder
        self.layer = nn.ModuleList()
        self.layer.append(
            FAT5LayerSelfAttention(
                config, has_relative_attention_bias=has_relative_attention_bias, is_decoder=is_decoder,
                layer_idx=layer_idx,
            )
        )
        if is_decoder:
            self.layer.append(FAT5LayerCrossAttention(config, layer_idx=layer_idx))
        self.layer.append(FAT5LayerFF(config))

    def forward(
        self,
        hidden_states,
        layout,
        encoder_hidden_states=None,
        encoder_layout=None,
        past_key_values=None,
        *position_parameters,
        output_attentions=False,
    ):
        """Returns the hidden states, the self-attention's and the cross-attention's probabilities (None unless
        ``output_attentions``; the cross-attention's also None where there is none), then the stack's position
        parameters for the next block (see :class:`StackPositionEncoding`).

        The position parameters come in and go out as tensors of their own, not in a container: reentrant gradient
        checkpointing (``use_reentrant=True``) carries gradients only through the tensors among a block's arguments
        and outputs, and would lose the later blocks' share of the first block's bias table."""
        hidden_states, position_parameters, self_probabilities = self.layer[0](
            hidden_states, layout, position_parameters, past_key_values, output_attentions
        )
        hidden_states = clamp_fp16(hidden_states)
        cross_probabilities = None
        if self.is_decoder and encoder_hidden_states is not None:
            hidden_states, cross_probabilities = self.layer[1](
                hidden_states, layout, encoder_hidden_states, encoder_layout, past_key_values, output_attentions
            )
            hidden_states = clamp_fp16(hidden_states)
        hidden_states = clamp_fp16(self.layer[-1](hidden_states))
        return hidden_states, self_probabilities, cross_probabilities, *position_parameters


class FAT5Stack(nn.Module):
    """The encoder or the decoder: blocks between an embedding (shared, owned by the model) and a final norm."""

    main_input_name = "input_ids"

    def __init__(self, config: FAT5Config, embed_tokens: nn.Embedding, is_decoder: bool):
        super().__init__()
        # the model's own config (not a copy, as T5's stacks have): its output_hidden_states and return_dict are the
        # stack's defaults too, and stay so when they change
        self.config = config
        self.embed_tokens = embed_tokens
        self.is_decoder = is_decoder
        num_layers = config.num_decoder_layers if is_decoder else config.num_layers
        self.block = nn.ModuleList(
            [
                FAT5Block(
                    config,
                    has_relative_attention_bias=config.position_bias_per_layer or i == 0,
                    is_decoder=is_decoder,
                    layer_idx=i,
                )
                for i in range(num_layers)
            ]
        )
        self.final_layer_norm = _layer_norm(config)
        self.dropout = nn.Dropout(config.dropout_rate)
        self.gradient_checkpointing = False

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        segment_ids=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        encoder_segment_ids=None,
        past_key_values=None,
        output_hidden_states=None,
        return_dict=None,
        cache=None,
        layout=None,
        encoder_layout=None,
        use_cache=None,
        output_attentions=None,
        **kwargs,
    ):
        """``layout`` / ``encoder_layout``: the TokenLayout of ``segment_ids`` / ``encoder_segment_ids`` when the
        caller has built it already (the seq2seq models build the encoder's once for both stacks: each build reads
        two numbers back to the host). ``use_cache`` (``config.use_cache`` when not given, as in T5's stack) on the
        decoder called on its own starts a KV cache, returned in the output, from which a later call continues; the
        models start theirs and pass ``use_cache=False``.
        ``attention_mask`` may be a custom 4-D mask (see :class:`TokenLayout`); ``output_attentions`` returns the
        attention probabilities, as T5's eager attention does: both run the materialising attention for the call."""
        _check_supported_arguments(self.config, kwargs)
        past_key_values = _given_cache(cache, past_key_values, self)
        if use_cache is None:
            use_cache = self.config.use_cache
        if use_cache and self.is_decoder and past_key_values is None and segment_ids is None:
            past_key_values = EncoderDecoderCache(DynamicCache(), DynamicCache())
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        output_attentions = _asks_for_attentions(self.config, output_attentions)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        layout = self._layout(inputs_embeds, attention_mask, segment_ids, layout, past_key_values)
        if output_attentions and layout.is_packed:
            raise ValueError(
                "output_attentions=True needs padded rows: packed rows (segment_ids) attend per segment, through the "
                "varlen kernels, and have no (batch, heads, query, key) probabilities"
            )
        if encoder_hidden_states is not None:
            encoder_layout = self._encoder_layout(
                layout, inputs_embeds, encoder_hidden_states, encoder_attention_mask, encoder_segment_ids,
                encoder_layout,
            )
            autocast_dtype = _autocast_dtype(encoder_hidden_states.device.type)
            if autocast_dtype is not None:
                # cast once here instead of by autocast at every cross-attention's k and v (and as often back)
                encoder_hidden_states = encoder_hidden_states.to(autocast_dtype)
        output = self._run_blocks(
            inputs_embeds, layout, encoder_hidden_states, encoder_layout, past_key_values, output_hidden_states,
            output_attentions,
        )
        return _as_requested(output, return_dict, self.config)

    def _layout(self, inputs_embeds, attention_mask, segment_ids, layout, past_key_values) -> TokenLayout:
        batch_size, length = inputs_embeds.shape[:2]
        if segment_ids is not None:
            if attention_mask is not None:
                raise ValueError("give either segment_ids (packed rows) or an attention_mask (padded rows), not both")
            if past_key_values is not None:
                raise ValueError("packed rows (segment_ids) cannot be decoded with a KV cache")
            if segment_ids.shape != (batch_size, length):
                raise ValueError(f"segment_ids must be {(batch_size, length)}, got {tuple(segment_ids.shape)}")
            return layout if layout is not None else TokenLayout.packed(segment_ids)
        offset = past_key_values.get_seq_length() if past_key_values is not None else 0
        if isinstance(offset, torch.Tensor):
            # a static cache's length: a tensor that each layer's update advances in place, so read it once here
            offset = offset.clone()
        return TokenLayout.padded(
            batch_size, length, attention_mask, offset, inputs_embeds.device,
            mask_name="decoder_attention_mask" if self.is_decoder else "attention_mask",
        )

    @staticmethod
    def _encoder_layout(layout, inputs_embeds, encoder_hidden_states, encoder_attention_mask, encoder_segment_ids,
                        encoder_layout) -> TokenLayout:
        """The layout of the encoder's tokens, which the cross-attention reads as keys."""
        if encoder_segment_ids is not None:
            if encoder_layout is None:
                encoder_layout = TokenLayout.packed(encoder_segment_ids)
            _check_same_examples(layout, encoder_layout)
            return encoder_layout
        if layout.is_packed:
            raise ValueError("packed decoder rows (decoder_segment_ids) need the encoder's segment_ids")
        return TokenLayout.padded(
            inputs_embeds.shape[0], encoder_hidden_states.shape[1], encoder_attention_mask,
            device=inputs_embeds.device, mask_name="the encoder's attention_mask",
        )

    def _run_blocks(self, inputs_embeds, layout, encoder_hidden_states, encoder_layout, past_key_values,
                    output_hidden_states, output_attentions) -> BaseModelOutputWithPastAndCrossAttentions:
        # the first block's position parameters (T5 table, FIRE) travel as tensors to the blocks that share them, never
        # as a reference to the first block, whose parameters FSDP shards again once it has run
        position_parameters = ()
        all_hidden_states = () if output_hidden_states else None
        attentions = () if output_attentions else None
        cross_attentions = () if output_attentions and encoder_hidden_states is not None else None
        hidden_states = self.dropout(inputs_embeds)
        for block in self.block:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states, self_probabilities, cross_probabilities, *position_parameters = block(
                hidden_states, layout, encoder_hidden_states, encoder_layout, past_key_values, *position_parameters,
                output_attentions=output_attentions,
            )
            if output_attentions:
                attentions += (self_probabilities,)
            if cross_attentions is not None:
                cross_attentions += (cross_probabilities,)
        hidden_states = self.dropout(self.final_layer_norm(hidden_states))
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states, hidden_states=all_hidden_states, attentions=attentions,
            cross_attentions=cross_attentions, **{_CACHE_FIELD: past_key_values},
        )


def _check_same_examples(layout: TokenLayout, encoder_layout: TokenLayout) -> None:
    """Decoder segment ``s`` attends to encoder segment ``s``: both layouts must number the same examples."""
    if not layout.is_packed:
        raise ValueError("decoder_segment_ids must hold the same examples, row by row, as the encoder's segment_ids")
    given = (layout.examples is None, encoder_layout.examples is None)
    if given == (True, True):
        # built by the caller: the segments pair up by their order, which only the caller can vouch for (reading
        # them here would wait for the device)
        if layout.cu_seqlens.shape != encoder_layout.cu_seqlens.shape:
            raise ValueError(
                f"decoder_cu_seqlens has {layout.cu_seqlens.numel() - 1} segments and cu_seqlens "
                f"{encoder_layout.cu_seqlens.numel() - 1}: decoder segment s holds the targets of encoder segment s"
            )
    elif given != (False, False):
        raise ValueError("give cu_seqlens and decoder_cu_seqlens together, or neither (the model derives both)")
    elif layout.examples.shape != encoder_layout.examples.shape or not torch.equal(
        layout.examples, encoder_layout.examples
    ):
        raise ValueError("decoder_segment_ids must hold the same examples, row by row, as the encoder's segment_ids")


@dataclass
class FAT5Seq2SeqLMOutput(Seq2SeqLMOutput):
    """``Seq2SeqLMOutput`` with the two parts of the loss, ``loss = ce_loss + z_loss``, set only when the forward is
    asked for them (``return_loss_parts=True``): otherwise the output holds T5's fields, so that its length, its keys
    and its positions are T5's."""

    ce_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None

    def to_tuple(self) -> tuple:
        # T5's tuple (``return_dict=False``) even when the parts were asked for: they are named fields only
        return tuple(value for name, value in self.items() if name not in ("ce_loss", "z_loss"))


def _as_requested(output, return_dict: bool | None, config: FAT5Config):
    """T5's ``return_dict``: the ModelOutput, or its tuple when False (the argument, else ``config.return_dict``)."""
    return output if (config.return_dict if return_dict is None else return_dict) else output.to_tuple()


# T5's masks over attention heads (transformers 5's T5 no longer reads them)
_HEAD_MASKS = ("head_mask", "decoder_head_mask", "cross_attn_head_mask")


def _check_supported_arguments(config: FAT5Config, kwargs: dict) -> None:
    """Refuse by name what the fused attention cannot do, instead of silently returning or computing something else."""
    head_masks = [name for name in _HEAD_MASKS if kwargs.get(name) is not None]
    if head_masks:
        raise ValueError(
            f"{', '.join(head_masks)} is not supported: FAT5's fused attention cannot mask or weight single heads "
            "(transformers 5 removed these arguments from T5 too)"
        )


def _asks_for_attentions(config: FAT5Config, output_attentions: bool | None) -> bool:
    """T5's ``output_attentions``: the argument, else the config's."""
    return config.output_attentions if output_attentions is None else bool(output_attentions)


# JAX's truncated normal, cut at two standard deviations, has a standard deviation of this many: T5X divides the scale
# of its draw by it, so that the drawn values keep the standard deviation asked for
_TRUNCATED_NORMAL_STD = 0.87962566103423978


def _draw(weight: torch.Tensor, distribution: str, std: float) -> None:
    """Draw ``weight`` in place (through transformers' ``init``: a loaded weight is left alone) from a centred
    distribution whose values have standard deviation ``std``: "normal", "truncated_normal" (JAX's, as T5X's) or
    "uniform"."""
    if distribution == "normal":
        init.normal_(weight, mean=0.0, std=std)
    elif distribution == "truncated_normal":
        scale = std / _TRUNCATED_NORMAL_STD
        init.trunc_normal_(weight, mean=0.0, std=scale, a=-2 * scale, b=2 * scale)
    elif distribution == "uniform":
        bound = std * 3**0.5
        init.uniform_(weight, -bound, bound)
    else:
        raise ValueError(f"unknown init distribution {distribution!r}")


def _unreadable_safetensors(model_name_or_path, kwargs) -> str:
    """The weights file of a local folder (or the Hub cache) whose safetensors header does not read, or the
    folder's name when none is found."""
    import os

    from safetensors import SafetensorError, safe_open

    folder = str(model_name_or_path)
    if not os.path.isdir(folder):
        from huggingface_hub import try_to_load_from_cache

        subfolder = kwargs.get("subfolder") or ""
        cached = try_to_load_from_cache(folder, os.path.join(subfolder, "model.safetensors"),
                                        cache_dir=kwargs.get("cache_dir"), revision=kwargs.get("revision"))
        folder = os.path.dirname(cached) if isinstance(cached, str) else folder
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                try:
                    with safe_open(os.path.join(folder, name), framework="pt"):
                        pass
                except (SafetensorError, OSError):
                    return os.path.join(folder, name)
    return f"a weights file of {model_name_or_path}"


def _register_with_peft() -> None:
    """Give FAT5 T5's entries in PEFT's per-model defaults (LoRA's and IA3's target modules, prefix tuning's cache
    layout...), so that ``LoraConfig(task_type="SEQ_2_SEQ_LM")`` without ``target_modules`` works as on T5: the
    modules keep T5's names. Only where PEFT is imported already: importing it here would slow every load."""
    constants = sys.modules.get("peft.utils.constants")
    if constants is None:
        return
    for name, mapping in vars(constants).items():
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(mapping, dict) and "t5" in mapping:
            mapping.setdefault(FAT5Config.model_type, mapping["t5"])


class FAT5PreTrainedModel(PreTrainedModel):
    """The base of every FAT5 model: transformers' loading and saving, and the first draw of the weights.

    A fresh model is drawn as T5X's (``config.initialization="t5x"``, the default) or transformers' T5's
    (``"transformers"``) is, by ``_init_weights``. The references: T5X's T5 v1.1, ``t5x/examples/t5/network.py``
    (``Transformer.setup``, ``Encoder``, ``Decoder``) and ``t5x/examples/t5/layers.py``
    (``MultiHeadDotProductAttention``, ``DenseGeneral``, ``MlpBlock``, ``Embed``, ``RelativePositionBiases``,
    ``LayerNorm``); transformers' ``models/t5/modeling_t5.py``, ``T5PreTrainedModel._init_weights``. Standard deviations
    of the drawn values:

    ======================== ================================================= ============================
    weight                   T5X (``"t5x"``)                                   transformers' T5
    ======================== ================================================= ============================
    shared (token embedding) normal, 1 (``Embed``, ``normal(stddev=1.0)``)     normal, 1
    q                        normal, (d_model * d_kv)**-0.5                    the same
    k, v                     normal, d_model**-0.5                             the same
    o                        normal, (num_heads * d_kv)**-0.5                  the same
    wi, wi_0, wi_1           truncated normal, d_model**-0.5                   normal, d_model**-0.5
    wo                       truncated normal, d_ff**-0.5                      normal, d_ff**-0.5
    relative_attention_bias  uniform, (2 / (num_buckets + num_heads))**0.5     normal, d_model**-0.5
    untied lm_head           truncated normal, d_model**-0.5                   normal, 1
    tied lm_head             the embedding's; logits / sqrt(d_model)           the same
    RMS norm weights         1                                                 1
    ======================== ================================================= ============================

    - q, k, v, o: ``MultiHeadDotProductAttention``'s ``variance_scaling(1.0, 'fan_in', 'normal')``, fan-in d_model
      (o: num_heads * d_kv). T5 does not scale q·k by 1/sqrt(d_kv): T5X folds it into q's draw (``query_init =
      kernel_init / sqrt(head_dim)``), hence (d_model * d_kv)**-0.5, which transformers draws too.
    - wi, wo and the untied head (``logits_dense``): ``DenseGeneral`` and ``MlpBlock``'s ``variance_scaling(1.0,
      'fan_in', 'truncated_normal')``, JAX's truncated normal: cut at two standard deviations of a normal whose
      standard deviation is divided by 0.8796 first, so that the drawn values keep d_model**-0.5 (d_ff**-0.5).
      transformers draws the same spreads untruncated, except its untied head: std 1 (``initializer_factor``),
      logits of std about sqrt(d_model) that the first hundreds of steps spend shrinking; T5X's fan-in head starts
      the loss near ln(vocab_size). This is the difference that matters.
    - relative_attention_bias: ``Encoder`` and ``Decoder`` give ``relpos_bias`` ``variance_scaling(1.0,
      'fan_avg', 'uniform')`` over its (num_heads, num_buckets) table: Glorot's uniform, bound (6 / (num_buckets +
      num_heads))**0.5, about 0.39 for T5's 32 buckets and 8 heads where transformers' std is 0.044 (d_model 512).
    - Tied head: T5X's ``logits_via_embedding`` divides the logits by sqrt(d_model); FAT5 scales the decoder
      output by d_model**-0.5 (``scale_decoder_outputs``, on by default when tied), as transformers does. A tied
      head without that scaling starts with logits of std about sqrt(d_model) under either draw: the embedding is
      also the input, so no draw can fix it.
    - Heads that T5X lacks. ``"t5x"`` gives them ``DenseGeneral``'s fan-in draw: truncated normal, d_model**-0.5
      for the sequence classification head's dense and out_proj, the token classifier and qa_outputs.
      ``"transformers"`` gives transformers' T5 draws: normal, d_model**-0.5 for all but the token classifier
      (std 1). Biases are zero under both.
    - FIRE (neither reference has it): its MLP is drawn by Glorot's uniform (biases zero), ``c`` and ``threshold``
      start at ``fire_init_c`` and ``fire_init_threshold``, under both. ALiBi's slopes are fixed and RoPE has no
      parameter: nothing to draw.
    - ``initializer_factor`` multiplies every standard deviation above (and the norms' 1), FIRE's MLP aside; at
      1.0, its default, the draws are the references'.
    """

    config_class = FAT5Config
    config: FAT5Config
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["FAT5Block"]
    _supports_cache_class = True
    _can_compile_fullgraph = False
    # T5's: fp16 checkpoints of T5 v1.1 / FLAN-T5 overflow in the feed-forward's output projection unless it stays fp32
    _keep_in_fp32_modules: ClassVar[list[str]] = ["wo"]
    # each class names the weights that may share the embedding's storage (what save_pretrained dedups) among the
    # modules it has; which ones actually do is decided per model by get_expanded_tied_weights_keys
    _tied_weights_keys: ClassVar[dict[str, str]] = {}

    def __init__(self, config: FAT5Config, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        _register_with_peft()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' ``from_pretrained``; a weights file that is not readable safetensors (truncated, empty,
        random) is named in the error, which safetensors' own does not do."""
        from safetensors import SafetensorError

        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as error:
            raise OSError(
                f"{_unreadable_safetensors(pretrained_model_name_or_path, kwargs)} is not a readable safetensors file "
                f"(truncated or corrupted?): {error}"
            ) from error

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """FAT5's attention is its own kernels (``config.attention_backend``), never one of transformers' attention
        functions, so ``attn_implementation`` has nothing to choose. "eager" (what transformers falls back to) and
        "sdpa" (what scripts ask of every model) load the model unchanged; the others are refused by name, rather
        than with transformers' advice to ask for support that FAT5 will never need."""
        if requested_attention in (None, "eager", "sdpa"):
            if requested_attention == "sdpa":
                logger.warning_once(
                    'FAT5 ignores attn_implementation="sdpa": its attention runs in its own fused kernels, chosen '
                    f"by config.attention_backend ({self.config.attention_backend!r})"
                )
            # the config keeps what was asked for, as T5's does (scripts read it back); both run the same kernels
            return requested_attention or "eager"
        raise ValueError(
            f"attn_implementation={requested_attention!r} is not supported: FAT5's attention runs in its own fused "
            "kernels, chosen by config.attention_backend ('auto', 'triton' or 'reference'); leave attn_implementation "
            "unset"
        )

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # The stacks use the model's embedding module itself, always; lm_head shares its weight only when the config
        # says so. (transformers' default ties nothing at all when tie_word_embeddings is False, FLAN-T5's case.)
        if all_submodels:
            # each FAT5 model inside this one (a sequence classifier's `transformer`) answers for itself, prefixed
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        tied = {
            f"{stack}.embed_tokens.weight": "shared.weight" for stack in ("encoder", "decoder") if hasattr(self, stack)
        }
        if self.config.tie_word_embeddings and isinstance(getattr(self, "lm_head", None), nn.Linear):
            tied["lm_head.weight"] = "shared.weight"
        return tied

    def mark_tied_weights_as_initialized(self, loading_info):
        """transformers marks the tied targets as loaded so that they are not drawn for nothing, and for custom code
        also drops from the missing keys every parameter so marked. FAT5's stacks hold the embedding module itself,
        so its target and source are one parameter: marked, a checkpoint without the embedding would load with an
        undrawn one and report nothing missing. Only a target that is a parameter of its own is marked here; the
        tying that follows then reports exactly T5's missing keys."""
        for target, source in self.all_tied_weights_keys.items():
            target_parameter = self.get_parameter(target)
            if target_parameter is not self.get_parameter(source):
                target_parameter._is_hf_initialized = True

    @torch.no_grad()
    def _init_weights(self, module):
        """The draw of a fresh model, T5X's (``config.initialization="t5x"``, the default) or transformers' T5's
        (``"transformers"``). It writes through transformers' ``init``, which leaves a weight loaded from a checkpoint
        alone: loading and conversion never draw a loaded weight, whatever the setting. Each Linear and Embedding
        draws its own weight, once, with the init spread of its place in the model (``_init_spread_of``), so that a
        direct call on one (transformers' ``resize_token_embeddings`` builds the new head outside the model and calls
        this on it) and a whole-model pass agree. The draws and their references: the class docstring.
        """
        if isinstance(module, FAT5LayerNorm):
            init.constant_(module.weight, self.config.initializer_factor)
        elif isinstance(module, (nn.Embedding, nn.Linear)):
            spread = self._init_spread_of(module)
            if spread is not None:
                _draw(module.weight, *spread)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, FAT5FIRE):
            init.constant_(module.c, self.config.fire_init_c)
            init.constant_(module.threshold, self.config.fire_init_threshold)

    def _init_spread_of(self, module: nn.Module) -> tuple[str, float] | None:
        """The init spread of a Linear's or Embedding's weight, by its place in this model and
        ``config.initialization`` (the table in ``_init_weights``): ``(distribution, std)``, the distribution
        ("normal", "truncated_normal" or "uniform") and the standard deviation of the drawn values. None for an
        lm_head tied to the embeddings, drawn as them. A module that is not (yet) part of the model, such as the head
        ``resize_token_embeddings`` builds, is drawn as its kind is by default: an Embedding as the token embeddings,
        a Linear by T5X's fan-in rule (``"t5x"``; d_model**-0.5 for that head) or with std 1 (``"transformers"``)."""
        config = self.config
        d_model = config.d_model
        t5x = config.initialization == "t5x"
        # T5X's DenseGeneral and MlpBlock draw a truncated normal where transformers' T5 draws a normal
        dense = "truncated_normal" if t5x else "normal"
        for holder in self.modules():
            if isinstance(holder, FAT5FIRE) and any(module is layer for layer in holder.mlp):
                return "uniform", (2 / (module.in_features + module.out_features)) ** 0.5  # Glorot's
            name = next((name for name, child in holder.named_children() if child is module), None)
            if name is None:
                continue
            spread = None
            if isinstance(holder, FAT5Attention):
                bias_table = (
                    ("uniform", (2 / (config.relative_attention_num_buckets + config.num_heads)) ** 0.5)
                    if t5x
                    else ("normal", d_model**-0.5)
                )
                spread = {
                    "q": ("normal", (d_model * config.d_kv) ** -0.5),
                    "k": ("normal", d_model**-0.5),
                    "v": ("normal", d_model**-0.5),
                    "o": ("normal", (config.num_heads * config.d_kv) ** -0.5),
                    "relative_attention_bias": bias_table,
                }.get(name)
            elif isinstance(holder, (FAT5DenseActDense, FAT5DenseGatedActDense)):
                spread = dense, (config.d_ff if name == "wo" else d_model) ** -0.5
            elif isinstance(holder, FAT5ClassificationHead) or (
                isinstance(holder, FAT5ForQuestionAnswering) and name == "qa_outputs"
            ):
                spread = dense, d_model**-0.5
            elif isinstance(holder, FAT5ForTokenClassification) and name == "classifier":
                spread = (dense, d_model**-0.5) if t5x else ("normal", 1.0)
            elif isinstance(holder, FAT5ForConditionalGeneration) and name == "lm_head":
                if config.tie_word_embeddings:
                    return None
                spread = (dense, d_model**-0.5) if t5x else ("normal", 1.0)
            if spread is not None:
                return spread[0], config.initializer_factor * spread[1]
        if isinstance(module, nn.Linear) and t5x:
            return dense, config.initializer_factor * module.in_features**-0.5
        return "normal", config.initializer_factor * 1.0

    def _initialize_weights(self, module, *args, **kwargs):
        # transformers takes a module of custom code that owns no parameter itself as already initialised, so a head
        # that a checkpoint lacks would keep garbage. `_init_weights` writes through transformers' `init`, which
        # leaves loaded tensors alone, so it can run on every module.
        if "is_custom_code" in kwargs:
            kwargs["is_custom_code"] = False
        elif args:
            args = (False, *args[1:])
        return super()._initialize_weights(module, *args, **kwargs)

    def _shift_right(self, input_ids: torch.Tensor) -> torch.Tensor:
        decoder_start_token_id = self.config.decoder_start_token_id
        pad_token_id = self.config.pad_token_id
        if decoder_start_token_id is None or pad_token_id is None:
            raise ValueError("config.decoder_start_token_id and config.pad_token_id must be set to shift labels right")
        shifted = input_ids.new_zeros(input_ids.shape)
        shifted[..., 1:] = input_ids[..., :-1].clone()
        shifted[..., 0] = decoder_start_token_id
        return shifted.masked_fill(shifted == -100, pad_token_id)

    def _lm_loss(self, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None):
        ce_loss, z_loss = cross_entropy(
            logits.view(-1, logits.shape[-1]), labels.to(logits.device).view(-1), **self._lm_loss_options(),
            num_items_in_batch=num_items_in_batch,
        )
        return ce_loss + z_loss, ce_loss, z_loss

    def _lm_loss_options(self) -> dict:
        return {
            "ignore_index": -100,
            "label_smoothing": self.config.label_smoothing,
            "z_loss": self.config.z_loss,
            "backend": self.config.attention_backend if self.config.use_fused_cross_entropy else "reference",
        }


_STACK_EMBEDDINGS = {"encoder.embed_tokens.weight": "shared.weight", "decoder.embed_tokens.weight": "shared.weight"}


class _FAT5EncoderDecoder(FAT5PreTrainedModel):
    """The encoder-decoder's parts, which the bare model and the language model share: the embedding and both stacks
    that read it. A subclass adds its head, then calls ``post_init``."""

    _tied_weights_keys = _STACK_EMBEDDINGS

    def __init__(self, config: FAT5Config):
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = FAT5Stack(config, self.shared, is_decoder=False)
        self.decoder = FAT5Stack(config, self.shared, is_decoder=True)

    def get_input_embeddings(self):
        return self.shared

    def set_input_embeddings(self, new_embeddings):
        self.shared = new_embeddings
        self.encoder.embed_tokens = new_embeddings
        self.decoder.embed_tokens = new_embeddings

    def get_encoder(self):
        return self.encoder

    def get_decoder(self):
        return self.decoder


class FAT5Model(_FAT5EncoderDecoder):
    """The bare encoder-decoder, returning the decoder's last hidden states."""

    # a checkpoint of the full model loads quietly without its head, as in T5Model
    _keys_to_ignore_on_load_unexpected: ClassVar[list[str]] = [r"^lm_head\."]

    def __init__(self, config: FAT5Config):
        super().__init__(config)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        decoder_input_ids=None,
        decoder_attention_mask=None,
        encoder_outputs=None,
        past_key_values=None,
        inputs_embeds=None,
        decoder_inputs_embeds=None,
        segment_ids=None,
        decoder_segment_ids=None,
        use_cache=None,
        output_hidden_states=None,
        return_dict=None,
        cache=None,
        cu_seqlens=None,
        segment_position_ids=None,
        decoder_cu_seqlens=None,
        decoder_segment_position_ids=None,
        output_attentions=None,
        **kwargs,
    ) -> Seq2SeqModelOutput:
        _check_supported_arguments(self.config, kwargs)
        packed_layout = {"cu_seqlens": cu_seqlens, "segment_position_ids": segment_position_ids,
                         "decoder_cu_seqlens": decoder_cu_seqlens,
                         "decoder_segment_position_ids": decoder_segment_position_ids}
        encoder_outputs, decoder_outputs = _encode_decode(
            self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
            _given_cache(cache, past_key_values, self), inputs_embeds, decoder_inputs_embeds, segment_ids,
            decoder_segment_ids, use_cache, output_hidden_states, packed_layout,
            _asks_for_attentions(self.config, output_attentions),
        )
        output = Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **{_CACHE_FIELD: getattr(decoder_outputs, _CACHE_FIELD)},
            **_seq2seq_states(encoder_outputs, decoder_outputs),
        )
        return _as_requested(output, return_dict, self.config)


def _encode_decode(
    model, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs, past_key_values,
    inputs_embeds, decoder_inputs_embeds, segment_ids, decoder_segment_ids, use_cache, output_hidden_states,
    packed_layout=None, output_attentions=False,
):
    """Run the encoder (unless its outputs are given) and the decoder, creating the KV cache when asked.

    ``packed_layout``: the packed rows' layout as the caller built it (``cu_seqlens``, ``segment_position_ids`` and
    their ``decoder_`` twins, see :meth:`TokenLayout.given`), None where not given. ``output_attentions``: the
    caller's answer, argument or config (the stacks are told it, so that an explicit False is not overruled by
    config.output_attentions). The encoder's ``attention_mask`` also masks the decoder's cross-attention, a custom
    4-D one included, as in T5."""
    packed_layout = packed_layout or {}
    encoder_layout = _given_layout(segment_ids, packed_layout, "")
    decoder_layout = _given_layout(decoder_segment_ids, packed_layout, "decoder")
    if encoder_layout is None and segment_ids is not None and attention_mask is None:
        encoder_layout = TokenLayout.packed(segment_ids)
    if encoder_outputs is None:
        encoder_outputs = model.encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            segment_ids=segment_ids,
            layout=encoder_layout,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            return_dict=True,
        )
    elif not isinstance(encoder_outputs, BaseModelOutput):
        encoder_outputs = BaseModelOutput(
            last_hidden_state=encoder_outputs[0],
            hidden_states=encoder_outputs[1] if len(encoder_outputs) > 1 else None,
            attentions=encoder_outputs[2] if len(encoder_outputs) > 2 else None,
        )
    use_cache = model.config.use_cache if use_cache is None else use_cache
    # use_cache=False makes no cache, but reads one that is given, as T5 does (PEFT's prefix tuning gives its prefix
    # as a cache)
    if use_cache and past_key_values is None and decoder_segment_ids is None and not model.training:
        past_key_values = EncoderDecoderCache(DynamicCache(), DynamicCache())
    decoder_outputs = model.decoder(
        input_ids=decoder_input_ids,
        attention_mask=decoder_attention_mask,
        inputs_embeds=decoder_inputs_embeds,
        segment_ids=decoder_segment_ids,
        layout=decoder_layout,
        encoder_hidden_states=encoder_outputs.last_hidden_state,
        encoder_attention_mask=attention_mask,
        encoder_segment_ids=segment_ids,
        encoder_layout=encoder_layout,
        cache=past_key_values,
        use_cache=False,  # the cache, where one is wanted, is made above
        output_hidden_states=output_hidden_states,
        output_attentions=output_attentions,
        return_dict=True,
    )
    return encoder_outputs, decoder_outputs


def _given_layout(segment_ids, packed_layout: dict, stack: str) -> TokenLayout | None:
    """The layout of one stack's packed rows from the caller's ``cu_seqlens`` and ``segment_position_ids`` (named
    with the ``decoder_`` prefix for the decoder), or None when it gave neither."""
    prefix = f"{stack}_" if stack else ""
    cu_seqlens = packed_layout.get(f"{prefix}cu_seqlens")
    position_ids = packed_layout.get(f"{prefix}segment_position_ids")
    if cu_seqlens is None:
        if position_ids is not None:
            raise ValueError(f"{prefix}segment_position_ids comes with {prefix}cu_seqlens, which is missing")
        return None
    if segment_ids is None or segment_ids.dim() != 2:
        raise ValueError(
            f"{prefix}cu_seqlens describes packed rows: give {prefix}segment_ids, a (batch, length) tensor, with it"
        )
    return TokenLayout.given(segment_ids, cu_seqlens, position_ids, name=stack)


# the fields of T5's seq2seq outputs that carry the stacks' states
_SEQ2SEQ_STATES = ("decoder_hidden_states", "decoder_attentions", "cross_attentions", "encoder_last_hidden_state",
                   "encoder_hidden_states", "encoder_attentions")


def _seq2seq_states(encoder_outputs, decoder_outputs) -> dict:
    """The hidden states and attention probabilities of both stacks, under the names of T5's seq2seq outputs."""
    return {
        "decoder_hidden_states": decoder_outputs.hidden_states,
        "decoder_attentions": decoder_outputs.attentions,
        "cross_attentions": decoder_outputs.cross_attentions,
        "encoder_last_hidden_state": encoder_outputs.last_hidden_state,
        "encoder_hidden_states": encoder_outputs.hidden_states,
        "encoder_attentions": encoder_outputs.attentions,
    }


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


class FAT5ForConditionalGeneration(_FAT5EncoderDecoder, GenerationMixin):
    """FAT5 with its language-modelling head: training with fused cross-entropy + z-loss, and ``generate``.

    Besides T5's arguments, ``forward`` takes ``segment_ids`` and ``decoder_segment_ids`` for packed rows (several
    examples per row, numbered 1..n in order, then 0 on the padding after the last; segment ``s`` of the decoder
    row is the target of segment ``s`` of the encoder row; the decoder inputs must then be given, shifted per
    segment), optionally with their layout built beforehand (``cu_seqlens``, ``segment_position_ids``,
    ``decoder_cu_seqlens``, ``decoder_segment_position_ids``, as the UL2 collator makes them: then the step reads
    nothing back from the device, see :meth:`TokenLayout.given`), ``num_items_in_batch`` (the Trainer's count of
    labelled tokens across gradient-accumulation steps: the loss is their sum over it), ``return_loss_parts`` (the
    output then holds ``ce_loss`` and ``z_loss`` too, whose sum is ``loss``; FAT5Trainer asks for them to log them)
    and ``return_logits`` (False: the output's ``logits`` is None; FAT5Trainer's training steps ask for that when
    nothing reads them, because accelerate's mixed precision converts every bf16 output to fp32, the logits
    included: 2.4 GB written at each step of the pretraining benchmark's small shape).

    ``generate`` takes every cache transformers offers. With ``cache_implementation="static"`` the KV cache is
    preallocated and its length stays on the device (the attention kernel reads it there), so transformers compiles
    the decoding step once into CUDA graphs and replays it for every new token.
    """

    _tied_weights_keys: ClassVar[dict[str, str]] = {**_STACK_EMBEDDINGS, "lm_head.weight": "shared.weight"}

    def __init__(self, config: FAT5Config):
        super().__init__(config)
        self.model_dim = config.d_model
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        decoder_input_ids=None,
        decoder_attention_mask=None,
        encoder_outputs=None,
        past_key_values=None,
        inputs_embeds=None,
        decoder_inputs_embeds=None,
        labels=None,
        segment_ids=None,
        decoder_segment_ids=None,
        use_cache=None,
        output_hidden_states=None,
        return_dict=None,
        num_items_in_batch=None,
        cache=None,
        return_loss_parts=False,
        return_logits=True,
        cu_seqlens=None,
        segment_position_ids=None,
        decoder_cu_seqlens=None,
        decoder_segment_position_ids=None,
        output_attentions=None,
        **kwargs,
    ) -> FAT5Seq2SeqLMOutput:
        _check_supported_arguments(self.config, kwargs)
        inputs = input_ids if input_ids is not None else inputs_embeds
        if labels is not None and inputs is not None and labels.shape[0] != inputs.shape[0]:
            # shifted into decoder inputs, they would meet the encoder's rows in a puzzling mask error
            raise ValueError(f"labels has {labels.shape[0]} rows but the inputs have {inputs.shape[0]}: give one row "
                             "of labels per input row")
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            if decoder_segment_ids is not None:
                raise ValueError("packed rows need decoder_input_ids shifted per segment; the model cannot shift them")
            decoder_input_ids = self._shift_right(labels)
        packed_layout = {"cu_seqlens": cu_seqlens, "segment_position_ids": segment_position_ids,
                         "decoder_cu_seqlens": decoder_cu_seqlens,
                         "decoder_segment_position_ids": decoder_segment_position_ids}
        encoder_outputs, decoder_outputs = _encode_decode(
            self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
            _given_cache(cache, past_key_values, self), inputs_embeds, decoder_inputs_embeds, segment_ids,
            decoder_segment_ids, use_cache, output_hidden_states, packed_layout,
            _asks_for_attentions(self.config, output_attentions),
        )
        logits, ce_loss, z_loss = self._logits_and_loss(decoder_outputs.last_hidden_state, labels, num_items_in_batch)
        output = FAT5Seq2SeqLMOutput(
            loss=None if ce_loss is None else ce_loss + z_loss,
            logits=logits if return_logits else None,
            **{_CACHE_FIELD: getattr(decoder_outputs, _CACHE_FIELD)},
            **_seq2seq_states(encoder_outputs, decoder_outputs),
            ce_loss=ce_loss if return_loss_parts else None,
            z_loss=z_loss if return_loss_parts else None,
        )
        return _as_requested(output, return_dict, self.config)

    def _logits_and_loss(self, sequence_output, labels, num_items_in_batch):
        """The logits (None where the chunked loss never forms them) and the loss's two parts (None without labels)."""
        if self.config.scale_decoder_outputs:
            sequence_output = sequence_output * (self.model_dim**-0.5)
        if labels is not None and self._computes_chunked_lm_loss():
            ce_loss, z_loss = linear_cross_entropy(
                sequence_output, self.lm_head.weight, labels.to(sequence_output.device), **self._lm_loss_options(),
                num_items_in_batch=num_items_in_batch,
            )
            return None, ce_loss, z_loss
        logits = self.lm_head(sequence_output)
        if labels is None:
            return logits, None, None
        _, ce_loss, z_loss = self._lm_loss(logits, labels, num_items_in_batch)
        return logits, ce_loss, z_loss

    def _computes_chunked_lm_loss(self) -> bool:
        # The chunked loss reads lm_head.weight without calling lm_head: only a bare Linear's weight is the whole map
        # (a PEFT layer adds its own product), and FSDP2 unshards a weight in its module's forward hook, so one that
        # is still a DTensor (the output layer as its own FSDP unit) must go through the module.
        return (
            self.config.use_chunked_lm_loss
            and self.training
            and type(self.lm_head) is nn.Linear
            and self.lm_head.bias is None
            and not _is_dtensor(self.lm_head.weight)
            and not torch.compiler.is_compiling()
        )

    def generate(self, inputs=None, generation_config=None, *args, **kwargs):
        """transformers' ``generate``. Greedy, sampled and beam search decoding run FAT5's graphed loop where
        ``config.graphed_decoding`` allows it and every option asked for is one that loop follows
        (``graphed_decoding.graphed_generate_arguments``): a decoding step of few kernels replayed from CUDA graphs,
        same ids. Any other option keeps transformers' loop."""
        # imported here: graphed_decoding.py reads this module's classes
        from .graphed_decoding import graphed_generate_arguments

        graphed_arguments = None if args else graphed_generate_arguments(self, generation_config, kwargs)
        return super().generate(inputs, generation_config, *args, **(graphed_arguments or kwargs))

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return self._shift_right(labels)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """A static cache given to ``generate`` must hold every position that it writes (the ones it sizes itself
        do): past its end, the cache's ``index_copy_`` fails in the middle of decoding, on a GPU as a
        device-side assert that takes the process's CUDA context with it (transformers' T5 does not check either).
        The other arguments pass through untouched: this private hook's signature is transformers' to change."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        # the decoder writes every position but the last one it generates
        max_cache_length = generation_config.max_length - 1
        cache = model_kwargs.get(_CACHE_FIELD)
        if not isinstance(cache, EncoderDecoderCache):
            return
        for layer in cache.self_attention_cache.layers:
            if getattr(layer, "is_compileable", False) and layer.max_cache_len < max_cache_length:
                raise ValueError(
                    f"the cache given is a static cache of {layer.max_cache_len} positions, but generate writes up to "
                    f"{max_cache_length} decoder positions (max_length - 1): give a StaticCache with max_cache_len >= "
                    f"{max_cache_length}, or pass cache_implementation=\"static\" and let generate size it"
                )

    def _expand_inputs_for_generation(self, *args, **model_kwargs):
        # transformers repeats encoder_outputs for beams and num_return_sequences in place: the caller's own encoder
        # outputs, given so that the encoder runs once for several calls, would come back expanded and break the next
        # call (T5's as well). A shallow copy takes the repeated tensors instead.
        if model_kwargs.get("encoder_outputs") is not None:
            model_kwargs["encoder_outputs"] = copy.copy(model_kwargs["encoder_outputs"])
        return super()._expand_inputs_for_generation(*args, **model_kwargs)

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, *args, **kwargs):
        """``generate`` builds a 4-D causal mask when it decodes into a static cache; FAT5's kernels mask causally from
        positions and take padding as a (batch, keys) mask, so the 2-D decoder mask passes through unchanged (the
        cache arrives as ``past_key_values`` up to transformers 5.23, as ``cache`` from 5.24: neither is needed)."""
        return attention_mask


class FAT5EncoderModel(FAT5PreTrainedModel):
    """The encoder alone (embeddings, blocks, final norm): sentence embeddings and encoder task heads."""

    _tied_weights_keys: ClassVar[dict[str, str]] = {"encoder.embed_tokens.weight": "shared.weight"}
    _keys_to_ignore_on_load_unexpected: ClassVar[list[str]] = [r"^decoder\.", r"^lm_head\."]

    def __init__(self, config: FAT5Config):
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = FAT5Stack(config, self.shared, is_decoder=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.shared

    def set_input_embeddings(self, new_embeddings):
        self.shared = new_embeddings
        self.encoder.embed_tokens = new_embeddings

    def get_encoder(self):
        return self.encoder

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        segment_ids=None,
        output_hidden_states=None,
        return_dict=None,
        output_attentions=None,
        **kwargs,
    ) -> BaseModelOutput:
        _check_supported_arguments(self.config, kwargs)
        outputs = self.encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            segment_ids=segment_ids,
            output_hidden_states=output_hidden_states,
            output_attentions=_asks_for_attentions(self.config, output_attentions),
            return_dict=True,
        )
        output = BaseModelOutput(last_hidden_state=outputs.last_hidden_state, hidden_states=outputs.hidden_states,
                                 attentions=outputs.attentions)
        return _as_requested(output, return_dict, self.config)


class _FAT5EncoderWithHead(FAT5PreTrainedModel):
    """An encoder task head: the encoder's parameters keep the full model's names, so a converted checkpoint loads."""

    _tied_weights_keys: ClassVar[dict[str, str]] = {"encoder.embed_tokens.weight": "shared.weight"}
    _keys_to_ignore_on_load_unexpected: ClassVar[list[str]] = [r"^decoder\.", r"^lm_head\."]

    def __init__(self, config: FAT5Config):
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = FAT5Stack(config, self.shared, is_decoder=False)

    def get_input_embeddings(self):
        return self.shared

    def set_input_embeddings(self, new_embeddings):
        self.shared = new_embeddings
        self.encoder.embed_tokens = new_embeddings

    def _encode(self, input_ids, attention_mask, inputs_embeds, output_hidden_states, output_attentions, kwargs):
        _check_supported_arguments(self.config, kwargs)
        return self.encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_attentions=_asks_for_attentions(self.config, output_attentions),
            return_dict=True,
        )


class FAT5ClassificationHead(nn.Module):
    """T5's sentence classification head: dense, tanh, projection."""

    def __init__(self, config: FAT5Config):
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.dropout = nn.Dropout(p=config.classifier_dropout)
        self.out_proj = nn.Linear(config.d_model, config.num_labels)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = torch.tanh(self.dense(self.dropout(hidden_states)))
        return self.out_proj(self.dropout(hidden_states))


def _encoder_only_outputs(model, input_ids, attention_mask, inputs_embeds, output_hidden_states, output_attentions,
                          decoder_arguments):
    """The encoder's outputs for an encoder-only head (config.encoder_only_heads), which has no decoder: decoder
    arguments are refused by name rather than ignored."""
    given = sorted(name for name, value in decoder_arguments.items() if value is not None)
    if given:
        raise ValueError(
            f"{type(model).__name__} was built with config.encoder_only_heads=True (the encoder alone), so it cannot "
            f"use {', '.join(given)}; T5's encoder-decoder head is config.encoder_only_heads=False"
        )
    return model.encoder(
        input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
        output_hidden_states=output_hidden_states,
        output_attentions=_asks_for_attentions(model.config, output_attentions), return_dict=True,
    )


def _decoder_inputs_of(model, input_ids, decoder_input_ids, decoder_inputs_embeds):
    """T5's heads decode the input shifted right when no decoder inputs are given."""
    if decoder_input_ids is None and decoder_inputs_embeds is None:
        if input_ids is None:
            raise ValueError(
                f"{type(model).__name__}: without decoder_input_ids or decoder_inputs_embeds the decoder reads "
                "input_ids shifted right, so input_ids must be given"
            )
        return model._shift_right(input_ids)
    return decoder_input_ids


class FAT5ForSequenceClassification(FAT5PreTrainedModel):
    """T5's sequence classification: the encoder-decoder reads the input (the decoder its copy shifted right) and the
    head classifies the decoder's state at the last EOS token (regression when num_labels == 1); every input row
    must hold the same number of EOS tokens, at least one. The parameters keep T5's names (``transformer.``), so a
    converted ``T5ForSequenceClassification`` loads as it is.

    With ``config.encoder_only_heads`` the encoder alone reads the input and the head classifies the mean of its
    unpadded tokens' states; the parameters then keep the full model's names (``encoder.``)."""

    def __init__(self, config: FAT5Config):
        super().__init__(config)
        if config.encoder_only_heads:
            self.shared = nn.Embedding(config.vocab_size, config.d_model)
            self.encoder = FAT5Stack(config, self.shared, is_decoder=False)
            self._tied_weights_keys = {"encoder.embed_tokens.weight": "shared.weight"}
            self._keys_to_ignore_on_load_unexpected = [r"^decoder\.", r"^lm_head\."]
        else:
            self.transformer = FAT5Model(config)
            self._keys_to_ignore_on_load_unexpected = [r"lm_head\."]
        self.classification_head = FAT5ClassificationHead(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.shared if self.config.encoder_only_heads else self.transformer.shared

    def set_input_embeddings(self, new_embeddings):
        if self.config.encoder_only_heads:
            self.shared = self.encoder.embed_tokens = new_embeddings
        else:
            self.transformer.set_input_embeddings(new_embeddings)

    def get_encoder(self):
        return self.encoder if self.config.encoder_only_heads else self.transformer.encoder

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        decoder_input_ids=None,
        decoder_attention_mask=None,
        encoder_outputs=None,
        inputs_embeds=None,
        decoder_inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_hidden_states=None,
        return_dict=None,
        output_attentions=None,
        **kwargs,
    ) -> Seq2SeqSequenceClassifierOutput | SequenceClassifierOutput:
        _check_supported_arguments(self.config, kwargs)
        num_items_in_batch = kwargs.get("num_items_in_batch")
        if self.config.encoder_only_heads:
            outputs = _encoder_only_outputs(
                self, input_ids, attention_mask, inputs_embeds, output_hidden_states, output_attentions, {
                    "decoder_input_ids": decoder_input_ids, "decoder_attention_mask": decoder_attention_mask,
                    "encoder_outputs": encoder_outputs, "decoder_inputs_embeds": decoder_inputs_embeds,
                    "use_cache": use_cache,
                })
            logits = self.classification_head(_mean_of_tokens(outputs.last_hidden_state, attention_mask))
            loss = None if labels is None else _sequence_classification_loss(self.config, logits, labels,
                                                                              num_items_in_batch)
            output = SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                              attentions=outputs.attentions)
            return _as_requested(output, return_dict, self.config)

        if input_ids is None:
            raise ValueError(
                f"{type(self).__name__} needs input_ids: it classifies the decoder's state at the input's last EOS "
                "token (inputs_embeds alone do not say where that is), as T5ForSequenceClassification"
            )
        outputs = self.transformer(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=_decoder_inputs_of(self, input_ids, decoder_input_ids, decoder_inputs_embeds),
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=False if labels is not None else use_cache,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            return_dict=True,
        )
        logits = self.classification_head(self._last_eos_states(input_ids, outputs.last_hidden_state))
        loss = None if labels is None else _sequence_classification_loss(self.config, logits, labels,
                                                                          num_items_in_batch)
        output = Seq2SeqSequenceClassifierOutput(
            loss=loss,
            logits=logits,
            **{_CACHE_FIELD: getattr(outputs, _CACHE_FIELD)},
            **{name: getattr(outputs, name) for name in _SEQ2SEQ_STATES},
        )
        return _as_requested(output, return_dict, self.config)

    def _last_eos_states(self, input_ids, sequence_output):
        """The decoder's state at each row's last EOS token, T5's sentence representation."""
        eos_mask = input_ids.eq(self.config.eos_token_id).to(sequence_output.device)
        eos_counts = eos_mask.sum(dim=1)
        if eos_counts.min() < 1 or eos_counts.max() != eos_counts.min():
            raise ValueError(
                f"{type(self).__name__}: every input row must hold the same number of EOS tokens (id "
                f"{self.config.eos_token_id}), at least one; the rows hold {eos_counts.tolist()}"
            )
        batch_size, _, hidden_size = sequence_output.shape
        return sequence_output[eos_mask, :].view(batch_size, -1, hidden_size)[:, -1, :]


def _mean_of_tokens(hidden_states, attention_mask):
    """The encoder-only classifier's sentence representation: the mean of the unpadded tokens' states."""
    if attention_mask is None:
        return hidden_states.mean(dim=1)
    if attention_mask.dim() != 2:
        raise ValueError(
            "the encoder-only classifier (config.encoder_only_heads) averages the tokens that a (batch, length) "
            f"attention_mask keeps, so it needs one, not a custom {attention_mask.dim()}-D mask"
        )
    weights = attention_mask.to(hidden_states.dtype)[..., None]
    return (hidden_states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)


def _sequence_classification_loss(config, logits, labels, num_items_in_batch=None):
    """transformers' convention: regression for one label, single- or multi-label classification otherwise.

    With ``num_items_in_batch`` (the Trainer's count over gradient-accumulation steps) the loss is a sum over it.
    """
    reduction = "mean" if num_items_in_batch is None else "sum"
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression":
        loss = nn.functional.mse_loss(logits.squeeze(-1).float(), labels.squeeze(-1).float(), reduction=reduction)
    elif config.problem_type == "single_label_classification":
        loss = nn.functional.cross_entropy(
            logits.float().view(-1, config.num_labels), labels.view(-1), reduction=reduction
        )
    else:
        loss = nn.functional.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction=reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


class FAT5ForTokenClassification(_FAT5EncoderWithHead):
    def __init__(self, config: FAT5Config):
        super().__init__(config)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.d_model, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        labels=None,
        output_hidden_states=None,
        return_dict=None,
        output_attentions=None,
        **kwargs,
    ) -> TokenClassifierOutput:
        outputs = self._encode(
            input_ids, attention_mask, inputs_embeds, output_hidden_states, output_attentions, kwargs
        )
        logits = self.classifier(self.dropout(outputs.last_hidden_state))
        loss = None
        if labels is not None:
            num_items_in_batch = kwargs.get("num_items_in_batch")
            loss = nn.functional.cross_entropy(
                logits.float().view(-1, self.config.num_labels),
                labels.view(-1),
                reduction="mean" if num_items_in_batch is None else "sum",
            )
            if num_items_in_batch is not None:
                loss = loss / num_items_in_batch
        output = TokenClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                       attentions=outputs.attentions)
        return _as_requested(output, return_dict, self.config)


class FAT5ForQuestionAnswering(FAT5PreTrainedModel):
    """Extractive question answering, T5's way: start and end logits over the decoder's positions, which read the
    input shifted right (T5ForQuestionAnswering's names, so a converted one loads as it is). With
    ``config.encoder_only_heads``, over the encoder's tokens, with no decoder."""

    def __init__(self, config: FAT5Config):
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = FAT5Stack(config, self.shared, is_decoder=False)
        if config.encoder_only_heads:
            self._tied_weights_keys = {"encoder.embed_tokens.weight": "shared.weight"}
            self._keys_to_ignore_on_load_unexpected = [r"^decoder\.", r"^lm_head\."]
        else:
            self.decoder = FAT5Stack(config, self.shared, is_decoder=True)
            self._tied_weights_keys = dict(_STACK_EMBEDDINGS)
            self._keys_to_ignore_on_load_unexpected = [r"^lm_head\."]
        self.qa_outputs = nn.Linear(config.d_model, 2)
        self.post_init()

    def get_input_embeddings(self):
        return self.shared

    def set_input_embeddings(self, new_embeddings):
        self.shared = self.encoder.embed_tokens = new_embeddings
        if hasattr(self, "decoder"):
            self.decoder.embed_tokens = new_embeddings

    def get_encoder(self):
        return self.encoder

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        decoder_input_ids=None,
        decoder_attention_mask=None,
        encoder_outputs=None,
        start_positions=None,
        end_positions=None,
        inputs_embeds=None,
        decoder_inputs_embeds=None,
        use_cache=None,
        output_hidden_states=None,
        return_dict=None,
        output_attentions=None,
        **kwargs,
    ) -> Seq2SeqQuestionAnsweringModelOutput | QuestionAnsweringModelOutput:
        _check_supported_arguments(self.config, kwargs)
        if self.config.encoder_only_heads:
            encoder_outputs = _encoder_only_outputs(
                self, input_ids, attention_mask, inputs_embeds, output_hidden_states, output_attentions, {
                    "decoder_input_ids": decoder_input_ids, "decoder_attention_mask": decoder_attention_mask,
                    "encoder_outputs": encoder_outputs, "decoder_inputs_embeds": decoder_inputs_embeds,
                    "use_cache": use_cache,
                })
            sequence_output, decoder_outputs = encoder_outputs.last_hidden_state, None
        else:
            if start_positions is not None and end_positions is not None:
                use_cache = False
            encoder_outputs, decoder_outputs = _encode_decode(
                self, input_ids, attention_mask,
                _decoder_inputs_of(self, input_ids, decoder_input_ids, decoder_inputs_embeds),
                decoder_attention_mask, encoder_outputs, None, inputs_embeds, decoder_inputs_embeds, None, None,
                use_cache, output_hidden_states, output_attentions=_asks_for_attentions(self.config, output_attentions),
            )
            sequence_output = decoder_outputs.last_hidden_state
        start_logits, end_logits = self.qa_outputs(sequence_output).float().unbind(dim=-1)
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = _span_loss(start_logits, end_logits, start_positions, end_positions)
        if decoder_outputs is None:
            output = QuestionAnsweringModelOutput(
                loss=loss, start_logits=start_logits, end_logits=end_logits,
                hidden_states=encoder_outputs.hidden_states, attentions=encoder_outputs.attentions,
            )
        else:
            output = Seq2SeqQuestionAnsweringModelOutput(
                loss=loss,
                start_logits=start_logits,
                end_logits=end_logits,
                **{_CACHE_FIELD: getattr(decoder_outputs, _CACHE_FIELD)},
                **_seq2seq_states(encoder_outputs, decoder_outputs),
            )
        return _as_requested(output, return_dict, self.config)


def _span_loss(start_logits, end_logits, start_positions, end_positions):
    """transformers' extractive QA loss: the mean of the start's and the end's cross-entropies, positions beyond the
    sequence ignored."""
    ignored = start_logits.shape[1]
    start_loss = nn.functional.cross_entropy(start_logits, start_positions.view(-1).clamp(0, ignored),
                                             ignore_index=ignored)
    end_loss = nn.functional.cross_entropy(end_logits, end_positions.view(-1).clamp(0, ignored), ignore_index=ignored)
    return (start_loss + end_loss) / 2


__all__ = [
    "FAT5EncoderModel",
    "FAT5ForConditionalGeneration",
    "FAT5ForQuestionAnswering",
    "FAT5ForSequenceClassification",
    "FAT5ForTokenClassification",
    "FAT5Model",
    "FAT5PreTrainedModel",
]
