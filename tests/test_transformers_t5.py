"""transformers' own T5, mT5 and UMT5 on FAT5's kernels (issue 49): ``attn_implementation="fat5"`` and
``apply_fat5_kernels_to_t5``, against the truth: the same models, same weights, on transformers' eager attention
(its SDPA where the fat5 path hands a call to it). On the kernels' PyTorch reference and on the Triton kernels
(through Triton's interpreter on a CPU)."""

import copy
import json
import logging
import os
import socket
import subprocess
import sys
from unittest import mock

import pytest
import torch
import yaml
from helpers import (
    BLOCK_FAT5,
    FINETUNE_QUIET,
    REPO,
    TINY,
    padded_batch,
    relative_error,
    run_isolated,
    transformers_class,
    word_tokenizer,
)
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import DataCollatorForSeq2Seq, PreTrainedModel, Seq2SeqTrainer, Seq2SeqTrainingArguments
from transformers.models.t5.modeling_t5 import T5Attention

import fat5
from fat5.integrations import transformers_t5

FAMILIES = ["t5", "mt5", "umt5"]
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.interpreter)]


@pytest.fixture(params=BACKENDS)
def backend(request):
    transformers_t5.set_kernel_backend(request.param)
    yield request.param
    transformers_t5.set_kernel_backend("auto")


@pytest.fixture
def warnings_said(caplog):
    """The integration's warnings of this test (its one-time warnings forgotten first)."""
    logging.Logger.warning_once.cache_clear()
    caplog.set_level(logging.WARNING, logger=transformers_t5.__name__)
    return lambda: [record.getMessage() for record in caplog.records if record.name == transformers_t5.__name__]


def with_attention(model, name):
    """``model`` on attention ``name``, set on every PreTrainedModel it holds: transformers 5.17's
    set_attn_implementation stops at T5's top model (its encoder and decoder stacks keep theirs, whatever the name)."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.set_attn_implementation(name)
    return model


def model_of(family, backbone="ForConditionalGeneration", attention="eager", **config_fields):
    """A tiny transformers model of ``family`` (T5 v1.1's layout), eval mode."""
    torch.manual_seed(0)
    fields = {**TINY, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, **config_fields}
    model = transformers_class(family, backbone)(transformers_class(family, "Config")(**fields))
    return with_attention(model, attention).eval()


def eager_and_fat5(family, backbone="ForConditionalGeneration", **config_fields):
    eager = model_of(family, backbone, **config_fields)
    return eager, with_attention(copy.deepcopy(eager), "fat5")


def tables(model) -> dict[str, torch.Tensor]:
    return {name: parameter for name, parameter in model.named_parameters() if "relative_attention_bias" in name}


def kernel_calls():
    """A spy on the integration's call of FAT5's attention (each call: the kernels served one attention)."""
    return mock.patch.object(transformers_t5, "attention", wraps=transformers_t5.attention)


BATCH = dict(zip(("input_ids", "attention_mask", "labels"), padded_batch()))
# the logits too, and never the padding id: a tiny random model often repeats one token (there, the decoder start's,
# and attention over equal tokens gives one value whatever its weights)
GREEDY = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "suppress_tokens": [0],
          "output_logits": True, "return_dict_in_generate": True}


def assert_same_generation(actual, expected):
    assert torch.equal(actual.sequences, expected.sequences)
    assert relative_error(torch.stack(actual.logits), torch.stack(expected.logits)) <= 1e-4


# ------------------------------------------------------------------------------------- the attention, end to end


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_table_gradients_and_greedy_ids_are_eagers(family, backend):
    """Padded rows; every table of the model (layer 0's of each stack in T5 and mT5, each layer's in UMT5) gets the
    gradient that eager T5's materialised bias gives it."""
    eager, fat5_model = eager_and_fat5(family)
    results = []
    for model in (eager, fat5_model):
        output = model(**BATCH)
        output.loss.backward()
        gradients = {name: table.grad for name, table in tables(model).items()}
        generated = model.generate(input_ids=BATCH["input_ids"], attention_mask=BATCH["attention_mask"], **GREEDY)
        results.append((output.logits, output.loss, gradients, generated))
    (logits, loss, gradients, generated), (expected_logits, expected_loss, expected_gradients, expected_ids) = (
        results[1], results[0])
    assert relative_error(logits, expected_logits) <= 1e-4
    assert relative_error(loss, expected_loss) <= 1e-5
    layers_with_tables = 2 * TINY["num_layers"] if family == "umt5" else 2
    assert len(expected_gradients) == layers_with_tables and gradients.keys() == expected_gradients.keys()
    for name, gradient in gradients.items():
        assert relative_error(gradient, expected_gradients[name]) <= 1e-3, name
    assert_same_generation(generated, expected_ids)


@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_static_cache_and_beam_search_give_eagers_ids(family, backend):
    """transformers' static cache (its length a tensor that the kernel reads as the query offset) and beams (the
    cache reordered between steps: nothing of the kernels', so on the reference only)."""
    eager, fat5_model = eager_and_fat5(family)
    inputs = {"input_ids": BATCH["input_ids"], "attention_mask": BATCH["attention_mask"], **GREEDY}
    for options in [{"cache_implementation": "static"}] + [{"num_beams": 3}] * (backend == "reference"):
        with kernel_calls() as calls:
            generated = fat5_model.generate(**inputs, **options)
        assert calls.called
        assert_same_generation(generated, eager.generate(**inputs, **options))


class ShapesSeen(TorchDispatchMode):
    """The shape of every tensor an operator returns while the mode is on."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        self.shapes += [tuple(tensor.shape) for tensor in tree_flatten(output)[0] if isinstance(tensor, torch.Tensor)]
        return output


def score_sized(model) -> list[tuple[int, ...]]:
    """The tensors of a training step (forward and backward) whose last two dimensions are a score matrix's:
    (encoder, encoder), (decoder, decoder) or (decoder, encoder) lengths (11 and 6: no other dimension is either)."""
    encoder_length, decoder_length = BATCH["input_ids"].shape[1], BATCH["labels"].shape[1]
    score_shapes = {(encoder_length, encoder_length), (decoder_length, decoder_length),
                    (decoder_length, encoder_length)}
    with ShapesSeen() as seen:
        model.train()(**BATCH).loss.backward()
    return [shape for shape in seen.shapes if shape[-2:] in score_shapes]


@pytest.mark.interpreter
@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_no_tensor_of_the_score_matrix_size_is_built(family):
    """On the Triton kernels nothing of a score matrix's size exists: not transformers' bias tensor (layer 0's
    compute_bias, UMT5's in every layer), not the zeros of its cross-attention, not a 4-D mask. Eager T5 builds
    them, and the same check finds them."""
    eager, fat5_model = eager_and_fat5(family)
    assert score_sized(eager)
    transformers_t5.set_kernel_backend("triton")
    try:
        assert score_sized(fat5_model) == []
    finally:
        transformers_t5.set_kernel_backend("auto")


# ----------------------------------------------------------------------------------------- how users turn it on


@pytest.mark.parametrize("family,backbone", [("t5", "ForConditionalGeneration"), ("mt5", "ForConditionalGeneration"),
                                             ("umt5", "ForConditionalGeneration"), ("t5", "EncoderModel")])
def test_from_pretrained_with_attn_implementation_runs_the_kernels(tmp_path, family, backbone):
    eager = model_of(family, backbone)
    eager.save_pretrained(tmp_path)
    loaded = transformers_class(family, backbone).from_pretrained(tmp_path, attn_implementation="fat5").eval()
    inputs = {key: value for key, value in BATCH.items() if backbone != "EncoderModel" or key != "labels"}
    with kernel_calls() as calls, torch.no_grad():
        actual = loaded(**inputs)
    expected = eager(**inputs)
    assert calls.call_count == (1 if backbone == "EncoderModel" else 3) * TINY["num_layers"]
    name = "last_hidden_state" if backbone == "EncoderModel" else "logits"
    assert relative_error(actual[name], expected[name]) <= 1e-4


def stacks_follow_the_top_model() -> bool:
    """Whether this transformers' set_attn_implementation reaches T5's encoder and decoder (5.24 does, 5.17 not)."""
    model = model_of("t5")
    model.set_attn_implementation("sdpa")
    return model.encoder.config._attn_implementation == "sdpa"


@pytest.mark.skipif(not stacks_follow_the_top_model(),
                    reason="this transformers' set_attn_implementation leaves T5's stacks as they were (any name)")
def test_set_attn_implementation_on_a_loaded_model_switches_to_the_kernels_and_back():
    model = model_of("t5")
    expected = model(**BATCH).logits
    model.set_attn_implementation("fat5")
    with kernel_calls() as calls, torch.no_grad():
        assert relative_error(model(**BATCH).logits, expected) <= 1e-4
    assert calls.called
    model.set_attn_implementation("eager")
    with kernel_calls() as calls, torch.no_grad():
        model(**BATCH)
    assert not calls.called


def test_another_model_type_is_refused_in_one_line():
    from transformers import BartConfig, BartModel

    config = BartConfig(vocab_size=96, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, attn_implementation="fat5")
    with pytest.raises(ValueError, match=r"serves transformers' T5, mT5 and UMT5 .* model_type is 'bart'"):
        BartModel(config)(input_ids=BATCH["input_ids"], attention_mask=BATCH["attention_mask"])


def test_a_bad_backend_name_is_refused():
    with pytest.raises(ValueError, match="kernel backend must be one of"):
        transformers_t5.set_kernel_backend("cuda")


# ------------------------------------------------------------------------- what the kernels hand to transformers


def test_output_attentions_runs_eager_attention_and_says_so_once(warnings_said):
    eager, fat5_model = eager_and_fat5("umt5")
    with torch.no_grad():
        expected = eager(**BATCH, output_attentions=True)
        actual = fat5_model(**BATCH, output_attentions=True)
        fat5_model(**BATCH, output_attentions=True)
    for name in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        assert len(actual[name]) == TINY["num_layers"]
        for layer, probabilities in enumerate(actual[name]):
            assert relative_error(probabilities, expected[name][layer]) <= 1e-5, (name, layer)
    assert relative_error(actual.logits, expected.logits) <= 1e-5
    said = warnings_said()
    assert len(said) == 1 and "output_attentions=True" in said[0]


def test_a_custom_4d_mask_runs_transformers_attention(warnings_said):
    eager, fat5_model = eager_and_fat5("t5", "EncoderModel")
    length = BATCH["input_ids"].shape[1]
    # each token sees the tokens of its own half only; additive, as transformers' eager attention takes a 4-D mask
    half = torch.arange(length) < length // 2
    hidden = (half[:, None] != half[None, :])[None, None].expand(len(BATCH["input_ids"]), 1, length, length)
    mask = torch.zeros(hidden.shape).masked_fill(hidden, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = eager(input_ids=BATCH["input_ids"], attention_mask=mask).last_hidden_state
        actual = fat5_model(input_ids=BATCH["input_ids"], attention_mask=mask).last_hidden_state
    assert relative_error(actual, expected) <= 1e-5
    assert any("4-D attention mask" in message for message in warnings_said())


def test_a_position_bias_tensor_passed_in_is_used_as_given(warnings_said):
    eager, fat5_model = eager_and_fat5("t5", "EncoderModel")
    torch.manual_seed(1)
    hidden_states = torch.randn(2, 7, TINY["d_model"])
    bias = torch.randn(1, TINY["num_heads"], 7, 7)
    with torch.no_grad():
        expected = eager.encoder.block[1].layer[0].SelfAttention(hidden_states, position_bias=bias)[0]
        actual = fat5_model.encoder.block[1].layer[0].SelfAttention(hidden_states, position_bias=bias)[0]
    assert relative_error(actual, expected) <= 1e-6
    assert any("position_bias tensor" in message for message in warnings_said())


def test_attention_dropout_runs_sdpa_until_the_patch_turns_it_off(warnings_said):
    """T5 drops attention probabilities at dropout_rate while training, which the kernels cannot: those calls run
    transformers' SDPA (the same random draws: the loss is SDPA's). With attention_dropout=0.0 the kernels serve
    them, T5's other dropout unchanged (the loss is SDPA's without attention dropout, same draws)."""
    sdpa = with_attention(model_of("t5", dropout_rate=0.2), "sdpa").train()
    fat5_model = with_attention(copy.deepcopy(sdpa), "fat5").train()
    losses = []
    for model in (sdpa, fat5_model):
        torch.manual_seed(7)
        losses.append(model(**BATCH).loss)
    assert relative_error(losses[1], losses[0]) <= 1e-6
    assert any("attention dropout (p=0.2" in message for message in warnings_said())

    fat5.apply_fat5_kernels_to_t5(fat5_model, rms_norm=False, cross_entropy=False, attention_dropout=0.0)
    for module in sdpa.modules():
        if isinstance(module, T5Attention):
            module.dropout = 0.0
    losses = []
    for model in (sdpa, fat5_model):
        torch.manual_seed(7)
        with kernel_calls() as calls:
            losses.append(model(**BATCH).loss)
    assert calls.call_count == 3 * TINY["num_layers"]
    assert relative_error(losses[1], losses[0]) <= 1e-5


# --------------------------------------------------------------------------------------------- the kernel patch


def norm_modules(model):
    return [module for module in model.modules() if type(module).__name__.endswith("LayerNorm")]


# the norm and the loss are the same in every family: the Triton kernels on one of them
@pytest.mark.parametrize("family,backend", [("t5", "reference"), ("mt5", "reference"), ("umt5", "reference"),
                                            pytest.param("umt5", "triton", marks=pytest.mark.interpreter)],
                         indirect=["backend"])
def test_the_patch_gives_eagers_logits_and_the_loss_with_z_loss_and_smoothing(family, backend):
    """The loss is cross-entropy with label smoothing plus z-loss, computed here from eager T5's logits."""
    eager, patched = eager_and_fat5(family)
    fat5.apply_fat5_kernels_to_t5(patched, z_loss=1e-3, label_smoothing=0.1)
    expected = eager(**BATCH)
    logits, labels = expected.logits.reshape(-1, TINY["vocab_size"]), BATCH["labels"].reshape(-1)
    counted = labels != -100
    expected_loss = (torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.1)
                     + 1e-3 * torch.logsumexp(logits[counted], dim=-1).square().mean())
    actual = patched(**BATCH)
    assert relative_error(actual.logits, expected.logits) <= 1e-4
    assert relative_error(actual.loss, expected_loss) <= 1e-5
    actual.loss.backward()
    expected_loss.backward()
    for name, table in tables(patched).items():
        assert relative_error(table.grad, eager.get_parameter(name).grad) <= 1e-3, name
    assert all(module.forward.__func__ is transformers_t5._fused_rms_norm_forward for module in norm_modules(patched))


def test_the_patch_keeps_transformers_outputs():
    """Tuples (return_dict=False: the loss first), positional arguments, no labels (no loss), the Trainer's
    num_items_in_batch (the sum over it, as transformers' models with a loss_function reduce), a PEFT model."""
    from peft import LoraConfig, get_peft_model

    eager, patched = eager_and_fat5("t5")
    fat5.apply_fat5_kernels_to_t5(patched)
    expected = eager(**BATCH)
    as_tuple = patched(**BATCH, return_dict=False)
    assert relative_error(as_tuple[0], expected.loss) <= 1e-6 and relative_error(as_tuple[1], expected.logits) <= 1e-6
    positional = patched(BATCH["input_ids"], BATCH["attention_mask"], labels=BATCH["labels"])
    assert relative_error(positional.loss, expected.loss) <= 1e-6
    assert patched(input_ids=BATCH["input_ids"], decoder_input_ids=BATCH["input_ids"][:, :3]).loss is None
    tokens = int((BATCH["labels"] != -100).sum())
    summed = patched(**BATCH, num_items_in_batch=2 * tokens).loss
    assert relative_error(summed, expected.loss / 2) <= 1e-6

    peft_model = get_peft_model(copy.deepcopy(eager), LoraConfig(target_modules=["q", "v"]))
    fat5.apply_fat5_kernels_to_t5(peft_model)
    base = peft_model.get_base_model()
    assert base.forward.__func__ is not type(base).forward and norm_modules(base)[0].forward.__func__ is (
        transformers_t5._fused_rms_norm_forward)


def test_the_patch_on_a_class_reaches_its_later_instances(monkeypatch):
    """As Liger-Kernel's apply_liger_kernel_to_* with no model: transformers' classes themselves (put back after
    this test), for every model built afterwards; a model of the class built before is patched too, the norm
    being its class's forward."""
    from transformers.models.umt5 import modeling_umt5

    model_class = modeling_umt5.UMT5ForConditionalGeneration
    monkeypatch.setattr(model_class, "forward", model_class.forward)
    monkeypatch.setattr(modeling_umt5.UMT5LayerNorm, "forward", modeling_umt5.UMT5LayerNorm.forward)
    eager = model_of("umt5")
    fat5.apply_fat5_kernels_to_t5(model_class, z_loss=1.0)
    fat5.apply_fat5_kernels_to_t5(model_class, z_loss=1e-2)  # again: the last options hold, not both
    patched = with_attention(model_of("umt5"), "fat5")
    logits = eager(**BATCH).logits.reshape(-1, TINY["vocab_size"])
    counted = BATCH["labels"].reshape(-1) != -100
    expected = (torch.nn.functional.cross_entropy(logits, BATCH["labels"].reshape(-1))
                + 1e-2 * torch.logsumexp(logits[counted], dim=-1).square().mean())
    assert relative_error(patched(**BATCH).loss, expected) <= 1e-5
    assert modeling_umt5.UMT5LayerNorm.forward is transformers_t5._fused_rms_norm_forward


@pytest.mark.parametrize("arguments,error,match", [
    ({"model_or_class": torch.nn.Linear(2, 2)}, TypeError, "takes a transformers T5, mT5 or UMT5 model or class"),
    ({"z_loss": -1.0}, ValueError, "z_loss must be >= 0"),
    ({"label_smoothing": 0.1, "cross_entropy": False}, ValueError, "belong to the fused cross-entropy"),
    ({"model_or_class": "class", "attention_dropout": 0.0}, ValueError, "pass the model, not its class"),
    ({"model_or_class": "encoder", "z_loss": 1e-4}, ValueError, "T5EncoderModel has none"),
])
def test_bad_patch_arguments_are_refused_in_one_line(arguments, error, match):
    arguments = {"model_or_class": model_of("t5"), **arguments}
    if arguments["model_or_class"] == "class":
        arguments["model_or_class"] = transformers_class("t5", "ForConditionalGeneration")
    if arguments["model_or_class"] == "encoder":
        arguments["model_or_class"] = model_of("t5", "EncoderModel")
    with pytest.raises(error, match=match):
        fat5.apply_fat5_kernels_to_t5(**arguments)


LOAD_WITHOUT_FAT5 = BLOCK_FAT5 + r"""
import json
import torch, transformers

batch, *folders = sys.argv[1:]
batch = torch.load(batch)
logits = {}
for folder in folders:
    # eager: transformers 5.17's UMT5 on SDPA lets its decoder see later tokens
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert type(model).__module__.startswith("transformers.models."), type(model).__module__
    with torch.no_grad():
        logits[folder] = model(**batch).logits.tolist()
print(json.dumps(logits))
"""


def test_saved_models_stay_plain_t5_and_load_without_fat5(tmp_path):
    """A model trained on the kernels saves the state dict and config that transformers' own would (model_type
    t5 / mt5 / umt5, no auto_map, nothing of fat5), and a process that cannot import fat5 loads it."""
    batch = {"input_ids": BATCH["input_ids"], "attention_mask": BATCH["attention_mask"],
             "decoder_input_ids": model_of("t5")._shift_right(BATCH["labels"])}
    torch.save(batch, tmp_path / "batch.pt")
    expected = {}
    for family in FAMILIES:
        eager, patched = eager_and_fat5(family)
        fat5.apply_fat5_kernels_to_t5(patched, z_loss=1e-4, attention_dropout=0.0)
        patched.train()(**BATCH).loss.backward()
        torch.optim.SGD(patched.parameters(), lr=0.1).step()
        for name, model in (("eager", eager), ("fat5", patched)):
            model.save_pretrained(tmp_path / f"{family}-{name}")
        plain, saved = (json.loads((tmp_path / f"{family}-{name}" / "config.json").read_text())
                        for name in ("eager", "fat5"))
        assert saved == plain and saved["model_type"] == family and "auto_map" not in saved
        assert "fat5" not in (tmp_path / f"{family}-fat5" / "config.json").read_text()
        assert patched.state_dict().keys() == eager.state_dict().keys()
        with torch.no_grad():
            expected[str(tmp_path / f"{family}-fat5")] = with_attention(patched, "eager").eval()(**batch).logits
    completed = run_isolated(LOAD_WITHOUT_FAT5, tmp_path / "batch.pt", *expected, tmp=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    loaded = json.loads(completed.stdout.strip().splitlines()[-1])
    for folder, logits in expected.items():
        assert relative_error(torch.tensor(loaded[folder]), logits) <= 1e-6, folder


# -------------------------------------------------------------------------------------- training tools around it


def seq2seq_rows(count=12, seed=2):
    """Tokenised examples of different lengths, as a Seq2SeqTrainer's dataset holds them."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        source, target = torch.randint(4, 13, (2,), generator=generator).tolist()
        rows.append({"input_ids": torch.randint(2, TINY["vocab_size"], (source,), generator=generator).tolist(),
                     "labels": torch.randint(2, TINY["vocab_size"], (target,), generator=generator).tolist()})
    return rows


def train_with_seq2seq_trainer(model, output_dir, **arguments) -> Seq2SeqTrainer:
    """Three steps of Seq2SeqTrainer (batches of 4 unless ``arguments`` say otherwise)."""
    training = Seq2SeqTrainingArguments(**{
        "output_dir": str(output_dir), "max_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 1e-2,
        "logging_steps": 1, "seed": 0, **FINETUNE_QUIET, **arguments})
    trainer = Seq2SeqTrainer(model=model, args=training, train_dataset=seq2seq_rows(),
                             data_collator=DataCollatorForSeq2Seq(word_tokenizer(), model=model))
    trainer.train()
    return trainer


def logged_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_seq2seq_trainer_with_gradient_checkpointing_trains_as_eager_t5(tmp_path):
    eager, patched = eager_and_fat5("t5")
    fat5.apply_fat5_kernels_to_t5(patched)
    expected = logged_losses(train_with_seq2seq_trainer(eager, tmp_path / "eager", gradient_checkpointing=True))
    with kernel_calls() as calls:
        losses = logged_losses(train_with_seq2seq_trainer(patched, tmp_path / "fat5", gradient_checkpointing=True))
    assert calls.called and len(losses) == len(expected) == 3
    for loss, expected_loss in zip(losses, expected):
        assert abs(loss - expected_loss) <= 1e-5 * expected_loss, (losses, expected)


def test_peft_lora_and_prefix_tuning_train_as_on_eager_t5():
    """LoRA on q and v, and prefix tuning (its virtual tokens in the KV cache: the kernels' query offset and a key
    padding mask longer than the input), on UMT5: loss and the adapters' gradients."""
    from peft import LoraConfig, PrefixTuningConfig, get_peft_model

    for peft_config in (LoraConfig(target_modules=["q", "v"], r=4, init_lora_weights=False),
                        PrefixTuningConfig(task_type="SEQ_2_SEQ_LM", num_virtual_tokens=3)):
        results = []
        for model in eager_and_fat5("umt5"):
            torch.manual_seed(5)
            peft_model = get_peft_model(model, copy.deepcopy(peft_config)).train()
            loss = peft_model(**BATCH).loss
            loss.backward()
            results.append((loss, [p.grad for p in peft_model.parameters() if p.requires_grad]))
        (expected_loss, expected_gradients), (loss, gradients) = results
        assert relative_error(loss, expected_loss) <= 1e-5 and len(gradients) == len(expected_gradients) > 0
        for gradient, expected in zip(gradients, expected_gradients):
            assert relative_error(gradient, expected) <= 1e-4, type(peft_config).__name__


@pytest.mark.interpreter
def test_torch_compile_fullgraph_traces_the_patched_model():
    """One graph, no break (Dynamo traces the wrapped attention, the described bias and the kernels' custom ops),
    and eager T5's loss and table gradients."""
    import torch._dynamo.testing

    eager, patched = eager_and_fat5("t5")
    fat5.apply_fat5_kernels_to_t5(patched, z_loss=1e-4)
    expected = eager(**BATCH)
    logits = expected.logits.reshape(-1, TINY["vocab_size"])[BATCH["labels"].reshape(-1) != -100]
    expected_loss = expected.loss + 1e-4 * torch.logsumexp(logits, dim=-1).square().mean()
    expected_loss.backward()
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    transformers_t5.set_kernel_backend("triton")
    try:
        loss = torch.compile(patched, fullgraph=True, backend=counter)(**BATCH).loss
        loss.backward()
    finally:
        transformers_t5.set_kernel_backend("auto")
    assert counter.frame_count == 1
    assert relative_error(loss, expected_loss) <= 1e-5
    for name, table in tables(patched).items():
        assert relative_error(table.grad, eager.get_parameter(name).grad) <= 1e-3, name


def test_bf16_weights_and_bf16_autocast_stay_with_eager_t5():
    """bf16 on the kernels' reference (the CPU path; Triton's interpreter has no bf16): under autocast (fp32
    weights, what the Trainer's bf16=True does) the numbers are eager T5's; with bf16 weights the rounding differs,
    within bf16's precision of the fp32 truth, as eager T5's own bf16 logits are."""
    eager, patched = eager_and_fat5("umt5")
    fat5.apply_fat5_kernels_to_t5(patched)
    truth = eager(**BATCH).logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, actual = eager(**BATCH), patched(**BATCH)
    assert actual.logits.dtype == torch.bfloat16
    assert relative_error(actual.logits, expected.logits) <= 1e-6
    assert relative_error(actual.loss, expected.loss) <= 1e-5
    expected_error = relative_error(copy.deepcopy(eager).bfloat16()(**BATCH).logits, truth)
    actual_error = relative_error(patched.bfloat16()(**BATCH).logits, truth)
    assert 0 < actual_error <= max(2 * expected_error, 1e-2)


# run by `accelerate launch` (the tests' folder on its path): the patched model trained by Seq2SeqTrainer, saved
TRAIN_UNDER_ACCELERATE = """
import sys

import fat5
from test_transformers_t5 import model_of, train_with_seq2seq_trainer, with_attention

output, batch_size = sys.argv[1], int(sys.argv[2])
model = with_attention(model_of("t5"), "fat5")
fat5.apply_fat5_kernels_to_t5(model)
trainer = train_with_seq2seq_trainer(model, output, per_device_train_batch_size=batch_size)
trainer.save_model(output)
"""


@pytest.mark.slow
def test_accelerate_launch_on_two_processes_trains_as_one_process_on_their_two_batches(tmp_path):
    """Two CPU processes (DDP over gloo) take batches of 2, the halves of one process's batches of 4. The patched
    loss sums over the Trainer's num_items_in_batch (counted across processes), so both runs take the same steps
    and save the same weights (T5's own loss, the mean of each process's batch, would weigh their tokens
    differently)."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN_UNDER_ACCELERATE)
    settings = yaml.safe_load((REPO / "examples" / "accelerate" / "ddp.yaml").read_text())
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        settings.update(num_processes=2, use_cpu=True, main_process_port=probe.getsockname()[1])
    settings.pop("gpu_ids")
    (tmp_path / "ddp.yaml").write_text(yaml.safe_dump(settings))
    environment = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                       PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)]))
    commands = {"one": [str(script), str(tmp_path / "one"), "4"],
                "two": ["-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "ddp.yaml"), str(script),
                        str(tmp_path / "two"), "2"]}
    for name, command in commands.items():
        completed = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=600,
                                   env=environment, cwd=tmp_path, check=False)
        assert completed.returncode == 0, f"{name}: {completed.stderr[-3000:]}"
    one, two = (load_file(tmp_path / name / "model.safetensors") for name in ("one", "two"))
    assert one.keys() == two.keys()
    initial = model_of("t5").state_dict()
    for name, value in one.items():
        assert not torch.equal(value, initial[name]), f"{name} was not trained"
        torch.testing.assert_close(two[name], value, rtol=1e-4, atol=1e-5, msg=name)
