"""`fat5 finetune CONFIG.yaml`: finetune a FAT5 model on a `datasets` dataset, fully or with LoRA, with FAT5Trainer.

Tasks: ``seq2seq`` (summarisation, instructions: ``text_column`` -> ``target_column``, evaluated with ROUGE on
generated text), ``sequence_classification`` and ``token_classification`` (the encoder heads). The configuration
is a YAML file (or a dict) with these sections; relative paths are taken from the current directory::

    task: seq2seq                      # or sequence_classification, token_classification
    model: out/fat5-flan-t5-small      # a FAT5 folder (`fat5 convert` writes one) or a FAT5 Hub repo id
    tokenizer: null                    # default: the model's folder
    model_overrides: {dropout_rate: 0.1}   # FAT5Config fields changed for finetuning (use_chunked_lm_loss: true
                                       # trains mT5-sized vocabularies without their logits)
    dtype: fp32                        # weights while training: fp32, bf16, fp16 (or float32, bfloat16, float16)
                                       # or auto; training.bf16: true adds mixed precision on fp32 weights
    output_dir: runs/summarize
    data:
      train_file: train.jsonl          # json / jsonl / csv / tsv / parquet, one file or a list, a save_to_disk
                                       # folder, or (from Python) a datasets.Dataset ...
      validation_file: valid.jsonl     # ... or dataset_name (+ dataset_config_name) of a Hub dataset
      train_split: train               # with dataset_name: the splits to train and evaluate on
      validation_split: validation
      validation_fraction: null        # hold out this share of train (seed 0) when there is no validation data
      text_column: text                # seq2seq / sequence_classification: a string; token_classification: words
      target_column: summary           # the summary, the class (string or integer), or the words' tags
      source_prefix: ""                # e.g. "summarize: " for FLAN-T5
      max_source_length: 512
      max_target_length: 128
      max_train_samples: null
      max_eval_samples: null
      pad_to_multiple_of: null         # 8 keeps tensor shapes friendly to tensor cores
      preprocessing_num_workers: null  # processes that tokenize
    lora:                              # absent or null: full finetuning
      r: 16
      alpha: 32
      dropout: 0.05
      target_modules: null             # default: q, k, v, o and the feed-forward's wi_0, wi_1 (or wi), wo
      modules_to_save: null            # default: the classification head of an encoder task
      bias: none                       # or all, lora_only (PEFT's)
      use_rslora: false                # rank-stabilised scaling alpha / sqrt(r)
      merge: true                      # also write the adapter merged into a plain FAT5 model
    training:                          # any FAT5TrainingArguments field (Seq2SeqTrainingArguments plus
      learning_rate: 3.0e-4            #   torch_compile_regional) but output_dir
      num_train_epochs: 3
    bundle: false                      # also write a self-contained remote-code folder (fat5.hub_upload.bundle)

Defaults the job sets in ``training`` unless given: ``train_sampling_strategy: group_by_length`` (batches of
similar lengths, less padding), ``report_to: none``, and for seq2seq with evaluation data
``predict_with_generate: true`` with ``generation_max_length: max_target_length``.

What it writes in ``output_dir``, as transformers' Trainer does: the final model and its tokenizer in the folder
itself, so that ``from_pretrained(output_dir)`` loads it (after ``import fat5``): the finetuned model, or with LoRA
the adapter merged back into a plain FAT5 model, the PEFT adapter itself then in ``adapter/`` (which
``peft.AutoPeftModelForSeq2SeqLM.from_pretrained`` loads; with ``merge: false`` the adapter is the folder's model);
the checkpoints in ``checkpoint-N``; ``bundle/`` when asked; ``metrics.json``; and the resolved configuration as
``finetune_config.yaml``. A folder that already holds a model or checkpoints is refused: ``--resume`` continues from
its newest complete checkpoint, ``--overwrite`` replaces its content (never a folder that holds the input).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..dtypes import canonical_dtype
from ..errors import FAT5Error
from ..output_folder import move_into, prepare_run_folder

TASKS = ("seq2seq", "sequence_classification", "token_classification")
DEFAULT_COLUMNS = {
    "seq2seq": ("text", "summary"),
    "sequence_classification": ("text", "label"),
    "token_classification": ("tokens", "ner_tags"),
}
# PEFT's task type, and the head that trains in full beside the adapters, per task
PEFT_TASK_TYPES = {"seq2seq": "SEQ_2_SEQ_LM", "sequence_classification": "SEQ_CLS", "token_classification": "TOKEN_CLS"}
HEAD_MODULES = {"seq2seq": None, "sequence_classification": ["classification_head"], "token_classification": ["classifier"]}
ATTENTION_PROJECTIONS = ["q", "k", "v", "o"]

DATA_DEFAULTS = {
    "dataset_name": None,
    "dataset_config_name": None,
    "train_file": None,
    "validation_file": None,
    "train_split": "train",
    "validation_split": "validation",
    "validation_fraction": None,
    "text_column": None,
    "target_column": None,
    "source_prefix": "",
    "max_source_length": 512,
    "max_target_length": 128,
    "max_train_samples": None,
    "max_eval_samples": None,
    "pad_to_multiple_of": None,
    "preprocessing_num_workers": None,
}
LORA_DEFAULTS = {
    "r": 16,
    "alpha": 32,
    "dropout": 0.05,
    "target_modules": None,
    "modules_to_save": None,
    "bias": "none",
    "use_rslora": False,
    "merge": True,
}
TOP_LEVEL_KEYS = (
    "task", "model", "tokenizer", "model_overrides", "dtype", "output_dir", "data", "lora", "training", "bundle"
)
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


# ----------------------------------------------------------------------------------------------- configuration


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


def _check_keys(section: dict, allowed, where: str) -> None:
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        raise FAT5Error(f"{where}: unknown key(s) {unknown}; known keys: {sorted(allowed)}")


def _section(config: dict, name: str, defaults: dict) -> dict:
    value = config.get(name)
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise FAT5Error(f"finetune config: {name} must be a mapping, got {type(value).__name__}")
    _check_keys(value, defaults, f"finetune config: {name}")
    return {**defaults, **value}


def _check_number(value, name: str, *, integer: bool, minimum: float, maximum: float | None = None, exclusive=False):
    kind_ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    below = value <= minimum if exclusive else value < minimum
    if not kind_ok or isinstance(value, bool) or below or (maximum is not None and value >= maximum):
        bound = f"> {minimum}" if exclusive else f">= {minimum}"
        bound += f" and < {maximum}" if maximum is not None else ""
        raise FAT5Error(f"{name} must be {'an integer' if integer else 'a number'} {bound}, got {value!r}")


def load_finetune_config(config_path_or_dict, output_dir=None, overrides=()) -> dict:
    """Read, check and complete a finetuning configuration (a YAML path or a dict); mistakes raise `FAT5Error`.

    Returns a new dict with every section present and every default filled in; ``output_dir`` and ``overrides``
    (``KEY=VALUE`` strings, see `apply_overrides`) take precedence over the file.
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
    _check_keys(raw, TOP_LEVEL_KEYS, "finetune config")

    task = raw.get("task", "seq2seq")
    if task not in TASKS:
        raise FAT5Error(f"finetune config: task must be one of {TASKS}, got {task!r}")
    if not raw.get("model") or not isinstance(raw["model"], (str, os.PathLike)):
        raise FAT5Error("finetune config: `model` is missing: give a FAT5 model folder (`fat5 convert` writes one)")
    if not raw.get("output_dir"):
        raise FAT5Error("finetune config: `output_dir` is missing (or pass output_dir / --output-dir)")
    model_overrides = raw.get("model_overrides") or {}
    if not isinstance(model_overrides, dict):
        raise FAT5Error("finetune config: model_overrides must be a mapping of FAT5Config fields")
    dtype = canonical_dtype(raw.get("dtype", "float32"), what="finetune config: dtype", allow_auto=True)
    if not isinstance(raw.get("bundle", False), bool):
        raise FAT5Error(f"finetune config: bundle must be true or false, got {raw['bundle']!r}")

    data = _section(raw, "data", DATA_DEFAULTS)
    default_text, default_target = DEFAULT_COLUMNS[task]
    data["text_column"] = data["text_column"] or default_text
    data["target_column"] = data["target_column"] or default_target
    if data["dataset_name"] is None and data["train_file"] is None:
        raise FAT5Error("finetune config: data needs train_file (json/jsonl/csv/tsv/parquet) or dataset_name")
    if data["dataset_name"] is not None and (data["train_file"] is not None or data["validation_file"] is not None):
        raise FAT5Error("finetune config: data takes either dataset_name or train_file/validation_file, not both")
    if data["validation_fraction"] is not None:
        _check_number(data["validation_fraction"], "data.validation_fraction", integer=False, minimum=0.0, maximum=1.0,
                      exclusive=True)
    for name in ("max_source_length", "max_target_length"):
        _check_number(data[name], f"data.{name}", integer=True, minimum=1)
    for name in ("max_train_samples", "max_eval_samples", "pad_to_multiple_of", "preprocessing_num_workers"):
        if data[name] is not None:
            _check_number(data[name], f"data.{name}", integer=True, minimum=1)
    if not isinstance(data["source_prefix"], str):
        raise FAT5Error(f"data.source_prefix must be a string, got {data['source_prefix']!r}")

    lora = None
    if raw.get("lora") is not None:
        lora = _section(raw, "lora", LORA_DEFAULTS)
        _check_number(lora["r"], "lora.r", integer=True, minimum=1)
        _check_number(lora["alpha"], "lora.alpha", integer=False, minimum=0.0, exclusive=True)
        _check_number(lora["dropout"], "lora.dropout", integer=False, minimum=0.0, maximum=1.0)
        for name in ("target_modules", "modules_to_save"):
            value = lora[name]
            if value is not None and (
                not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value)
            ):
                raise FAT5Error(f"lora.{name} must be a non-empty list of module names, e.g. [q, v], got {value!r}")
        if lora["bias"] not in ("none", "all", "lora_only"):
            raise FAT5Error(f"lora.bias must be 'none', 'all' or 'lora_only', got {lora['bias']!r}")
        if raw.get("bundle") and not lora["merge"]:
            raise FAT5Error("bundle: true needs a full model: with LoRA, keep lora.merge: true")

    training = raw.get("training") or {}
    if not isinstance(training, dict):
        raise FAT5Error("finetune config: training must be a mapping of FAT5TrainingArguments fields")
    if "output_dir" in training:
        raise FAT5Error("finetune config: set output_dir at the top level, not in training")
    return {
        "task": task,
        "model": str(raw["model"]),
        "tokenizer": str(raw["tokenizer"]) if raw.get("tokenizer") else None,
        "model_overrides": dict(model_overrides),
        "dtype": dtype,
        "output_dir": str(raw["output_dir"]),
        "data": data,
        "lora": lora,
        "training": dict(training),
        "bundle": bool(raw.get("bundle", False)),
    }


# ----------------------------------------------------------------------------------------------- model, tokenizer


def resolve_model_path(model: str) -> str:
    """A local FAT5 folder as an absolute path (a saved adapter records it to find its base), or a Hub repo id."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise FAT5Error(f"model: {folder} has no config.json; give a FAT5 model folder (`fat5 convert` writes one)")
        try:
            model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError) as error:
            raise FAT5Error(f"model: cannot read {config_file} ({error})") from None
        if model_type != "fat5":
            raise FAT5Error(
                f"model: {folder} holds a {model_type!r} model, not a FAT5 one; convert it first: "
                f"fat5 convert {model} OUT_DIR"
            )
        return str(folder.resolve())
    if folder.exists() or not _HUB_ID.match(model) or model.startswith((".", "/", "~")):
        raise FAT5Error(f"model: {model} is not a model folder (no such directory) nor a Hub repo id")
    _model_config(model)
    return model


def _model_config(model_path: str):
    """The FAT5Config saved at ``model_path`` (a folder or a Hub repo id); anything else is a FAT5Error."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise FAT5Error(f"model: {model_path}: no such folder here, and no FAT5 model could be loaded from the Hub "
                        f"under that name ({reason})") from None
    if config.model_type != "fat5":
        raise FAT5Error(f"model: {model_path} holds a {config.model_type!r} model, not a FAT5 one; convert it first: "
                        f"fat5 convert {model_path} OUT_DIR")
    return config


def _model_class(task: str):
    from .. import FAT5ForConditionalGeneration, FAT5ForSequenceClassification, FAT5ForTokenClassification

    return {
        "seq2seq": FAT5ForConditionalGeneration,
        "sequence_classification": FAT5ForSequenceClassification,
        "token_classification": FAT5ForTokenClassification,
    }[task]


def load_model(task: str, model_path: str, model_kwargs: dict, dtype: str = "float32"):
    """The task's FAT5 class from ``model_path`` (config fields in ``model_kwargs`` override the saved ones), its
    weights in ``dtype`` (``"auto"``: as saved)."""
    import torch

    config = _model_config(model_path)
    head_fields = {"num_labels", "id2label", "label2id", "problem_type"}
    unknown = sorted(name for name in model_kwargs if name not in head_fields and not hasattr(config, name))
    if unknown:
        raise FAT5Error(f"model_overrides: {unknown} are not FAT5Config fields")
    for name, value in model_kwargs.items():
        setattr(config, name, value)
    try:
        config._validate()
    except ValueError as error:
        raise FAT5Error(f"model_overrides: {error}") from None
    try:
        model = _model_class(task).from_pretrained(
            model_path,
            config=config,
            dtype=dtype if dtype == "auto" else getattr(torch, dtype),
            # a classification checkpoint with another number of classes gets a new head
            ignore_mismatched_sizes=task != "seq2seq",
        )
    except (OSError, ValueError) as error:
        raise FAT5Error(f"model: cannot load the weights of {model_path} ({error})") from None
    return model


def load_tokenizer(path: str, task: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as error:
        raise FAT5Error(f"tokenizer: cannot load a tokenizer from {path} ({error}); set `tokenizer:` in the config")
    if tokenizer.pad_token_id is None:
        raise FAT5Error(f"tokenizer: {path}'s tokenizer has no padding token")
    if task == "token_classification" and not tokenizer.is_fast:
        raise FAT5Error("tokenizer: token_classification needs a fast tokenizer (it maps sub-word pieces to words)")
    return tokenizer


def linear_module_names(model) -> dict[str, str]:
    """Full name -> last name component of every `nn.Linear` of ``model`` (what LoRA can wrap)."""
    from torch import nn

    return {name: name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def default_lora_targets(model) -> list[str]:
    """T5's projections: attention q, k, v, o; feed-forward wi_0, wi_1, wo (gated) or wi, wo (ReLU, T5 v1.0)."""
    feed_forward = ["wi_0", "wi_1", "wo"] if model.config.is_gated_act else ["wi", "wo"]
    return ATTENTION_PROJECTIONS + feed_forward


def check_lora_targets(model, target_modules: list[str]) -> None:
    """Every LoRA target must name linear layers of ``model`` (by last name component or full name)."""
    linear = linear_module_names(model)
    short_names = set(linear.values())
    missing = [
        target for target in target_modules
        if target not in short_names and not any(name == target or name.endswith("." + target) for name in linear)
    ]
    if missing:
        hint = ""
        if {"wi_0", "wi_1"} & set(missing) and "wi" in short_names:
            hint = " (this model's feed-forward is not gated: its input projection is `wi`, not wi_0/wi_1)"
        elif "wi" in missing and "wi_0" in short_names:
            hint = " (this model's feed-forward is gated: its input projections are `wi_0` and `wi_1`)"
        raise FAT5Error(
            f"lora.target_modules: {missing} name no linear layer of this model{hint}; its linear layers are "
            f"{sorted(short_names)}"
        )


def apply_lora(model, task: str, lora: dict):
    """Wrap ``model`` in a PEFT LoRA model; the base weights freeze, the adapters (and a task head) train."""
    from peft import LoraConfig, get_peft_model

    target_modules = lora["target_modules"] or default_lora_targets(model)
    check_lora_targets(model, target_modules)
    modules_to_save = lora["modules_to_save"] if lora["modules_to_save"] is not None else HEAD_MODULES[task]
    peft_config = LoraConfig(
        task_type=PEFT_TASK_TYPES[task],
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=target_modules,
        modules_to_save=modules_to_save,
        bias=lora["bias"],
        use_rslora=lora["use_rslora"],
    )
    try:
        return get_peft_model(model, peft_config)
    except ValueError as error:
        raise FAT5Error(f"lora: {error}") from None


# ----------------------------------------------------------------------------------------------- data


def _data_files(value, name: str) -> list[str]:
    files = value if isinstance(value, list) else [value]
    if not files or not all(isinstance(f, (str, os.PathLike)) for f in files):
        raise FAT5Error(f"data.{name} must be a file path or a list of paths, got {value!r}")
    checked = []
    for file in files:
        path = Path(file).expanduser()
        if not path.is_file() or not os.access(path, os.R_OK):
            raise FAT5Error(f"data.{name}: cannot read {path} (no such file, or not readable)")
        checked.append(str(path))
    return checked


def _builder(files: list[str], name: str) -> tuple[str, dict]:
    kinds = set()
    for file in files:
        stem = file.lower()
        for suffix in COMPRESSION_SUFFIXES:
            stem = stem.removesuffix(suffix)
        kinds.add(Path(stem).suffix)
    unknown = sorted(kind for kind in kinds if kind not in FILE_BUILDERS)
    if unknown or len({FILE_BUILDERS[kind] for kind in kinds}) != 1 or kinds == {".csv", ".tsv"}:
        raise FAT5Error(f"data.{name}: files must share one format among {sorted(FILE_BUILDERS)}, got {sorted(kinds)}")
    kind = kinds.pop()
    return FILE_BUILDERS[kind], ({"delimiter": "\t"} if kind == ".tsv" else {})


def _dataset_given_or_saved(value, name: str, split: str):
    """A ``datasets.Dataset`` given as ``data.train_file`` / ``validation_file``, or the one in a folder written by
    ``save_to_disk`` (a ``DatasetDict`` folder gives its split of that name), as ``fat5 pretrain`` takes them; None
    for file paths."""
    import datasets

    if isinstance(value, datasets.Dataset):
        return value
    if not isinstance(value, (str, os.PathLike)) or not Path(value).expanduser().is_dir():
        return None
    path = Path(value).expanduser()
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise FAT5Error(f"data.{name}: {path} is a folder, but not one written by datasets' save_to_disk") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise FAT5Error(f"data.{name}: {path} holds the splits {sorted(loaded)}, none named {split!r}")
        loaded = loaded[split]
    return loaded


def load_raw_datasets(data: dict):
    """``DatasetDict`` with ``train`` and, when there is evaluation data, ``validation``."""
    import datasets

    try:
        if data["dataset_name"] is not None:
            loaded = datasets.load_dataset(data["dataset_name"], data["dataset_config_name"])
            splits = {"train": data["train_split"], "validation": data["validation_split"]}
            if splits["train"] not in loaded:
                raise FAT5Error(f"data: {data['dataset_name']} has no split {splits['train']!r}: {sorted(loaded)}")
            raw = datasets.DatasetDict({key: loaded[split] for key, split in splits.items() if split in loaded})
        else:
            splits, data_files = {}, {}
            for split, name in (("train", "train_file"), ("validation", "validation_file")):
                if data[name] is None:
                    continue
                dataset = _dataset_given_or_saved(data[name], name, split)
                if dataset is None:
                    data_files[split] = _data_files(data[name], name)
                else:
                    splits[split] = dataset
            if data_files:
                builder, options = _builder([f for files in data_files.values() for f in files], "train_file")
                splits.update(datasets.load_dataset(builder, data_files=data_files, **options))
            raw = datasets.DatasetDict({split: splits[split] for split in ("train", "validation") if split in splits})
    except FAT5Error:
        raise
    except Exception as error:  # noqa: BLE001  (datasets raises many kinds: file format, network, missing dataset)
        source = data["dataset_name"] or data["train_file"]
        raise FAT5Error(f"data: cannot load {source}: {type(error).__name__}: {error}") from None

    if "validation" not in raw and data["validation_fraction"] is not None:
        split = raw["train"].train_test_split(test_size=data["validation_fraction"], seed=0)
        raw = datasets.DatasetDict(train=split["train"], validation=split["test"])
    for key, dataset in raw.items():
        missing = [c for c in (data["text_column"], data["target_column"]) if c not in dataset.column_names]
        if missing:
            raise FAT5Error(
                f"data: the {key} data has no column(s) {missing}; its columns are {dataset.column_names} "
                "(set data.text_column / data.target_column)"
            )
    if len(raw["train"]) == 0:
        raise FAT5Error("data: the training data is empty")
    return raw


def limit_samples(raw, data: dict):
    """The first ``max_train_samples`` / ``max_eval_samples`` rows of the splits (label sets are read before)."""
    for key, limit in (("train", data["max_train_samples"]), ("validation", data["max_eval_samples"])):
        if key in raw and limit is not None:
            raw[key] = raw[key].select(range(min(limit, len(raw[key]))))
    return raw


def label_mapping(raw, column: str, sequence: bool) -> tuple[list[str] | None, dict | None]:
    """Class names and raw value -> class index for a classification target; ``(None, None)`` for a regression
    (float) target. A `ClassLabel` column keeps its names and indices; strings and integers are sorted."""
    import datasets

    feature = raw["train"].features[column]
    if sequence:
        feature = getattr(feature, "feature", feature)
    if isinstance(feature, datasets.ClassLabel):
        return list(feature.names), {index: index for index in range(len(feature.names))}
    values = set()
    for dataset in raw.values():
        for value in dataset[column]:
            if value is not None:
                values.update(value if sequence else [value])
    if not values:
        raise FAT5Error(f"data: the column {column!r} holds no labels")
    if not sequence and all(isinstance(v, float) for v in values):
        return None, None
    if not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in values):
        raise FAT5Error(f"data: the labels in {column!r} must be strings or integers (or floats for a regression)")
    if len(values) < 2:
        raise FAT5Error(f"data: the column {column!r} holds a single class ({values.pop()!r}); a classifier needs two")
    ordered = sorted(values, key=lambda v: (isinstance(v, str), v))
    return [str(v) for v in ordered], {value: index for index, value in enumerate(ordered)}


def _check_text_column(dataset, column: str, words: bool) -> None:
    first_rows = dataset.select(range(min(len(dataset), 100)))[column]
    example = next((value for value in first_rows if value is not None), None)
    if words and not (isinstance(example, list) and all(isinstance(word, str) for word in example)):
        raise FAT5Error(f"data: token_classification needs lists of words in {column!r}, got {example!r}")
    if not words and not isinstance(example, str):
        raise FAT5Error(f"data: the column {column!r} must hold strings, got {example!r}")


def tokenize_datasets(raw, tokenizer, task: str, data: dict, label_ids: dict | None):
    """Tokenize every split for ``task``; rows with a missing text or target are dropped."""
    text_column, target_column = data["text_column"], data["target_column"]
    for dataset in raw.values():
        _check_text_column(dataset, text_column, words=task == "token_classification")
    if task == "seq2seq":
        for dataset in raw.values():
            _check_text_column(dataset, target_column, words=False)
    raw = raw.filter(
        lambda text, target: text is not None and target is not None and len(text) > 0,
        input_columns=[text_column, target_column],
    )

    def seq2seq(batch):
        encoded = tokenizer(
            [data["source_prefix"] + text for text in batch[text_column]],
            max_length=data["max_source_length"],
            truncation=True,
        )
        encoded["labels"] = tokenizer(
            text_target=batch[target_column], max_length=data["max_target_length"], truncation=True
        )["input_ids"]
        return encoded

    def sequence_classification(batch):
        encoded = tokenizer(
            [data["source_prefix"] + text for text in batch[text_column]],
            max_length=data["max_source_length"],
            truncation=True,
        )
        labels = batch[target_column]
        encoded["labels"] = [label_ids[label] for label in labels] if label_ids else [float(v) for v in labels]
        return encoded

    def token_classification(batch):
        encoded = tokenizer(
            batch[text_column], is_split_into_words=True, max_length=data["max_source_length"], truncation=True
        )
        all_labels = []
        for row, (words, tags) in enumerate(zip(batch[text_column], batch[target_column])):
            if len(words) != len(tags):
                raise FAT5Error(f"data: a row has {len(words)} words in {text_column!r} but {len(tags)} tags in "
                                f"{target_column!r}: {words!r}")
            labels, previous_word = [], None
            for word in encoded.word_ids(row):
                # the first piece of each word carries its tag; other pieces and special tokens are not scored
                labels.append(-100 if word is None or word == previous_word else label_ids[tags[word]])
                previous_word = word
            all_labels.append(labels)
        encoded["labels"] = all_labels
        return encoded

    preprocess = {"seq2seq": seq2seq, "sequence_classification": sequence_classification,
                  "token_classification": token_classification}[task]
    return raw.map(
        preprocess,
        batched=True,
        remove_columns=raw["train"].column_names,
        num_proc=data["preprocessing_num_workers"],
        desc="tokenizing",
    )


def _data_collator(task: str, tokenizer, pad_to_multiple_of):
    from transformers import DataCollatorForSeq2Seq, DataCollatorForTokenClassification, DataCollatorWithPadding

    if task == "seq2seq":
        # the model shifts the labels into decoder inputs itself
        return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, pad_to_multiple_of=pad_to_multiple_of)
    if task == "token_classification":
        return DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=pad_to_multiple_of)
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)


# ----------------------------------------------------------------------------------------------- the job


def training_arguments(config: dict, has_eval_data: bool):
    """`FAT5TrainingArguments` from the ``training`` section plus the job's defaults (see the module doc)."""
    from .trainer import FAT5TrainingArguments, check_training_arguments

    defaults = {"train_sampling_strategy": "group_by_length", "report_to": "none"}
    if config["task"] == "seq2seq" and has_eval_data:
        defaults.update(predict_with_generate=True, generation_max_length=config["data"]["max_target_length"])
    arguments = {**defaults, **config["training"], "output_dir": config["output_dir"]}
    for name, value in arguments.items():
        # YAML 1.1 reads an unquoted `no` as false; no *_strategy field is a boolean
        if name.endswith("_strategy") and value is False:
            arguments[name] = "no"
    if config["task"] != "seq2seq" and arguments.get("predict_with_generate"):
        raise FAT5Error(f"training.predict_with_generate needs task seq2seq, not {config['task']}")
    check_training_arguments(arguments)
    fields = FAT5TrainingArguments.__dataclass_fields__
    for name, value in arguments.items():
        choices = fields[name].metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise FAT5Error(f"training.{name} must be one of {list(choices)}, got {value!r}")
    try:
        return FAT5TrainingArguments(**arguments)
    except (TypeError, ValueError) as error:
        raise FAT5Error(f"training: {error}") from None


@dataclass
class FinetuneSetup:
    """Everything `prepare_finetune` built: the trainer is ready for ``trainer.train()``."""

    config: dict
    trainer: Any
    model: Any
    tokenizer: Any
    train_dataset: Any
    eval_dataset: Any
    model_path: str
    model_kwargs: dict = field(default_factory=dict)


def prepare_finetune(config: dict) -> FinetuneSetup:
    """Load the model, tokenizer and data of a checked configuration (`load_finetune_config`) and build the
    FAT5Trainer (with LoRA applied when configured)."""
    from transformers import set_seed

    from .metrics import rouge_metric, sequence_classification_metric, token_classification_metric
    from .trainer import FAT5Trainer

    task, data = config["task"], config["data"]
    model_path = resolve_model_path(config["model"])
    tokenizer = load_tokenizer(config["tokenizer"] or model_path, task)
    raw = load_raw_datasets(data)
    has_eval_data = "validation" in raw
    args = training_arguments(config, has_eval_data)

    model_kwargs = dict(config["model_overrides"])
    label_names, label_ids = None, None
    if task != "seq2seq":
        label_names, label_ids = label_mapping(raw, data["target_column"], sequence=task == "token_classification")
        model_kwargs["num_labels"] = len(label_names) if label_names else 1
        model_kwargs["problem_type"] = "single_label_classification" if label_names else "regression"
        if label_names:
            model_kwargs["id2label"] = dict(enumerate(label_names))
            model_kwargs["label2id"] = {name: index for index, name in enumerate(label_names)}

    # under several processes the main one tokenizes first and the others read the datasets cache it wrote
    with args.main_process_first(desc="tokenizing"):
        tokenized = tokenize_datasets(limit_samples(raw, data), tokenizer, task, data, label_ids)
    set_seed(args.seed)
    model = load_model(task, model_path, model_kwargs, config["dtype"])
    if len(tokenizer) > model.config.vocab_size:
        raise FAT5Error(f"tokenizer: {len(tokenizer)} tokens, more than the model's vocab_size "
                        f"{model.config.vocab_size}; give the model's own tokenizer")
    if config["lora"] is not None:
        if args.gradient_checkpointing:
            # the frozen embedding's output must require grad for checkpointed blocks to pass gradients back
            model.enable_input_require_grads()
        model = apply_lora(model, task, config["lora"])

    compute_metrics = {
        "seq2seq": rouge_metric(tokenizer) if args.predict_with_generate else None,
        "sequence_classification": sequence_classification_metric,
        "token_classification": token_classification_metric,
    }[task]
    trainer = FAT5Trainer(
        model=model,
        args=args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"] if has_eval_data else None,
        processing_class=tokenizer,
        data_collator=_data_collator(task, tokenizer, data["pad_to_multiple_of"]),
        compute_metrics=compute_metrics if has_eval_data else None,
    )
    return FinetuneSetup(
        config=config,
        trainer=trainer,
        model=model,
        tokenizer=tokenizer,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"] if has_eval_data else None,
        model_path=model_path,
        model_kwargs=model_kwargs,
    )


def merge_adapter(setup: FinetuneSetup, adapter_dir: Path, merged_dir: Path) -> Path:
    """Reload the saved adapter onto a fresh copy of the base model, merge it in (``merge_and_unload``) and save the
    plain FAT5 model with the tokenizer: the saved adapter is proven to load, the trained model stays as it was."""
    from peft import PeftModel

    base = load_model(setup.config["task"], setup.model_path, setup.model_kwargs, setup.config["dtype"])
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    temporary = merged_dir / ".merged-model.tmp"
    merged.save_pretrained(temporary)
    setup.tokenizer.save_pretrained(temporary)
    move_into(temporary, merged_dir)
    return merged_dir


def _save_final(trainer, folder: Path) -> None:
    """``trainer.save_model`` into a temporary folder inside ``folder``, then its files to the top of ``folder``."""
    temporary = folder / ".final-model.tmp"
    trainer.save_model(str(temporary))
    if trainer.is_world_process_zero():
        move_into(temporary, folder)


def run_finetune(setup: FinetuneSetup, resume: bool = False) -> dict:
    """Train (from the newest complete checkpoint of the output folder with ``resume``), evaluate and save what
    `prepare_finetune` built; returns the paths written and the metrics."""
    from .trainer import find_resume_checkpoint, require_full_state_dict

    config, trainer = setup.config, setup.trainer
    output_dir = Path(config["output_dir"])
    require_full_state_dict(trainer)
    checkpoint = find_resume_checkpoint(output_dir, announce=trainer.is_world_process_zero()) if resume else None
    train_result = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    eval_metrics = trainer.evaluate() if setup.eval_dataset is not None else None

    result = {
        "output_dir": str(output_dir),
        "model_dir": None,
        "adapter_dir": None,
        "merged_dir": None,
        "bundle_dir": None,
        "train": dict(train_result.metrics),
        "eval": eval_metrics,
        "log_history": list(trainer.state.log_history),
    }
    # save_model writes from the main process only; the steps after it run there alone
    main_process = trainer.is_world_process_zero()
    final_dir = output_dir
    if config["lora"] is None:
        _save_final(trainer, final_dir)
        result["model_dir"] = str(final_dir)
    elif config["lora"]["merge"]:
        adapter_dir = output_dir / "adapter"
        trainer.save_model(str(adapter_dir))
        result["adapter_dir"] = str(adapter_dir)
        if main_process:
            merge_adapter(setup, adapter_dir, final_dir)
        result["merged_dir"] = str(final_dir)
    else:
        _save_final(trainer, final_dir)
        result["adapter_dir"] = str(final_dir)
    if config["bundle"]:
        bundle_dir = output_dir / "bundle"
        if main_process:
            from ..hub_upload import bundle

            bundle(final_dir, bundle_dir, overwrite=True)
        result["bundle_dir"] = str(bundle_dir.absolute())

    if main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        metrics = {"train": result["train"], "eval": result["eval"]}
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
        (output_dir / "finetune_config.yaml").write_text(yaml.safe_dump(_as_written(config), sort_keys=False),
                                                         encoding="utf-8")
    # no process returns before the main one has written what the result names
    trainer.accelerator.wait_for_everyone()
    return result


def _as_written(config: dict) -> dict:
    """The config as finetune_config.yaml records it: a dataset given as an object is named by its size."""
    data = {key: f"<datasets.Dataset of {len(value)} rows, given in memory>" if hasattr(value, "column_names")
            else value for key, value in config["data"].items()}
    return {**config, "data": data}


def _inputs(config: dict) -> list[Path]:
    """The local paths a finetuning job reads (model, tokenizer, data files): never removed by ``--overwrite``."""
    data = config["data"]
    paths = [config["model"], config["tokenizer"], data["dataset_name"]]
    for name in ("train_file", "validation_file"):
        paths += data[name] if isinstance(data[name], list) else [data[name]]
    return [Path(path) for path in paths if isinstance(path, (str, os.PathLike)) and Path(path).exists()]


def finetune(config_path_or_dict, output_dir=None, overrides=(), overwrite: bool = False, resume: bool = False) -> dict:
    """Run the `fat5 finetune` job described by a YAML file or a dict (see the module doc for its keys).

    Returns ``{"output_dir", "model_dir", "adapter_dir", "merged_dir", "bundle_dir", "train", "eval",
    "log_history"}``: the folders written (None where not applicable), the train and final evaluation metrics and
    the Trainer's log history. Configuration and data mistakes raise `FAT5Error`, as does an output folder that
    already holds a model or checkpoints unless ``resume`` (continue from the newest complete checkpoint) or
    ``overwrite`` (replace the folder's content) is set.
    """
    from accelerate import PartialState

    config = load_finetune_config(config_path_or_dict, output_dir=output_dir, overrides=overrides)
    state = PartialState()
    inputs = _inputs(config)
    if isinstance(config_path_or_dict, (str, os.PathLike)):
        inputs.append(Path(config_path_or_dict))
    prepare_run_folder(config["output_dir"], overwrite=overwrite, resume=resume, inputs=inputs,
                       main_process=state.is_main_process)
    state.wait_for_everyone()
    return run_finetune(prepare_finetune(config), resume=resume)


# ----------------------------------------------------------------------------------------------- a model to try it on


def make_tiny_model(output_dir, texts, vocab_size: int = 256, seed: int = 0, **config_fields) -> Path:
    """Write a tiny randomly initialised FAT5ForConditionalGeneration and a BPE tokenizer trained on ``texts``
    (T5's special tokens: pad 0, eos 1, unk 2) to ``output_dir``: a model to run the finetuning pipeline on
    in seconds, on a CPU, without a download. ``config_fields`` override the small FAT5Config defaults here.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from .. import FAT5Config, FAT5ForConditionalGeneration

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.normalizer = normalizers.NFKC()
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    bpe.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"])
    )
    # T5 ends every sequence, input or target, with </s>
    bpe.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", bpe.token_to_id("</s>"))]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    fields = {
        "vocab_size": len(tokenizer), "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4,
        "relative_attention_num_buckets": 8, "relative_attention_max_distance": 32, "dropout_rate": 0.0,
        "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
    }
    torch.manual_seed(seed)
    model = FAT5ForConditionalGeneration(FAT5Config(**{**fields, **config_fields}))
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


# ----------------------------------------------------------------------------------------------- command line


def _run_finetune_command(args: argparse.Namespace) -> int:
    from .trainer import resume_hint

    try:
        result = finetune(args.config, output_dir=args.output_dir, overrides=args.overrides, overwrite=args.overwrite,
                          resume=args.resume)
    except KeyboardInterrupt:
        output_dir = load_finetune_config(args.config, output_dir=args.output_dir, overrides=args.overrides)["output_dir"]
        command = " ".join(["fat5 finetune", args.config, *(["--output-dir", args.output_dir] if args.output_dir else []),
                            *(f"--set {override}" for override in args.overrides)])
        print(f"fat5 finetune: interrupted; {resume_hint(command, output_dir)}", file=sys.stderr, flush=True)
        raise
    for name in ("model_dir", "adapter_dir", "merged_dir", "bundle_dir"):
        if result[name]:
            print(f"{name.removesuffix('_dir')}: {result[name]}")
    if result["eval"]:
        print("evaluation: " + ", ".join(f"{key} {value:.4g}" for key, value in result["eval"].items()
                                         if isinstance(value, (int, float))))
    return 0


def add_finetune_command(subparsers) -> None:
    """Register ``finetune`` on the `fat5` command's subparsers; it sets ``func(args) -> int``."""
    parser = subparsers.add_parser(
        "finetune",
        help="finetune a FAT5 model (seq2seq or an encoder head), fully or with LoRA, from a YAML config",
        description="Finetune the FAT5 model that CONFIG names on its dataset with FAT5Trainer, then save it (or its "
        "LoRA adapter and the merged model) under output_dir. Examples: fat5/trainer/configs/finetune_*.yaml.",
    )
    parser.add_argument("config", help="YAML configuration (task, model, data, lora, training, ...)")
    parser.add_argument("--output-dir", default=None, help="where to write (overrides the config's output_dir): the "
                        "final model and tokenizer, loadable with from_pretrained(DIR), and the checkpoints")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in the output folder")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the content of the output folder (never a folder that holds the input)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config entry (dotted key, YAML value), e.g. --set training.max_steps=100; repeatable",
    )
    parser.set_defaults(func=_run_finetune_command)
