"""What a transformers user does with a seq2seq model, on FAT5 and on transformers' own T5 with the same weights.

Resizing the vocabulary, tokenizer and pipeline round trips, tuple and hidden-state outputs, embeddings instead of ids,
the seq2seq collator, loading options, gradient checkpointing, the decoding strategies of ``generate`` and the
embedding accessors: each gives what T5 gives (fp32, CPU). What FAT5's fused attention cannot do (attention
probabilities, head masks) is refused by name where T5 would return something.
"""

import copy
import inspect

import pytest
import torch
import transformers
from helpers import TINY, hf_and_fat5, padded_batch, relative_error, word_tokenizer
from transformers import T5Config, T5EncoderModel, T5ForConditionalGeneration

from fat5 import FAT5Config, FAT5EncoderModel, FAT5ForConditionalGeneration


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


TEXTS = ["w5 w17 w33 w8 w61", "w40 w4", "w90 w12 w12 w70"]
GREEDY = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}


# 1. resize_token_embeddings


@pytest.mark.parametrize(
    ("family", "new_size", "mean_resizing"),
    [("t5", 120, True), ("t5", 64, True), ("t5v1.1", 120, True), ("t5v1.1", 120, False), ("t5v1.1", 64, True)],
)
def test_resize_token_embeddings_matches_transformers(family, new_size, mean_resizing):
    """Growing (new rows drawn as T5 draws them, from the same seed) or shrinking, tied or untied head."""
    hf, model = hf_and_fat5(family)
    for resized in (hf, model):
        torch.manual_seed(0)
        resized.resize_token_embeddings(new_size, mean_resizing=mean_resizing)
    assert model.config.vocab_size == hf.config.vocab_size == new_size
    assert (model.lm_head.weight is model.shared.weight) == (hf.lm_head.weight is hf.shared.weight)
    assert model.encoder.embed_tokens is model.shared and model.decoder.embed_tokens is model.shared
    assert torch.equal(model.shared.weight, hf.shared.weight)
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    input_ids, attention_mask, labels = padded_batch()
    input_ids, labels = input_ids % new_size, labels.masked_fill(labels >= new_size, -100)
    with torch.no_grad():
        expected = hf(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        actual = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert actual.logits.shape[-1] == new_size
    assert relative_error(actual.logits, expected.logits) < 1e-5
    torch.testing.assert_close(actual.loss, expected.loss)
    assert torch.equal(
        model.generate(input_ids=input_ids, attention_mask=attention_mask, **GREEDY),
        hf.generate(input_ids=input_ids, attention_mask=attention_mask, **GREEDY),
    )


# 2. tokenizer and pipelines (transformers 5 removed the text2text-generation pipeline, for T5 as for FAT5)


def test_tokenize_generate_decode_matches_transformers(tokenizer):
    hf, model = hf_and_fat5("t5v1.1")
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    settings = {"max_new_tokens": 5, "num_beams": 2}
    expected = tokenizer.batch_decode(hf.generate(**batch, **settings), skip_special_tokens=True)
    actual = tokenizer.batch_decode(model.generate(**batch, **settings), skip_special_tokens=True)
    assert actual == expected
    assert any(text.strip() for text in expected)


def test_feature_extraction_pipeline_matches_transformers(tokenizer):
    torch.manual_seed(0)
    hf = T5EncoderModel(T5Config(**TINY, feed_forward_proj="gated-gelu")).eval()
    model = FAT5EncoderModel(FAT5Config(**TINY, feed_forward_proj="gated-gelu", attention_backend="reference")).eval()
    model.load_state_dict(hf.state_dict(), strict=False)
    expected = transformers.pipeline("feature-extraction", model=hf, tokenizer=tokenizer)(TEXTS, return_tensors=True)
    actual = transformers.pipeline("feature-extraction", model=model, tokenizer=tokenizer)(TEXTS, return_tensors=True)
    for states, expected_states in zip(actual, expected, strict=True):
        assert relative_error(states, expected_states) < 1e-5


# 3. tuples, hidden states, attention probabilities


def assert_same_outputs(actual, expected):
    """Two tuples (or tuples of tuples) of T5 outputs: same layout, same tensors."""
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        if isinstance(want, tuple):
            assert_same_outputs(got, want)
        elif isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.shape == want.shape
            assert relative_error(got, want) < 1e-5 if want.dim() else torch.allclose(got, want)
        else:
            assert type(got) is type(want)


@pytest.mark.parametrize("output_hidden_states", [False, True])
def test_return_dict_false_gives_t5s_tuple(output_hidden_states):
    hf, model = hf_and_fat5()
    input_ids, attention_mask, labels = padded_batch()
    arguments = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "return_dict": False,
                 "output_hidden_states": output_hidden_states}
    with torch.no_grad():
        expected, actual = hf(**arguments), model(**arguments)
        assert isinstance(actual, tuple)
        assert_same_outputs(actual, expected)
        encoder_arguments = {"input_ids": input_ids, "attention_mask": attention_mask, "return_dict": False,
                             "output_hidden_states": output_hidden_states}
        assert_same_outputs(model.get_encoder()(**encoder_arguments), hf.get_encoder()(**encoder_arguments))


def test_config_output_flags_are_the_defaults():
    """config.output_hidden_states and config.return_dict act as T5's arguments do. (T5 reads the first from copies
    of the config made at construction and fails on the second, so the truth here is T5 given the arguments.)"""
    hf, model = hf_and_fat5()
    input_ids, attention_mask, labels = padded_batch()
    arguments = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    model.config.output_hidden_states = True
    with torch.no_grad():
        expected = hf(**arguments, output_hidden_states=True)
        actual = model(**arguments)
        for name in ("encoder_hidden_states", "decoder_hidden_states"):
            assert_same_outputs(actual[name], expected[name])
        model.config.return_dict = False
        assert_same_outputs(model(**arguments), hf(**arguments, output_hidden_states=True, return_dict=False))
        assert isinstance(model.get_encoder()(input_ids=input_ids), tuple)
    assert torch.equal(  # generate asks for ModelOutputs whatever the config says
        model.generate(input_ids=input_ids, attention_mask=attention_mask, **GREEDY),
        hf.generate(input_ids=input_ids, attention_mask=attention_mask, **GREEDY),
    )


def test_attention_probabilities_are_t5s_eager_ones():
    """T5 (eager) returns the attention probabilities; FAT5 forms them with its materialising attention for the call
    that asks, however it asks (more in test_t5_parity.py)."""
    hf, model = hf_and_fat5()
    # built eager rather than switched: transformers 5.17's T5 stacks keep copies of the config that a switch misses
    eager_config = copy.deepcopy(hf.config)
    eager_config._attn_implementation = "eager"
    eager = T5ForConditionalGeneration(eager_config).eval()
    eager.load_state_dict(hf.state_dict())
    input_ids, attention_mask, labels = padded_batch()
    arguments = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    with torch.no_grad():
        expected = eager(**arguments, output_attentions=True)
        model.config.output_attentions = True
        try:
            actual = model(**arguments)
        finally:
            model.config.output_attentions = False
    assert len(expected.encoder_attentions) == TINY["num_layers"] and len(expected.cross_attentions) > 0
    for name in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        for got, want in zip(actual[name], expected[name], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_trainer_predictions_are_t5s(tmp_path):
    """The Trainer's evaluation keeps what T5 returns; the loss's parts (ce_loss, z_loss) stay out of predictions."""
    hf, model = hf_and_fat5()
    input_ids, attention_mask, labels = padded_batch()
    dataset = [{"input_ids": i, "attention_mask": m, "labels": lab}
               for i, m, lab in zip(input_ids, attention_mask, labels)]
    results = []
    for evaluated in (hf, model):
        arguments = transformers.Seq2SeqTrainingArguments(tmp_path / type(evaluated).__name__, report_to=[],
                                                          per_device_eval_batch_size=2, use_cpu=True)
        results.append(transformers.Seq2SeqTrainer(model=evaluated, args=arguments).predict(dataset))
    expected, actual = results
    assert len(actual.predictions) == len(expected.predictions)
    for got, want in zip(actual.predictions, expected.predictions, strict=True):
        assert got.shape == want.shape
        assert relative_error(torch.from_numpy(got), torch.from_numpy(want)) < 1e-5
    assert actual.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-5)


# 4. inputs_embeds / decoder_inputs_embeds


def test_embeddings_instead_of_ids_match_transformers():
    hf, model = hf_and_fat5()
    input_ids, attention_mask, labels = padded_batch()
    with torch.no_grad():
        inputs_embeds = hf.shared(input_ids) * 0.9  # not what the ids would give, so the embeddings must be used
        decoder_inputs_embeds = hf.shared(hf.prepare_decoder_input_ids_from_labels(labels=labels)) * 1.1
        for arguments in (
            {"inputs_embeds": inputs_embeds},
            {"inputs_embeds": inputs_embeds, "decoder_inputs_embeds": decoder_inputs_embeds},
            {"input_ids": input_ids, "decoder_inputs_embeds": decoder_inputs_embeds},
        ):
            expected = hf(**arguments, attention_mask=attention_mask, labels=labels)
            actual = model(**arguments, attention_mask=attention_mask, labels=labels)
            assert relative_error(actual.logits, expected.logits) < 1e-5, list(arguments)
            torch.testing.assert_close(actual.loss, expected.loss)
    assert torch.equal(
        model.generate(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **GREEDY),
        hf.generate(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **GREEDY),
    )
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        model(input_ids=input_ids, inputs_embeds=inputs_embeds, labels=labels)


# 5. labels: the seq2seq collator, -100


def test_seq2seq_collator_and_ignored_labels_match_transformers(tokenizer):
    hf, model = hf_and_fat5("t5v1.1")
    features = [{"input_ids": tokenizer(text).input_ids, "labels": tokenizer(text).input_ids[::-1][:4]}
                for text in TEXTS]
    batches = [transformers.DataCollatorForSeq2Seq(tokenizer, model=m)(copy.deepcopy(features)) for m in (hf, model)]
    expected_batch, batch = batches
    assert batch.keys() == expected_batch.keys() and "decoder_input_ids" in batch
    for name in batch:
        assert torch.equal(batch[name], expected_batch[name]), name
    assert (batch["labels"] == -100).any()
    labels = batch["labels"]
    assert torch.equal(
        model.prepare_decoder_input_ids_from_labels(labels=labels),
        hf.prepare_decoder_input_ids_from_labels(labels=labels),
    )
    with torch.no_grad():
        expected, actual = hf(**batch), model(**batch)
    assert relative_error(actual.logits, expected.logits) < 1e-5
    torch.testing.assert_close(actual.loss, expected.loss)
    # a batch without one labelled token: T5's mean over nothing is NaN, FAT5's fused loss divides by max(count, 1)
    unlabelled = dict(batch, labels=torch.full_like(labels, -100))
    with torch.no_grad():
        assert hf(**unlabelled).loss.isnan()
        assert model(**unlabelled).loss.item() == 0.0


# 6. from_pretrained options


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The same weights saved by transformers' T5 and by FAT5."""
    hf, model = hf_and_fat5("t5v1.1")
    folders = tmp_path_factory.mktemp("hf"), tmp_path_factory.mktemp("fat5")
    hf.save_pretrained(folders[0])
    model.save_pretrained(folders[1])
    return folders


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_attn_implementation_sdpa_or_eager_loads_the_same_model(saved, attn_implementation):
    hf_folder, fat5_folder = saved
    hf = T5ForConditionalGeneration.from_pretrained(hf_folder, attn_implementation=attn_implementation).eval()
    model = FAT5ForConditionalGeneration.from_pretrained(fat5_folder, attn_implementation=attn_implementation).eval()
    # the config records what was asked for, as T5's does; the same fused kernels run either way
    assert model.config._attn_implementation == hf.config._attn_implementation == attn_implementation
    input_ids, attention_mask, labels = padded_batch()
    with torch.no_grad():
        expected = hf(input_ids=input_ids, attention_mask=attention_mask, labels=labels).logits
        actual = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).logits
    assert relative_error(actual, expected) < 1e-5


@pytest.mark.parametrize("attn_implementation", ["flash_attention_2", "flex_attention"])
def test_other_attn_implementations_are_refused_by_name(saved, attn_implementation):
    with pytest.raises(ValueError,
                       match=f"attn_implementation='{attn_implementation}' is not supported.*attention_backend"):
        FAT5ForConditionalGeneration.from_pretrained(saved[1], attn_implementation=attn_implementation)


@pytest.mark.parametrize("argument", ["dtype", "torch_dtype"])
def test_bfloat16_loading_matches_transformers(saved, argument):
    hf_folder, fat5_folder = saved
    hf = T5ForConditionalGeneration.from_pretrained(hf_folder, **{argument: torch.bfloat16}).eval()
    model = FAT5ForConditionalGeneration.from_pretrained(fat5_folder, **{argument: torch.bfloat16}).eval()
    assert {p.dtype for p in model.parameters()} == {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    input_ids, attention_mask, labels = padded_batch()
    with torch.no_grad():
        expected = hf(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        actual = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert actual.logits.dtype == expected.logits.dtype == torch.bfloat16
    assert relative_error(actual.logits, expected.logits) < 2e-2  # bf16 rounding, which FAT5 does less of
    assert abs(actual.loss.item() - expected.loss.item()) < 2e-2 * expected.loss.item()
    generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, **GREEDY)
    assert generated.shape == hf.generate(input_ids=input_ids, attention_mask=attention_mask, **GREEDY).shape


# 7. gradient checkpointing


@pytest.mark.parametrize("family", ["t5", "t5v1.1"])
@pytest.mark.parametrize("checkpointing", [None, {"use_reentrant": True}, {"use_reentrant": False}], ids=str)
def test_gradient_checkpointing_gives_transformers_gradients(family, checkpointing):
    """Reentrant checkpointing too: the later blocks' gradient for the first block's shared bias table must cross
    the checkpoint boundary."""
    hf, model = hf_and_fat5(family)
    input_ids, attention_mask, labels = padded_batch()

    def gradients(trained, checkpointing_kwargs=False):
        trained.train().zero_grad()
        if checkpointing_kwargs is not False:
            trained.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs)
        trained(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        return {name: p.grad.clone() for name, p in trained.named_parameters() if p.grad is not None}

    expected, plain, checkpointed = gradients(hf), gradients(model), gradients(model, checkpointing)
    assert checkpointed.keys() == plain.keys() == expected.keys()
    assert "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in checkpointed
    for name in expected:
        assert relative_error(checkpointed[name], expected[name]) < 1e-5, name
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7)


# 8. generate


@pytest.mark.parametrize(
    "settings",
    [
        {"num_beams": 3, "max_new_tokens": 7},
        {"do_sample": True, "max_new_tokens": 7, "top_k": 30, "temperature": 0.8},
        {"min_length": 7, "max_new_tokens": 8},
        {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 6},
        {"do_sample": True, "num_return_sequences": 2, "max_new_tokens": 6},
        {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 6, "output_scores": True,
         "output_logits": True, "return_dict_in_generate": True},
        {"do_sample": True, "max_new_tokens": 6, "output_scores": True, "return_dict_in_generate": True},
        {"max_new_tokens": 6, "output_scores": True, "output_hidden_states": True, "return_dict_in_generate": True},
    ],
    ids=lambda settings: ",".join(settings),
)
def test_generate_matches_transformers(settings):
    hf, model = hf_and_fat5("t5v1.1")
    input_ids, attention_mask, _ = padded_batch(seed=4)
    torch.manual_seed(5)  # sampling draws the same numbers for both
    expected = hf.generate(input_ids=input_ids, attention_mask=attention_mask, **settings)
    torch.manual_seed(5)
    actual = model.generate(input_ids=input_ids, attention_mask=attention_mask, **settings)
    if not settings.get("return_dict_in_generate"):
        assert torch.equal(actual, expected)
        assert actual.shape[0] == input_ids.shape[0] * settings.get("num_return_sequences", 1)
        return
    assert type(actual) is type(expected)
    assert torch.equal(actual.sequences, expected.sequences)
    for name in ("scores", "logits", "sequences_scores", "beam_indices", "encoder_hidden_states",
                 "decoder_hidden_states"):
        got, want = getattr(actual, name, None), getattr(expected, name, None)
        assert (got is None) == (want is None), name
        if want is None:
            continue
        for got_step, want_step in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want)), strict=True):
            for got_tensor, want_tensor in zip(*(x if isinstance(x, tuple) else (x,) for x in (got_step, want_step)),
                                               strict=True):
                assert torch.equal(got_tensor.isinf(), want_tensor.isinf()), name  # the same tokens masked
                finite = want_tensor.isfinite()
                torch.testing.assert_close(got_tensor[finite], want_tensor[finite], rtol=1e-4, atol=1e-5)


# 9. the embedding and stack accessors


def test_accessors_and_set_input_embeddings_match_transformers():
    hf, model = hf_and_fat5()
    input_ids, attention_mask, labels = padded_batch()
    assert model.get_input_embeddings() is model.shared and model.get_output_embeddings() is model.lm_head
    assert torch.equal(model.get_input_embeddings().weight, hf.get_input_embeddings().weight)
    assert torch.equal(model.get_output_embeddings().weight, hf.get_output_embeddings().weight)
    with torch.no_grad():
        expected_encoder = hf.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
        encoder = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
        assert relative_error(encoder.last_hidden_state, expected_encoder.last_hidden_state) < 1e-5
        decoder_input_ids = hf.prepare_decoder_input_ids_from_labels(labels=labels)
        expected_decoder = hf.get_decoder()(input_ids=decoder_input_ids,
                                            encoder_hidden_states=encoder.last_hidden_state,
                                            encoder_attention_mask=attention_mask)
        decoder = model.get_decoder()(input_ids=decoder_input_ids, encoder_hidden_states=encoder.last_hidden_state,
                                      encoder_attention_mask=attention_mask)
        assert relative_error(decoder.last_hidden_state, expected_decoder.last_hidden_state) < 1e-5

    torch.manual_seed(1)
    replacement = torch.nn.Embedding(TINY["vocab_size"], TINY["d_model"])
    hf.set_input_embeddings(copy.deepcopy(replacement))
    model.set_input_embeddings(replacement)
    assert model.get_input_embeddings() is replacement
    assert model.encoder.embed_tokens is replacement and model.decoder.embed_tokens is replacement
    for tie in (False, True):  # the head keeps the old weight until the weights are tied again, in both
        if tie:
            hf.tie_weights()
            model.tie_weights()
        assert (model.lm_head.weight is replacement.weight) == (hf.lm_head.weight is hf.shared.weight) == tie
        with torch.no_grad():
            expected = hf(input_ids=input_ids, attention_mask=attention_mask, labels=labels).logits
            actual = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).logits
        assert relative_error(actual, expected) < 1e-5


# 10. head masks


@pytest.mark.parametrize("name", ["head_mask", "decoder_head_mask", "cross_attn_head_mask"])
def test_head_masks_are_refused_by_name(name):
    """transformers 5's T5 no longer takes head masks (it drops them unread into **kwargs); FAT5 refuses them rather
    than ignore a mask its caller means to apply."""
    assert name not in inspect.signature(T5ForConditionalGeneration.forward).parameters
    _, model = hf_and_fat5()
    input_ids, attention_mask, labels = padded_batch()
    mask = torch.ones(TINY["num_layers"], TINY["num_heads"])
    with pytest.raises(ValueError, match=f"{name} is not supported: FAT5's fused attention cannot mask"):
        model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **{name: mask})


def test_fresh_model_draws_t5s_initialisation_once_per_weight(monkeypatch):
    """A model built from a config: each weight drawn once (no projection drawn and then drawn again), with the
    spread transformers' T5 gives the same weight."""
    from transformers import initialization

    config = {"vocab_size": 512, "d_model": 64, "d_kv": 16, "d_ff": 256, "num_layers": 2, "num_heads": 4,
              "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, "decoder_start_token_id": 0}
    torch.manual_seed(0)
    hf = T5ForConditionalGeneration(T5Config(**config))
    draws = {}
    normal = initialization.normal_

    def counting_normal(tensor, *args, **kwargs):
        draws[id(tensor)] = draws.get(id(tensor), 0) + 1
        return normal(tensor, *args, **kwargs)

    monkeypatch.setattr(initialization, "normal_", counting_normal)
    model = FAT5ForConditionalGeneration(FAT5Config(**config, initialization="transformers"))
    monkeypatch.undo()
    assert draws and max(draws.values()) == 1
    hf_parameters = dict(hf.named_parameters())
    compared = 0
    for name, parameter in model.named_parameters():
        if name in hf_parameters and parameter.numel() >= 256:
            expected = hf_parameters[name].detach().float().std().item()
            assert abs(parameter.detach().float().std().item() - expected) < 0.15 * expected, name
            compared += 1
    assert compared >= 20


def test_initialising_one_module_draws_it_as_its_place_in_the_model_asks():
    """`_init_weights` on one Linear (what resize_token_embeddings does with the head it builds) and `init_weights`
    after a head is replaced draw T5's spread for that module, as a whole fresh model does."""
    config = FAT5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=256, num_layers=2, num_heads=4,
                        tie_word_embeddings=False, decoder_start_token_id=0, initialization="transformers")
    model = FAT5ForConditionalGeneration(config)
    for module, std in ((model.lm_head, 1.0), (model.encoder.block[0].layer[0].SelfAttention.q, (64 * 16) ** -0.5),
                        (model.decoder.block[1].layer[-1].DenseReluDense.wo, 256**-0.5)):
        with torch.no_grad():
            module.weight.zero_()
        model._init_weights(module)
        assert abs(module.weight.std().item() - std) < 0.1 * std
    model.set_output_embeddings(torch.nn.Linear(64, 512, bias=False))
    model.init_weights()
    assert abs(model.lm_head.weight.std().item() - 1.0) < 0.1


def test_a_model_on_the_meta_device_runs_its_forward():
    """Shape inference on meta tensors: no autocast state to ask for there."""
    with torch.device("meta"):
        model = FAT5ForConditionalGeneration(FAT5Config(**TINY, attention_backend="reference"))
        input_ids = torch.zeros(2, 5, dtype=torch.long)
        output = model(input_ids=input_ids, labels=input_ids)
    assert output.logits.shape == (2, 5, TINY["vocab_size"]) and output.logits.is_meta
