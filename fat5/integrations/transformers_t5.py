"""transformers' own T5, mT5 and UMT5 on FAT5's kernels, their checkpoints left as they are.

Two entry points, for transformers' classes of the three families (``T5ForConditionalGeneration``,
``MT5ForConditionalGeneration``, ``UMT5ForConditionalGeneration``, ``T5EncoderModel`` and the other heads on the
same stacks):

- ``attn_implementation="fat5"``, which ``import fat5`` registers (:func:`register`): attention runs in FAT5's
  kernels, with T5's relative position bias computed inside them from the layer's bucket table. transformers'
  ``T5Attention`` builds a (1, heads, Lq, Lk) bias tensor in its first layer (in every layer in UMT5), and a zero
  one for cross-attention, before it calls the attention function. :func:`register` wraps the three families'
  attention ``forward`` so that, on this path only, they pass on a :class:`KernelPositionBias` instead: the table
  (layer 0's, shared by its stack, in T5 and mT5; each layer's own in UMT5), causality and the query's offset in
  the cache. No tensor the size of the score matrix is built, and the table's gradient comes from the kernel. The
  mask builder gives the kernels the (batch, key_length) key padding mask instead of a 4-D mask. What the kernels
  cannot serve (the attention probabilities, a custom 4-D mask, attention dropout, a bias tensor passed in) runs
  transformers' own attention on the materialised bias, and a warning says why, once.
- :func:`apply_fat5_kernels_to_t5`, in Liger-Kernel's convention: FAT5's RMSNorm as the norms' forward and its fused
  cross-entropy (optionally with z-loss) as the language model's loss, in a model or a class. Only forwards are
  rebound: no parameter, buffer or config field is added, so the state dict and ``save_pretrained``'s folder stay
  plain T5, loadable without fat5.
"""

import functools
import importlib
import inspect
import types
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, GenerationMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    bidirectional_mask_function,
    causal_mask_function,
    prepare_padding_mask,
    sdpa_mask,
)
from transformers.utils import logging

from ..kernels.attention import attention, visible_keys
from ..kernels.cross_entropy import cross_entropy as fused_cross_entropy
from ..kernels.dispatch import BACKENDS
from ..kernels.position_bias import NO_POSITION_BIAS, PositionBias
from ..kernels.rms_norm import rms_norm as fused_rms_norm

logger = logging.get_logger(__name__)

ATTENTION_NAME = "fat5"
# model_type -> the prefix of its classes in transformers' modeling_<model_type>.py
FAMILIES = {"t5": "T5", "mt5": "MT5", "umt5": "UMT5"}

_backend = "auto"


def set_kernel_backend(backend: str) -> None:
    """Which implementation of FAT5's kernels the integration calls: ``"auto"`` (the default: Triton on CUDA
    tensors, the PyTorch reference elsewhere), ``"triton"`` (on a CPU under ``TRITON_INTERPRET=1``, as the tests
    run it) or ``"reference"``. One setting for the process, as the attention function is one for all models."""
    global _backend
    if backend not in BACKENDS:
        raise ValueError(f"the kernel backend must be one of {BACKENDS}, got {backend!r}")
    _backend = backend


def _family_module(model_type: str) -> types.ModuleType:
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def _original(function):
    """The function FAT5 wrapped, or ``function`` itself: wrapping again starts from transformers' own."""
    return getattr(function, "__fat5_original__", function)


# ---------------------------------------------------------------------------------------------------- attention


@dataclass(frozen=True, eq=False)
class KernelPositionBias:
    """What a T5-family attention module passes as ``position_bias`` on the fat5 path, in place of the materialised
    (1, heads, Lq, Lk) tensor: the bias as the kernels take it (``PositionBias.t5`` over the layer's table, or none
    for cross-attention), whether the attention is causal, and the position of the first query (the cache's length
    before this step; a tensor for a static cache, which the kernel reads in place)."""

    position_bias: PositionBias
    causal: bool
    query_offset: int | torch.Tensor = 0

    @classmethod
    def of(cls, module, is_cross_attention: bool, cache, passed_on: bool) -> "KernelPositionBias":
        """``module``'s bias. ``passed_on``: T5's first layer hands it to the later ones, which then hold a copy of
        the table, not the parameter (whose backward needs no parameter values: under FSDP a block's parameters
        are sharded again once it has run), as FAT5's own stacks do."""
        position_bias, query_offset = NO_POSITION_BIAS, 0
        if not is_cross_attention and module.has_relative_attention_bias:
            table = module.relative_attention_bias.weight
            position_bias = PositionBias.t5(table.clone() if passed_on else table, bidirectional=not module.is_decoder,
                                            max_distance=module.relative_attention_max_distance)
        if not is_cross_attention and cache is not None:
            query_offset = cache.get_seq_length(module.layer_idx)
            if isinstance(query_offset, torch.Tensor):  # a static cache's count, which its update changes in place
                query_offset = query_offset.clone()
        return cls(position_bias, module.is_decoder and not is_cross_attention, query_offset)


def _cache(kwargs: dict):
    # the KV cache argument: `cache` since transformers 5.24, `past_key_values` before (and deprecated until 5.40)
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _described_t5_forward(original):
    """``T5Attention.forward`` (MT5's is a copy of it) that, on the fat5 path, receives a KernelPositionBias where
    transformers would build a bias tensor: in the first layer, whose bias its stack passes on to the later ones,
    and in the first cross-attention (zeros)."""

    @functools.wraps(original)
    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, **kwargs):
        if position_bias is None and self.config._attn_implementation == ATTENTION_NAME:
            position_bias = KernelPositionBias.of(self, key_value_states is not None, _cache(kwargs), passed_on=True)
        return original(self, hidden_states, mask=mask, key_value_states=key_value_states, position_bias=position_bias,
                        **kwargs)

    forward.__fat5_original__ = original
    return forward


def _described_umt5_forward(original, t5_forward):
    """``UMT5Attention.forward``, which builds its bias in every layer and takes none: on the fat5 path, T5's forward
    (the same projections, cache and attention call, under other argument names) runs the module with its own
    KernelPositionBias."""

    @functools.wraps(original)
    def forward(self, hidden_states, encoder_hidden_states=None, **kwargs):
        if self.config._attn_implementation != ATTENTION_NAME:
            return original(self, hidden_states, encoder_hidden_states, **kwargs)
        mask = kwargs.pop("attention_mask", None)
        position_bias = KernelPositionBias.of(self, encoder_hidden_states is not None, _cache(kwargs), passed_on=False)
        output, _, weights = t5_forward(self, hidden_states, mask=mask, key_value_states=encoder_hidden_states,
                                        position_bias=position_bias, **kwargs)
        return output, weights

    forward.__fat5_original__ = original
    return forward


def _fallback_reason(module, attention_mask, dropout: float, position_bias, kwargs: dict) -> str | None:
    """Why this call cannot run in the kernels, or None."""
    if position_bias is None:
        raise TypeError(
            f'attn_implementation="fat5" got no position bias from {type(module).__name__}: it serves transformers\' '
            "T5Attention, MT5Attention and UMT5Attention, whose forwards `import fat5` wraps"
        )
    if not isinstance(position_bias, KernelPositionBias):
        return "a position_bias tensor was passed in (the kernels compute T5's bias from the layer's table)"
    if kwargs.get("output_attentions"):
        return "output_attentions=True asks for the attention probabilities, which the fused kernels never form"
    if attention_mask is not None and attention_mask.dim() != 2:
        return "a 4-D attention mask (the kernels take a key padding mask and causality)"
    if dropout > 0.0:
        return (f"attention dropout (p={dropout}, T5's dropout_rate, while training): the kernels do not drop "
                "attention probabilities; fat5.apply_fat5_kernels_to_t5(model, attention_dropout=0.0) turns it off "
                "and keeps T5's other dropout")
    return None


def fat5_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: float | None = None, position_bias=None, **kwargs):
    """transformers' attention-function signature: (batch, heads, length, head_dim) ``query``, ``key``, ``value``,
    ``attention_mask`` from :func:`fat5_attention_mask`, ``position_bias`` a :class:`KernelPositionBias`. Returns
    the (batch, query_length, heads, head_dim) output and no probabilities."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    reason = _fallback_reason(module, attention_mask, dropout, position_bias, kwargs)
    if reason is not None:
        logger.warning_once(f'attn_implementation="fat5": {reason}. Such calls run transformers\' own attention, '
                            "on the materialised position bias")
        return _transformers_attention(module, query, key, value, attention_mask, dropout, scale, position_bias,
                                       kwargs)
    output = attention(
        query, key, value, position_bias=position_bias.position_bias, scale=scale, causal=position_bias.causal,
        key_padding_mask=attention_mask, query_offset=position_bias.query_offset, backend=_backend,
    )
    return output.transpose(1, 2), None


def _transformers_attention(module, query, key, value, attention_mask, dropout, scale, position_bias, kwargs):
    """transformers' eager attention (which returns the probabilities) or SDPA, on the materialised bias and a 4-D
    mask built from the key padding mask and causality."""
    query_length, key_length = query.shape[2], key.shape[2]
    if isinstance(position_bias, KernelPositionBias):
        causal, query_offset = position_bias.causal, position_bias.query_offset
        bias = position_bias.position_bias.materialise(query_length, key_length, query_offset)
        bias = None if bias is None else bias.unsqueeze(0)
    else:  # a tensor passed in says nothing of causality: the module does (transformers 5.24 sets is_causal)
        causal, query_offset, bias = getattr(module, "is_causal", False), key_length - query_length, position_bias
    mask = attention_mask
    if mask is None or mask.dim() == 2:
        mask = _boolean_mask(mask, causal, query_offset, query_length, key_length, query.device)
    if kwargs.get("output_attentions"):
        from transformers.models.t5.modeling_t5 import eager_attention_forward

        if mask is not None and mask.dtype == torch.bool:  # eager adds the mask to the scores
            mask = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(~mask,
                                                                                       torch.finfo(query.dtype).min)
        return eager_attention_forward(module, query, key, value, mask, scaling=scale, dropout=dropout,
                                       position_bias=bias, **kwargs)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scale, is_causal=False,
                                  position_bias=bias, **kwargs)


def _boolean_mask(key_padding_mask, causal, query_offset, query_length, key_length, device):
    """(batch or 1, 1, query_length, key_length), True where a key may be attended; None when all may."""
    if key_padding_mask is None and not causal:
        return None
    visible = visible_keys(query_length, key_length, causal, query_offset, key_padding_mask, device)
    return visible.view(-1, 1, query_length, key_length)


def fat5_attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                        mask_function=causal_mask_function, attention_mask=None, **kwargs):
    """transformers' mask-builder signature. Causality and T5's bias travel with the KernelPositionBias: the mask is
    the (batch, kv_length) key padding mask, True where a key may be attended, or None. A pattern beyond these
    (``or_mask_function``, packed rows...) gets transformers' own boolean 4-D mask, which the attention serves on
    transformers' path."""
    config = kwargs.get("config")
    if config is not None and config.model_type not in FAMILIES:
        raise ValueError(f'attn_implementation="fat5" serves transformers\' T5, mT5 and UMT5 (model_type '
                         f"{', '.join(FAMILIES)}); this model's model_type is {config.model_type!r}")
    if mask_function is not causal_mask_function and mask_function is not bidirectional_mask_function:
        options = {key: value for key, value in kwargs.items()
                   if key not in ("allow_is_causal_skip", "allow_is_bidirectional_skip")}
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **options)
    if attention_mask is None:
        return None
    # a static cache's keys are its whole buffer: the mask is padded to it (the unwritten slots lie after the query,
    # hidden by causality)
    return prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, kv_offset:kv_offset + kv_length]


def register() -> None:
    """Add ``"fat5"`` to transformers' AttentionInterface and AttentionMaskInterface, and wrap the attention forwards
    of T5, mT5 and UMT5 (see the module's docstring; behaviour under any other attn_implementation is unchanged).
    ``import fat5`` calls it; calling it again changes nothing."""
    AttentionInterface.register(ATTENTION_NAME, fat5_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, fat5_attention_mask)
    t5_attention = _family_module("t5").T5Attention
    t5_forward = _original(t5_attention.forward)
    for model_type, prefix in FAMILIES.items():
        attention_class = getattr(_family_module(model_type), f"{prefix}Attention")
        original = _original(attention_class.forward)
        attention_class.forward = (_described_umt5_forward(original, t5_forward) if model_type == "umt5"
                                   else _described_t5_forward(original))


# ------------------------------------------------------------------------------------------------- kernel patch


def _fused_rms_norm_forward(self, hidden_states):
    """T5LayerNorm's forward (MT5's and UMT5's are copies) in FAT5's RMSNorm, which has its semantics exactly."""
    return fused_rms_norm(hidden_states, self.weight, self.variance_epsilon, backend=_backend)



def _forward_with_fused_loss(original, z_loss: float, label_smoothing: float):
    """A ``*ForConditionalGeneration.forward`` whose loss is FAT5's fused cross-entropy (+ z-loss): transformers'
    forward runs without the labels (it computes no loss of its own) on the decoder inputs it would derive from
    them, then the loss comes from its logits. Honours ``num_items_in_batch`` (which the Trainer passes under
    gradient accumulation), as transformers' models with a ``loss_function`` do; T5's own forward ignores it."""
    parameter_names = tuple(inspect.signature(original).parameters)[1:]

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        arguments = {**dict(zip(parameter_names, args)), **kwargs}
        labels = arguments.pop("labels", None)
        if labels is None:
            return original(self, *args, **kwargs)
        if arguments.get("decoder_input_ids") is None and arguments.get("decoder_inputs_embeds") is None:
            arguments["decoder_input_ids"] = self._shift_right(labels)
        return_dict = arguments.pop("return_dict", None)
        outputs = original(self, **arguments, return_dict=True)
        logits = outputs.logits
        ce_loss, z_loss_term = fused_cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.to(logits.device).reshape(-1), ignore_index=-100,
            label_smoothing=label_smoothing, z_loss=z_loss, num_items_in_batch=arguments.get("num_items_in_batch"),
            backend=_backend,
        )
        outputs = type(outputs)(**{**outputs, "loss": ce_loss + z_loss_term})
        if return_dict is False or (return_dict is None and not self.config.return_dict):
            return outputs.to_tuple()
        return outputs

    forward.__fat5_original__ = original
    return forward


def _patch_target(model_or_class):
    """The class and, for a model, the transformers model itself (a PEFT model's base model) to patch."""
    if isinstance(model_or_class, type):
        model_class, model = model_or_class, None
    else:
        model = model_or_class.get_base_model() if hasattr(model_or_class, "get_base_model") else model_or_class
        model_class = type(model)
    model_type = getattr(getattr(model_class, "config_class", None), "model_type", None)
    if model_type not in FAMILIES:
        raise TypeError(f"apply_fat5_kernels_to_t5 takes a transformers T5, mT5 or UMT5 model or class, got "
                        f"{model_class.__name__} (model_type {model_type!r})")
    return model_type, model_class, model


def apply_fat5_kernels_to_t5(model_or_class, *, rms_norm: bool = True, cross_entropy: bool = True,
                             z_loss: float = 0.0, label_smoothing: float = 0.0,
                             attention_dropout: float | None = None) -> None:
    """Put FAT5's kernels into a transformers T5, mT5 or UMT5 model (in place) or class (its later instances).

    Args:
        model_or_class: a model (a PEFT model's base model is patched), or a class such as
            ``T5ForConditionalGeneration``. A class patches transformers' classes themselves, as Liger-Kernel's
            ``apply_liger_kernel_to_*`` do: the family's norm class for every model of the family in this process.
        rms_norm: FAT5's RMSNorm as the forward of every ``T5LayerNorm`` (``MT5LayerNorm``, ``UMT5LayerNorm``).
        cross_entropy: FAT5's fused cross-entropy as the loss of a ``*ForConditionalGeneration`` given ``labels``
            (other classes have no language-model loss and keep theirs).
        z_loss: coefficient of the z-loss term (``z_loss * logsumexp(logits)**2`` per token) added to that loss.
        label_smoothing: as ``torch.nn.functional.cross_entropy``'s.
        attention_dropout: for a model: the dropout its attention layers apply to the attention probabilities while
            training. T5 uses ``dropout_rate`` for it, which the fused kernels cannot apply (such calls run
            transformers' attention): 0.0 turns it off and keeps the rest of T5's dropout. None leaves it.

    Weights, config and the saved folder are untouched: the model saves and loads as plain T5.
    """
    model_type, model_class, model = _patch_target(model_or_class)
    if z_loss < 0.0 or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"z_loss must be >= 0 and label_smoothing in [0, 1], got {z_loss} and {label_smoothing}")
    if (z_loss or label_smoothing) and not cross_entropy:
        raise ValueError("z_loss and label_smoothing belong to the fused cross-entropy: leave cross_entropy=True")
    if (z_loss or label_smoothing) and not issubclass(model_class, GenerationMixin):
        raise ValueError(f"z_loss and label_smoothing belong to a language model's loss: {model_class.__name__} has "
                         "none (T5ForConditionalGeneration, MT5..., UMT5... have)")
    if attention_dropout is not None and model is None:
        raise ValueError("attention_dropout is set on a model's attention layers: pass the model, not its class")
    family = _family_module(model_type)
    if rms_norm:
        norm_class = getattr(family, f"{FAMILIES[model_type]}LayerNorm")
        if model is None:
            norm_class.forward = _fused_rms_norm_forward
        for module in model.modules() if model is not None else ():
            if isinstance(module, norm_class):
                module.forward = types.MethodType(_fused_rms_norm_forward, module)
    if cross_entropy and issubclass(model_class, GenerationMixin):
        forward = _forward_with_fused_loss(_original(model_class.forward), z_loss, label_smoothing)
        if model is None:
            model_class.forward = forward
        else:
            model.forward = types.MethodType(forward, model)
    if attention_dropout is not None:
        attention_class = getattr(family, f"{FAMILIES[model_type]}Attention")
        for module in model.modules():
            if isinstance(module, attention_class):
                module.dropout = attention_dropout
