"""Tiny FAT5 models for tests, examples and CPU checks of the jobs: built in seconds, without a download."""

from pathlib import Path

# The one tiny shape of the package: the tests' models, `make_tiny_model` and every benchmark's `--tiny` CPU check.
# T5 v1.1's layout (gated-GELU, untied output layer) at a size a CPU trains in seconds; the position buckets are cut
# to fit inputs of a few dozen tokens. The vocabulary is left out: it is a tokenizer's length where there is one
# (`fat5 pretrain`'s job config sets it so), else TINY_VOCAB_SIZE.
TINY_VOCAB_SIZE = 256
TINY_MODEL_FIELDS = {
    "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4,
    "relative_attention_num_buckets": 8, "relative_attention_max_distance": 32, "dropout_rate": 0.0,
    "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
}


def tiny_config(**overrides):
    """A FAT5Config of the tiny shape: ``TINY_MODEL_FIELDS`` and TINY_VOCAB_SIZE ids, ``overrides`` (any FAT5Config
    field) on top."""
    from . import FAT5Config

    return FAT5Config(**{"vocab_size": TINY_VOCAB_SIZE, **TINY_MODEL_FIELDS, **overrides})


def make_tiny_model(output_dir, texts, vocab_size: int = TINY_VOCAB_SIZE, seed: int = 0, **config_fields) -> Path:
    """Write a tiny randomly initialised FAT5ForConditionalGeneration and a BPE tokenizer trained on ``texts``
    (T5's special tokens: pad 0, eos 1, unk 2) to ``output_dir``: a model to run the finetuning pipeline on
    in seconds, on a CPU, without a download. ``config_fields`` override ``TINY_MODEL_FIELDS``.
    """
    import torch

    from . import FAT5ForConditionalGeneration

    tokenizer = _tiny_tokenizer(texts, vocab_size)
    torch.manual_seed(seed)
    model = FAT5ForConditionalGeneration(tiny_config(**{"vocab_size": len(tokenizer), **config_fields}))
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def _tiny_tokenizer(texts, vocab_size: int):
    """A byte-pair tokenizer trained on ``texts`` that ends every sequence, input or target, with ``</s>`` as T5's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.normalizer = normalizers.NFKC()
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    bpe.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"])
    )
    bpe.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", bpe.token_to_id("</s>"))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
