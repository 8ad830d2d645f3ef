"""T5-shaped families beyond T5 / FLAN-T5 / mT5 / UMT5, built tiny with transformers' own classes (nothing is
downloaded): `fat5 convert` gives transformers' logits within 1e-4 and its greedy ids, and carries their tokenizers
over. T5-like families whose computation FAT5 lacks are refused by name."""

import json

import pytest
import torch
from helpers import _edit_like_the_hub
from test_conversion import leftovers
from transformers import (
    AutoTokenizer,
    ByT5Tokenizer,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
    UMT5Config,
    UMT5ForConditionalGeneration,
)

from fat5 import FAT5ForConditionalGeneration
from fat5.conversion import ConversionError, convert

SMALL = {"d_model": 32, "d_kv": 8, "d_ff": 48, "num_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8,
         "relative_attention_max_distance": 16, "dropout_rate": 0.0, "decoder_start_token_id": 0}

# name -> (transformers' classes, config fields over SMALL, untied head)
FAMILIES = {
    # ByT5: bytes (3 special ids + 256 + 125 extra), an encoder three times deeper than the decoder
    "byt5": (T5Config, T5ForConditionalGeneration,
             {"vocab_size": 384, "num_layers": 3, "num_decoder_layers": 1, "feed_forward_proj": "gated-gelu"}, True),
    # Flan-UL2: heads of 256
    "flan-ul2": (T5Config, T5ForConditionalGeneration,
                 {"vocab_size": 128, "d_kv": 256, "num_heads": 2, "feed_forward_proj": "gated-silu"}, True),
    # CodeT5+ 220M / 770M: plain T5 with RoBERTa's BPE vocabulary
    "codet5p": (T5Config, T5ForConditionalGeneration, {"vocab_size": 32100, "feed_forward_proj": "relu"}, False),
    # Chronos: T5 over 4096 value tokens
    "chronos": (T5Config, T5ForConditionalGeneration, {"vocab_size": 4096, "feed_forward_proj": "relu"}, False),
    # Pile-T5: UMT5's layout
    "pile-t5": (UMT5Config, UMT5ForConditionalGeneration, {"vocab_size": 512, "feed_forward_proj": "gated-silu"}, True),
    # MADLAD-400: T5 with 256k tokens
    "madlad-400": (T5Config, T5ForConditionalGeneration,
                   {"vocab_size": 256000, "d_model": 16, "d_ff": 32, "feed_forward_proj": "gated-gelu"}, True),
}


def _source(folder, family, seed=0):
    config_class, model_class, fields, untied = FAMILIES[family]
    torch.manual_seed(seed)
    model_class(config_class(**{**SMALL, **fields})).save_pretrained(folder)
    if untied:
        _edit_like_the_hub(folder, "untie", seed)
    return folder


def _batch(vocab_size):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, vocab_size, (2, 9), generator=generator)
    attention_mask = (torch.arange(9)[None] < torch.tensor([9, 5])[:, None]).long()
    decoder_input_ids = torch.randint(3, vocab_size, (2, 5), generator=generator)
    decoder_input_ids[:, 0] = 0
    return {"input_ids": input_ids * attention_mask, "attention_mask": attention_mask,
            "decoder_input_ids": decoder_input_ids}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_converts_to_transformers_outputs(tmp_path, family):
    source = _source(tmp_path / "src", family)
    _, model_class, fields, _ = FAMILIES[family]
    convert(source, tmp_path / "out")
    reference = model_class.from_pretrained(source).eval()
    converted = FAT5ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    assert converted.config.d_kv == reference.config.d_kv
    assert len(converted.decoder.block) == reference.config.num_decoder_layers
    batch = _batch(fields["vocab_size"])
    with torch.no_grad():
        torch.testing.assert_close(converted(**batch).logits, reference(**batch).logits, rtol=0, atol=1e-4)
        prompt = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "max_new_tokens": 6,
                  "do_sample": False}
        assert torch.equal(converted.generate(**prompt), reference.generate(**prompt))


def _bpe_tokenizer():
    """A byte-level BPE tokenizer as CodeT5+'s (RoBERTa's), trained here on a few lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["def add(a, b):\n    return a + b\n", "print('hello world')\n"] * 4,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("family, tokenizer", [("byt5", ByT5Tokenizer), ("codet5p", _bpe_tokenizer)])
def test_tokenizers_travel(tmp_path, family, tokenizer):
    source = _source(tmp_path / "src", family)
    tokenizer().save_pretrained(source)
    convert(source, tmp_path / "out")
    text = "def add(a, b): return a + b"
    expected = AutoTokenizer.from_pretrained(source)(text).input_ids
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(text).input_ids == expected


@pytest.mark.parametrize("model_type, named", [
    ("longt5", "LongT5ForConditionalGeneration"),
    ("switch_transformers", "SwitchTransformersForConditionalGeneration"),
    ("t5gemma", "T5GemmaForConditionalGeneration"),
])
def test_t5_like_families_without_fat5_computation_are_refused_by_name(tmp_path, model_type, named):
    source = _source(tmp_path / "src", "chronos")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    with pytest.raises(ConversionError, match=f"cannot convert a '{model_type}' model: .*{named}$") as error:
        convert(source, tmp_path / "out")
    assert "\n" not in str(error.value)
    assert leftovers(tmp_path / "out") == []
