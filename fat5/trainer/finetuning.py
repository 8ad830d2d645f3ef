"""`fat5 finetune CONFIG.yaml`: finetune a FAT5 model on a `datasets` dataset, fully or with LoRA, with FAT5Trainer.

Tasks: ``seq2seq`` (summarisation, instructions: ``text_column`` -> ``target_column``, evaluated with ROUGE on
generated text), ``sequence_classification`` and ``token_classification`` (the encoder heads). The configuration's
keys, their defaults and meanings are the fields of `fat5.trainer.finetune_config.FinetuneConfig` (`fat5 finetune
--help` lists them); the model side is in `finetune_model`, the data side in `finetune_data`.

What it writes in ``output_dir``, as transformers' Trainer does: the final model and its tokenizer in the folder
itself, so that ``from_pretrained(output_dir)`` loads it (after ``import fat5``): the finetuned model, or with LoRA
the adapter merged back into a plain FAT5 model, the PEFT adapter itself then in ``adapter/`` (which
``peft.AutoPeftModelForSeq2SeqLM.from_pretrained`` loads; with ``merge: false`` the adapter is the folder's model);
the checkpoints in ``checkpoint-N``; ``bundle/`` when asked; ``metrics.json``; and the resolved configuration as
``finetune_config.yaml``. A folder that already holds a model or checkpoints is refused: ``--resume`` continues from
its newest complete checkpoint, ``--overwrite`` removes what a run wrote there (never the user's other files, nor a
folder that holds the input).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import FAT5Error
from ..output_folder import is_disk_full, move_into, prepare_run_folder
from .finetune_config import load_finetune_config
from .finetune_data import data_collator, label_mapping, limit_samples, load_raw_datasets, tokenize_datasets
from .finetune_model import apply_lora, load_model, resolve_model_path
from .tokenizer import load_tokenizer


def finetune(config_path_or_dict, output_dir=None, overrides=(), overwrite: bool = False, resume: bool = False) -> dict:
    """Run the `fat5 finetune` job described by a YAML file or a dict (see `FinetuneConfig` for its keys).

    Returns ``{"output_dir", "model_dir", "adapter_dir", "merged_dir", "bundle_dir", "train", "eval",
    "log_history"}``: the folders written (None where not applicable), the train and final evaluation metrics and
    the Trainer's log history. Configuration and data mistakes raise `FAT5Error`, as does an output folder that
    already holds a model or checkpoints unless ``resume`` (continue from the newest complete checkpoint) or
    ``overwrite`` (remove what a run wrote there) is set.
    """
    config = load_finetune_config(config_path_or_dict, output_dir=output_dir, overrides=overrides)
    _prepare_output_folder(config, config_path_or_dict, overwrite=overwrite, resume=resume)
    setup = prepare_finetune(config)
    return run_finetune(setup, resume=resume)


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
    model_path = resolve_model_path(config["model"])
    tokenizer = load_tokenizer(config["tokenizer"] or model_path, config["task"])
    raw = load_raw_datasets(config["data"])
    args = training_arguments(config, has_eval_data="validation" in raw)
    # what the job needs later (a metric's package, a writable folder, the tokenizer's tokens) is checked now
    compute_metrics = _compute_metrics(config["task"], tokenizer, args) if "validation" in raw else None
    _check_job_needs(config, tokenizer)
    model_kwargs, label_ids = _model_kwargs(config, raw)
    # under several processes the main one tokenizes first and the others read the datasets cache it wrote
    with args.main_process_first(desc="tokenizing"):
        tokenized = tokenize_datasets(limit_samples(raw, config["data"]), tokenizer, config["task"], config["data"],
                                      label_ids)
    model = _build_model(config, model_path, model_kwargs, tokenizer, args)
    eval_dataset = tokenized.get("validation")
    trainer = _build_trainer(config, args, model, tokenizer, tokenized["train"], eval_dataset, compute_metrics)
    return FinetuneSetup(config=config, trainer=trainer, model=model, tokenizer=tokenizer,
                         train_dataset=tokenized["train"], eval_dataset=eval_dataset, model_path=model_path,
                         model_kwargs=model_kwargs)


def run_finetune(setup: FinetuneSetup, resume: bool = False) -> dict:
    """Train (from the newest complete checkpoint of the output folder with ``resume``), evaluate and save what
    `prepare_finetune` built; returns the paths written and the metrics."""
    from ..checkpoints import find_resume_checkpoint
    from .trainer import require_full_state_dict

    trainer, output_dir = setup.trainer, Path(setup.config["output_dir"])
    require_full_state_dict(trainer)
    checkpoint = find_resume_checkpoint(output_dir, announce=trainer.is_world_process_zero()) if resume else None
    train_result = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    eval_metrics = trainer.evaluate_final_weights() if setup.eval_dataset is not None else None
    result = {"output_dir": str(output_dir), **_save_models(setup, output_dir), "train": dict(train_result.metrics),
              "eval": eval_metrics, "log_history": list(trainer.state.log_history)}
    if trainer.is_world_process_zero():
        _write_records(setup.config, result, output_dir)
    # no process returns before the main one has written what the result names
    trainer.accelerator.wait_for_everyone()
    return result


# ----------------------------------------------------------------------------------------------- preparing


def training_arguments(config: dict, has_eval_data: bool):
    """`FAT5TrainingArguments` from the ``training`` section plus the job's defaults (see `FinetuneConfig.training`)."""
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


def _model_kwargs(config: dict, raw) -> tuple[dict, dict | None]:
    """The config fields the model loads with (``model_overrides``, and an encoder head's classes read from the
    data), and the raw label -> class index map the tokenizing uses."""
    model_kwargs = dict(config["model_overrides"])
    if config["task"] == "seq2seq":
        return model_kwargs, None
    column = config["data"]["target_column"]
    label_names, label_ids = label_mapping(raw, column, sequence=config["task"] == "token_classification")
    model_kwargs["num_labels"] = len(label_names) if label_names else 1
    model_kwargs["problem_type"] = "single_label_classification" if label_names else "regression"
    if label_names:
        model_kwargs["id2label"] = dict(enumerate(label_names))
        model_kwargs["label2id"] = {name: index for index, name in enumerate(label_names)}
    return model_kwargs, label_ids


def _build_model(config: dict, model_path: str, model_kwargs: dict, tokenizer, args):
    """The task's model, seeded as the run is, wrapped in LoRA adapters when configured."""
    from transformers import set_seed

    set_seed(args.seed)
    model = load_model(config["task"], model_path, model_kwargs, config["dtype"])
    if len(tokenizer) > model.config.vocab_size:
        raise FAT5Error(f"tokenizer: {len(tokenizer)} tokens, more than the model's vocab_size "
                        f"{model.config.vocab_size}; give the model's own tokenizer")
    if config["lora"] is None:
        return model
    if args.gradient_checkpointing:
        # the frozen embedding's output must require grad for checkpointed blocks to pass gradients back
        model.enable_input_require_grads()
    return apply_lora(model, config["task"], config["lora"])


def _compute_metrics(task: str, tokenizer, args):
    """The task's ``compute_metrics``; ROUGE's fails here, naming the package to install, when it is missing."""
    from .metrics import rouge_metric, sequence_classification_metric, token_classification_metric

    if task == "seq2seq":
        return rouge_metric(tokenizer) if args.predict_with_generate else None
    return {"sequence_classification": sequence_classification_metric,
            "token_classification": token_classification_metric}[task]


def _check_job_needs(config: dict, tokenizer) -> None:
    """Before any work: the output folder (or the folder it will be made in) is writable, and a seq2seq tokenizer
    has the end-of-sequence token its targets end with."""
    folder = Path(config["output_dir"]).absolute()
    while not folder.exists():
        folder = folder.parent
    if not os.access(folder, os.W_OK):
        raise FAT5Error(f"output_dir: cannot write in {folder}; choose an output folder you can write to")
    if config["task"] == "seq2seq" and tokenizer.eos_token_id is None:
        raise FAT5Error("tokenizer: it has no end-of-sequence (eos) token, which seq2seq targets end with; give a "
                        "tokenizer with one")


def _build_trainer(config: dict, args, model, tokenizer, train_dataset, eval_dataset, compute_metrics):
    from .trainer import FAT5Trainer

    return FAT5Trainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=data_collator(config["task"], tokenizer, config["data"]["pad_to_multiple_of"]),
        compute_metrics=compute_metrics,
    )


def _prepare_output_folder(config: dict, config_path_or_dict, overwrite: bool, resume: bool) -> None:
    """Refuse, resume or empty the output folder as asked; never touching what the job reads."""
    from accelerate import PartialState

    state = PartialState()
    inputs = _inputs(config)
    if isinstance(config_path_or_dict, (str, os.PathLike)):
        inputs.append(Path(config_path_or_dict))
    prepare_run_folder(config["output_dir"], overwrite=overwrite, resume=resume, inputs=inputs,
                       main_process=state.is_main_process)
    state.wait_for_everyone()


def _inputs(config: dict) -> list[Path]:
    """The local paths a finetuning job reads (model, tokenizer, data files): never removed by ``--overwrite``."""
    data = config["data"]
    paths = [config["model"], config["tokenizer"], data["dataset_name"]]
    for name in ("train_file", "validation_file"):
        paths += data[name] if isinstance(data[name], list) else [data[name]]
    return [Path(path) for path in paths if isinstance(path, (str, os.PathLike)) and Path(path).exists()]


# ----------------------------------------------------------------------------------------------- saving


def _save_models(setup: FinetuneSetup, output_dir: Path) -> dict:
    """Save the trained model (or adapter, and the merged model) and the bundle; returns the folders written,
    None where not applicable. A full disk says so in one line, its half-written temporary folders removed."""
    from ..output_folder import final_model_disk_full_error

    try:
        return _write_models(setup, output_dir)
    except Exception as error:
        if not is_disk_full(error, output_dir):
            raise
        for temporary in (".final-model.tmp", ".merged-model.tmp", "adapter"):
            shutil.rmtree(output_dir / temporary, ignore_errors=True)
        raise final_model_disk_full_error(output_dir) from None


def _write_models(setup: FinetuneSetup, output_dir: Path) -> dict:
    config, trainer = setup.config, setup.trainer
    # save_model writes from the main process only; the steps after it run there alone
    main_process = trainer.is_world_process_zero()
    folders = {"model_dir": None, "adapter_dir": None, "merged_dir": None, "bundle_dir": None}
    if config["lora"] is None:
        _save_final(trainer, output_dir)
        folders["model_dir"] = str(output_dir)
    elif config["lora"]["merge"]:
        adapter_dir = output_dir / "adapter"
        trainer.save_model(str(adapter_dir))
        folders["adapter_dir"] = str(adapter_dir)
        if main_process:
            merge_adapter(setup, adapter_dir, output_dir)
        folders["merged_dir"] = str(output_dir)
    else:
        _save_final(trainer, output_dir)
        folders["adapter_dir"] = str(output_dir)
    if config["bundle"]:
        bundle_dir = output_dir / "bundle"
        if main_process:
            from ..hub_upload import bundle

            # finetune_config.yaml, where a later `fat5 bundle` reads the prefix, is not written yet
            bundle(output_dir, bundle_dir, overwrite=True, source_prefix=config["data"]["source_prefix"])
        folders["bundle_dir"] = str(bundle_dir.absolute())
    return folders


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


def _write_records(config: dict, result: dict, output_dir: Path) -> None:
    """``metrics.json`` and the resolved configuration, ``finetune_config.yaml``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    metrics = {"train": result["train"], "eval": result["eval"]}
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    (output_dir / "finetune_config.yaml").write_text(yaml.safe_dump(_as_written(config), sort_keys=False),
                                                     encoding="utf-8")


def _as_written(config: dict) -> dict:
    """The config as finetune_config.yaml records it: a dataset given as an object is named by its size."""
    data = {key: f"<datasets.Dataset of {len(value)} rows, given in memory>" if hasattr(value, "column_names")
            else value for key, value in config["data"].items()}
    return {**config, "data": data}
