"""How a fresh FAT5 draws its weights (``FAT5Config.initialization``), and that a loaded one draws none.

The truth for ``"t5x"`` is T5X's T5 v1.1 (``t5x/examples/t5/network.py`` and ``layers.py``), written out by hand
below; for ``"transformers"`` it is transformers' own T5 classes, drawn here.
"""

import math

import pytest
import torch
from transformers import (
    T5Config,
    T5ForConditionalGeneration,
    T5ForQuestionAnswering,
    T5ForSequenceClassification,
    T5ForTokenClassification,
    initialization,
)
from transformers.activations import ACT2FN

from fat5 import (
    FAT5Config,
    FAT5ForConditionalGeneration,
    FAT5ForQuestionAnswering,
    FAT5ForSequenceClassification,
    FAT5ForTokenClassification,
)

# large enough tensors for a standard deviation within a few percent, small enough to draw in milliseconds
WIDE = {"vocab_size": 2048, "d_model": 64, "d_kv": 16, "d_ff": 256, "num_layers": 2, "num_heads": 4,
        "relative_attention_num_buckets": 32, "decoder_start_token_id": 0}
# JAX's truncated normal (cut at +-2) has this standard deviation; T5X divides its scale by it
TRUNCATED_STD = 0.87962566103423978
DRAWS = ("normal_", "trunc_normal_", "uniform_")


def t5x_spread(name: str, config: dict) -> tuple[str, float]:
    """T5X's draw of a FAT5 weight, by name: ``layers.py``'s ``MultiHeadDotProductAttention`` (fan-in normal, q's
    divided by sqrt(head_dim)), ``DenseGeneral``/``MlpBlock`` (fan-in truncated normal), ``network.py``'s
    ``relpos_bias`` (fan-avg uniform), ``Embed(normal(stddev=1.0))`` and the untied ``logits_dense``."""
    d_model, d_kv, heads = config["d_model"], config["d_kv"], config["num_heads"]
    if name.endswith(("shared.weight", "embed_tokens.weight")):
        return "normal", 1.0
    if name.endswith("relative_attention_bias.weight"):
        fan_avg = (config["relative_attention_num_buckets"] + heads) / 2  # of its (heads, buckets) table
        return "uniform", fan_avg**-0.5  # variance 1 / fan_avg: bounds +-sqrt(3 / fan_avg)
    projection = name.split(".")[-2]
    if projection == "q":
        return "normal", (d_model**-0.5) / math.sqrt(d_kv)
    if projection in ("k", "v"):
        return "normal", d_model**-0.5
    if projection == "o":
        return "normal", (heads * d_kv) ** -0.5
    if projection == "wo":
        return "truncated_normal", config["d_ff"] ** -0.5
    # wi, wi_0, wi_1, the untied head and the task heads: DenseGeneral's default, fan-in d_model
    return "truncated_normal", d_model**-0.5


def assert_drawn_as(name: str, weight: torch.Tensor, distribution: str, std: float) -> None:
    """The spread and the shape of the distribution: a truncated normal never passes 2 / 0.8796 of its standard
    deviation, a uniform never passes sqrt(3) of it, a normal of thousands of values does."""
    values = weight.detach().double().flatten()
    assert abs(values.std().item() - std) < 0.08 * std, (name, values.std().item(), std)
    peak = values.abs().max().item() / std
    if distribution == "truncated_normal":
        assert peak <= 2 / TRUNCATED_STD + 1e-6, (name, peak)
    elif distribution == "uniform":
        assert 0.8 * math.sqrt(3) < peak <= math.sqrt(3) + 1e-6, (name, peak)
    elif values.numel() >= 1000:
        assert peak > 2 / TRUNCATED_STD + 0.2, (name, peak)


def counting_draws(monkeypatch) -> dict:
    """Count, per tensor, the draws that go through transformers' `init` (what `_init_weights` uses)."""
    draws = {}
    for function in DRAWS:
        original = getattr(initialization, function)

        def counting(tensor, *args, _original=original, **kwargs):
            draws[id(tensor)] = draws.get(id(tensor), 0) + 1
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(initialization, function, counting)
    return draws


# the config field


@pytest.mark.parametrize("value", ["jax", "T5X", "", None, 1, ["t5x"]])
def test_an_unknown_initialization_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"FAT5Config.initialization must be one of \('t5x', 'transformers'\)"):
        FAT5Config(initialization=value)


def test_t5x_is_the_default_and_the_setting_travels_with_the_config(tmp_path):
    assert FAT5Config().initialization == "t5x"
    FAT5Config(initialization="transformers").save_pretrained(tmp_path)
    assert FAT5Config.from_pretrained(tmp_path).initialization == "transformers"
    # a config saved before the field existed: a fresh model from it draws as T5X
    (tmp_path / "config.json").write_text((tmp_path / "config.json").read_text().replace('"transformers"', '"t5x"'))
    assert FAT5Config.from_pretrained(tmp_path).initialization == "t5x"


# the draws of a fresh model


@pytest.mark.parametrize("feed_forward_proj", ["relu", "gated-gelu"])
@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_a_fresh_model_draws_as_t5x(feed_forward_proj, tie_word_embeddings):
    config = {**WIDE, "feed_forward_proj": feed_forward_proj, "tie_word_embeddings": tie_word_embeddings}
    torch.manual_seed(0)
    model = FAT5ForConditionalGeneration(FAT5Config(**config))
    checked = set()
    for name, parameter in model.named_parameters():
        if name.endswith("layer_norm.weight"):
            assert torch.equal(parameter, torch.ones_like(parameter)), name
            continue
        assert_drawn_as(name, parameter, *t5x_spread(name, config))
        checked.add(name.split(".")[-2])
    head = {"shared"} if tie_word_embeddings else {"shared", "lm_head"}
    ff = {"wi"} if feed_forward_proj == "relu" else {"wi_0", "wi_1"}
    assert checked == {"q", "k", "v", "o", "wo", "relative_attention_bias"} | ff | head
    assert (model.lm_head.weight is model.shared.weight) == tie_word_embeddings


@pytest.mark.parametrize(
    ("fat5_class", "t5_class", "head"),
    [
        (FAT5ForSequenceClassification, T5ForSequenceClassification, "classification_head"),
        (FAT5ForTokenClassification, T5ForTokenClassification, "classifier"),
        (FAT5ForQuestionAnswering, T5ForQuestionAnswering, "qa_outputs"),
    ],
)
def test_task_heads_draw_as_the_setting_asks(fat5_class, t5_class, head):
    """T5X has no task head: "t5x" draws them by its fan-in rule (DenseGeneral's); "transformers" as transformers'
    T5 classes do (std 1 for the token classifier, d_model**-0.5 for the others)."""
    config = {**WIDE, "num_labels": 300}
    torch.manual_seed(0)
    t5 = dict(t5_class(T5Config(**config)).named_parameters())
    for setting in ("t5x", "transformers"):
        model = fat5_class(FAT5Config(**config, initialization=setting))
        heads = [(name, parameter) for name, parameter in model.named_parameters() if name.startswith(head)]
        assert len(heads) == (4 if head == "classification_head" else 2)
        for name, parameter in heads:
            if name.endswith("bias"):
                assert torch.equal(parameter, torch.zeros_like(parameter)), name
            elif setting == "t5x":
                assert_drawn_as(name, parameter, "truncated_normal", config["d_model"] ** -0.5)
            else:
                assert_drawn_as(name, parameter, "normal", t5[name].std().item())


@pytest.mark.parametrize("setting", ["t5x", "transformers"])
@pytest.mark.parametrize(
    "extra",
    [{"feed_forward_proj": "relu"}, {"tie_word_embeddings": False, "position_bias_per_layer": True},
     {"position_encoding": "fire", "tie_word_embeddings": False}, {"position_encoding": "alibi"}],
)
def test_every_weight_is_drawn_exactly_once(monkeypatch, setting, extra):
    """No weight drawn and then drawn again (a whole-model pass visits holders and children), and none left undrawn,
    for every Linear and Embedding, FIRE's MLP and every block's bias table included."""
    draws = counting_draws(monkeypatch)
    model = FAT5ForConditionalGeneration(FAT5Config(**{**WIDE, **extra}, initialization=setting))
    monkeypatch.undo()
    weights = {id(module.weight): name for name, module in model.named_modules()
               if isinstance(module, (torch.nn.Linear, torch.nn.Embedding))}
    assert {weights.get(key, key): count for key, count in draws.items()} == dict.fromkeys(weights.values(), 1)


def test_transformers_setting_keeps_t5s_draw_where_t5x_differs():
    """Where the two references differ, each setting gives its own: the untied head, the feed-forward's truncation
    and the bias table."""
    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(T5Config(**WIDE, feed_forward_proj="gated-gelu", tie_word_embeddings=False))
    model = FAT5ForConditionalGeneration(FAT5Config(**WIDE, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                                    initialization="transformers"))
    # transformers 5's T5 ties its head whatever the config says: untie it and let T5's _init_weights draw it
    t5.config.tie_word_embeddings = False
    t5.lm_head.weight = torch.nn.Parameter(torch.zeros_like(t5.lm_head.weight))
    t5._init_weights(t5)
    t5_parameters, parameters = dict(t5.named_parameters()), dict(model.named_parameters())
    for name in ("lm_head.weight", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"):
        t5_std = t5_parameters[name].std().item()
        assert_drawn_as(name, parameters[name], "normal", t5_std)
        assert abs(t5_std - t5x_spread(name, WIDE)[1]) > 0.3 * t5_std
    for name in ("encoder.block.0.layer.1.DenseReluDense.wi_0.weight",
                 "decoder.block.1.layer.2.DenseReluDense.wo.weight"):
        assert t5x_spread(name, WIDE)[0] == "truncated_normal"  # the same spread, untruncated
        assert_drawn_as(name, parameters[name], "normal", t5_parameters[name].std().item())


def test_a_module_initialised_alone_draws_as_its_place_and_setting_ask():
    """`_init_weights` on one module (resize_token_embeddings builds the new head outside the model and calls it)
    draws what a whole-model pass draws there; a head set after construction and `init_weights` too."""
    model = FAT5ForConditionalGeneration(FAT5Config(**WIDE, tie_word_embeddings=False))
    for name in ("lm_head", "encoder.block.0.layer.0.SelfAttention.q", "decoder.block.1.layer.2.DenseReluDense.wo",
                 "encoder.block.0.layer.0.SelfAttention.relative_attention_bias"):
        module = model.get_submodule(name)
        with torch.no_grad():
            module.weight.zero_()
        model._init_weights(module)
        assert_drawn_as(name, module.weight, *t5x_spread(f"{name}.weight", WIDE))
    outside = torch.nn.Linear(WIDE["d_model"], 4000, bias=False)
    model._init_weights(outside)
    assert_drawn_as("lm_head", outside.weight, "truncated_normal", WIDE["d_model"] ** -0.5)
    model.set_output_embeddings(torch.nn.Linear(WIDE["d_model"], WIDE["vocab_size"], bias=False))
    model.init_weights()
    assert_drawn_as("lm_head", model.lm_head.weight, "truncated_normal", WIDE["d_model"] ** -0.5)


@pytest.mark.parametrize("setting", ["t5x", "transformers"])
def test_resized_head_rows_are_drawn_as_the_setting_asks(setting):
    model = FAT5ForConditionalGeneration(FAT5Config(**WIDE, tie_word_embeddings=False, initialization=setting))
    old = model.lm_head.weight.detach().clone()
    model.resize_token_embeddings(2 * WIDE["vocab_size"], mean_resizing=False)
    assert torch.equal(model.lm_head.weight[: WIDE["vocab_size"]], old)
    new_rows = model.lm_head.weight[WIDE["vocab_size"]:]
    if setting == "t5x":
        assert_drawn_as("new lm_head rows", new_rows, "truncated_normal", WIDE["d_model"] ** -0.5)
    else:
        assert_drawn_as("new lm_head rows", new_rows, "normal", 1.0)


# the loss a fresh model starts from


def random_batch(vocab_size: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, vocab_size, (4, 24), generator=generator),
            "labels": torch.randint(0, vocab_size, (4, 16), generator=generator)}


ACTIVATIONS = sorted(ACT2FN)


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_a_fresh_model_starts_near_ln_vocab_for_every_feed_forward(tie_word_embeddings):
    """Random tokens are unpredictable: a fresh model's loss on them is ln(vocab_size) plus half the variance of its
    logits. T5X's draw keeps that variance near 1 (within 10% of ln(vocab_size)), with either head and every
    feed-forward the config accepts; transformers' untied head (std 1) gives logits of variance d_model."""
    config = {**WIDE, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 1, "vocab_size": 4096,
              "tie_word_embeddings": tie_word_embeddings, "attention_backend": "reference"}
    batch, ln_vocab = random_batch(config["vocab_size"]), math.log(config["vocab_size"])
    losses = {}
    for feed_forward_proj in [f"{gate}{act}" for act in ACTIVATIONS for gate in ("", "gated-")]:
        torch.manual_seed(0)
        model = FAT5ForConditionalGeneration(FAT5Config(**config, feed_forward_proj=feed_forward_proj)).eval()
        with torch.no_grad():
            losses[feed_forward_proj] = model(**batch).loss.item()
    assert len(losses) == 2 * len(ACTIVATIONS) and {"relu", "gated-gelu"} <= set(losses)
    assert {name: loss for name, loss in losses.items() if abs(loss - ln_vocab) > 0.1 * ln_vocab} == {}
    torch.manual_seed(0)
    transformers_draw = FAT5ForConditionalGeneration(FAT5Config(**config, initialization="transformers")).eval()
    with torch.no_grad():
        loss = transformers_draw(**batch).loss.item()
    if tie_word_embeddings:  # the same draw: the embedding's, with the decoder output scaled by d_model**-0.5
        assert abs(loss - ln_vocab) < 0.1 * ln_vocab
    else:
        assert loss > 1.5 * ln_vocab


# loading and conversion never draw a loaded weight

SMALL = {**WIDE, "vocab_size": 256, "d_model": 32, "d_kv": 8, "d_ff": 64, "relative_attention_num_buckets": 8,
         "relative_attention_max_distance": 16, "feed_forward_proj": "gated-gelu"}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(torch.uint8)


def poison_draws(monkeypatch) -> dict:
    """Make every initialisation transformers' `init` would write (and torch's, which loading guards the same way)
    fill NaN instead; returns the tensors written, by id. A loaded weight that `_init_weights` drew again would be
    NaN, whatever the random state."""
    written = {}
    for function, original in initialization.TORCH_INIT_FUNCTIONS.items():

        def poison(tensor, *args, _original=original, **kwargs):
            written[id(tensor)] = tensor
            with torch.no_grad():
                return tensor.fill_(float("nan"))

        monkeypatch.setitem(initialization.TORCH_INIT_FUNCTIONS, function, poison)
    return written


@pytest.mark.parametrize("setting", ["t5x", "transformers"])
@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_from_pretrained_never_draws_a_loaded_weight(tmp_path, monkeypatch, setting, tie_word_embeddings):
    """Saved, then loaded under another seed, with poisoned draws and the other setting: every tensor comes back bit
    for bit, and `_init_weights` wrote nothing."""
    torch.manual_seed(0)
    saved = FAT5ForConditionalGeneration(
        FAT5Config(**SMALL, tie_word_embeddings=tie_word_embeddings, initialization=setting)
    )
    saved.save_pretrained(tmp_path)
    expected = {name: tensor.clone() for name, tensor in saved.state_dict().items()}
    other = "transformers" if setting == "t5x" else "t5x"
    torch.manual_seed(1)
    written = poison_draws(monkeypatch)
    loaded = FAT5ForConditionalGeneration.from_pretrained(tmp_path, initialization=other)
    monkeypatch.undo()
    assert written == {}
    assert loaded.config.initialization == other
    state = loaded.state_dict()
    assert state.keys() == expected.keys()
    assert [name for name, tensor in expected.items() if not torch.equal(bits(state[name]), bits(tensor))] == []
    assert (loaded.lm_head.weight is loaded.shared.weight) == tie_word_embeddings


def test_a_task_head_loaded_from_a_seq2seq_checkpoint_draws_only_its_head(tmp_path, monkeypatch):
    torch.manual_seed(0)
    FAT5ForConditionalGeneration(FAT5Config(**SMALL, tie_word_embeddings=False)).save_pretrained(tmp_path)
    saved = FAT5ForConditionalGeneration.from_pretrained(tmp_path).state_dict()
    torch.manual_seed(1)
    written = poison_draws(monkeypatch)
    model = FAT5ForSequenceClassification.from_pretrained(tmp_path, num_labels=3)
    monkeypatch.undo()
    head = {id(tensor) for tensor in model.classification_head.parameters()}
    assert set(written) == head and len(head) == 4
    # the head's model holds the seq2seq model's weights under `transformer.`, as T5ForSequenceClassification does
    body = {name.removeprefix("transformer."): tensor for name, tensor in model.state_dict().items()
            if not name.startswith("classification")}
    assert body.keys() <= saved.keys()
    assert [name for name, tensor in body.items() if not torch.equal(bits(tensor), bits(saved[name]))] == []
    # unpoisoned, the head is drawn by the checkpoint's setting: T5X's fan-in draw
    model = FAT5ForSequenceClassification.from_pretrained(tmp_path, num_labels=300)
    assert_drawn_as("out_proj", model.classification_head.out_proj.weight, "truncated_normal", SMALL["d_model"] ** -0.5)


@pytest.mark.parametrize("family", ["t5", "flan-t5"])
def test_fat5_convert_never_draws_a_loaded_weight(tmp_path, monkeypatch, family):
    """`fat5 convert` under another seed with poisoned draws (the model it builds is drawn, then every weight is
    loaded over the draw): the written weights are the source's bit for bit, and so are those loaded back."""
    from helpers import make_checkpoint
    from safetensors.torch import load_file

    from fat5.cli import main

    source = make_checkpoint(tmp_path / "source", family)
    expected = load_file(source / "model.safetensors")
    torch.manual_seed(1)
    poison_draws(monkeypatch)
    assert main(["convert", str(source), str(tmp_path / "fat5")]) == 0
    monkeypatch.undo()
    written = load_file(tmp_path / "fat5" / "model.safetensors")
    assert written.keys() <= expected.keys() and "shared.weight" in written
    assert [name for name, tensor in written.items() if not torch.equal(bits(tensor), bits(expected[name]))] == []
    config = FAT5Config.from_pretrained(tmp_path / "fat5")
    assert config.initialization == "t5x"
    torch.manual_seed(2)
    poison_draws(monkeypatch)
    loaded = FAT5ForConditionalGeneration.from_pretrained(tmp_path / "fat5").state_dict()
    monkeypatch.undo()
    assert [name for name, tensor in written.items() if not torch.equal(bits(loaded[name]), bits(tensor))] == []
