"""FAT5's greedy, sampled and beam search decoding through a decoding step of few kernels, replayed from CUDA graphs.

``FAT5ForConditionalGeneration.generate`` hands its decoding loop here when :func:`graphed_generate_arguments` allows:
transformers prepares the call as for its own loop (generation config, the encoder's outputs, logits processors,
stopping criteria) and runs :func:`graphed_decode` as its ``custom_generate`` loop. What differs from transformers'
loop, where FAT5's step is some 330 kernels, launched by the host between ``generate``'s own bookkeeping:

- the step (:func:`_decoder_step`): per decoder layer one product for self-attention's q, k and v, one for the
  feed-forward's input projections, the residual added by each output projection (``addmm_``), FAT5's RMSNorm,
  attention and activation kernels; the cross-attention keys and values of every layer come from one product of the
  encoder's output at the start of the call; T5's bias by relative position is made once per version of the weights,
  not by every attention launch. These derived weights (:class:`_DecoderWeights`) are kept on the model and made
  again when a parameter changes (its ``data_ptr()`` or ``_version``: an in-place change through ``.data`` is not
  seen).
- static buffers for one (batch, encoder length bucket, cache length bucket, ...) and, on a GPU, a CUDA graph of
  the step over them (:class:`_DecodingGraph`); an encoder length is rounded up to its bucket (the keys beyond it
  are masked) and the self-attention cache holds ``max_length - 1`` positions rounded up, so that calls of other
  lengths replay a graph already captured. At most ``MAX_KEPT_GRAPHS`` are kept, the least recently used dropped.
  On a CPU the same step runs eagerly.
- the loop (:func:`_run`): greedy decoding picks the token inside the graph, EOS masked there under min_length /
  min_new_tokens; any other logits processor (and sampling) is transformers' own, run eagerly on the step's
  logits. Finished rows are tracked on the device (tokens after EOS are ``pad_token_id``, as in transformers) and
  the host looks at them every ``HOST_CHECK_EVERY`` steps; sampling looks at every step, so that it draws exactly
  the random numbers that transformers' loop draws.
- beam search and beam sampling (:class:`_BeamSearch`): the graph's rows are the inputs times ``num_beams``, as
  transformers expands them; its step only gives the logits, and the beams are kept as in transformers'
  ``_beam_search``, through the helper methods of ``GenerationMixin`` that it calls (top-k continuations, running
  and finished beams, length penalty, early stopping). Between two steps the self-attention cache is reordered
  eagerly by the beams chosen (:meth:`_DecodingGraph.reorder_cache`): the captured step is the one greedy decoding
  replays. The host looks at every step, as transformers does.

Anything this loop does not follow (scores other than beam search's, logits, attentions, custom stopping criteria, a
decoder prefix...) keeps transformers' loop, unchanged.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.activations import ACT2FN
from transformers.generation import GenerateBeamEncoderDecoderOutput, GenerateEncoderDecoderOutput
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .kernels.activation import gated_activation
from .kernels.attention import attention
from .kernels.dispatch import use_triton
from .kernels.position_bias import NO_POSITION_BIAS, PositionBias
from .kernels.rms_norm import rms_norm
from .position_encoding import LENGTH_FREE_ENCODINGS, StackPositionEncoding, clamp_fp16, length_free_biases

MAX_KEPT_GRAPHS = 4
HOST_CHECK_EVERY = 16
# FIRE evaluates its MLP for every query position: its bias would have to be made inside the step
_POSITION_ENCODINGS = ("t5", "alibi", "rope", "none")
# generate's arguments that only transformers' loop follows
_LOOP_ARGUMENTS = (
    "assistant_model", "streamer", "custom_generate", "prefix_allowed_tokens_fn", "negative_prompt_ids",
    "negative_prompt_attention_mask", "synced_gpus", "tokenizer", "assistant_tokenizer", "cache", "past_key_values",
    "decoder_input_ids", "decoder_inputs_embeds", "decoder_attention_mask",
)
_GRAPHED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH,
                  GenerationMode.BEAM_SAMPLE)
_MINIMUM_LENGTHS = (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor)
_OUTPUT_OPTIONS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
# beam search runs transformers' processors on the host at every step, as its loop does: their scores cost a copy
_BEAM_OUTPUT_OPTIONS = ("output_scores",)


# ----------------------------------------------------------------------------------------------------------------
# When the loop applies


def graphed_generate_arguments(model, generation_config, kwargs: dict) -> dict | None:
    """The arguments with which ``model.generate(generation_config=generation_config, **kwargs)`` runs
    :func:`graphed_decode` as its loop, or None where transformers' loop serves: ``config.graphed_decoding``
    forbids the graphed loop here, the model is training or has weights the step cannot read (an adapter, FIRE), or
    the call asks for something other than greedy, sampled or beam search decoding with options the loop follows. A
    cache implementation asked for is dropped: the loop has static buffers of its own, and transformers would
    allocate the cache before it for nothing."""
    mode = model.config.graphed_decoding
    if mode == "never" or (mode == "auto" and model.device.type != "cuda"):
        return None
    if model.training or unsupported_model_reason(model) is not None:
        return None
    if any(kwargs.get(name) is not None for name in _LOOP_ARGUMENTS):
        return None
    if kwargs.get("logits_processor") or kwargs.get("stopping_criteria"):
        return None
    config, _ = model._prepare_generation_config(generation_config, **kwargs)
    if config.get_generation_mode() not in _GRAPHED_MODES or config.low_memory:
        return None
    followed = _BEAM_OUTPUT_OPTIONS if config.num_beams > 1 else ()
    outputs = [name for name in _OUTPUT_OPTIONS if name not in followed]
    if any(getattr(config, name, False) for name in outputs) or config.stop_strings or config.max_time:
        return None
    arguments = {**kwargs, "custom_generate": graphed_decode}
    if config.cache_implementation is not None:
        arguments["cache_implementation"] = None
    return arguments


def unsupported_model_reason(model) -> str | None:
    """Why the graphed step cannot stand for this model's decoder, or None when it can."""
    config = model.config
    if config.num_decoder_layers == 0:
        return "no decoder layers"
    if config.position_encoding not in LENGTH_FREE_ENCODINGS:
        return f"position_encoding={config.position_encoding!r} (supported: {LENGTH_FREE_ENCODINGS})"
    if any(type(module) is not nn.Linear or module.bias is not None for module in _projections(model)):
        return "a decoder projection is not a plain bias-free nn.Linear (an adapter such as LoRA wraps it)"
    if type(model.decoder.embed_tokens) is not nn.Embedding:
        return "the decoder's embedding is not a plain nn.Embedding"
    modules = [*model.decoder.modules(), model.lm_head]
    if any(module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook") for module in modules):
        return "a decoder module has forward hooks (accelerate's offloading, a user's hook), which the step would skip"
    parameters = [*model.decoder.parameters(), model.lm_head.weight]
    if len({(parameter.dtype, parameter.device) for parameter in parameters}) != 1:
        return "the decoder's parameters differ in dtype or device"
    if not parameters[0].dtype.is_floating_point:
        return f"the decoder's weights are {parameters[0].dtype} (quantised)"
    return None


def _projections(model) -> list[nn.Module]:
    """The decoder's projections whose weights the step reads, and the output layer."""
    projections = [model.lm_head]
    for block in model.decoder.block:
        for attention_ in (block.layer[0].SelfAttention, block.layer[1].EncDecAttention):
            projections += [attention_.q, attention_.k, attention_.v, attention_.o]
        feed_forward = block.layer[2].DenseReluDense
        names = ("wi", "wo") if hasattr(feed_forward, "wi") else ("wi_0", "wi_1", "wo")
        projections += [getattr(feed_forward, name) for name in names]
    return projections


def _loop_unsupported_reason(input_ids, stopping_criteria, model_kwargs) -> str | None:
    if input_ids.shape[1] != 1:
        return "a decoder prefix"
    if any(type(criterion) not in (MaxLengthCriteria, EosTokenCriteria) for criterion in stopping_criteria):
        return "stopping criteria other than max_length and eos_token_id"
    if model_kwargs.get("encoder_outputs") is None or model_kwargs.get("decoder_attention_mask") is not None:
        return "no encoder outputs, or a decoder attention mask"
    return None


# ----------------------------------------------------------------------------------------------------------------
# Derived weights


def _weights_key(model) -> tuple:
    return tuple((parameter.data_ptr(), parameter._version) for parameter in model.parameters())


@dataclass
class _DecoderWeights:
    """The decoder's weights as the step reads them: concatenated where one product replaces several."""

    embedding: torch.Tensor
    norms: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per layer: self-attention, cross, feed-forward
    query_key_value: list[torch.Tensor]  # (3 * inner, d_model)
    self_output: list[torch.Tensor]
    cross_query: list[torch.Tensor]
    cross_output: list[torch.Tensor]
    cross_key_value: torch.Tensor  # (layers * 2 * inner, d_model): every layer's k then v
    feed_forward_input: list[torch.Tensor]  # gated: (2, d_model, d_ff), wi_0 then wi_1, transposed; else wi
    feed_forward_output: list[torch.Tensor]
    final_norm: torch.Tensor  # times d_model**-0.5 when the head's input is scaled (tied embeddings)
    lm_head: torch.Tensor
    position_bias: list[PositionBias]
    position_encoding: StackPositionEncoding  # every layer's rotation: RoPE's, or none
    t5_bias_rows: list[torch.Tensor | None]
    # the modules' own choices, which later edits of the config do not change
    norm_backend: str
    attention_backend: str
    activation_backend: str | None  # None: transformers' ACT2FN module

    @staticmethod
    @torch.no_grad()
    def of(model) -> "_DecoderWeights":
        config, blocks = model.config, model.decoder.block
        self_attentions = [block.layer[0].SelfAttention for block in blocks]
        crosses = [block.layer[1].EncDecAttention for block in blocks]
        feed_forwards = [block.layer[2].DenseReluDense for block in blocks]
        final_norm = model.decoder.final_layer_norm.weight
        if config.scale_decoder_outputs:
            final_norm = final_norm * model.model_dim**-0.5
        position_bias = length_free_biases([attention_.stack_position_encoding for attention_ in self_attentions],
                                           [attention_.own_position_parameters() for attention_ in self_attentions],
                                           model.lm_head.weight.device)
        attention_backend = self_attentions[0].backend
        return _DecoderWeights(
            embedding=model.decoder.embed_tokens.weight,
            norms=[tuple(sub.layer_norm.weight for sub in block.layer) for block in blocks],
            query_key_value=[torch.cat((a.q.weight, a.k.weight, a.v.weight)) for a in self_attentions],
            self_output=[attention_.o.weight for attention_ in self_attentions],
            cross_query=[cross.q.weight for cross in crosses],
            cross_output=[cross.o.weight for cross in crosses],
            cross_key_value=torch.cat([weight for cross in crosses for weight in (cross.k.weight, cross.v.weight)]),
            feed_forward_input=[_feed_forward_input(feed_forward) for feed_forward in feed_forwards],
            feed_forward_output=[feed_forward.wo.weight for feed_forward in feed_forwards],
            final_norm=final_norm,
            lm_head=model.lm_head.weight,
            position_bias=position_bias,
            position_encoding=self_attentions[0].stack_position_encoding,
            t5_bias_rows=_t5_bias_rows(attention_backend, position_bias),
            norm_backend=model.decoder.final_layer_norm.backend,
            attention_backend=attention_backend,
            activation_backend=feed_forwards[0].activation_backend,
        )


def _feed_forward_input(feed_forward) -> torch.Tensor:
    if hasattr(feed_forward, "wi"):
        return feed_forward.wi.weight
    return torch.stack((feed_forward.wi_0.weight, feed_forward.wi_1.weight)).transpose(1, 2)


def _t5_bias_rows(backend: str, position_biases: list[PositionBias]) -> list[torch.Tensor | None]:
    """Each layer's T5 bias by relative position for the decoding kernel, made once per table (the layers that
    share the first layer's table share its rows); None where the kernel does not run or the bias is no T5 one."""
    rows_by_bias = {}
    for bias in position_biases:
        if id(bias) not in rows_by_bias and bias.kind == "t5" and use_triton(backend, bias.tensor):
            from .kernels.attention_triton import t5_bias_rows

            rows_by_bias[id(bias)] = t5_bias_rows(bias)
    return [rows_by_bias.get(id(bias)) for bias in position_biases]


# ----------------------------------------------------------------------------------------------------------------
# The step


def _norm(config, weights, hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, weight, config.layer_norm_epsilon, backend=weights.norm_backend)


def _attend(config, weights, query, key, value, position_bias=NO_POSITION_BIAS, bias_rows=None, causal=False,
            key_padding_mask=None, query_offset=None) -> torch.Tensor:
    """(batch, heads, 1, head_dim) attention output: FAT5's decoding kernel, or its reference off the GPU."""
    arguments = {"position_bias": position_bias, "scale": config.effective_attention_scale, "causal": causal,
                 "key_padding_mask": key_padding_mask}
    if use_triton(weights.attention_backend, query):
        from .kernels.attention_triton import decode_attention

        return decode_attention(query, key, value, t5_bias_rows=bias_rows, query_offset=query_offset, **arguments)
    offset = 0 if query_offset is None else query_offset
    return attention(query, key, value, query_offset=offset, backend="reference", **arguments)


def _self_attention(config, weights, buffers, layer: int, hidden_states: torch.Tensor) -> torch.Tensor:
    batch, heads, head_dim = hidden_states.shape[0], config.num_heads, config.d_kv
    normed = _norm(config, weights, hidden_states, weights.norms[layer][0])
    query_key_value = nn.functional.linear(normed, weights.query_key_value[layer]).view(batch, 3, heads, 1, head_dim)
    query, key_value = query_key_value[:, 0], query_key_value[:, 1:].transpose(0, 1)
    if weights.position_encoding.rotates:  # else the key is written to the cache as it is, without a copy
        position_ids = buffers.position.view(1, 1)
        query = weights.position_encoding.rotate(query, position_ids)
        key_value = torch.stack((weights.position_encoding.rotate(key_value[0], position_ids), key_value[1]))
    cache = buffers.self_cache[layer]
    cache.index_copy_(3, buffers.position, key_value)
    output = _attend(config, weights, query, cache[0], cache[1], weights.position_bias[layer],
                     weights.t5_bias_rows[layer], causal=True, query_offset=buffers.position)
    # in place: out of place, addmm copies the residual into a new tensor first (one more kernel)
    return hidden_states.addmm_(output.reshape(batch, heads * head_dim), weights.self_output[layer].t())


def _cross_attention(config, weights, buffers, layer: int, hidden_states: torch.Tensor) -> torch.Tensor:
    batch, heads, head_dim = hidden_states.shape[0], config.num_heads, config.d_kv
    normed = _norm(config, weights, hidden_states, weights.norms[layer][1])
    query = nn.functional.linear(normed, weights.cross_query[layer]).view(batch, heads, 1, head_dim)
    key, value = buffers.cross_key_value_of(layer)
    output = _attend(config, weights, query, key, value, key_padding_mask=buffers.cross_mask)
    return hidden_states.addmm_(output.reshape(batch, heads * head_dim), weights.cross_output[layer].t())


def _feed_forward(config, weights, layer: int, hidden_states: torch.Tensor) -> torch.Tensor:
    normed = _norm(config, weights, hidden_states, weights.norms[layer][2])
    projection = weights.feed_forward_input[layer]
    if config.is_gated_act:
        gate, linear = torch.matmul(normed, projection)  # one batched product: (2, batch, d_ff)
    else:
        gate, linear = nn.functional.linear(normed, projection), None
    if weights.activation_backend is not None:
        activated = gated_activation(gate, linear, config.dense_act_fn, weights.activation_backend)
    else:
        activated = ACT2FN[config.dense_act_fn](gate)
        activated = activated if linear is None else activated * linear
    return hidden_states.addmm_(activated, weights.feed_forward_output[layer].t())


def _decoder_step(config, weights: _DecoderWeights, buffers: "_DecodingGraph") -> torch.Tensor:
    """The (batch, vocab) logits of the tokens in ``buffers.token`` at decoder position ``buffers.position``."""
    hidden_states = nn.functional.embedding(buffers.token, weights.embedding)
    for layer in range(len(weights.query_key_value)):
        hidden_states = clamp_fp16(_self_attention(config, weights, buffers, layer, hidden_states))
        hidden_states = clamp_fp16(_cross_attention(config, weights, buffers, layer, hidden_states))
        hidden_states = clamp_fp16(_feed_forward(config, weights, layer, hidden_states))
    return nn.functional.linear(_norm(config, weights, hidden_states, weights.final_norm), weights.lm_head)


# ----------------------------------------------------------------------------------------------------------------
# Static buffers and graphs


def encoder_length_bucket(length: int) -> int:
    """The encoder length a graph is captured for: a multiple of 128 up to 2048, of 1024 beyond."""
    granule = 128 if length <= 2048 else 1024
    return max(granule, -(-length // granule) * granule)


def cache_length_bucket(positions: int) -> int:
    """The self-attention cache length for ``positions`` decoder positions: a power of two, 64 at least."""
    return max(64, 1 << (positions - 1).bit_length())


@dataclass(frozen=True)
class _GraphKey:
    batch: int
    encoder_length: int
    cache_length: int
    greedy_in_graph: bool
    suppresses_eos: bool  # greedy under min_length / min_new_tokens: EOS masked inside the graph
    eos_token_ids: tuple[int, ...] | None
    pad_token_id: int | None


class _DecodingGraph:
    """The static buffers of one :class:`_GraphKey` and the decoding step over them, captured in a CUDA graph on a
    GPU (run eagerly elsewhere). ``position`` is the decoder position of ``token``; a step writes the next token at
    ``position + 1`` of ``sequences``."""

    def __init__(self, model, weights: _DecoderWeights, key: _GraphKey):
        config, device, dtype = model.config, weights.lm_head.device, weights.lm_head.dtype
        self.config, self.weights, self.key = config, weights, key
        layers, heads, batch = len(weights.query_key_value), config.num_heads, key.batch
        self.token = torch.zeros(batch, dtype=torch.long, device=device)
        # the token's position and the next one, advanced by one kernel; ``position`` and ``next_position`` view it
        self.positions = torch.tensor([0, 1], dtype=torch.long, device=device)
        self.position, self.next_position = self.positions[:1], self.positions[1:]
        self.sequences = torch.zeros(batch, key.cache_length + 1, dtype=torch.long, device=device)
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.eos = None if key.eos_token_ids is None else torch.tensor(key.eos_token_ids, device=device)
        # the tokens masked before position ``eos_allowed_from`` (min_length / min_new_tokens), set by each call
        self.eos_allowed_from = torch.zeros(1, dtype=torch.long, device=device)
        self.suppressed_tokens = torch.zeros(config.vocab_size, dtype=torch.bool, device=device)
        # zeros: the slots that causal masking hides must hold no NaN for the products with their zero weights
        self.self_cache = torch.zeros(layers, 2, batch, heads, key.cache_length, config.d_kv, dtype=dtype,
                                      device=device)
        # encoder position first: the positions of a shorter input are one contiguous block, which the projection
        # writes in place (a (batch, length) layout would need the product in a temporary as large as the buffer)
        self.cross_key_value = torch.zeros(key.encoder_length, batch, layers * 2 * heads * config.d_kv, dtype=dtype,
                                           device=device)
        self.cross_mask = torch.zeros(batch, key.encoder_length, dtype=torch.bool, device=device)
        self.logits = None
        self._replay = None

    def cross_key_value_of(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s cross-attention keys and values, (batch, heads, encoder_length, head_dim) views."""
        batch, length = self.cross_mask.shape
        layers = len(self.weights.query_key_value)
        per_layer = self.cross_key_value.view(length, batch, layers, 2, self.config.num_heads, self.config.d_kv)
        return per_layer[:, :, layer, 0].permute(1, 2, 0, 3), per_layer[:, :, layer, 1].permute(1, 2, 0, 3)

    def start(self, encoder_states: torch.Tensor, attention_mask: torch.Tensor | None, first_tokens: torch.Tensor):
        """Project the encoder's states into every layer's cross-attention keys and values, and set the loop back
        to position 0 with ``first_tokens`` (batch,)."""
        batch, length, _ = encoder_states.shape
        positions_first = encoder_states.transpose(0, 1).reshape(length * batch, -1)
        torch.mm(positions_first, self.weights.cross_key_value.t(),
                 out=self.cross_key_value[:length].view(length * batch, -1))
        self.cross_mask.zero_()
        self.cross_mask[:, :length] = True if attention_mask is None else attention_mask.bool()
        self.restart(first_tokens)

    def restart(self, first_tokens: torch.Tensor) -> None:
        self.token.copy_(first_tokens)
        self.sequences[:, 0] = first_tokens
        self.positions.copy_(torch.arange(2, device=self.positions.device))
        self.unfinished.fill_(True)

    def _step(self) -> torch.Tensor:
        logits = _decoder_step(self.config, self.weights, self)
        if self.key.greedy_in_graph:
            if self.key.suppresses_eos:
                masked = self.suppressed_tokens & (self.position < self.eos_allowed_from)
                logits = torch.where(masked, float("-inf"), logits)
            self.advance(logits.argmax(dim=-1))
        return logits

    def advance(self, next_tokens: torch.Tensor) -> None:
        """Write the chosen tokens (pad after a row's EOS, as transformers does) and move to the next position."""
        if self.eos is not None:
            next_tokens = torch.where(self.unfinished, next_tokens, self.key.pad_token_id)
            self.unfinished.logical_and_(torch.isin(next_tokens, self.eos, invert=True))
        self.sequences.index_copy_(1, self.next_position, next_tokens[:, None])
        self.token.copy_(next_tokens)
        self.positions.add_(1)

    def reorder_cache(self, rows: torch.Tensor, length: int) -> None:
        """Give row ``i`` the self-attention keys and values of row ``rows[i]`` in the first ``length`` positions: beam
        search's choice of beams, made eagerly between two steps so that the captured step stays the greedy one."""
        filled = self.self_cache[:, :, :, :, :length]
        filled.copy_(filled.index_select(2, rows))

    def replay(self) -> None:
        """One decoding step: the captured graph on a GPU (captured at the first call), the calls eagerly elsewhere."""
        if self._replay is None:
            self._replay = self._capture() if self.token.is_cuda else self._eager_step
        self._replay()

    def _eager_step(self) -> None:
        self.logits = self._step()

    def _capture(self):
        """Warm up on a side stream (kernels compiled, workspaces allocated), put the state back, then capture."""
        first_tokens = self.token.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.restart(first_tokens)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self._step()
        return graph.replay


class GraphedDecodingState:
    """What a model keeps for the graphed loop: the derived weights, while its parameters are unchanged, and up to
    ``MAX_KEPT_GRAPHS`` graphs with their buffers, least recently used dropped first. ``weight_builds`` and
    ``graph_builds`` count how often each was made, ``graph_uses`` the calls served (tests and benchmarks read
    them)."""

    def __init__(self):
        self.weights_key = None
        self.weights = None
        self.graphs: OrderedDict = OrderedDict()
        self.weight_builds = 0
        self.graph_builds = 0
        self.graph_uses = 0

    def __reduce__(self):
        # a copy or a pickle of the model starts empty: the graphs and buffers belong to this model's weights (and a
        # CUDA graph can be neither copied nor pickled)
        return GraphedDecodingState, ()

    def clear(self) -> None:
        """Drop the derived weights, the graphs and their buffers (their memory goes back to PyTorch's allocator)."""
        self.graphs.clear()
        self.weights = self.weights_key = None

    def graph_for(self, model, key: _GraphKey) -> _DecodingGraph:
        weights_key = _weights_key(model)
        if weights_key != self.weights_key:
            self.graphs.clear()
            self.weights, self.weights_key = _DecoderWeights.of(model), weights_key
            self.weight_builds += 1
        self.graph_uses += 1
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key]
        while len(self.graphs) >= MAX_KEPT_GRAPHS:
            self.graphs.popitem(last=False)
        self.graphs[key] = _DecodingGraph(model, self.weights, key)
        self.graph_builds += 1
        return self.graphs[key]


def graphed_decoding_state(model) -> GraphedDecodingState:
    """The model's :class:`GraphedDecodingState`, made at its first graphed call; ``.clear()`` frees its memory."""
    state = model.__dict__.get("_graphed_decoding_state")
    if state is None:
        state = model.__dict__["_graphed_decoding_state"] = GraphedDecodingState()
    return state


# ----------------------------------------------------------------------------------------------------------------
# The loop


def graphed_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
    """``generate``'s decoding loop (its ``custom_generate``) for greedy, sampled and beam search decoding:
    transformers' own ``_sample`` or ``_beam_search`` where :func:`_loop_unsupported_reason` finds something this loop
    does not follow. With ``return_dict_in_generate`` the output holds the ``sequences`` alone (and beam search's
    ``beam_indices``, with its scores under ``output_scores``): the keys and values stay in the graph's buffers, so
    its ``cache`` is None (transformers' is the cache it filled)."""
    beam_search = generation_config.num_beams > 1
    if _loop_unsupported_reason(input_ids, stopping_criteria, model_kwargs) is not None:
        loop = GenerationMixin._beam_search if beam_search else GenerationMixin._sample
        return loop(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs)
    if beam_search:
        return _beam_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)
    eos = next((criterion.eos_token_id for criterion in stopping_criteria if isinstance(criterion, EosTokenCriteria)),
               None)
    pad = generation_config._pad_token_tensor
    max_length = generation_config.max_length
    suppression = None if generation_config.do_sample else _eos_suppression(logits_processor)
    key = _GraphKey(
        batch=input_ids.shape[0], encoder_length=_encoder_length_bucket_of(model_kwargs),
        cache_length=cache_length_bucket(max_length - 1),
        greedy_in_graph=not generation_config.do_sample and (len(logits_processor) == 0 or suppression is not None),
        suppresses_eos=suppression is not None, eos_token_ids=None if eos is None else _token_ids(eos),
        pad_token_id=None if pad is None else int(pad),
    )
    graph = graphed_decoding_state(model).graph_for(model, key)
    if suppression is not None:
        graph.eos_allowed_from.fill_(suppression[0])
        graph.suppressed_tokens.zero_()
        graph.suppressed_tokens[list(suppression[1])] = True
    _start(graph, input_ids, model_kwargs)
    length = _run(graph, max_length, logits_processor, generation_config.do_sample)
    sequences = graph.sequences[:, :length].clone()
    if generation_config.return_dict_in_generate:
        return GenerateEncoderDecoderOutput(sequences=sequences)
    return sequences


def _encoder_length_bucket_of(model_kwargs) -> int:
    return encoder_length_bucket(model_kwargs["encoder_outputs"][0].shape[1])


def _start(graph: _DecodingGraph, input_ids, model_kwargs) -> None:
    encoder_states = model_kwargs["encoder_outputs"][0].to(graph.weights.lm_head.dtype)
    graph.start(encoder_states, model_kwargs.get("attention_mask"), input_ids[:, 0])


def _beam_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
    """Beam search (or beam sampling) over the rows that transformers made: each input repeated ``num_beams``
    times, its encoder output and attention mask with it. The graph picks no token and tracks no EOS: its step
    gives the logits, and :class:`_BeamSearch` does the rest."""
    key = _GraphKey(
        batch=input_ids.shape[0], encoder_length=_encoder_length_bucket_of(model_kwargs),
        cache_length=cache_length_bucket(generation_config.max_length - 1), greedy_in_graph=False,
        suppresses_eos=False, eos_token_ids=None, pad_token_id=None,
    )
    graph = graphed_decoding_state(model).graph_for(model, key)
    _start(graph, input_ids, model_kwargs)
    beams = _BeamSearch(model, input_ids, generation_config)
    _run_beam_search(graph, beams, logits_processor, stopping_criteria)
    return beams.output()


def _token_ids(ids) -> tuple[int, ...]:
    return tuple(torch.as_tensor(ids).reshape(-1).tolist())


def _eos_suppression(logits_processor) -> tuple[int, tuple[int, ...]] | None:
    """(the first decoder position whose next token may be EOS, the EOS ids) when every processor is a minimum
    length (min_length, min_new_tokens: what a greedy call with such options builds), else None. A processor at
    position ``p`` sees ``p + 1`` tokens; it masks EOS while their count is below its minimum."""
    if not logits_processor or any(type(processor) not in _MINIMUM_LENGTHS for processor in logits_processor):
        return None
    allowed_from, eos = 0, set()
    for processor in logits_processor:
        if isinstance(processor, MinLengthLogitsProcessor):
            allowed_from = max(allowed_from, processor.min_length - 1)
        else:
            allowed_from = max(allowed_from, processor.min_new_tokens + processor.prompt_length_to_skip - 1)
        eos.update(_token_ids(processor.eos_token_id))
    return allowed_from, tuple(sorted(eos))


def _run(graph: _DecodingGraph, max_length: int, logits_processor, do_sample: bool) -> int:
    """Decode up to ``max_length`` positions (the first token included); returns the length of the sequences, which
    ends where every row has finished, as transformers' loop stops."""
    tracks_eos = graph.eos is not None
    for length in range(1, max_length):
        graph.replay()
        if not graph.key.greedy_in_graph:
            scores = logits_processor(graph.sequences[:, :length], graph.logits.to(torch.float32, copy=True))
            if do_sample:
                next_tokens = torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                next_tokens = torch.argmax(scores, dim=-1)
            graph.advance(next_tokens)
        looks = do_sample or length % HOST_CHECK_EVERY == 0
        if tracks_eos and looks and not graph.unfinished.any():
            break
    return _finished_length(graph, max_length) if tracks_eos else max_length


def _finished_length(graph: _DecodingGraph, max_length: int) -> int:
    """Where transformers' loop stops: after the step at which the last row makes its first EOS (the tokens before
    a row's first EOS are none, those after it padding), or at ``max_length`` while a row has none."""
    generated = graph.sequences[:, 1:max_length]
    is_eos = torch.isin(generated, graph.eos)
    ended_at = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, max_length - 1)
    return 1 + int(ended_at.max())


# ----------------------------------------------------------------------------------------------------------------
# Beam search


class _BeamSearch:
    """transformers' ``_beam_search`` bookkeeping over the graph's logits, through the helper methods of
    ``GenerationMixin`` that it calls, in its order: the running and finished beams of each input, their scores and
    the beam each of their tokens came from. The rows of the graph are the inputs times ``num_beams``."""

    def __init__(self, model, input_ids: torch.Tensor, generation_config):
        self.model, self.config = model, generation_config
        self.num_beams = generation_config.num_beams
        self.batch_size = input_ids.shape[0] // self.num_beams
        self.length = self.prompt_length = input_ids.shape[1]
        self.scores = () if generation_config.return_dict_in_generate and generation_config.output_scores else None
        pad_token_id, eos_token_id = generation_config._pad_token_tensor, generation_config._eos_token_tensor
        eos_count = eos_token_id.shape[0] if eos_token_id is not None else 0
        self.beams_to_keep = max(2, 1 + eos_count) * self.num_beams
        device, shape = input_ids.device, (self.batch_size, self.num_beams)
        self.top_num_beam_mask = torch.arange(self.beams_to_keep, device=device) < self.num_beams
        # transformers' expression, precedence included: a pad id of 0 fills with the first EOS
        fill_value = pad_token_id or eos_token_id[0] if eos_token_id is not None else -1
        self.running_sequences = torch.full((*shape, generation_config.max_length), fill_value, dtype=torch.int64,
                                            device=device)
        self.running_sequences[:, :, :self.length] = model._unflatten_beam_dim(input_ids, *shape)
        self.sequences = self.running_sequences.clone()
        # only the first beam's continuations count at the first step: the beams start alike
        self.running_beam_scores = torch.zeros(shape, dtype=torch.float, device=device)
        self.running_beam_scores[:, 1:] = -1e9
        self.beam_scores = torch.full(shape, -1e9, dtype=torch.float, device=device)
        self.is_sent_finished = torch.zeros(shape, dtype=torch.bool, device=device)
        self.improvement_possible = torch.ones((self.batch_size, 1), dtype=torch.bool, device=device)
        self.running_beam_indices = torch.full((*shape, generation_config.max_length - self.length), -1,
                                               dtype=torch.int32, device=device)
        self.beam_indices = self.running_beam_indices.clone()

    def advance(self, logits: torch.Tensor, logits_processor, stopping_criteria) -> tuple[torch.Tensor, bool]:
        """Extend the beams by the step's (rows, vocab) logits: returns the row each running beam continues (whose
        cache it takes) and whether the search goes on."""
        model, shape = self.model, (self.batch_size, self.num_beams)
        log_probs = nn.functional.log_softmax(logits.to(torch.float32, copy=True), dim=-1)
        log_probs = logits_processor(model._flatten_beam_dim(self.running_sequences[:, :, :self.length]), log_probs)
        if self.scores is not None:
            self.scores += (log_probs.clone(),)
        log_probs = model._unflatten_beam_dim(log_probs, *shape) + self.running_beam_scores[:, :, None]
        log_probs = log_probs.reshape(self.batch_size, -1)
        # vocab_size: transformers 5.17's signature asks for it, later ones take it from the scores' width
        topk_log_probs, topk_sequences, topk_beam_indices = model._get_top_k_continuations(
            accumulated_log_probs=log_probs, running_sequences=self.running_sequences,
            running_beam_indices=self.running_beam_indices, cur_len=self.length,
            decoder_prompt_len=self.prompt_length, do_sample=self.config.do_sample,
            beams_to_keep=self.beams_to_keep, num_beams=self.num_beams, vocab_size=logits.shape[-1],
            batch_size=self.batch_size,
        )
        hits_stop = stopping_criteria(model._flatten_beam_dim(topk_sequences[:, :, :self.length + 1]), self.scores)
        hits_stop = model._unflatten_beam_dim(hits_stop, self.batch_size, self.beams_to_keep)
        self.running_sequences, self.running_beam_scores, self.running_beam_indices = (
            model._get_running_beams_for_next_iteration(topk_log_probs, topk_sequences, topk_beam_indices,
                                                        hits_stop, self.num_beams)
        )
        self.sequences, self.beam_scores, self.beam_indices, self.is_sent_finished = model._update_finished_beams(
            self.sequences, topk_sequences, self.beam_scores, topk_log_probs, self.beam_indices, topk_beam_indices,
            self.improvement_possible, self.is_sent_finished, hits_stop, self.top_num_beam_mask, self.num_beams,
            self.length, self.prompt_length, self.config.length_penalty, self.config.early_stopping,
        )
        rows = model._flatten_beam_dim(self.running_beam_indices[..., self.length - self.prompt_length])
        self.length += 1
        return rows, self._goes_on(hits_stop)

    def _goes_on(self, hits_stop: torch.Tensor) -> bool:
        early_stopping, model = self.config.early_stopping, self.model
        self.improvement_possible = model._check_early_stop_heuristic(
            self.improvement_possible, self.running_beam_scores, self.beam_scores, self.is_sent_finished,
            self.length, self.config.max_length, self.prompt_length, early_stopping, self.config.length_penalty,
        )
        return bool(model._beam_search_has_unfinished_sequences(self.improvement_possible, self.is_sent_finished,
                                                                 hits_stop, early_stopping))

    def next_tokens(self) -> torch.Tensor:
        """The (rows,) last tokens of the running beams: the next step's input."""
        return self.model._flatten_beam_dim(self.running_sequences[:, :, self.length - 1])

    def output(self):
        """transformers' output: the best ``num_return_sequences`` finished beams of each input, cut to the longest."""
        model, returned = self.model, self.config.num_return_sequences
        sequences = model._flatten_beam_dim(self.sequences[:, :returned])
        beam_indices = model._flatten_beam_dim(self.beam_indices[:, :returned])
        generated_length = (beam_indices + 1).bool().sum(dim=1).max()
        sequences = sequences[:, :self.prompt_length + generated_length]
        if not self.config.return_dict_in_generate:
            return sequences
        # transformers returns the finished beams' scores with output_scores alone
        sequences_scores = None if self.scores is None else model._flatten_beam_dim(self.beam_scores[:, :returned])
        return GenerateBeamEncoderDecoderOutput(sequences=sequences, sequences_scores=sequences_scores,
                                                scores=self.scores, beam_indices=beam_indices[:, :generated_length])


def _run_beam_search(graph: _DecodingGraph, beams: _BeamSearch, logits_processor, stopping_criteria) -> None:
    """Step the graph until transformers' beam search would stop (max_length's criterion stops it at the latest),
    the self-attention cache reordered by the chosen beams after each step."""
    for _ in range(1, beams.config.max_length):
        graph.replay()
        rows, goes_on = beams.advance(graph.logits, logits_processor, stopping_criteria)
        if not goes_on:
            return
        graph.reorder_cache(rows, beams.length - 1)
        graph.advance(beams.next_tokens())
