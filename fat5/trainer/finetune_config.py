"""The `fat5 finetune` configuration: one dataclass per section, whose fields carry each key's default, meaning and
check, so that the keys, the reference `fat5 finetune --help` prints (`config_reference`) and the errors for bad
values come from one place.

A configuration is a YAML file (or a dict) with the keys of `FinetuneConfig`; its ``data`` section holds those of
`DataSection`, its ``lora`` section those of `LoraSection`. Relative paths are taken from the current directory.
"""

from __future__ import annotations

import copy
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import yaml

from ..dtypes import canonical_dtype
from ..errors import FAT5Error

TASKS = ("seq2seq", "sequence_classification", "token_classification")
DEFAULT_COLUMNS = {
    "seq2seq": ("text", "summary"),
    "sequence_classification": ("text", "label"),
    "token_classification": ("tokens", "ner_tags"),
}

# ----------------------------------------------------------------------------------------------- checks
# Each takes the value and the key's name as messages say it, and returns the value to keep or raises FAT5Error.


def _number(*, integer: bool, minimum: float, maximum: float | None = None, exclusive=False, optional=False):
    def check(value, name):
        if value is None and optional:
            return value
        kind_ok = isinstance(value, int) if integer else isinstance(value, (int, float))
        below = kind_ok and (value <= minimum if exclusive else value < minimum)
        if not kind_ok or isinstance(value, bool) or below or (maximum is not None and value >= maximum):
            bound = f"> {minimum}" if exclusive else f">= {minimum}"
            bound += f" and < {maximum}" if maximum is not None else ""
            raise FAT5Error(f"{name} must be {'an integer' if integer else 'a number'} {bound}, got {value!r}")
        return value

    return check


def _one_of(choices: tuple, said: str | None = None):
    def check(value, name):
        if value not in choices:
            raise FAT5Error(f"{name} must be {said or f'one of {choices}'}, got {value!r}")
        return value

    return check


def _required(message: str):
    def check(value, name):
        if not value or not isinstance(value, (str, os.PathLike)):
            raise FAT5Error(f"finetune config: {message}")
        return str(value)

    return check


def _mapping_of(what: str):
    def check(value, name):
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise FAT5Error(f"{name} must be a mapping of {what}")
        return dict(value)

    return check


def _boolean(value, name):
    if not isinstance(value, bool):
        raise FAT5Error(f"{name} must be true or false, got {value!r}")
    return value


def _string(value, name):
    if not isinstance(value, str):
        raise FAT5Error(f"{name} must be a string, got {value!r}")
    return value


def _module_names(value, name):
    if value is not None and (
        not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value)
    ):
        raise FAT5Error(f"{name} must be a non-empty list of module names, e.g. [q, v], got {value!r}")
    return value


def _dtype(value, name):
    return canonical_dtype(value, what=name, allow_auto=True)


def _optional_path(value, name):
    return str(value) if value else None


def _training(value, name):
    value = _mapping_of("FAT5TrainingArguments fields")(value, name)
    if "output_dir" in value:
        raise FAT5Error("finetune config: set output_dir at the top level, not in training")
    return value


def _about(help: str, check=None) -> dict:
    """A key's field metadata: what it means (`config_reference` prints it) and its check (None: any value)."""
    return {"help": help, "check": check}


_POSITIVE = _number(integer=True, minimum=1)
_POSITIVE_OR_NULL = _number(integer=True, minimum=1, optional=True)


# ----------------------------------------------------------------------------------------------- sections


@dataclass
class DataSection:
    """The ``data`` section: where the examples are, which columns hold them and how they are cut."""

    dataset_name: str | None = field(
        default=None, metadata=_about("a Hub dataset (+ dataset_config_name), instead of train_file")
    )
    dataset_config_name: str | None = field(default=None, metadata=_about("the Hub dataset's configuration"))
    train_file: object = field(
        default=None,
        metadata=_about(
            "json / jsonl / csv / tsv / parquet, one file or a list, a save_to_disk "
            "folder, or (from Python) a datasets.Dataset"
        ),
    )
    validation_file: object = field(default=None, metadata=_about("the same kinds as train_file"))
    train_split: str = field(default="train", metadata=_about("with dataset_name: the split to train on"))
    validation_split: str = field(default="validation", metadata=_about("with dataset_name: the split to evaluate on"))
    validation_fraction: float | None = field(
        default=None,
        metadata=_about(
            "hold out this share of train (seed 0) when there is no validation data",
            _number(integer=False, minimum=0.0, maximum=1.0, exclusive=True, optional=True),
        ),
    )
    text_column: str | None = field(
        default=None,
        metadata=_about(
            "seq2seq / sequence_classification: a string; token_classification: words (default: text, text, tokens)"
        ),
    )
    target_column: str | None = field(
        default=None,
        metadata=_about(
            "the summary, the class (string or integer), or the words' tags (default: summary, label, ner_tags)"
        ),
    )
    source_prefix: str = field(default="", metadata=_about('e.g. "summarize: " for FLAN-T5', _string))
    max_source_length: int = field(default=512, metadata=_about("tokens kept of each input", _POSITIVE))
    max_target_length: int = field(default=128, metadata=_about("tokens kept of each target", _POSITIVE))
    max_train_samples: int | None = field(
        default=None, metadata=_about("train on the first N rows only", _POSITIVE_OR_NULL)
    )
    max_eval_samples: int | None = field(
        default=None, metadata=_about("evaluate on the first N rows only", _POSITIVE_OR_NULL)
    )
    pad_to_multiple_of: int | None = field(
        default=None, metadata=_about("8 keeps tensor shapes friendly to tensor cores", _POSITIVE_OR_NULL)
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata=_about("processes that tokenize", _POSITIVE_OR_NULL)
    )

    def complete(self, task: str) -> DataSection:
        """Fill the task's default columns and check that the data comes from exactly one kind of source."""
        default_text, default_target = DEFAULT_COLUMNS[task]
        self.text_column = self.text_column or default_text
        self.target_column = self.target_column or default_target
        if self.dataset_name is None and self.train_file is None:
            raise FAT5Error("finetune config: data needs train_file (json/jsonl/csv/tsv/parquet) or dataset_name")
        if self.dataset_name is not None and (self.train_file is not None or self.validation_file is not None):
            raise FAT5Error("finetune config: data takes either dataset_name or train_file/validation_file, not both")
        return self


@dataclass
class LoraSection:
    """The ``lora`` section (absent or null: full finetuning): PEFT's LoRA adapters and how they are saved."""

    r: int = field(default=16, metadata=_about("the adapters' rank", _POSITIVE))
    alpha: float = field(
        default=32, metadata=_about("scaling numerator: alpha / r", _number(integer=False, minimum=0.0, exclusive=True))
    )
    dropout: float = field(
        default=0.05,
        metadata=_about("dropout on the adapters' input", _number(integer=False, minimum=0.0, maximum=1.0)),
    )
    target_modules: list | None = field(
        default=None,
        metadata=_about("default: q, k, v, o and the feed-forward's wi_0, wi_1 (or wi), wo", _module_names),
    )
    modules_to_save: list | None = field(
        default=None,
        metadata=_about(
            "trained in full beside the adapters; default: the classification head of an encoder task", _module_names
        ),
    )
    bias: str = field(
        default="none",
        metadata=_about(
            "or all, lora_only (PEFT's)", _one_of(("none", "all", "lora_only"), "'none', 'all' or 'lora_only'")
        ),
    )
    use_rslora: bool = field(default=False, metadata=_about("rank-stabilised scaling alpha / sqrt(r)", _boolean))
    merge: bool = field(
        default=True, metadata=_about("also write the adapter merged into a plain FAT5 model", _boolean)
    )


@dataclass
class FinetuneConfig:
    """A whole `fat5 finetune` job; `load_finetune_config` reads one and returns it as a dict."""

    task: str = field(
        default="seq2seq", metadata=_about("seq2seq, sequence_classification or token_classification", _one_of(TASKS))
    )
    model: str | None = field(
        default=None,
        metadata=_about(
            "required: a FAT5 folder (`fat5 convert` writes one) or a FAT5 Hub repo id",
            _required("`model` is missing: give a FAT5 model folder (`fat5 convert` writes one)"),
        ),
    )
    tokenizer: str | None = field(default=None, metadata=_about("default: the model's folder", _optional_path))
    model_overrides: dict = field(
        default_factory=dict,
        metadata=_about(
            "FAT5Config fields changed for finetuning, e.g. {dropout_rate: 0.1}; "
            "use_chunked_lm_loss: true trains mT5-sized vocabularies without their logits",
            _mapping_of("FAT5Config fields"),
        ),
    )
    dtype: str = field(
        default="float32",
        metadata=_about(
            "weights while training: fp32, bf16, fp16 (or float32, bfloat16, float16) or "
            "auto; training.bf16: true adds mixed precision on fp32 weights",
            _dtype,
        ),
    )
    output_dir: str | None = field(
        default=None,
        metadata=_about(
            "required (or --output-dir): where the model, checkpoints and records go",
            _required("`output_dir` is missing (or pass output_dir / --output-dir)"),
        ),
    )
    data: DataSection = field(default_factory=DataSection, metadata=_about("where the examples are"))
    lora: LoraSection | None = field(default=None, metadata=_about("absent or null: full finetuning"))
    training: dict = field(
        default_factory=dict,
        metadata=_about(
            "any FAT5TrainingArguments field (Seq2SeqTrainingArguments plus torch_compile_regional) but "
            "output_dir; the job's defaults: train_sampling_strategy: group_by_length, report_to: none, and for "
            "seq2seq with evaluation data predict_with_generate: true, generation_max_length: "
            "data.max_target_length",
            _training,
        ),
    )
    bundle: bool = field(
        default=False,
        metadata=_about("also write a self-contained remote-code folder (fat5.hub_upload.bundle)", _boolean),
    )

    @classmethod
    def from_mapping(cls, raw: dict) -> FinetuneConfig:
        """Check every key of ``raw`` (the YAML's mapping) and fill in the defaults; mistakes raise FAT5Error."""
        config = _checked(cls, raw, "finetune config", "finetune config: ")
        config.data = _checked(DataSection, _section(raw, "data"), "finetune config: data", "data.")
        config.data.complete(config.task)
        if raw.get("lora") is not None:
            config.lora = _checked(LoraSection, _section(raw, "lora"), "finetune config: lora", "lora.")
            if config.bundle and not config.lora.merge:
                raise FAT5Error("bundle: true needs a full model: with LoRA, keep lora.merge: true")
        return config

    def to_dict(self) -> dict:
        """The configuration as nested plain dicts, in the keys' order (as finetune_config.yaml records it)."""
        as_dict = _shallow_dict(self)
        as_dict["data"] = _shallow_dict(self.data)
        as_dict["lora"] = _shallow_dict(self.lora) if self.lora is not None else None
        return as_dict


SECTIONS = {"data": DataSection, "lora": LoraSection}


def _shallow_dict(instance) -> dict:
    # not dataclasses.asdict: it deep-copies every value, a datasets.Dataset given as train_file among them
    return {key.name: getattr(instance, key.name) for key in fields(instance)}


def _section(raw: dict, name: str) -> dict:
    value = raw.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise FAT5Error(f"finetune config: {name} must be a mapping, got {type(value).__name__}")
    return value


def _checked(cls, mapping: dict, where: str, prefix: str):
    """``cls`` built from ``mapping``: unknown keys refused, each value (given or default) through its key's check,
    whose messages name it ``prefix`` + key; the sections, built apart, are left at their defaults."""
    known = [key.name for key in fields(cls)]
    unknown = sorted(set(mapping) - set(known))
    if unknown:
        raise FAT5Error(f"{where}: unknown key(s) {unknown}; known keys: {sorted(known)}")
    values = {}
    for key in fields(cls):
        if key.name in SECTIONS:
            continue
        value = mapping[key.name] if key.name in mapping else _default(key)
        check = key.metadata["check"]
        values[key.name] = check(value, prefix + key.name) if check else value
    return cls(**values)


def _default(key):
    return key.default_factory() if key.default is MISSING else key.default


# ----------------------------------------------------------------------------------------------- reading


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FAT5Error(f"finetune config {path}: no such file") from None
    except OSError as error:
        raise FAT5Error(f"finetune config {path}: cannot read it ({error})") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise FAT5Error(f"finetune config {path} is not valid YAML: {error}") from None
    if not isinstance(config, dict):
        raise FAT5Error(f"finetune config {path} must be a YAML mapping (task:, model:, data:, ...)")
    return config


def apply_overrides(config: dict, overrides) -> dict:
    """Set ``KEY=VALUE`` overrides in a copy of ``config``: dotted keys reach into sections, values are YAML.

    ``["training.max_steps=10", "lora=null"]`` sets ``config["training"]["max_steps"] = 10`` and removes LoRA.
    """
    config = copy.deepcopy(config)
    for override in overrides:
        key, equals, value = override.partition("=")
        if not equals or not key.strip():
            raise FAT5Error(f"override {override!r} must read KEY=VALUE, e.g. training.max_steps=100")
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as error:
            raise FAT5Error(f"override {override!r}: the value is not valid YAML ({error})") from None
        *sections, name = key.strip().split(".")
        target = config
        for section in sections:
            if target.get(section) is None:
                target[section] = {}
            if not isinstance(target[section], dict):
                raise FAT5Error(f"override {override!r}: {section} is not a section")
            target = target[section]
        target[name] = value
    return config


def load_finetune_config(config_path_or_dict, output_dir=None, overrides=()) -> dict:
    """Read, check and complete a finetuning configuration (a YAML path or a dict); mistakes raise `FAT5Error`.

    Returns a new dict with every section present and every default filled in (`FinetuneConfig.to_dict`);
    ``output_dir`` and ``overrides`` (``KEY=VALUE`` strings, see `apply_overrides`) take precedence over the file.
    """
    if isinstance(config_path_or_dict, dict):
        raw = copy.deepcopy(config_path_or_dict)
    elif isinstance(config_path_or_dict, (str, os.PathLike)):
        raw = _read_yaml(Path(config_path_or_dict).expanduser())
    else:
        raise FAT5Error(f"finetune config must be a YAML path or a dict, got {type(config_path_or_dict).__name__}")
    raw = apply_overrides(raw, overrides)
    if output_dir is not None:
        raw["output_dir"] = str(output_dir)
    return FinetuneConfig.from_mapping(raw).to_dict()


def config_reference() -> str:
    """Every key of a finetuning configuration with its default and meaning, as commented YAML."""
    return "\n".join(_reference_lines(FinetuneConfig, indent=""))


def _reference_lines(cls, indent: str) -> list[str]:
    lines = []
    for key in fields(cls):
        if key.name in SECTIONS:
            lines.append(f"{indent}{key.name}:  # {key.metadata['help']}")
            lines += _reference_lines(SECTIONS[key.name], indent + "  ")
            continue
        value = yaml.safe_dump(_default(key), default_flow_style=True).removesuffix("...\n").strip()
        lines.append(f"{indent}{key.name}: {value}  # {key.metadata['help']}")
    return lines
