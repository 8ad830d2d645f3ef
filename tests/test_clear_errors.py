"""Mistakes in a model's config, inputs or files are named where they are made, not met later as an IndexError, a
misattributed mask error or a safetensors error without a file name."""

import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

from fat5 import FAT5Config, FAT5ForConditionalGeneration

TINY = {"vocab_size": 64, "d_model": 16, "d_kv": 4, "d_ff": 32, "num_layers": 1, "num_heads": 4,
        "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16}


@pytest.mark.parametrize("name, value", [
    *((name, value) for name in ("pad_token_id", "eos_token_id", "decoder_start_token_id") for value in (64, 1000, -1)),
    ("eos_token_id", [1, 64]),
])
def test_a_token_id_outside_the_vocabulary_is_refused(name, value):
    with pytest.raises(ValueError, match=rf"FAT5Config.{name} must be a token id in \[0, vocab_size = 64\)"):
        FAT5Config(**TINY, **{name: value})
    assert FAT5Config(**TINY, **{name: [1, 63] if isinstance(value, list) else 63})


def test_labels_with_another_batch_size_are_named():
    model = FAT5ForConditionalGeneration(FAT5Config(**TINY)).eval()
    input_ids = torch.randint(2, 64, (3, 7))
    with pytest.raises(ValueError, match="labels has 2 rows but the inputs have 3: give one row of labels per input"):
        model(input_ids=input_ids, labels=torch.randint(2, 64, (2, 5)))
    assert model(input_ids=input_ids, labels=torch.randint(2, 64, (3, 5))).loss.isfinite()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved") / "model"
    FAT5ForConditionalGeneration(FAT5Config(**TINY)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("damage", ["truncated", "empty", "random"])
def test_unreadable_weights_are_named(saved, tmp_path, damage):
    broken = shutil.copytree(saved, tmp_path / "broken")
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "random": os.urandom(4096)}[damage])
    for load in (FAT5ForConditionalGeneration.from_pretrained, AutoModelForSeq2SeqLM.from_pretrained):
        with pytest.raises(OSError, match=f"{weights} is not a readable safetensors file"):
            load(broken)


def test_unreadable_weights_of_a_bundle_are_named(saved, tmp_path):
    """The Hub bundle's own (remote-code) class names the file too."""
    from fat5.hub_upload import bundle

    out = bundle(saved, tmp_path / "bundle", validate=False).output
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    config = json.loads((out / "config.json").read_text())
    assert "auto_map" in config
    with pytest.raises(OSError, match=f"{weights} is not a readable safetensors file"):
        AutoModelForSeq2SeqLM.from_pretrained(out, trust_remote_code=True)


def test_a_t5_checkpoint_read_as_fat5_is_refused_by_name(tmp_path):
    """transformers only warns when a config of another model type is read by FAT5's class; the checkpoint must be
    converted first."""
    from transformers import T5Config, T5ForConditionalGeneration

    T5ForConditionalGeneration(T5Config(**TINY, feed_forward_proj="gated-gelu")).save_pretrained(tmp_path / "t5")
    for load in (FAT5ForConditionalGeneration.from_pretrained, FAT5Config.from_pretrained):
        with pytest.raises(ValueError, match="holds a 't5' model, not a FAT5 one: convert it first"):
            load(tmp_path / "t5")
    assert AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "t5").config.model_type == "t5"
