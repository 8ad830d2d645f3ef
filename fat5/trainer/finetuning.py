"""`fat5 finetune CONFIG.yaml`: finetune a FAT5 model on a `datasets` dataset, fully or with LoRA, with FAT5Trainer.

Tasks: ``seq2seq`` (summarisation, instructions: ``text_column`` -> ``target_column``, evaluated with ROUGE on
generated text), ``sequence_classification`` and ``token_classification`` (the encoder heads). The configuration's
keys, their defaults and meanings are the fields of `fat5.trainer.finetune_config.FinetuneConfig` (`fat5 finetune
--help` lists them); the model side is in `finetune_model`, the data side in `finetune_data`, the steps both jobs
take in `jobs`.

What it writes in the output folder, as transformers' Trainer does: the final model and its tokenizer in the folder
itself, so that ``from_pretrained(output_dir)`` loads it (after ``import fat5``): the finetuned model, or with LoRA
the adapter merged back into a plain FAT5 model, the PEFT adapter itself then in ``adapter/`` (which
``peft.AutoPeftModelForSeq2SeqLM.from_pretrained`` loads; with ``merge: false`` the adapter is the folder's model);
the checkpoints in ``checkpoint-N``; ``bundle/`` when asked; ``metrics.json``; and the resolved configuration as
``finetune_config.yaml``. A folder that already holds a model or checkpoints is refused: ``--resume`` continues from
its newest complete checkpoint, ``--overwrite`` removes what a run wrote there (never the user's other files, nor a
folder that holds the input).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import FAT5Error
from ..folder_contents import MERGED_MODEL_STAGING, temporary_name
from ..output_folder import write_atomically
from . import jobs
from .finetune_config import FinetuneConfig, load_finetune_config
from .finetune_data import (
    check_data_files,
    data_collator,
    label_mapping,
    limit_samples,
    load_raw_datasets,
    tokenize_datasets,
)
from .finetune_model import apply_lora, check_local_model, load_model, resolve_model_path
from .tokenizer import load_tokenizer


@dataclass
class FinetuningJob:
    """A finetuning run made ready by :func:`prepare_finetuning`: its settings (the checked `FinetuneConfig`), output
    folder, the checkpoint it resumes from, tokenizer, model (wrapped in LoRA when configured), tokenized datasets,
    the trainer wired to them, and what merging an adapter needs (the base model's path and its loading fields).
    ``run()`` trains, evaluates and saves."""

    settings: FinetuneConfig
    output_dir: Path
    checkpoint: Path | None
    tokenizer: Any
    model: Any
    train_dataset: Any
    eval_dataset: Any
    trainer: Any
    model_path: str
    model_kwargs: dict = field(default_factory=dict)

    def run(self) -> dict:
        """Train, evaluate and save; returns ``{"output_dir", "model_dir", "adapter_dir", "merged_dir",
        "bundle_dir", "train", "eval", "log_history"}``: the folders written (None where not applicable), the
        train and final evaluation metrics and the Trainer's log history."""
        with jobs.released_at_the_end(self.output_dir):
            train_output, metrics = jobs.train_and_evaluate(self.trainer, self.checkpoint)
            result = {"output_dir": str(self.output_dir), **self._save_models(), "train": dict(train_output.metrics),
                      "eval": metrics, "log_history": list(self.trainer.state.log_history)}
            if self.trainer.is_world_process_zero():
                self._write_records(result)
            # no process returns before the main one has written what the result names
            self.trainer.accelerator.wait_for_everyone()
        return result

    def _save_models(self) -> dict:
        """Save the trained model (or adapter, and the merged model) and the bundle; returns the folders written,
        None where not applicable."""
        lora, output_dir = self.settings.lora, self.output_dir
        folders = {"model_dir": None, "adapter_dir": None, "merged_dir": None, "bundle_dir": None}
        if lora is None or not lora.merge:
            jobs.save_final_model(self.trainer, output_dir)
            folders["adapter_dir" if lora else "model_dir"] = str(output_dir)
        else:
            adapter_dir = output_dir / "adapter"
            merged = output_dir / temporary_name(MERGED_MODEL_STAGING)
            with jobs.final_writes(output_dir, [adapter_dir, merged]):
                self.trainer.save_model(str(adapter_dir))
                # save_model writes from the main process only; the steps after it run there alone
                if self.trainer.is_world_process_zero():
                    merge_adapter(self, adapter_dir, merged)
            folders.update(adapter_dir=str(adapter_dir), merged_dir=str(output_dir))
        if self.settings.bundle:
            bundle_dir = output_dir / "bundle"
            if self.trainer.is_world_process_zero():
                from ..hub_upload import bundle

                # finetune_config.yaml, where a later `fat5 bundle` reads the prefix, is not written yet
                bundle(output_dir, bundle_dir, overwrite=True, source_prefix=self.settings.data.source_prefix)
            folders["bundle_dir"] = str(bundle_dir.absolute())
        return folders

    def _write_records(self, result: dict) -> None:
        """``metrics.json`` and the resolved configuration, ``finetune_config.yaml`` (a dataset given as an object
        named by its size)."""
        metrics = {"train": result["train"], "eval": result["eval"]}
        write_atomically(self.output_dir / "metrics.json", (json.dumps(metrics, indent=2) + "\n").encode())
        config = self.settings.to_dict()
        config["output_dir"] = str(self.output_dir)
        config["data"] = {key: f"<datasets.Dataset of {len(value)} rows, given in memory>"
                          if hasattr(value, "column_names") else value for key, value in config["data"].items()}
        write_atomically(self.output_dir / "finetune_config.yaml", yaml.safe_dump(config, sort_keys=False).encode())


@contextlib.contextmanager
def begun_finetuning(config, output_dir=None, *, overrides=None, resume: bool = False,
                     overwrite: bool = False) -> Iterator[Path]:
    """What `fat5 finetune` does before it imports torch and transformers, in its first second: the config read and
    checked (what needs transformers' classes aside), a model folder and its tokenizer and the data files checked
    (`check_local_inputs`), the output folder checked and locked (the job, `prepare_finetuning`, takes the lock over),
    and the job said in one line. Yields the output folder, released at the end of the block."""
    settings = FinetuneConfig.read(config, overrides)
    output_dir = _output_dir(settings, output_dir)
    jobs.check_output_dir(output_dir, resume=resume, overwrite=overwrite)
    try:
        check_local_inputs(settings)
        if jobs.is_main_launch_process():
            print(_job_line(settings, output_dir, resume), flush=True)
        yield output_dir
    finally:
        jobs.release_output_dir(output_dir)


def check_local_inputs(settings: FinetuneConfig) -> None:
    """What the job reads from this machine, checked without torch or transformers: a model folder and its tokenizer
    (`check_local_model`), the data files (`check_data_files`)."""
    check_local_model(settings)
    check_data_files(settings.data)


def _job_line(settings: FinetuneConfig, output_dir: Path, resume: bool) -> str:
    """The job's first line: what it finetunes, how, on what, how long, and where."""
    data, steps = settings.data, settings.training.get("max_steps", -1)
    examples = data.dataset_name or data.train_file
    if not isinstance(examples, (str, os.PathLike)):
        examples = "the given examples"
    length = f"{steps} steps" if steps > 0 else f"{settings.training.get('num_train_epochs', 3)} epochs"
    how = "LoRA" if settings.lora is not None else "full"
    run = f"continuing the run in {output_dir}" if resume else f"into {output_dir}"
    return (f"finetuning {settings.model} ({settings.task}, {how}) for {length} on {examples}, {run} (loading torch "
            "and transformers)")


def _output_dir(settings: FinetuneConfig, output_dir) -> Path:
    output_dir = output_dir or settings.output_dir
    if output_dir is None:
        raise FAT5Error("output_dir is missing: give --output-dir (output_dir= in Python) or output_dir in the config")
    return Path(output_dir)


def prepare_finetuning(config, output_dir=None, *, overrides=None, resume: bool = False,
                       overwrite: bool = False) -> FinetuningJob:
    """Every step of :func:`finetune` before training: the settings read (``config`` updated by ``overrides``), what
    the job needs checked before any work (the model, the tokenizer and its tokens, the data, the metric's package,
    a writable output folder), the output folder prepared, the data tokenized, the model (with LoRA when configured)
    and the trainer built."""
    settings = load_finetune_config(config, overrides)
    output_dir = _output_dir(settings, output_dir)
    jobs.check_output_dir(output_dir, resume=resume, overwrite=overwrite)
    with jobs.released_on_failure(output_dir):
        check_local_inputs(settings)
        return _prepared_finetuning(settings, config, output_dir, resume=resume, overwrite=overwrite)


def _prepared_finetuning(settings: FinetuneConfig, config, output_dir: Path, *, resume: bool,
                         overwrite: bool) -> FinetuningJob:
    """`prepare_finetuning` once the output folder is locked."""
    model_path = resolve_model_path(settings.model)
    tokenizer = _checked_tokenizer(settings, model_path)
    raw = load_raw_datasets(settings.data)
    evaluates = "validation" in raw
    defaults = _training_defaults(settings, evaluates)
    compute_metrics = _compute_metrics(settings, tokenizer, {**defaults, **settings.training}) if evaluates else None
    arguments = jobs.training_arguments(output_dir, settings.training, defaults=defaults, evaluates=evaluates)
    model_kwargs, label_ids = _model_kwargs(settings, raw)
    # what the checks above found wrong left the folder untouched; what --overwrite removes goes only now
    output_dir, checkpoint = jobs.prepare_output_folder(output_dir, config, _inputs(settings), settings.training,
                                                        overwrite=overwrite, resume=resume)
    # under several processes the main one tokenizes first and the others read the datasets cache it wrote
    with arguments.main_process_first(desc="tokenizing"):
        tokenized = tokenize_datasets(limit_samples(raw, settings.data), tokenizer, settings.task, settings.data,
                                      label_ids)
    model = _build_model(settings, model_path, model_kwargs, tokenizer, arguments)
    trainer = jobs.build_trainer(arguments, model, tokenizer,
                                 data_collator(settings.task, tokenizer, settings.data.pad_to_multiple_of),
                                 tokenized["train"], tokenized.get("validation"), compute_metrics=compute_metrics)
    return FinetuningJob(settings, output_dir, checkpoint, tokenizer, model, tokenized["train"],
                         tokenized.get("validation"), trainer, model_path, model_kwargs)


def finetune(config, output_dir=None, *, overrides=None, resume: bool = False, overwrite: bool = False) -> dict:
    """Run the `fat5 finetune` job described by ``config``, a YAML path or a mapping (see `FinetuneConfig` for its
    keys), updated by ``overrides`` (a mapping of sections or ``KEY=VALUE`` strings); returns what
    `FinetuningJob.run` returns.

    The model is written to ``output_dir`` (else the config's ``output_dir``) itself. Configuration and data mistakes
    raise `FAT5Error`, as does an output folder that already holds a model or checkpoints unless ``resume``
    (continue from the newest complete checkpoint) or ``overwrite`` (remove what a run wrote there) is set.
    """
    return prepare_finetuning(config, output_dir, overrides=overrides, resume=resume, overwrite=overwrite).run()


# ----------------------------------------------------------------------------------------------- preparing


def _training_defaults(settings: FinetuneConfig, evaluates: bool) -> dict:
    """The job's training arguments, which the training section's keys override: batches grouped by length, no
    reporter, and for seq2seq with evaluation data generated answers of up to data.max_target_length tokens."""
    defaults = {"train_sampling_strategy": "group_by_length", "report_to": "none"}
    if settings.task == "seq2seq" and evaluates:
        defaults.update(predict_with_generate=True, generation_max_length=settings.data.max_target_length)
    return defaults


def _checked_tokenizer(settings: FinetuneConfig, model_path: str):
    """The configured tokenizer (default: the model's); a seq2seq one must have the end-of-sequence token its
    targets end with."""
    tokenizer = load_tokenizer(settings.tokenizer or model_path, settings.task)
    if settings.task == "seq2seq" and tokenizer.eos_token_id is None:
        raise FAT5Error("tokenizer: it has no end-of-sequence (eos) token, which seq2seq targets end with; give a "
                        "tokenizer with one")
    return tokenizer


def _compute_metrics(settings: FinetuneConfig, tokenizer, arguments: dict):
    """The task's ``compute_metrics``; ROUGE's fails here, naming the package to install, when it is missing."""
    from .metrics import rouge_metric, sequence_classification_metric, token_classification_metric

    if settings.task == "seq2seq":
        return rouge_metric(tokenizer) if arguments.get("predict_with_generate") else None
    return {"sequence_classification": sequence_classification_metric,
            "token_classification": token_classification_metric}[settings.task]


def _model_kwargs(settings: FinetuneConfig, raw) -> tuple[dict, dict | None]:
    """The config fields the model loads with (``model_overrides``, and an encoder head's classes read from the
    data), and the raw label -> class index map the tokenizing uses."""
    model_kwargs = dict(settings.model_overrides)
    if settings.task == "seq2seq":
        return model_kwargs, None
    sequence = settings.task == "token_classification"
    label_names, label_ids = label_mapping(raw, settings.data.target_column, sequence=sequence)
    model_kwargs["num_labels"] = len(label_names) if label_names else 1
    model_kwargs["problem_type"] = "single_label_classification" if label_names else "regression"
    if label_names:
        model_kwargs["id2label"] = dict(enumerate(label_names))
        model_kwargs["label2id"] = {name: index for index, name in enumerate(label_names)}
    return model_kwargs, label_ids


def _build_model(settings: FinetuneConfig, model_path: str, model_kwargs: dict, tokenizer, arguments):
    """The task's model, seeded as the run is, wrapped in LoRA adapters when configured."""
    from transformers import set_seed

    set_seed(arguments.seed)
    model = load_model(settings.task, model_path, model_kwargs, settings.dtype)
    if len(tokenizer) > model.config.vocab_size:
        raise FAT5Error(f"tokenizer: {len(tokenizer)} tokens, more than the model's vocab_size "
                        f"{model.config.vocab_size}; give the model's own tokenizer")
    if settings.lora is None:
        return model
    if arguments.gradient_checkpointing:
        # the frozen embedding's output must require grad for checkpointed blocks to pass gradients back
        model.enable_input_require_grads()
    return apply_lora(model, settings.task, settings.lora)


def _inputs(settings: FinetuneConfig) -> list:
    """The paths a finetuning job reads (model, tokenizer, data): never removed by ``--overwrite``."""
    data = settings.data
    paths = [settings.model, settings.tokenizer, data.dataset_name]
    for files in (data.train_file, data.validation_file):
        paths += files if isinstance(files, list) else [files]
    return [path for path in paths if isinstance(path, (str, os.PathLike))]


# ----------------------------------------------------------------------------------------------- saving


def merge_adapter(job: FinetuningJob, adapter_dir: Path, temporary: Path) -> Path:
    """Reload the saved adapter onto a fresh copy of the base model, merge it in (``merge_and_unload``) and save the
    plain FAT5 model with the tokenizer in ``temporary``, then at the top of the output folder: the saved adapter is
    proven to load, the trained model stays as it was."""
    from peft import PeftModel

    from ..output_folder import move_into

    base = load_model(job.settings.task, job.model_path, job.model_kwargs, job.settings.dtype)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(temporary)
    job.tokenizer.save_pretrained(temporary)
    move_into(temporary, job.output_dir)
    return job.output_dir

