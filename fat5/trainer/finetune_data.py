"""The data side of `fat5 finetune`: loading the examples (files, a saved or given dataset, a Hub dataset), reading
the label set of a classification, tokenizing for the task and the collator that pads the batches."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import FAT5Error
from .data import cache_file_outside_user_data, is_saved_dataset, map_processes
from .finetune_config import FinetuneDataSection

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")


def _data_files(value, name: str) -> list[str]:
    files = value if isinstance(value, list) else [value]
    if not files or not all(isinstance(f, (str, os.PathLike)) for f in files):
        raise FAT5Error(f"data.{name} must be a file path or a list of paths, got {value!r}")
    checked = []
    for file in files:
        path = Path(file).expanduser()
        if not path.is_file() or not os.access(path, os.R_OK):
            raise FAT5Error(f"data.{name}: cannot read {path} (no such file, or not readable)")
        if path.stat().st_size == 0:  # datasets' loaders fail on it with a bare StopIteration
            raise FAT5Error(f"data.{name}: {path} is empty")
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


def check_data_files(data: FinetuneDataSection) -> None:
    """What can be told of ``train_file`` and ``validation_file`` without `datasets`, which takes seconds to import:
    the files named exist, can be read and are not empty, and those of each split share one format (a folder is
    `datasets`' to read)."""
    for name, given in (("train_file", data.train_file), ("validation_file", data.validation_file)):
        folder = isinstance(given, (str, os.PathLike)) and Path(given).expanduser().is_dir()
        if isinstance(given, (str, os.PathLike, list)) and not folder:
            _builder(_data_files(given, name), name)


def _dataset_given_or_in_folder(value, name: str, split: str):
    """A ``datasets.Dataset`` given as ``data.train_file`` / ``validation_file``, or the one in a folder, as
    ``fat5 pretrain`` takes them: one written by ``save_to_disk`` (a ``DatasetDict`` folder gives its split of that
    name), or a folder of data files, read as ``datasets.load_dataset(folder)`` reads it (its split of that name, or
    its only one); None for file paths."""
    import datasets

    if isinstance(value, datasets.Dataset):
        return value
    if not isinstance(value, (str, os.PathLike)) or not Path(value).expanduser().is_dir():
        return None
    path = Path(value).expanduser()
    if is_saved_dataset(path):
        loaded = datasets.load_from_disk(str(path))
    else:
        try:
            loaded = datasets.load_dataset(str(path))
        except (FileNotFoundError, ValueError) as error:  # datasets' "no (supported) data files found"
            raise FAT5Error(f"data.{name}: {path} is a folder, but neither one that datasets' save_to_disk wrote nor "
                            f"one of data files that datasets.load_dataset reads ({error})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded and len(loaded) != 1:
            raise FAT5Error(f"data.{name}: {path} holds the splits {sorted(loaded)}, none named {split!r}")
        loaded = loaded[split] if split in loaded else next(iter(loaded.values()))
    return loaded


def load_raw_datasets(data: FinetuneDataSection):
    """``DatasetDict`` with ``train`` and, when there is evaluation data, ``validation``."""
    import datasets

    try:
        raw = _load_hub_dataset(data) if data.dataset_name is not None else _load_local_data(data)
    except FAT5Error:
        raise
    except Exception as error:  # noqa: BLE001  (datasets raises many kinds: file format, network, missing dataset)
        source = data.dataset_name or data.train_file
        # datasets wraps the parser's error (a malformed line, with its row) in a generic one
        cause = f" ({type(error.__cause__).__name__}: {error.__cause__})" if error.__cause__ else ""
        raise FAT5Error(f"data: cannot load {source}: {type(error).__name__}: {error}{cause}") from None
    if len(raw["train"]) == 0:
        raise FAT5Error("data: the training data is empty")
    if "validation" not in raw and data.validation_fraction is not None:
        fraction, train = data.validation_fraction, raw["train"]
        try:
            split = train.train_test_split(
                test_size=fraction, seed=0,
                train_indices_cache_file_name=cache_file_outside_user_data(train, "split-train", fraction),
                test_indices_cache_file_name=cache_file_outside_user_data(train, "split-validation", fraction),
            )
        except ValueError as error:  # a split with no example on one side: datasets names the sizes
            raise FAT5Error(f"data.validation_fraction {fraction} of {len(train)} training example(s) leaves one "
                            f"side empty ({error}): give more examples, a data.validation_file, or no "
                            "validation_fraction") from None
        raw = datasets.DatasetDict(train=split["train"], validation=split["test"])
    for key, dataset in raw.items():
        missing = [c for c in (data.text_column, data.target_column) if c not in dataset.column_names]
        if missing:
            raise FAT5Error(
                f"data: the {key} data has no column(s) {missing}; its columns are {dataset.column_names} "
                "(set data.text_column / data.target_column)"
            )
    return raw


def _load_hub_dataset(data: FinetuneDataSection):
    import datasets

    loaded = datasets.load_dataset(data.dataset_name, data.dataset_config_name)
    splits = {"train": data.train_split, "validation": data.validation_split}
    if splits["train"] not in loaded:
        raise FAT5Error(f"data: {data.dataset_name} has no split {splits['train']!r}: {sorted(loaded)}")
    return datasets.DatasetDict({key: loaded[split] for key, split in splits.items() if split in loaded})


def _load_local_data(data: FinetuneDataSection):
    """``train_file`` / ``validation_file``: datasets given or saved with ``save_to_disk``, or data files."""
    import datasets

    splits = {}
    for split, name, given in (("train", "train_file", data.train_file),
                               ("validation", "validation_file", data.validation_file)):
        if given is None:
            continue
        splits[split] = _dataset_given_or_in_folder(given, name, split)
        if splits[split] is None:
            # each split read by the builder of its own format: a JSONL train_file, a CSV validation_file
            files = _data_files(given, name)
            builder, options = _builder(files, name)
            splits[split] = datasets.load_dataset(builder, data_files={split: files}, **options)[split]
    return datasets.DatasetDict(splits)


def limit_samples(raw, data: FinetuneDataSection):
    """The first ``max_train_samples`` / ``max_eval_samples`` rows of the splits (label sets are read before)."""
    for key, limit in (("train", data.max_train_samples), ("validation", data.max_eval_samples)):
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


def tokenize_datasets(raw, tokenizer, task: str, data: FinetuneDataSection, label_ids: dict | None):
    """Tokenize every split for ``task``; rows with a missing text or target are dropped."""
    text_column, target_column = data.text_column, data.target_column
    for dataset in raw.values():
        _check_text_column(dataset, text_column, words=task == "token_classification")
    if task == "seq2seq":
        for dataset in raw.values():
            _check_text_column(dataset, target_column, words=False)
    columns = [text_column, target_column]
    raw = raw.filter(
        _has_text_and_target,
        input_columns=columns,
        cache_file_names={key: cache_file_outside_user_data(split, "filter", columns) for key, split in raw.items()},
    )
    preprocess = {"seq2seq": _seq2seq_examples, "sequence_classification": _sequence_classification_examples,
                  "token_classification": _token_classification_examples}[task]
    identity = (task, preprocess, tokenizer, data, label_ids)
    cache_files = {key: cache_file_outside_user_data(split, "tokenize", *identity) for key, split in raw.items()}
    return raw.map(
        lambda batch: preprocess(batch, tokenizer, data, label_ids),
        batched=True,
        remove_columns=raw["train"].column_names,
        num_proc=map_processes(data.preprocessing_num_workers),
        desc="tokenizing",
        cache_file_names=cache_files,
    )


def _has_text_and_target(text, target) -> bool:
    return text is not None and target is not None and len(text) > 0


def _encode_sources(batch, tokenizer, data: FinetuneDataSection):
    return tokenizer(
        [data.source_prefix + text for text in batch[data.text_column]],
        max_length=data.max_source_length,
        truncation=True,
    )


def _seq2seq_examples(batch, tokenizer, data: FinetuneDataSection, label_ids):
    encoded = _encode_sources(batch, tokenizer, data)
    encoded["labels"] = tokenizer(
        text_target=batch[data.target_column], max_length=data.max_target_length, truncation=True
    )["input_ids"]
    return encoded


def _sequence_classification_examples(batch, tokenizer, data: FinetuneDataSection, label_ids: dict | None):
    encoded = _encode_sources(batch, tokenizer, data)
    labels = batch[data.target_column]
    encoded["labels"] = [label_ids[label] for label in labels] if label_ids else [float(v) for v in labels]
    return encoded


def _token_classification_examples(batch, tokenizer, data: FinetuneDataSection, label_ids: dict):
    text_column, target_column = data.text_column, data.target_column
    encoded = tokenizer(
        batch[text_column], is_split_into_words=True, max_length=data.max_source_length, truncation=True
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


def data_collator(task: str, tokenizer, pad_to_multiple_of):
    from transformers import DataCollatorForSeq2Seq, DataCollatorForTokenClassification, DataCollatorWithPadding

    if task == "seq2seq":
        # the model shifts the labels into decoder inputs itself
        return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, pad_to_multiple_of=pad_to_multiple_of)
    if task == "token_classification":
        return DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=pad_to_multiple_of)
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)
