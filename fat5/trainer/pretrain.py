"""`fat5 pretrain`: UL2 pretraining of a FAT5 model, from a YAML config, in one command.

The steps, in order: read the config (the built-in default when none is given), get a tokenizer (train one on the
corpus when none is given), load and tokenize the corpus, build the packed UL2 batches, train with
:class:`FAT5Trainer`, evaluate, and save the model and tokenizer to the output folder itself, where
``AutoModelForSeq2SeqLM.from_pretrained(folder)`` (after ``import fat5``) and ``AutoTokenizer`` load them.

The output folder also holds the checkpoints (``checkpoint-N``, each written whole or not at all), the tokenizer
trained for the run (``tokenizer/``) and ``pretrain_summary.json``. A folder that already holds a model or
checkpoints is refused: ``--resume`` continues from its newest complete checkpoint, ``--overwrite`` replaces its
content (never a folder that holds the input or the current directory).
"""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import FAT5Error
from ..output_folder import is_disk_full, move_into, prepare_run_folder

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "pretrain_default.yaml"
SECTIONS = ("seed", "model", "tokenizer", "data", "ul2", "training")
# the keys the job reads from these sections (model: FAT5Config fields, training: FAT5TrainingArguments fields); a
# misspelt one would otherwise be ignored without a word
TOKENIZER_KEYS = ("path", "vocab_size", "num_sentinels", "train_on_documents")
DATA_KEYS = ("corpus", "unit", "eval_fraction", "max_eval_documents", "path", "name", "data_files", "split",
             "eval_split", "streaming", "text_column", "max_input_length", "max_target_length", "tokens_per_batch",
             "num_proc", "shape_buckets")
# data lengths and counts the packing computes with; null where the job accepts none
DATA_INTEGERS = {"max_input_length": False, "tokens_per_batch": False, "max_target_length": True,
                 "max_eval_documents": True, "num_proc": True}


def load_config(config=None, overrides: dict | None = None) -> dict:
    """The built-in default updated, section by section, with ``config`` (a YAML path or a mapping), then with
    ``overrides`` (a mapping of sections)."""
    with open(DEFAULT_CONFIG) as handle:
        merged = yaml.safe_load(handle)
    if config is None and not overrides:
        return merged
    if config is not None:
        _merge_sections(merged, _read_config(config))
    if overrides:
        _merge_sections(merged, overrides)
    _check_sections(merged)
    return merged


def _read_config(config) -> dict:
    if not isinstance(config, dict):
        path = Path(config)
        if not path.is_file():
            raise FAT5Error(f"no pretraining config at {path}")
        try:
            config = yaml.safe_load(path.read_text())
        except yaml.YAMLError as error:
            raise FAT5Error(f"{path} is not valid YAML: {error}") from None
        if not isinstance(config, dict):
            raise FAT5Error(f"{path} must hold a mapping with the sections {', '.join(SECTIONS)}")
    return config


def _merge_sections(merged: dict, config: dict) -> None:
    unknown = set(config) - set(SECTIONS)
    if unknown:
        raise FAT5Error(f"unknown config sections {sorted(unknown)}; the sections are {', '.join(SECTIONS)}")
    for section, value in config.items():
        if isinstance(merged.get(section), dict) and isinstance(value, dict):
            if section == "data" and "path" in value:
                merged[section].pop("corpus", None)
            merged[section].update(value)
        else:
            merged[section] = value


def _check_sections(settings: dict) -> None:
    """Raise FAT5Error for an unknown key in the tokenizer, data, model or training section, or a data length, count
    or training field of the wrong type."""
    from .. import FAT5Config
    from .trainer import check_training_arguments

    for section in ("model", "tokenizer", "data", "training"):
        if not isinstance(settings.get(section), dict):
            raise FAT5Error(f"the {section} section must be a mapping, got {settings.get(section)!r}")
    known = {"tokenizer": TOKENIZER_KEYS, "data": DATA_KEYS, "model": tuple(FAT5Config().to_dict())}
    for section, keys in known.items():
        unknown = sorted(set(settings[section]) - set(keys))
        if unknown:
            known_ones = "they are no FAT5Config fields" if section == "model" else f"its keys are {', '.join(keys)}"
            raise FAT5Error(f"unknown key(s) {unknown} in the {section} section: {known_ones}")
    for name, may_be_null in DATA_INTEGERS.items():
        value = settings["data"].get(name)
        if not (value is None and may_be_null) and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise FAT5Error(f"data.{name} must be an integer >= 1{' or null' if may_be_null else ''}, got {value!r}")
    check_training_arguments({key: value for key, value in settings["training"].items() if key != "output_dir"})
    _check_ul2(settings.get("ul2"))
    tokenizer = settings["tokenizer"]
    if tokenizer.get("path") is None:
        vocab_size = tokenizer.get("vocab_size", 4096)
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 8:
            raise FAT5Error(f"tokenizer.vocab_size must be an integer >= 8, got {vocab_size!r}")
        # the model section is checked now, not after minutes of tokenizer training: as the job will build it, with
        # the ids a trained tokenizer has (pad 0, eos 1)
        _model_config(settings["model"], vocab_size=-(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE, pad_token_id=0,
                      eos_token_id=1)
    buckets = settings["data"].get("shape_buckets")
    valid = buckets is None or (
        isinstance(buckets, int) and not isinstance(buckets, bool) and buckets >= 1
    ) or (
        isinstance(buckets, list) and buckets
        and all(isinstance(width, int) and not isinstance(width, bool) and width >= 1 for width in buckets)
    )
    if not valid:
        raise FAT5Error("data.shape_buckets must be null (shapes follow each batch), a number of decoder widths >= 1 "
                        f"(chosen from the UL2 mixture's rows) or a list of decoder widths, got {buckets!r}")


def _check_ul2(ul2) -> None:
    """Raise FAT5Error for a ul2 section (a mapping, or the path of a YAML file) that names no readable mixture."""
    from .ul2 import UL2Mixture, load_ul2_config

    if ul2 is None:
        return
    if isinstance(ul2, (str, os.PathLike)):
        path = Path(ul2).expanduser()
        if not path.is_file():
            raise FAT5Error(f"ul2: no such file {path} (give a YAML file of denoisers, or the mixture itself)")
        try:
            ul2 = load_ul2_config(path)
        except (OSError, yaml.YAMLError, TypeError) as error:
            raise FAT5Error(f"ul2: cannot read {path}: {error}") from None
    if not isinstance(ul2, dict):
        raise FAT5Error(f"ul2 must be a mapping (denoisers, proportions) or a YAML path, got {ul2!r}")
    try:
        UL2Mixture.from_config(ul2)
    except (TypeError, ValueError, KeyError) as error:
        raise FAT5Error(f"ul2: {error}") from None


def _texts_for_tokenizer(dataset, limit: int | None, text_column: str):
    for index, record in enumerate(dataset):
        if limit is not None and index >= limit:
            return
        yield record[text_column]


def load_corpus(data: dict, seed: int):
    """(train, eval) text datasets with a ``text`` column; eval is None when nothing is held out."""
    from .data import load_shakespeare, load_text_dataset

    if data.get("corpus") == "shakespeare":
        fraction = data.get("eval_fraction", 0.0)
        if fraction:
            splits = load_shakespeare(unit=data.get("unit", "scene"), test_fraction=fraction, seed=seed)
            return splits["train"], splits["test"]
        return load_shakespeare(unit=data.get("unit", "scene")), None
    if "path" not in data:
        raise FAT5Error("the data section needs `corpus: shakespeare` or a `path` (dataset name, file or folder)")
    options = {"name": data.get("name"), "data_files": data.get("data_files"), "streaming": data.get("streaming", False),
                   "text_column": data.get("text_column", "text")}
    try:
        train = load_text_dataset(data["path"], split=data.get("split", "train"), **options)
        evaluation = None
        if data.get("eval_split"):
            evaluation = load_text_dataset(data["path"], split=data["eval_split"], **dict(options, streaming=False))
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as error:
        raise FAT5Error(f"cannot load the corpus {data['path']!r}: {error}") from None
    return train, evaluation


def get_tokenizer(settings: dict, train_texts, text_column: str, output_dir: Path, saved=None):
    """The configured tokenizer; else the one this run saved (``saved``: the checkpoint a run resumes from, or the
    folder where the main process saved the tokenizer it trained); else a new one, saved in ``output_dir/tokenizer``."""
    from .tokenizer import load_tokenizer, train_tokenizer

    path = settings.get("path") or saved
    if path:
        try:
            return load_tokenizer(path)
        except (OSError, ValueError) as error:
            raise FAT5Error(f"cannot load the tokenizer at {path}: {error}") from None
    print(f"training a {settings.get('vocab_size', 4096)}-token tokenizer on the corpus", flush=True)
    return train_tokenizer(
        _texts_for_tokenizer(train_texts, settings.get("train_on_documents"), text_column),
        vocab_size=settings.get("vocab_size", 4096),
        num_sentinels=settings.get("num_sentinels", 256),
        save_directory=str(output_dir / "tokenizer"),
    )


# The embeddings and the output layer get rows for a multiple of this many ids, as T5 has 32,128 for its 32,100
# tokens: with an output width that is not a multiple of 8, cuBLAS has only its pre-Hopper kernels for the logits'
# products (minipile config on an H100: 29,699 ids, 146 ms of GPU time a step; 29,824, 126 ms). The ids past the
# tokenizer's never occur in the data; training pushes their logits down.
VOCAB_MULTIPLE = 128


def _model_config(model_settings: dict, vocab_size: int, pad_token_id: int, eos_token_id: int):
    from .. import FAT5Config

    fields = dict(model_settings)
    fields.update(vocab_size=vocab_size, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                  decoder_start_token_id=pad_token_id)
    try:
        return FAT5Config(**fields)
    except (TypeError, ValueError) as error:
        raise FAT5Error(f"invalid model section: {error}") from None


def build_model(model_settings: dict, tokenizer, vocab_size: int | None = None):
    """A fresh FAT5 for the tokenizer; ``vocab_size`` (a resumed run's, from its checkpoint) replaces the rounded
    length of the tokenizer."""
    from .. import FAT5ForConditionalGeneration

    vocab_size = vocab_size or -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return FAT5ForConditionalGeneration(
        _model_config(model_settings, vocab_size, tokenizer.pad_token_id, tokenizer.eos_token_id)
    )


@dataclass
class PretrainingJob:
    """A pretraining run made ready by :func:`prepare_pretraining`: its settings, output folder, the checkpoint it
    resumes from, tokenizer, model, UL2 collator, packed batches and the trainer wired to them. ``run()`` trains,
    evaluates and saves. Benchmarks add their callbacks to ``trainer`` and feed peers ``batches`` in between."""

    settings: dict
    output_dir: Path
    checkpoint: Path | None
    tokenizer: Any
    model: Any
    collator: Any
    batches: "PackedBatches"
    trainer: Any

    def run(self) -> dict:
        """Train (from the checkpoint when resuming), evaluate, save; returns the summary."""
        return _train_evaluate_save(self.trainer, self.tokenizer, self.checkpoint, self.output_dir)


def prepare_pretraining(config=None, output_dir=None, resume: bool = False, overwrite: bool = False,
                        overrides: dict | None = None) -> PretrainingJob:
    """Every step of :func:`pretrain` before training: the settings read (``overrides``, a mapping of sections,
    updates ``config`` key by key), the output folder prepared, the corpus, tokenizer, model, collator, batches and
    trainer built."""
    from accelerate import PartialState
    from transformers import set_seed

    settings = load_config(config, overrides)
    state = PartialState()
    output_dir = _prepare_output_folder(settings, config, output_dir, overwrite=overwrite, resume=resume, state=state)
    checkpoint = _resume_checkpoint(output_dir, resume, state)
    set_seed(_seed(settings))
    train_texts, eval_texts, tokenizer = _corpus_and_tokenizer(settings, output_dir, checkpoint, state)
    model = build_model(settings["model"], tokenizer, _saved_vocab_size(checkpoint))
    collator = _ul2_collator(settings, tokenizer)
    batches = _packed_batches(settings, train_texts, eval_texts, tokenizer, collator)
    trainer = _build_trainer(settings, output_dir, model, tokenizer, collator, batches)
    return PretrainingJob(settings, output_dir, checkpoint, tokenizer, model, collator, batches, trainer)


def pretrain(config=None, output_dir=None, resume: bool = False, overwrite: bool = False,
             overrides: dict | None = None) -> dict:
    """Run the whole pretraining job; returns a summary (losses, steps, where the model is).

    ``config`` is a YAML path, a mapping, or None for the built-in default; ``overrides`` a mapping of sections
    applied over it. The final model and tokenizer are written to ``output_dir`` itself; a folder that holds a model
    or checkpoints is refused unless ``resume`` (continue from its newest complete checkpoint, or start over when
    there is none) or ``overwrite`` (replace its content) is set.
    """
    return prepare_pretraining(config, output_dir, resume=resume, overwrite=overwrite, overrides=overrides).run()


def _seed(settings: dict) -> int:
    return int(settings.get("seed", 0))


def _text_column(data: dict) -> str:
    return "text" if data.get("corpus") == "shakespeare" else data.get("text_column", "text")


def _prepare_output_folder(settings: dict, config, output_dir, overwrite: bool, resume: bool, state) -> Path:
    """Refuse, resume or empty the output folder as asked; never touching what the job reads."""
    inputs = [settings["tokenizer"].get("path"), settings["data"].get("path")]
    if isinstance(settings.get("ul2"), (str, os.PathLike)):
        inputs.append(settings["ul2"])
    if isinstance(config, (str, os.PathLike)):
        inputs.append(config)
    output_dir = prepare_run_folder(output_dir or "outputs/fat5-pretrain", overwrite=overwrite, resume=resume,
                                    inputs=[path for path in inputs if path and Path(path).exists()],
                                    main_process=state.is_main_process)
    state.wait_for_everyone()
    return output_dir


def _resume_checkpoint(output_dir: Path, resume: bool, state) -> Path | None:
    """With ``resume``, the newest complete checkpoint to continue from; the output folder exists afterwards."""
    from ..output_folder import find_resume_checkpoint

    checkpoint = find_resume_checkpoint(output_dir, announce=state.is_main_process) if resume else None
    output_dir.mkdir(parents=True, exist_ok=True)
    return checkpoint


def _corpus_and_tokenizer(settings: dict, output_dir: Path, checkpoint: Path | None, state):
    """(train texts, eval texts or None, tokenizer).

    Under `accelerate launch` every process runs this: the main one loads the corpus first (filling the datasets
    cache the others then read) and trains the tokenizer; the others load the tokenizer it saved, since a tokenizer
    trained on each rank could differ, and would then give the same ids different meanings.
    """
    with state.main_process_first():
        train_texts, eval_texts = load_corpus(settings["data"], _seed(settings))
        saved = checkpoint or (None if state.is_main_process else output_dir / "tokenizer")
        tokenizer = get_tokenizer(settings["tokenizer"], train_texts, _text_column(settings["data"]), output_dir, saved)
    return train_texts, eval_texts, tokenizer


def _saved_vocab_size(checkpoint: Path | None) -> int | None:
    """The resumed checkpoint's vocab_size: a run started by an older release may have its embeddings at the
    tokenizer's own length."""
    if checkpoint and (checkpoint / "config.json").is_file():
        return json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    return None


def _ul2_collator(settings: dict, tokenizer):
    from .collator import UL2DataCollator

    data = settings["data"]
    return UL2DataCollator(
        tokenizer,
        mixture=settings.get("ul2"),
        max_input_length=data["max_input_length"],
        max_target_length=data.get("max_target_length"),
        packed=True,
        seed=_seed(settings),
    )


@dataclass
class PackedBatches:
    """The tokenized training and evaluation data, and the samplers that pack them into UL2 batches (None for a
    streamed training set, which packs itself, and where there is no evaluation data)."""

    train: Any
    train_sampler: Any
    evaluation: Any
    eval_sampler: Any


def _packed_batches(settings: dict, train_texts, eval_texts, tokenizer, collator) -> PackedBatches:
    from .data import tokenize_dataset
    from .packing import PackedStreamDataset, UL2PackedBatchSampler

    data = settings["data"]
    tokenize = {"text_column": _text_column(data), "num_proc": data.get("num_proc")}
    train = tokenize_dataset(train_texts, tokenizer, **tokenize)
    batching = {"tokens_per_batch": data["tokens_per_batch"], "seed": _seed(settings),
                "shape_buckets": data.get("shape_buckets")}
    train_sampler = None
    if data.get("streaming"):
        train = PackedStreamDataset(train, collator, **batching)
    else:
        train_sampler = UL2PackedBatchSampler(
            train["length"], collator.objective, drop_last=bool(settings["training"].get("dataloader_drop_last")),
            **batching,
        )
        if train_sampler.buckets is not None:
            # the evaluation batches take the training shapes too
            batching["shape_buckets"] = list(train_sampler.buckets.target_widths)
            print("packed batches in shapes (rows, encoder, decoder): "
                  + ", ".join(str(shape) for shape in train_sampler.buckets.shapes()), flush=True)
    evaluation, eval_sampler = None, None
    if eval_texts is not None and data.get("max_eval_documents"):
        eval_texts = eval_texts.select(range(min(int(data["max_eval_documents"]), len(eval_texts))))
    if eval_texts is not None:
        evaluation = tokenize_dataset(eval_texts, tokenizer, **tokenize)
        eval_sampler = UL2PackedBatchSampler(evaluation["length"], collator.objective, shuffle=False, **batching)
    return PackedBatches(train, train_sampler, evaluation, eval_sampler)


def _build_trainer(settings: dict, output_dir: Path, model, tokenizer, collator, batches: PackedBatches):
    from .trainer import FAT5Trainer, FAT5TrainingArguments

    try:
        arguments = FAT5TrainingArguments(
            output_dir=str(output_dir),
            seed=_seed(settings),
            remove_unused_columns=False,
            **{key: value for key, value in settings["training"].items() if key != "output_dir"},
        )
    except (TypeError, ValueError) as error:
        raise FAT5Error(f"invalid training section: {error}") from None
    if batches.evaluation is None and arguments.eval_strategy != "no":
        arguments.eval_strategy = "no"
    return FAT5Trainer(
        model=model,
        args=arguments,
        train_dataset=batches.train,
        eval_dataset=batches.evaluation,
        data_collator=collator,
        processing_class=tokenizer,
        train_batch_sampler=batches.train_sampler,
        eval_batch_sampler=batches.eval_sampler,
    )


def _train_evaluate_save(trainer, tokenizer, checkpoint: Path | None, output_dir: Path) -> dict:
    """Train (from ``checkpoint`` when resuming), evaluate, save the model and tokenizer to ``output_dir`` itself
    and write ``pretrain_summary.json``; returns the summary."""
    from transformers import AutoModelForSeq2SeqLM

    from .trainer import require_full_state_dict

    require_full_state_dict(trainer)
    train_output = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    metrics = trainer.evaluate() if trainer.eval_dataset is not None else {}
    _save_verified(trainer, tokenizer, output_dir)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    summary = {
        "output": str(output_dir),
        "steps": trainer.state.global_step,
        "first_logged_loss": losses[0] if losses else None,
        "last_logged_loss": losses[-1] if losses else None,
        "train_loss": train_output.training_loss,
        "eval_loss": metrics.get("eval_loss"),
        "log_history": trainer.state.log_history,
    }
    if trainer.is_world_process_zero():
        with open(output_dir / "pretrain_summary.json", "w") as handle:
            json.dump(summary, handle, indent=2)
        # a last check that what was written is what users will load
        AutoModelForSeq2SeqLM.from_pretrained(output_dir)
    # no process returns before the model and summary are in place
    trainer.accelerator.wait_for_everyone()
    return summary


def _save_verified(trainer, tokenizer, final: Path) -> None:
    """Save model and tokenizer to a temporary folder inside ``final``, load it back, then move its files to the
    top of ``final``.

    Every process calls it: under FSDP, ``save_model`` gathers the full state dict from all of them (and writes
    it from the main process, as it always does); the files are touched by the main process alone.
    """
    from transformers import AutoModelForSeq2SeqLM

    from ..output_folder import final_model_disk_full_error

    main_process = trainer.is_world_process_zero()
    temporary = final / ".final-model.tmp"
    if main_process:
        shutil.rmtree(temporary, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    try:
        trainer.save_model(str(temporary))
        if main_process:
            tokenizer.save_pretrained(str(temporary))
            AutoModelForSeq2SeqLM.from_pretrained(temporary)
            move_into(temporary, final)
    except Exception as error:
        if not is_disk_full(error, temporary):
            raise
        shutil.rmtree(temporary, ignore_errors=True)
        raise final_model_disk_full_error(final) from None
    trainer.accelerator.wait_for_everyone()
