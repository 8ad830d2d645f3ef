"""Everyday transformers calls give on FAT5 what they give on transformers' own T5 (issue: "whatever a transformers
user does with T5 works the same with FAT5"): loading reports, tied-weight declarations, the output tuple, fp16,
the stacks called on their own, masks, attention probabilities, task heads, PEFT defaults and pipelines."""

import pytest
import torch
from helpers import (
    BLOCK_FAT5,
    DATA,
    TINY,
    fat5_from_hf,
    make_hf,
    padded_batch,
    relative_error,
    run_isolated,
    word_tokenizer,
)
from safetensors.torch import load_file, save_file
from transformers import T5Config, T5EncoderModel, T5ForConditionalGeneration, T5Model

import fat5
from fat5 import FAT5Config, FAT5ForConditionalGeneration, FAT5ForQuestionAnswering, FAT5ForSequenceClassification

# every model class fat5 exports: one added later is checked without being listed here
ALL_CLASSES = [
    value for value in map(vars(fat5).get, fat5.__all__)
    if isinstance(value, type) and issubclass(value, fat5.FAT5PreTrainedModel) and value is not fat5.FAT5PreTrainedModel
]
T5_OF = {fat5.FAT5Model: T5Model, FAT5ForConditionalGeneration: T5ForConditionalGeneration,
         fat5.FAT5EncoderModel: T5EncoderModel}


def tiny_config(**overrides):
    return FAT5Config(**{**TINY, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
                         "attention_backend": "reference", **overrides})


def drop_embeddings(folder):
    """Rewrite a saved model without its token embedding (what a truncated or hand-edited checkpoint looks like)."""
    weights = load_file(folder / "model.safetensors")
    kept = {name: tensor for name, tensor in weights.items() if "shared" not in name and "embed_tokens" not in name}
    assert len(kept) < len(weights)
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})


# 1. a checkpoint without the token embedding is reported, as T5 reports it


@pytest.fixture(scope="module")
def checkpoints_without_embeddings(tmp_path_factory):
    root = tmp_path_factory.mktemp("no_embeddings")
    FAT5ForConditionalGeneration(tiny_config()).save_pretrained(root / "fat5")
    torch.manual_seed(0)
    T5ForConditionalGeneration(T5Config(**TINY, feed_forward_proj="gated-gelu")).save_pretrained(root / "t5")
    for folder in ("fat5", "t5"):
        drop_embeddings(root / folder)
    return root


@pytest.mark.parametrize("model_class", ALL_CLASSES, ids=lambda c: c.__name__)
def test_missing_embeddings_are_reported_as_t5_reports_them(checkpoints_without_embeddings, model_class):
    model, info = model_class.from_pretrained(checkpoints_without_embeddings / "fat5", output_loading_info=True)
    prefix = "transformer." if hasattr(model, "transformer") else ""  # T5ForSequenceClassification's layout
    embedding_keys = {f"{prefix}shared.weight", f"{prefix}encoder.embed_tokens.weight"}
    if hasattr(model, "decoder") or prefix:
        embedding_keys.add(f"{prefix}decoder.embed_tokens.weight")
    assert embedding_keys <= set(info["missing_keys"])
    if model_class in T5_OF:
        _, t5_info = T5_OF[model_class].from_pretrained(checkpoints_without_embeddings / "t5", output_loading_info=True)
        assert {k for k in info["missing_keys"] if k in embedding_keys} == {
            k for k in t5_info["missing_keys"] if k in embedding_keys
        }
    # the embedding is drawn as a fresh model's is (T5's N(0, initializer_factor)), not left as uninitialised memory
    weight = model.get_input_embeddings().weight
    assert torch.isfinite(weight).all() and 0.8 < weight.std().item() < 1.2


@pytest.mark.parametrize("model_class", ALL_CLASSES, ids=lambda c: c.__name__)
def test_a_complete_checkpoint_loads_quietly(tmp_path, model_class):
    FAT5ForConditionalGeneration(tiny_config()).save_pretrained(tmp_path)
    _, info = model_class.from_pretrained(tmp_path, output_loading_info=True)
    head_keys = {"classification_head", "classifier", "qa_outputs"}
    assert not [k for k in info["missing_keys"] if k.split(".")[0] not in head_keys]
    assert not info["unexpected_keys"]  # item 23.11: AutoModel on a seq2seq checkpoint ignores lm_head quietly


# 2. each class declares only the tied weights that it has


@pytest.mark.parametrize("model_class", ALL_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("tied", [True, False])
def test_tied_weights_keys_name_parameters_of_the_class(model_class, tied):
    model = model_class(tiny_config(tie_word_embeddings=tied))
    parameters = dict(model.named_parameters(remove_duplicate=False))
    # transformers' own reading of the declarations: each (sub)model's, prefixed by where it sits
    submodels = [
        (name, module) for name, module in model.named_modules() if isinstance(module, fat5.FAT5PreTrainedModel)
    ]
    declared = {f"{name}.{key}" if name else key: f"{name}.{value}" if name else value
                for name, module in submodels for key, value in (module._tied_weights_keys or {}).items()}
    assert declared and all(target in parameters and source in parameters for target, source in declared.items())
    assert set(model.all_tied_weights_keys) <= set(declared)


# 5. the output's length, keys and positions are T5's; the loss's parts come when asked


@pytest.mark.parametrize("output_hidden_states", [False, True])
def test_output_fields_and_positions_are_t5s(output_hidden_states):
    hf = make_hf("t5v1.1")
    model = fat5_from_hf(hf, "t5v1.1")
    input_ids, attention_mask, labels = padded_batch()
    arguments = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                 "output_hidden_states": output_hidden_states}
    with torch.no_grad():
        expected, actual = hf(**arguments), model(**arguments)
        parts = model(**arguments, return_loss_parts=True)
    assert len(actual) == len(expected) and list(actual.keys()) == list(expected.keys())
    for position in range(len(expected)):
        assert type(actual[position]) is type(expected[position])
    torch.testing.assert_close(actual[1], expected[1], rtol=1e-4, atol=1e-5)  # logits, where T5 keeps them
    torch.testing.assert_close(parts.ce_loss + parts.z_loss, parts.loss)
    assert len(parts.to_tuple()) == len(expected.to_tuple())


# 4. custom 4-D attention masks, as transformers' models take them


def as_float_mask(mask):
    """transformers' additive form of a bool mask: 0 where a key may be attended, the dtype's minimum elsewhere."""
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def custom_masks(batch_size, length):
    """An encoder mask no 2-D mask can say (each query sees itself, the first key and the keys two steps away) and a
    decoder mask that hides one earlier token from one row's later queries, on top of causality."""
    position = torch.arange(length)
    distance = (position[:, None] - position[None, :]).abs()
    encoder = ((distance % 2 == 0) | (position[None, :] == 0)).expand(batch_size, 1, length, length).clone()
    decoder = torch.ones(4, 4, dtype=torch.bool).tril().expand(batch_size, 1, 4, 4).clone()
    decoder[1, 0, 2:, 1] = False
    return encoder, decoder


@pytest.mark.parametrize("form", ["bool", "float"])
def test_custom_4d_masks_give_t5s_outputs(form):
    hf = make_hf("t5v1.1")
    model = fat5_from_hf(hf, "t5v1.1")
    input_ids, attention_mask, _ = padded_batch()
    encoder_mask, decoder_mask = custom_masks(*input_ids.shape)
    if form == "float":
        encoder_mask, decoder_mask = as_float_mask(encoder_mask), as_float_mask(decoder_mask)
    decoder_input_ids = torch.tensor([[0, 5, 9, 17]] * len(input_ids))
    # the encoder's mask masks the decoder's cross-attention too, as in T5: there a (batch, 1, 1, keys) one
    cross_mask = attention_mask[:, None, None, :].bool()
    if form == "float":
        cross_mask = as_float_mask(cross_mask)
    with torch.no_grad():
        expected = hf.encoder(input_ids=input_ids, attention_mask=encoder_mask).last_hidden_state
        actual = model.get_encoder()(input_ids=input_ids, attention_mask=encoder_mask).last_hidden_state
        assert not torch.allclose(actual, model.get_encoder()(input_ids=input_ids).last_hidden_state, atol=1e-3)
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
        arguments = {"input_ids": input_ids, "attention_mask": cross_mask, "decoder_input_ids": decoder_input_ids,
                     "decoder_attention_mask": decoder_mask}
        expected, actual = hf(**arguments).logits, model(**arguments).logits
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
        # the 4-D decoder mask is the whole mask: one that hides nothing takes causality away, as in T5
        unmasked = dict(arguments, decoder_attention_mask=torch.ones_like(decoder_mask))
        torch.testing.assert_close(model(**unmasked).logits, hf(**unmasked).logits, rtol=1e-4, atol=1e-5)


def test_a_custom_4d_mask_decodes_step_by_step_as_t5():
    hf = make_hf("t5v1.1")
    model = fat5_from_hf(hf, "t5v1.1")
    input_ids, attention_mask, _ = padded_batch()
    _, decoder_mask = custom_masks(*input_ids.shape)
    decoder_input_ids = torch.tensor([[0, 5, 9, 17]] * len(input_ids))
    with torch.no_grad():
        results = []
        for owner in (hf, model):
            first = owner(input_ids=input_ids, attention_mask=attention_mask,
                          decoder_input_ids=decoder_input_ids[:, :3], decoder_attention_mask=decoder_mask[:, :, :3, :3],
                          use_cache=True)
            step = owner(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids[:, 3:],
                         decoder_attention_mask=decoder_mask[:, :, 3:], cache=first.cache, use_cache=True)
            results.append(torch.cat([first.logits, step.logits], dim=1))
            full = owner(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                         decoder_attention_mask=decoder_mask).logits
            torch.testing.assert_close(results[-1], full, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-5)


def test_custom_4d_masks_that_do_not_fit_are_refused_by_name():
    model = fat5_from_hf(make_hf("t5v1.1"), "t5v1.1")
    input_ids, _, labels = padded_batch()
    batch_size, length = input_ids.shape
    encoder_mask, _ = custom_masks(batch_size, length)
    with pytest.raises(ValueError, match=r"\(batch, length\) or a custom \(batch, 1, query_length, key_length\)"):
        model(input_ids=input_ids, attention_mask=encoder_mask.expand(-1, 4, -1, -1), labels=labels)
    with pytest.raises(ValueError, match="covers 10 positions but there are 11 tokens"):
        model(input_ids=input_ids, attention_mask=encoder_mask[..., :10], labels=labels)
    with pytest.raises(ValueError, match="bool .* or float"):
        model(input_ids=input_ids, attention_mask=encoder_mask.long(), labels=labels)
    with pytest.raises(ValueError, match=r"\(batch, 1, query_length or 1, key_length\) = \(batch, 1, 11, 11\)"):
        model.get_encoder()(input_ids=input_ids, attention_mask=encoder_mask[:, :, :5])
    # T5 fails here deep in its attention; FAT5 says that the encoder's mask meets the decoder's queries
    with pytest.raises(ValueError, match="also masks the decoder's cross-attention"):
        model(input_ids=input_ids, attention_mask=encoder_mask, labels=labels)


# 6. output_attentions: the materialising attention for that call, T5's (eager) probabilities


@pytest.fixture(scope="module")
def eager_pair():
    hf = make_hf("t5v1.1")
    model = fat5_from_hf(hf, "t5v1.1")
    hf.set_attn_implementation("eager")  # T5's sdpa returns no probabilities (it warns and gives empty tuples)
    return hf, model


ATTENTIONS = ("encoder_attentions", "decoder_attentions", "cross_attentions")


def test_attention_probabilities_are_t5s(eager_pair):
    hf, model = eager_pair
    input_ids, attention_mask, labels = padded_batch()
    arguments = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    with torch.no_grad():
        expected = hf(**arguments, output_attentions=True)
        actual = model(**arguments, output_attentions=True)
        plain = model(**arguments)
    assert list(actual.keys()) == list(expected.keys())
    for name in ATTENTIONS:
        assert len(actual[name]) == len(expected[name]) == TINY["num_layers"]
        for got, want in zip(actual[name], expected[name], strict=True):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(actual.logits, plain.logits, rtol=1e-5, atol=1e-6)  # the kernels' numerics
    torch.testing.assert_close(actual.logits, expected.logits, rtol=1e-4, atol=1e-5)
    assert all(got.sum(-1).sub(1).abs().max() < 1e-5 for got in actual.encoder_attentions)
    with torch.no_grad():
        tuple_output = model(**arguments, output_attentions=True, return_dict=False)
    assert len(tuple_output) == len(expected.to_tuple())
    # an explicit False wins over the config, as in T5
    model.config.output_attentions = True
    try:
        with torch.no_grad():
            assert len(model(**arguments).encoder_attentions) == TINY["num_layers"]
            assert model(**arguments, output_attentions=False).encoder_attentions is None
    finally:
        model.config.output_attentions = False


def test_attention_probabilities_of_the_encoder_and_of_generate_are_t5s(eager_pair):
    hf, model = eager_pair
    input_ids, attention_mask, _ = padded_batch()
    with torch.no_grad():
        expected = hf.get_encoder()(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
        actual = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
        for got, want in zip(actual.attentions, expected.attentions, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        generate = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 3, "do_sample": False,
                    "output_attentions": True, "return_dict_in_generate": True}
        expected, actual = hf.generate(**generate), model.generate(**generate)
    assert torch.equal(actual.sequences, expected.sequences)
    for name in ATTENTIONS:
        flat = [list(step) if isinstance(step, tuple) else [step] for step in getattr(expected, name)]
        got = [list(step) if isinstance(step, tuple) else [step] for step in getattr(actual, name)]
        assert len(got) == len(flat), name
        for got_step, want_step in zip(got, flat, strict=True):
            for a, b in zip(got_step, want_step, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_attention_probabilities_of_packed_rows_are_refused_by_name():
    model = fat5_from_hf(make_hf("t5v1.1"), "t5v1.1")
    segment_ids = torch.tensor([[1, 1, 2, 2, 0]])
    with pytest.raises(ValueError, match="output_attentions=True needs padded rows"):
        model.get_encoder()(input_ids=torch.tensor([[5, 6, 7, 8, 0]]), segment_ids=segment_ids,
                            output_attentions=True)


# 7. fp16: the feed-forward's output projection stays fp32, as in T5


def test_fp16_keeps_wo_in_fp32_and_stays_finite_where_fp16_overflows(tmp_path):
    hf = make_hf("t5v1.1")
    with torch.no_grad():
        for name, parameter in hf.named_parameters():
            if name.endswith("DenseReluDense.wo.weight"):
                # feed-forward outputs beyond fp16's 65504, as T5 v1.1 / FLAN-T5 activations grow
                parameter.mul_(3e4)
    fat5_from_hf(hf, "t5v1.1").save_pretrained(tmp_path / "fat5")
    hf.save_pretrained(tmp_path / "t5")
    input_ids, attention_mask, labels = padded_batch()
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    with torch.no_grad():
        reference = FAT5ForConditionalGeneration.from_pretrained(tmp_path / "fat5").eval()(**batch)
        half = FAT5ForConditionalGeneration.from_pretrained(tmp_path / "fat5", dtype=torch.float16).eval()
        t5_half = T5ForConditionalGeneration.from_pretrained(tmp_path / "t5", dtype=torch.float16).eval()
        assert half.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
        assert half.shared.weight.dtype == torch.float16
        actual, expected = half(**batch), t5_half(**batch)
        assert torch.isfinite(actual.logits).all()
        assert relative_error(actual.logits, reference.logits) < 1e-2
        assert relative_error(actual.logits, expected.logits) < 5e-3
        # the case is one that fp16 cannot hold: with wo in fp16 too, the logits are far off
        for module in half.modules():
            if hasattr(module, "wo"):
                module.wo.half()
        assert not relative_error(half(**batch).logits, reference.logits) < 5e-2


# 8. sequence classification and question answering are T5's encoder-decoder heads; encoder-only is an option


def head_pair(t5_class, fat5_class, family="t5v1.1", **config):
    """A T5 head and the FAT5 head with its weights, loaded by name (the names are T5's on both sides)."""
    torch.manual_seed(4)
    t5_config = T5Config(**{**TINY, **config}, feed_forward_proj="gated-gelu" if family == "t5v1.1" else "relu")
    t5 = t5_class(t5_config).eval()
    fat5_head = fat5_class(tiny_config(feed_forward_proj=t5_config.feed_forward_proj, **config)).eval()
    missing, unexpected = fat5_head.load_state_dict(t5.state_dict(), strict=False)
    assert not unexpected and not [key for key in missing if "embed_tokens" not in key], (missing, unexpected)
    return t5, fat5_head


def rows_with_one_eos(seed=2):
    """Padded rows, each ending in one EOS (id 1) before its padding, as a tokenizer gives them."""
    input_ids, attention_mask, _ = padded_batch(seed)
    input_ids = input_ids.clamp(min=2).masked_fill(attention_mask == 0, 0)
    input_ids[torch.arange(len(input_ids)), attention_mask.sum(1) - 1] = 1
    return input_ids, attention_mask


@pytest.mark.parametrize(("num_labels", "labels"), [(3, torch.tensor([0, 2, 1])), (1, torch.tensor([0.5, -1.0, 2.0]))])
def test_sequence_classification_is_t5s(num_labels, labels):
    from transformers import T5ForSequenceClassification

    t5, fat5_head = head_pair(T5ForSequenceClassification, FAT5ForSequenceClassification, num_labels=num_labels)
    input_ids, attention_mask = rows_with_one_eos()
    with torch.no_grad():
        expected = t5(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        actual = fat5_head(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert list(actual.keys()) == list(expected.keys())
    torch.testing.assert_close(actual.logits, expected.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-4, atol=1e-5)


def test_question_answering_is_t5s():
    from transformers import T5ForQuestionAnswering

    t5, fat5_head = head_pair(T5ForQuestionAnswering, FAT5ForQuestionAnswering, family="t5")
    input_ids, attention_mask = rows_with_one_eos()
    positions = {"start_positions": torch.tensor([1, 0, 3]), "end_positions": torch.tensor([2, 4, 3])}
    with torch.no_grad():
        expected = t5(input_ids=input_ids, attention_mask=attention_mask, **positions)
        actual = fat5_head(input_ids=input_ids, attention_mask=attention_mask, **positions)
        for name in ("start_logits", "end_logits", "loss"):
            torch.testing.assert_close(getattr(actual, name), getattr(expected, name), rtol=1e-4, atol=1e-5)
        expected = t5(input_ids=input_ids, attention_mask=attention_mask)
        actual = fat5_head(input_ids=input_ids, attention_mask=attention_mask)
    assert list(actual.keys()) == list(expected.keys())


@pytest.mark.parametrize("head_class", [FAT5ForSequenceClassification, FAT5ForQuestionAnswering],
                         ids=lambda c: c.__name__)
def test_heads_load_quietly_from_a_seq2seq_checkpoint_in_either_layout(tmp_path, head_class):
    FAT5ForConditionalGeneration(tiny_config()).save_pretrained(tmp_path)
    for encoder_only in (False, True):
        model, info = head_class.from_pretrained(tmp_path, encoder_only_heads=encoder_only, output_loading_info=True)
        assert hasattr(model.get_input_embeddings(), "weight")
        assert not info["unexpected_keys"]
        assert {key.split(".")[0] for key in info["missing_keys"]} <= {"classification_head", "qa_outputs"}
        assert any(".decoder." in f".{name}" for name, _ in model.named_parameters()) == (not encoder_only)
        model.save_pretrained(tmp_path / f"head-{encoder_only}")
        reloaded, info = head_class.from_pretrained(tmp_path / f"head-{encoder_only}", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        assert reloaded.config.encoder_only_heads == encoder_only


@pytest.mark.parametrize("head_class", [FAT5ForSequenceClassification, FAT5ForQuestionAnswering],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("argument", ["decoder_input_ids", "decoder_attention_mask"])
def test_encoder_only_heads_refuse_decoder_arguments(head_class, argument):
    model = head_class(tiny_config(encoder_only_heads=True)).eval()
    input_ids, attention_mask = rows_with_one_eos()
    with pytest.raises(ValueError, match=f"encoder_only_heads=True.*{argument}"):
        model(input_ids=input_ids, attention_mask=attention_mask, **{argument: attention_mask})


def test_sequence_classification_refuses_rows_with_unequal_eos_counts():
    model = FAT5ForSequenceClassification(tiny_config()).eval()
    input_ids, attention_mask = rows_with_one_eos()
    input_ids[0, 0] = 1
    with pytest.raises(ValueError, match="same number of EOS"):
        model(input_ids=input_ids, attention_mask=attention_mask)


# 1, 9, 11 and the base model's quiet load, from a Hub bundle in a process that cannot import fat5

BUNDLE_WITHOUT_FAT5 = BLOCK_FAT5 + r"""
import json, peft, torch, transformers

folder, no_embeddings, out_file = sys.argv[1:4]
results = {}
_, info = transformers.AutoModel.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
results["base_unexpected"] = sorted(info["unexpected_keys"])
model, info = transformers.AutoModelForSeq2SeqLM.from_pretrained(no_embeddings, trust_remote_code=True,
                                                                 output_loading_info=True)
results["missing"] = sorted(info["missing_keys"])
results["module"] = type(model).__module__
lora = peft.get_peft_model(model, peft.LoraConfig(task_type="SEQ_2_SEQ_LM"))
results["lora_targets"] = sorted(lora.targeted_module_names)
generator = transformers.pipeline("text-generation", model=folder, trust_remote_code=True)
results["pipeline_model"] = type(generator.model).__module__
results["generated"] = generator("w5 w17 w33", max_new_tokens=4, do_sample=False)[0]["generated_text"]
with open(out_file, "w") as handle:
    json.dump(results, handle)
"""


def test_a_bundle_reports_missing_embeddings_takes_peft_defaults_and_serves_the_pipeline(tmp_path):
    import json
    import shutil

    import transformers
    from peft import LoraConfig, get_peft_model

    from fat5.hub_upload import bundle

    model_dir = tmp_path / "model"
    fat5_from_hf(make_hf("t5v1.1"), "t5v1.1").save_pretrained(model_dir)
    word_tokenizer().save_pretrained(model_dir)
    bundle(model_dir, tmp_path / "bundle", repo_id="someone/fat5-tiny", license="apache-2.0", validate=False)
    shutil.copytree(tmp_path / "bundle", tmp_path / "no_embeddings")
    drop_embeddings(tmp_path / "no_embeddings")
    completed = run_isolated(BUNDLE_WITHOUT_FAT5, tmp_path / "bundle", tmp_path / "no_embeddings",
                             tmp_path / "out.json", tmp=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    remote = json.loads((tmp_path / "out.json").read_text())
    assert remote["module"].startswith("transformers_modules.")
    assert remote["pipeline_model"].startswith("transformers_modules.")
    assert remote["base_unexpected"] == []
    assert {"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"} <= set(remote["missing"])
    local = FAT5ForConditionalGeneration.from_pretrained(model_dir)
    assert remote["lora_targets"] == sorted(get_peft_model(local, LoraConfig(task_type="SEQ_2_SEQ_LM"))
                                            .targeted_module_names)
    generated = transformers.pipeline("text-generation", model=str(model_dir), trust_remote_code=True)(
        "w5 w17 w33", max_new_tokens=4, do_sample=False)
    assert remote["generated"] == generated[0]["generated_text"]


def test_text_generation_pipelines_return_the_text_t5_generates(tmp_path):
    """A saved folder names FAT5's pipeline for both generation tasks (transformers 5 has none for seq2seq models):
    with remote code trusted, each answers the text T5 generates from the same weights; without, transformers'
    refusal names the option."""
    import transformers

    tokenizer = word_tokenizer()
    hf = make_hf("t5v1.1")
    fat5_from_hf(hf, "t5v1.1").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts = ["w5 w17 w33", "w40 w4"]
    expected = [tokenizer.decode(hf.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=4,
                                             do_sample=False)[0], skip_special_tokens=True) for prompt in prompts]
    assert any(expected)
    for task in ("text2text-generation", "text-generation"):
        answers = transformers.pipeline(task, model=str(tmp_path), trust_remote_code=True)(
            prompts, max_new_tokens=4, do_sample=False)
        assert answers == [[{"generated_text": text}] for text in expected], task
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        transformers.pipeline("text-generation", model=str(tmp_path))


# 3. the decoder stack on its own keeps a cache and continues from it, as T5's does


def test_bare_decoder_stack_returns_a_cache_and_continues_from_it():
    hf = make_hf("t5v1.1")
    model = fat5_from_hf(hf, "t5v1.1")
    input_ids, attention_mask, _ = padded_batch()
    decoder_input_ids = torch.tensor([[0, 5, 9, 17]] * len(input_ids))
    with torch.no_grad():
        results = []
        for stack_owner in (hf, model):
            encoder_states = stack_owner.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)[0]
            decoder = stack_owner.get_decoder()
            common = {"encoder_hidden_states": encoder_states, "encoder_attention_mask": attention_mask}
            full = decoder(input_ids=decoder_input_ids, **common)[0]
            first = decoder(input_ids=decoder_input_ids[:, :3], use_cache=True, **common)
            cache = first[1]
            assert cache is not None and cache.get_seq_length() == 3
            step = decoder(input_ids=decoder_input_ids[:, 3:], past_key_values=cache, use_cache=True, **common)[0]
            torch.testing.assert_close(step[:, -1], full[:, -1], rtol=1e-4, atol=1e-5)
            results.append(step)
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-5)


# 12. finetuning data from a save_to_disk folder, a folder of data files or a datasets.Dataset, as pretraining takes
# it, and each split's files in a format of their own


def test_finetune_reads_save_to_disk_folders_and_dataset_objects(tmp_path, tiny_model):
    import datasets
    import yaml

    from fat5.errors import FAT5Error
    from fat5.trainer.finetune_config import load_finetune_config
    from fat5.trainer.finetune_data import load_raw_datasets
    from fat5.trainer.finetuning import finetune

    def config(train, validation=None, **training):
        return {"task": "seq2seq", "model": str(tiny_model), "output_dir": str(tmp_path / "run"),
                "data": {"train_file": train, "validation_file": validation, "text_column": "document",
                         "target_column": "summary", "max_target_length": 16},
                "training": {"per_device_train_batch_size": 4, "disable_tqdm": True, "report_to": "none",
                             "save_strategy": "no", "use_cpu": True, **training}}

    expected = load_raw_datasets(load_finetune_config(config(str(DATA))).data)["train"]
    whole = datasets.Dataset.from_list(expected.to_list())
    whole.save_to_disk(tmp_path / "saved")
    datasets.DatasetDict(train=whole.select(range(20)), validation=whole.select(range(20, 30))).save_to_disk(
        tmp_path / "saved_dict"
    )
    from_folder = load_raw_datasets(load_finetune_config(config(str(tmp_path / "saved"))).data)
    assert from_folder["train"].to_list() == expected.to_list()
    from_dict = load_raw_datasets(
        load_finetune_config(config(str(tmp_path / "saved_dict"), str(tmp_path / "saved_dict"))).data
    )
    assert len(from_dict["train"]) == 20 and from_dict["validation"].to_list() == whole.select(range(20, 30)).to_list()
    (tmp_path / "not_saved").mkdir()
    with pytest.raises(FAT5Error, match="neither one that datasets' save_to_disk wrote nor one of data files"):
        load_raw_datasets(load_finetune_config(config(str(tmp_path / "not_saved"))).data)

    # a folder of data files, as datasets.load_dataset(folder) reads it (its train and validation files by name)
    files = tmp_path / "files"
    files.mkdir()
    whole.select(range(20)).to_json(files / "train.jsonl")
    whole.select(range(20, 30)).to_json(files / "validation.jsonl")
    from_files = load_raw_datasets(load_finetune_config(config(str(files), str(files))).data)
    assert from_files["train"].to_list() == whole.select(range(20)).to_list()
    assert from_files["validation"].to_list() == whole.select(range(20, 30)).to_list()
    # a JSONL train_file beside a CSV validation_file: each read by its own format
    whole.select(range(20, 30)).to_csv(tmp_path / "validation.csv", index=False)
    mixed = load_raw_datasets(load_finetune_config(config(str(files / "train.jsonl"), str(tmp_path / "validation.csv"))
                                                   ).data)
    for column in ("document", "summary"):  # CSV keeps text; the list columns come back as their text
        assert mixed["validation"][column] == whole.select(range(20, 30))[column]
    assert mixed["train"].to_list() == whole.select(range(20)).to_list()

    result = finetune(config(whole.select(range(16)), max_steps=2))
    assert any(entry.get("train_loss", 0) > 0 for entry in result["log_history"])
    written = yaml.safe_load((tmp_path / "run" / "finetune_config.yaml").read_text())
    assert "16 rows" in written["data"]["train_file"]


# 13. torch.compile: FAT5 adds no warning to the ones T5 gets, and FAT5's code never calls torch.jit

COMPILE_AND_RECORD = r"""
import json, sys, warnings
import torch

which, out_file = sys.argv[1:3]
torch.set_num_threads(1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from test_modeling import fat5_from_hf, make_hf, padded_batch

    hf = make_hf("t5v1.1")
    model = hf if which == "t5" else fat5_from_hf(hf, "t5v1.1")
    input_ids, attention_mask, labels = padded_batch()
    with torch.no_grad():
        torch.compile(model)(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
with open(out_file, "w") as handle:
    json.dump([[w.category.__name__, w.filename, w.lineno, str(w.message)] for w in caught], handle)
"""


@pytest.mark.slow
def test_compiling_fat5_warns_no_more_than_compiling_t5(tmp_path):
    """torch's own modules warn when torch.compile loads them (the 14 `torch.jit.script_method` deprecations come from
    torch/utils/mkldnn.py, which inductor imports): T5 gets them as well. Each model compiles in a fresh process, so
    that both meet every warning that fires once per process."""
    import collections
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests)]), TRANSFORMERS_VERBOSITY="error")
    recorded = {}
    for which in ("t5", "fat5"):
        completed = subprocess.run([sys.executable, "-c", COMPILE_AND_RECORD, which, str(tmp_path / which)], env=env,
                                   cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False)
        assert completed.returncode == 0, completed.stderr[-3000:]
        recorded[which] = collections.Counter(map(tuple, json.loads((tmp_path / which).read_text())))
    added = recorded["fat5"] - recorded["t5"]
    assert not added, added
    fat5_folder = tests.parent / "fat5"
    assert not [warning for warning in recorded["fat5"] if warning[1].startswith(str(fat5_folder))]
    uses = [f"{path}:{number}" for path in fat5_folder.rglob("*.py")
            for number, line in enumerate(path.read_text().splitlines(), 1) if "torch.jit" in line]
    assert not uses, uses
