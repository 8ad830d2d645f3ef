"""FAT5 configuration: T5's fields, with their T5 meaning, plus the choices FAT5 adds."""

import copy
from typing import ClassVar

from transformers import PretrainedConfig

from .remote_code import write_remote_code

POSITION_ENCODINGS = ("t5", "alibi", "rope", "fire", "none")
ATTENTION_BACKENDS = ("auto", "reference", "triton")
INITIALIZATIONS = ("t5x", "transformers")
GRAPHED_DECODING_MODES = ("auto", "always", "never")


class FAT5Config(PretrainedConfig):
    r"""
    Configuration of a FAT5 model: a T5 encoder-decoder whose attention, RMSNorm and loss run in fused kernels.
    A T5, T5 v1.1, FLAN-T5, mT5 or UMT5 checkpoint converts into it with no change in outputs.

    T5's own fields (same names, same meaning as `transformers.T5Config`):

        vocab_size (`int`, defaults to 32128): number of tokens in the vocabulary.
        d_model (`int`, defaults to 512): width of the residual stream.
        d_kv (`int`, defaults to 64): width of one attention head (the kernels take 32, 64 or 128 fastest).
        d_ff (`int`, defaults to 2048): width of the feed-forward layer.
        num_layers (`int`, defaults to 6): encoder blocks.
        num_decoder_layers (`int`, *optional*): decoder blocks; `num_layers` when not given.
        num_heads (`int`, defaults to 8): attention heads.
        relative_attention_num_buckets (`int`, defaults to 32): buckets of the T5 relative position bias.
        relative_attention_max_distance (`int`, defaults to 128): distance from which all positions share a bucket.
        dropout_rate (`float`, defaults to 0.1): dropout on the residual branches and embeddings.
        layer_norm_epsilon (`float`, defaults to 1e-6): epsilon of the RMS norms.
        initializer_factor (`float`, defaults to 1.0): scales T5's initialisation (1.0 in real use).
        feed_forward_proj (`str`, defaults to `"relu"`): `"relu"` (T5 v1.0), `"gated-gelu"` (T5 v1.1, FLAN-T5,
            mT5) or any `ACT` / `gated-ACT` with an activation known to transformers.
        tie_word_embeddings (`bool`, defaults to `True`): share `lm_head` with the input embedding (T5 v1.0). Unlike
            transformers 5's T5Config this is not rewritten: v1.1 / FLAN-T5 / mT5 keep `False`.
        scale_decoder_outputs (`bool`, *optional*): multiply the decoder output by `d_model**-0.5` before
            `lm_head`; defaults to `tie_word_embeddings`, as original T5 does.
        classifier_dropout (`float`, defaults to 0.0): dropout in the classification head.
        is_encoder_decoder, use_cache, pad_token_id (0), eos_token_id (1), decoder_start_token_id (0): as in T5.

    FAT5's own fields:

        encoder_only_heads (`bool`, defaults to `False`): `FAT5ForSequenceClassification` and
            `FAT5ForQuestionAnswering` run the encoder alone (classification of the mean of the unpadded tokens'
            states; answer span over the input tokens) instead of T5's encoder-decoder heads (the decoder's state at
            the last EOS; span over the decoder positions). About half the compute and no decoder weights; a
            converted `T5ForSequenceClassification` / `T5ForQuestionAnswering` needs `False`.

        position_encoding (`str`, defaults to `"t5"`): `"t5"` (the bucketed relative bias table, computed inside the
            attention kernel), `"alibi"` (fixed per-head linear distance penalties), `"rope"` (rotary embedding of
            queries and keys), `"fire"` (a learned MLP of the normalised log-distance, passed as a full bias) or
            `"none"`. Cross-attention never has a position encoding.
        position_bias_per_layer (`bool`, defaults to `False`): every block owns its T5 bias table (UMT5) instead
            of all blocks sharing the first block's (T5). Also applies to FIRE's MLP.
        attention_backend (`str`, defaults to `"auto"`): `"triton"` (fused kernels), `"reference"` (pure PyTorch)
            or `"auto"` (Triton on CUDA when installed, the reference elsewhere).
        attention_scale (`float`, *optional*, defaults to 1.0): factor on `q·k`. T5 uses 1.0 (its scale lives in the
            initialisation); `None` means `d_kv**-0.5`, usual with RoPE or ALiBi trained from scratch.
        attention_dropout_rate (`float`, defaults to 0.0): dropout on attention probabilities. The fused kernels do
            not drop attention probabilities: a non-zero value runs the reference attention while training.
        z_loss (`float`, defaults to 0.0): coefficient of the z-loss, `z_loss * mean(logsumexp(logits)**2)` over the
            labelled tokens, added to the loss and reported apart (FAT5's recipe uses 1e-4).
        label_smoothing (`float`, defaults to 0.0): label smoothing of the cross-entropy.
        use_fused_cross_entropy (`bool`, defaults to `True`): compute the loss with the fused kernel where the
            backend allows (it never materialises fp32 copies of the logits).
        use_chunked_lm_loss (`bool`, defaults to `False`): while training with labels, compute the loss from the
            decoder's output in chunks (`kernels.linear_cross_entropy`) so that the logits are never materialised,
            at the price of computing them twice; for large vocabularies (mT5's 250k: 4 GB of bf16 logits for 8192
            decoder tokens, their gradient as much again). `logits` is then `None` in the training forward's output;
            evaluation and generation compute them as usual. The logits path runs instead when the output layer is
            not a bare `nn.Linear` (a PEFT adapter on it), when its weight is still an FSDP2 shard, and under
            `torch.compile`.
        use_fused_rms_norm (`bool`, defaults to `True`): compute the RMS norms with the fused kernel where the
            backend allows, in eager mode; under `torch.compile` Inductor fuses the norms with their neighbours.
        use_fused_activation (`bool`, defaults to `True`): compute the feed-forward activation (and its gate
            product) in one fused kernel where the backend allows and the activation is one it knows (tanh or erf
            GELU, ReLU, SiLU); it rounds once where eager PyTorch rounds after every operation.
        rope_theta (`float`, defaults to 10000.0): RoPE base.
        fire_mlp_width (`int`, defaults to 32): hidden width of FIRE's MLP.
        fire_init_c (`float`, defaults to 0.1): initial value of FIRE's learnable log-transform scale `c`.
        fire_init_threshold (`float`, defaults to 512.0): initial value of FIRE's learnable length threshold `L`.
        graphed_decoding (`str`, defaults to `"auto"`): how `FAT5ForConditionalGeneration.generate` decodes greedily,
            by sampling or by beam search. `"auto"`: on a GPU, through FAT5's own loop (`graphed_decoding.py`): a
            decoding step of few kernels replayed from CUDA graphs, the same ids as transformers' loop, for the
            options that loop follows (max_new_tokens / max_length, min_new_tokens / min_length, eos / pad /
            decoder_start ids, do_sample, num_beams, length_penalty, early_stopping, num_return_sequences,
            temperature, top_k, top_p, repetition_penalty and the other logits processors that the generation config
            builds, return_dict_in_generate with `sequences`, and for beam search `beam_indices` and output_scores),
            transformers' loop for anything else (scores without beams, logits, attentions, hidden states, custom
            logits processors or stopping criteria, a decoder prefix, a cache given). `"always"`: that loop on a CPU
            too (the same step, run eagerly). `"never"`: transformers' loop.
        initialization (`str`, defaults to `"t5x"`): how a fresh model draws its weights; weights loaded from a
            checkpoint are never drawn, so a loaded or converted model is the same under either. `"t5x"`: T5X's
            T5 v1.1 draw, in which an untied `lm_head` has std `d_model**-0.5`, so that pretraining starts from a
            loss near ln(vocab_size). `"transformers"`: `T5ForConditionalGeneration`'s draw (an untied `lm_head`
            with std 1.0: logits of std about sqrt(d_model) at the first step), for parity tests with it.
            `FAT5PreTrainedModel._init_weights` lists every draw under both.
    """

    model_type = "fat5"
    # what the Trainer leaves out of the predictions: with the loss's two parts left out too, they are T5's
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values", "cache", "ce_loss", "z_loss"]
    attribute_map: ClassVar[dict[str, str]] = {
        "hidden_size": "d_model",
        "num_attention_heads": "num_heads",
        "num_hidden_layers": "num_layers",
        "head_dim": "d_kv",
    }

    def __init__(
        self,
        vocab_size: int = 32128, d_model: int = 512, d_kv: int = 64, d_ff: int = 2048, num_layers: int = 6,
        num_decoder_layers: int | None = None, num_heads: int = 8, relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128, dropout_rate: float = 0.1, layer_norm_epsilon: float = 1e-6,
        initializer_factor: float = 1.0, feed_forward_proj: str = "relu", tie_word_embeddings: bool = True,
        scale_decoder_outputs: bool | None = None, classifier_dropout: float = 0.0, encoder_only_heads: bool = False,
        is_encoder_decoder: bool = True, use_cache: bool = True, pad_token_id: int = 0, eos_token_id: int = 1,
        decoder_start_token_id: int = 0, position_encoding: str = "t5", position_bias_per_layer: bool = False,
        attention_backend: str = "auto", attention_scale: float | None = 1.0, attention_dropout_rate: float = 0.0,
        z_loss: float = 0.0, label_smoothing: float = 0.0, use_fused_cross_entropy: bool = True,
        use_chunked_lm_loss: bool = False, use_fused_rms_norm: bool = True, use_fused_activation: bool = True,
        rope_theta: float = 10000.0, fire_mlp_width: int = 32, fire_init_c: float = 0.1,
        fire_init_threshold: float = 512.0, initialization: str = "t5x", graphed_decoding: str = "auto", **kwargs,
    ):
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.d_kv = d_kv
        self.d_ff = d_ff
        self.num_layers = num_layers
        self.num_decoder_layers = num_layers if num_decoder_layers is None else num_decoder_layers
        self.num_heads = num_heads
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.relative_attention_max_distance = relative_attention_max_distance
        self.dropout_rate = dropout_rate
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_factor = initializer_factor
        self.feed_forward_proj = feed_forward_proj
        self.scale_decoder_outputs = tie_word_embeddings if scale_decoder_outputs is None else scale_decoder_outputs
        self.classifier_dropout = classifier_dropout
        self.encoder_only_heads = encoder_only_heads
        self.use_cache = use_cache
        self.position_encoding = position_encoding
        self.position_bias_per_layer = position_bias_per_layer
        self.attention_backend = attention_backend
        self.attention_scale = attention_scale
        self.attention_dropout_rate = attention_dropout_rate
        self.z_loss = z_loss
        self.label_smoothing = label_smoothing
        self.use_fused_cross_entropy = use_fused_cross_entropy
        self.use_chunked_lm_loss = use_chunked_lm_loss
        self.use_fused_rms_norm = use_fused_rms_norm
        self.use_fused_activation = use_fused_activation
        self.rope_theta = rope_theta
        self.fire_mlp_width = fire_mlp_width
        self.fire_init_c = fire_init_c
        self.fire_init_threshold = fire_init_threshold
        self.initialization = initialization
        self.graphed_decoding = graphed_decoding
        # transformers passes `is_decoder` when it builds the decoder stack's copy of the config
        kwargs.setdefault("is_decoder", False)
        super().__init__(pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                         decoder_start_token_id=decoder_start_token_id, is_encoder_decoder=is_encoder_decoder,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
        self._validate()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "FAT5Config":
        """transformers only warns when a config of another model type is read as this one; a T5 checkpoint read as
        FAT5 would fail deep inside (T5's derived fields have no setter here) or load with its weights misnamed."""
        model_type = config_dict.get("model_type")
        if model_type not in (None, cls.model_type):
            raise ValueError(f"this checkpoint holds a {model_type!r} model, not a FAT5 one: convert it first "
                             "(`fat5 convert SRC OUT`), or load it with transformers' own class")
        return super().from_dict(config_dict, **kwargs)

    @property
    def dense_act_fn(self) -> str:
        activation = self.feed_forward_proj.split("-")[-1]
        # T5 v1.1's "gated-gelu" is the tanh approximation
        return "gelu_new" if self.feed_forward_proj == "gated-gelu" else activation

    @property
    def is_gated_act(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    @property
    def effective_attention_scale(self) -> float:
        return self.d_kv**-0.5 if self.attention_scale is None else float(self.attention_scale)

    def get_text_config(self, decoder=None, encoder=None) -> "FAT5Config":
        """The decoder's config (``decoder=True``: what ``generate`` sizes its KV caches from) counts the decoder's
        blocks as its ``num_layers``: a decoder deeper than the encoder (T5-Efficient's "DL" models) would otherwise
        get a cache with too few layers, and transformers' T5 fails there with an IndexError."""
        config = super().get_text_config(decoder=decoder, encoder=encoder)
        if decoder and not encoder and config.num_decoder_layers != config.num_layers:
            # transformers gives a copy already (the decoder's fields of a flat encoder-decoder config); never self
            config = copy.deepcopy(config) if config is self else config
            config.num_layers = config.num_decoder_layers
        return config

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """transformers' save, with the flat remote code beside config.json, which names it (``auto_map``, and
        ``custom_pipelines`` for the seq2seq pipeline): the folder loads with ``trust_remote_code=True`` where fat5 is
        not installed. Every FAT5 model's ``save_pretrained`` (and so ``push_to_hub`` and the Trainers' saves) saves
        its config through here, package class or one loaded as remote code."""
        write_remote_code(save_directory, self)
        return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    def _validate(self) -> None:
        self._validate_sizes_and_token_ids()
        self._validate_choices()
        self._validate_rates_and_scales()
        self._validate_flags()

    def _validate_sizes_and_token_ids(self) -> None:
        for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads", "fire_mlp_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"FAT5Config.{name} must be a positive integer, got {value!r}")
        # an id past the embedding would fail only in the forward, as an IndexError from deep inside it
        for name in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
            ids = getattr(self, name, None)
            for token_id in ids if isinstance(ids, (list, tuple)) else [ids]:
                if token_id is not None and (not isinstance(token_id, int) or isinstance(token_id, bool)
                                             or not 0 <= token_id < self.vocab_size):
                    raise ValueError(
                        f"FAT5Config.{name} must be a token id in [0, vocab_size = {self.vocab_size}), got {ids!r}"
                    )
        if not isinstance(self.num_decoder_layers, int) or self.num_decoder_layers < 0:
            raise ValueError(
                f"FAT5Config.num_decoder_layers must be a non-negative integer, got {self.num_decoder_layers!r}"
            )

    def _validate_choices(self) -> None:
        """The named options (activation, position encoding, initialisation, backend) and what each one requires."""
        from transformers.activations import ACT2FN

        parts = self.feed_forward_proj.split("-") if isinstance(self.feed_forward_proj, str) else []
        if not parts or len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated") or self.dense_act_fn not in ACT2FN:
            raise ValueError(
                f"FAT5Config.feed_forward_proj must be 'ACT' or 'gated-ACT' with an activation known to transformers "
                f"(e.g. 'relu', 'gated-gelu'), got {self.feed_forward_proj!r}"
            )
        if self.position_encoding not in POSITION_ENCODINGS:
            raise ValueError(
                f"FAT5Config.position_encoding must be one of {POSITION_ENCODINGS}, got {self.position_encoding!r}"
            )
        if self.initialization not in INITIALIZATIONS:
            raise ValueError(
                f"FAT5Config.initialization must be one of {INITIALIZATIONS} (T5X's draw, or transformers' T5 draw for "
                f"parity tests), got {self.initialization!r}"
            )
        if self.graphed_decoding not in GRAPHED_DECODING_MODES:
            raise ValueError(
                f"FAT5Config.graphed_decoding must be one of {GRAPHED_DECODING_MODES}, got {self.graphed_decoding!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"FAT5Config.attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.position_encoding == "t5":
            buckets, distance = self.relative_attention_num_buckets, self.relative_attention_max_distance
            # the encoder's buckets split in two directions, each half exact and half logarithmic up to max_distance
            if not isinstance(buckets, int) or buckets < 4 or buckets % 2:
                raise ValueError(
                    f"FAT5Config.relative_attention_num_buckets must be an even integer >= 4, got {buckets!r}"
                )
            if not isinstance(distance, int) or distance <= buckets // 2:
                raise ValueError(
                    "FAT5Config.relative_attention_max_distance must be an integer larger than "
                    f"relative_attention_num_buckets / 2 = {buckets // 2}, got {distance!r}"
                )
        if self.position_encoding == "rope" and self.d_kv % 2:
            raise ValueError(f"FAT5Config.d_kv must be even for position_encoding='rope', got {self.d_kv}")

    def _validate_rates_and_scales(self) -> None:
        for name in ("dropout_rate", "attention_dropout_rate", "classifier_dropout", "label_smoothing"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"FAT5Config.{name} must lie in [0, 1), got {value!r}")
        if not isinstance(self.z_loss, (int, float)) or self.z_loss < 0:
            raise ValueError(f"FAT5Config.z_loss must be >= 0, got {self.z_loss!r}")
        if self.attention_scale is not None and (
            not isinstance(self.attention_scale, (int, float)) or self.attention_scale <= 0
        ):
            raise ValueError(
                f"FAT5Config.attention_scale must be a positive number or None, got {self.attention_scale!r}"
            )
        if self.layer_norm_epsilon <= 0:
            raise ValueError(f"FAT5Config.layer_norm_epsilon must be positive, got {self.layer_norm_epsilon!r}")
        # RoPE's frequencies are powers of theta, FIRE takes log(c * distance + 1) / log(c * threshold + 1)
        for name in ("rope_theta", "fire_init_c", "fire_init_threshold"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"FAT5Config.{name} must be a positive number, got {value!r}")

    def _validate_flags(self) -> None:
        # a string such as "false" from a hand-edited config.json would be truthy and silently switch the feature on
        for name in (
            "tie_word_embeddings",
            "scale_decoder_outputs",
            "position_bias_per_layer",
            "use_fused_cross_entropy",
            "use_chunked_lm_loss",
            "use_fused_rms_norm",
            "use_fused_activation",
        ):
            if not isinstance(getattr(self, name), bool):  # ValueError, as for every invalid field
                raise ValueError(f"FAT5Config.{name} must be true or false, got {getattr(self, name)!r}")  # noqa: TRY004
