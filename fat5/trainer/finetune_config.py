"""The `fat5 finetune` configuration: one dataclass per section, whose fields carry each key's default, meaning and
check (`fat5 finetune --help` lists them, `FinetuneConfig.reference`), on the same machinery as `fat5 pretrain`'s
(`config_schema`).

A configuration is a YAML file (or a mapping) with the keys of `FinetuneConfig`; its ``data`` section holds those of
`FinetuneDataSection`, its ``lora`` section those of `LoraSection`. Relative paths are taken from the current
directory. An unknown key anywhere is an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..dtypes import canonical_dtype
from ..errors import FAT5Error
from .config_schema import (
    POSITIVE,
    POSITIVE_OR_NULL,
    JobConfig,
    about,
    boolean,
    checked,
    mapping_of,
    number,
    one_of,
    optional_path,
    string,
    training_section,
)

TASKS = ("seq2seq", "sequence_classification", "token_classification")
DEFAULT_COLUMNS = {
    "seq2seq": ("text", "summary"),
    "sequence_classification": ("text", "label"),
    "token_classification": ("tokens", "ner_tags"),
}

# ----------------------------------------------------------------------------------------------- checks
# Each takes the value and the key's name as messages say it, and returns the value to keep or raises FAT5Error
# (the shared ones are in config_schema).


def _required(message: str):
    def check(value, name):
        if not value or not isinstance(value, (str, os.PathLike)):
            raise FAT5Error(message)
        return str(value)

    return check


def _module_names(value, name):
    if value is not None and (
        not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value)
    ):
        raise FAT5Error(f"{name} must be a non-empty list of module names, e.g. [q, v], got {value!r}")
    return value


def _dtype(value, name):
    return canonical_dtype(value, what=name, allow_auto=True)


# ----------------------------------------------------------------------------------------------- sections


@dataclass
class FinetuneDataSection:
    """The ``data`` section of `fat5 finetune`: where the examples are, which columns hold them and how they are
    cut."""

    dataset_name: str | None = field(
        default=None, metadata=about("a Hub dataset (+ dataset_config_name), instead of train_file")
    )
    dataset_config_name: str | None = field(default=None, metadata=about("the Hub dataset's configuration"))
    train_file: object = field(
        default=None,
        metadata=about(
            "json / jsonl / csv / tsv / parquet, one file or a list, a save_to_disk "
            "folder, or (from Python) a datasets.Dataset"
        ),
    )
    validation_file: object = field(default=None, metadata=about("the same kinds as train_file"))
    train_split: str = field(default="train", metadata=about("with dataset_name: the split to train on"))
    validation_split: str = field(default="validation", metadata=about("with dataset_name: the split to evaluate on"))
    validation_fraction: float | None = field(
        default=None,
        metadata=about(
            "hold out this share of train (seed 0) when there is no validation data",
            number(integer=False, minimum=0.0, maximum=1.0, exclusive=True, optional=True),
        ),
    )
    text_column: str | None = field(
        default=None,
        metadata=about(
            "seq2seq / sequence_classification: a string; token_classification: words (default: text, text, tokens)"
        ),
    )
    target_column: str | None = field(
        default=None,
        metadata=about(
            "the summary, the class (string or integer), or the words' tags (default: summary, label, ner_tags)"
        ),
    )
    source_prefix: str = field(default="", metadata=about('e.g. "summarize: " for FLAN-T5', string))
    max_source_length: int = field(default=512, metadata=about("tokens kept of each input", POSITIVE))
    max_target_length: int = field(default=128, metadata=about("tokens kept of each target", POSITIVE))
    max_train_samples: int | None = field(
        default=None, metadata=about("train on the first N rows only", POSITIVE_OR_NULL)
    )
    max_eval_samples: int | None = field(
        default=None, metadata=about("evaluate on the first N rows only", POSITIVE_OR_NULL)
    )
    pad_to_multiple_of: int | None = field(
        default=None, metadata=about("8 keeps tensor shapes friendly to tensor cores", POSITIVE_OR_NULL)
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata=about("processes that tokenize", POSITIVE_OR_NULL)
    )

    def complete(self, task: str) -> FinetuneDataSection:
        """Fill the task's default columns and check that the data comes from exactly one kind of source."""
        default_text, default_target = DEFAULT_COLUMNS[task]
        self.text_column = self.text_column or default_text
        self.target_column = self.target_column or default_target
        if self.dataset_name is None and self.train_file is None:
            raise FAT5Error("data needs train_file (json/jsonl/csv/tsv/parquet) or dataset_name")
        if self.dataset_name is not None and (self.train_file is not None or self.validation_file is not None):
            raise FAT5Error("data takes either dataset_name or train_file/validation_file, not both")
        return self


@dataclass
class LoraSection:
    """The ``lora`` section (absent or null: full finetuning): PEFT's LoRA adapters and how they are saved."""

    r: int = field(default=16, metadata=about("the adapters' rank", POSITIVE))
    alpha: float = field(
        default=32, metadata=about("scaling numerator: alpha / r", number(integer=False, minimum=0.0, exclusive=True))
    )
    dropout: float = field(
        default=0.05,
        metadata=about("dropout on the adapters' input", number(integer=False, minimum=0.0, maximum=1.0)),
    )
    target_modules: list | None = field(
        default=None,
        metadata=about("default: q, k, v, o and the feed-forward's wi_0, wi_1 (or wi), wo", _module_names),
    )
    modules_to_save: list | None = field(
        default=None,
        metadata=about(
            "trained in full beside the adapters; default: the classification head of an encoder task", _module_names
        ),
    )
    bias: str = field(
        default="none",
        metadata=about(
            "or all, lora_only (PEFT's)", one_of(("none", "all", "lora_only"), "'none', 'all' or 'lora_only'")
        ),
    )
    use_rslora: bool = field(default=False, metadata=about("rank-stabilised scaling alpha / sqrt(r)", boolean))
    merge: bool = field(
        default=True, metadata=about("also write the adapter merged into a plain FAT5 model", boolean)
    )


@dataclass
class FinetuneConfig(JobConfig):
    """A whole `fat5 finetune` job; `FinetuneConfig.load` (`load_finetune_config`) reads and checks one."""

    WHAT = "finetune config"

    task: str = field(
        default="seq2seq", metadata=about("seq2seq, sequence_classification or token_classification", one_of(TASKS))
    )
    model: str | None = field(
        default=None,
        metadata=about(
            "required: a FAT5 folder (`fat5 convert` writes one) or a FAT5 Hub repo id",
            _required("`model` is missing: give a FAT5 model folder (`fat5 convert` writes one)"),
        ),
    )
    tokenizer: str | None = field(default=None, metadata=about("default: the model's folder", optional_path))
    model_overrides: dict = field(
        default_factory=dict,
        metadata=about(
            "FAT5Config fields changed for finetuning, e.g. {dropout_rate: 0.1}; "
            "use_chunked_lm_loss: true trains mT5-sized vocabularies without their logits",
            mapping_of("FAT5Config fields"),
        ),
    )
    dtype: str = field(
        default="float32",
        metadata=about(
            "weights while training: fp32, bf16, fp16 (or float32, bfloat16, float16) or "
            "auto; training.bf16: true adds mixed precision on fp32 weights",
            _dtype,
        ),
    )
    output_dir: str | None = field(
        default=None,
        metadata=about(
            "where the model, checkpoints and records go; --output-dir (output_dir= in Python) replaces it, and one "
            "of the two is required",
            optional_path,
        ),
    )
    data: FinetuneDataSection = field(default_factory=FinetuneDataSection, metadata=about("where the examples are"))
    lora: LoraSection | None = field(default=None, metadata=about("absent or null: full finetuning",
                                                                 section=LoraSection))
    training: dict = field(
        default_factory=dict,
        metadata=about(
            "any FAT5TrainingArguments field (Seq2SeqTrainingArguments plus torch_compile_regional) but "
            "output_dir; the job's defaults: train_sampling_strategy: group_by_length, report_to: none, and for "
            "seq2seq with evaluation data predict_with_generate: true, generation_max_length: "
            "data.max_target_length",
            training_section({"output_dir": "the output folder is output_dir, at the top level, or --output-dir"}),
        ),
    )
    bundle: bool = field(
        default=False,
        metadata=about("also write a self-contained remote-code folder (fat5.hub_upload.bundle)", boolean),
    )

    @classmethod
    def from_mapping(cls, raw: dict) -> FinetuneConfig:
        """Check every key of ``raw`` (the YAML's mapping) and fill in the defaults; mistakes raise FAT5Error."""
        config = checked(cls, raw, cls.WHAT)
        config.data.complete(config.task)
        if config.bundle and config.lora is not None and not config.lora.merge:
            raise FAT5Error("bundle: true needs a full model: with LoRA, keep lora.merge: true")
        if config.task != "seq2seq" and config.training.get("predict_with_generate"):
            raise FAT5Error(f"training.predict_with_generate needs task seq2seq, not {config.task}")
        return config


# the job's name for `FinetuneConfig.load`, as fat5.trainer exports it
load_finetune_config = FinetuneConfig.load
