"""FAT5's training wing: the `fat5 pretrain` and `fat5 finetune` jobs, FAT5Trainer, and the UL2 pretraining data
(denoisers, packing, the collator, a T5-style tokenizer and text corpora).

The jobs are the functions ``pretrain`` and ``finetune`` (in the modules ``pretraining`` and ``finetuning``, named
apart so that importing a module never replaces the package's function of that name), with one signature,
``(config, output_dir, *, overrides, resume, overwrite)``; ``prepare_pretraining`` and ``prepare_finetuning`` build a
job (`PretrainingJob`, `FinetuningJob`) whose ``run()`` trains; their configs are ``PretrainConfig`` and
``FinetuneConfig``, read and checked the same way (``config_schema``); the steps both take are in ``jobs``.

Names are imported lazily, from the one table below, so ``import fat5.trainer`` stays cheap and pulls in the Trainer,
`datasets` or `tokenizers` only when a name that needs them is used.
"""

from importlib import import_module

_EXPORTS = {
    "trainer": ("FAT5Trainer", "FAT5TrainingArguments"),
    "pretraining": ("pretrain", "prepare_pretraining", "PretrainingJob"),
    "pretrain_config": ("PretrainConfig", "load_pretrain_config"),
    "finetuning": ("finetune", "prepare_finetuning", "FinetuningJob"),
    "finetune_config": ("FinetuneConfig", "load_finetune_config"),
    "collator": ("UL2DataCollator",),
    "tokenizer": ("train_tokenizer", "load_tokenizer", "sentinel_token_ids", "prefix_token_ids",
                  "add_ul2_special_tokens", "UL2_PREFIXES"),
    "ul2": ("Denoiser", "UL2Mixture", "UL2Objective", "UL2Plan", "CorruptedBatch", "load_ul2_config",
            "random_spans_noise_mask", "num_noise_tokens", "num_noise_spans", "DEFAULT_CONFIG_PATH"),
    "packing": ("UL2PackedBatchSampler", "PlannedDataset", "PlannedExample", "PackedStreamDataset", "packed_stream",
                "pack_rows", "batch_rows", "plan_packed_batches", "padding_stats", "ShapeBuckets", "bucket_batches",
                "choose_target_widths", "shape_buckets_for", "group_by_shape"),
    "data": ("load_shakespeare", "shakespeare_dir", "shakespeare_documents", "shakespeare_texts", "load_text_dataset",
             "tokenize_dataset"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = list(_MODULE_OF)


def __getattr__(name):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
