"""FAT5 pretraining data: UL2 denoisers, packing, the collator, a T5-style tokenizer and text corpora.

Names are imported lazily, so ``import fat5.trainer`` stays cheap and pulls in `datasets` or `tokenizers`
only when a function that needs them is used.
"""

from importlib import import_module
from typing import TYPE_CHECKING

_EXPORTS = {
    "ul2": [
        "Denoiser",
        "UL2Mixture",
        "UL2Objective",
        "UL2Plan",
        "CorruptedBatch",
        "random_spans_noise_mask",
        "load_ul2_config",
        "num_noise_tokens",
        "num_noise_spans",
        "DEFAULT_CONFIG_PATH",
    ],
    "packing": [
        "PlannedExample",
        "PackedStreamDataset",
        "PlannedDataset",
        "UL2PackedBatchSampler",
        "pack_rows",
        "batch_rows",
        "plan_packed_batches",
        "packed_stream",
        "PackedStreamDataset",
        "padding_stats",
        "ShapeBuckets",
        "bucket_batches",
        "choose_target_widths",
        "shape_buckets_for",
    ],
    "collator": ["UL2DataCollator"],
    "tokenizer": [
        "train_tokenizer",
        "load_tokenizer",
        "load_ul2_config",
        "sentinel_token_ids",
        "prefix_token_ids",
        "add_ul2_special_tokens",
        "UL2_PREFIXES",
    ],
    "data": [
        "shakespeare_dir",
        "shakespeare_documents",
        "shakespeare_texts",
        "load_shakespeare",
        "load_text_dataset",
        "tokenize_dataset",
    ],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [
    "DEFAULT_CONFIG_PATH",
    "UL2_PREFIXES",
    "CorruptedBatch",
    "Denoiser",
    "PackedStreamDataset",
    "PlannedDataset",
    "PlannedExample",
    "ShapeBuckets",
    "UL2DataCollator",
    "UL2Mixture",
    "UL2Objective",
    "UL2PackedBatchSampler",
    "UL2Plan",
    "add_ul2_special_tokens",
    "batch_rows",
    "bucket_batches",
    "choose_target_widths",
    "load_shakespeare",
    "load_text_dataset",
    "load_tokenizer",
    "load_ul2_config",
    "num_noise_spans",
    "num_noise_tokens",
    "pack_rows",
    "packed_stream",
    "padding_stats",
    "plan_packed_batches",
    "prefix_token_ids",
    "random_spans_noise_mask",
    "sentinel_token_ids",
    "shakespeare_dir",
    "shakespeare_documents",
    "shakespeare_texts",
    "shape_buckets_for",
    "tokenize_dataset",
    "train_tokenizer",
]

if TYPE_CHECKING:
    from .collator import UL2DataCollator
    from .data import (
        load_shakespeare,
        load_text_dataset,
        shakespeare_dir,
        shakespeare_documents,
        shakespeare_texts,
        tokenize_dataset,
    )
    from .packing import (
        PackedStreamDataset,
        PlannedDataset,
        PlannedExample,
        ShapeBuckets,
        UL2PackedBatchSampler,
        batch_rows,
        bucket_batches,
        choose_target_widths,
        pack_rows,
        packed_stream,
        padding_stats,
        plan_packed_batches,
        shape_buckets_for,
    )
    from .tokenizer import (
        UL2_PREFIXES,
        add_ul2_special_tokens,
        load_tokenizer,
        prefix_token_ids,
        sentinel_token_ids,
        train_tokenizer,
    )
    from .ul2 import (
        DEFAULT_CONFIG_PATH,
        CorruptedBatch,
        Denoiser,
        UL2Mixture,
        UL2Objective,
        UL2Plan,
        load_ul2_config,
        num_noise_spans,
        num_noise_tokens,
        random_spans_noise_mask,
    )


def __getattr__(name):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
