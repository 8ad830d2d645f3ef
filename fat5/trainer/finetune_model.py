"""The model side of `fat5 finetune`: the FAT5 folder or Hub id, the task's class, the tokenizer and PEFT's LoRA."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import FAT5Error
from ..folder_contents import TOKENIZER_VOCABULARY_FILES, read_config_json
from .finetune_config import FinetuneConfig, LoraSection

# PEFT's task type, and the head that trains in full beside the adapters, per task
PEFT_TASK_TYPES = {"seq2seq": "SEQ_2_SEQ_LM", "sequence_classification": "SEQ_CLS", "token_classification": "TOKEN_CLS"}
HEAD_MODULES = {"seq2seq": None, "sequence_classification": ["classification_head"],
                "token_classification": ["classifier"]}
ATTENTION_PROJECTIONS = ["q", "k", "v", "o"]
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def resolve_model_path(model: str) -> str:
    """A local FAT5 folder as an absolute path (a saved adapter records it to find its base), or a Hub repo id."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        missing = f"model: {folder} has no config.json; give a FAT5 model folder (`fat5 convert` writes one)"
        model_type = read_config_json(folder, missing).get("model_type")
        if model_type != "fat5":
            raise FAT5Error(
                f"model: {folder} holds a {model_type!r} model, not a FAT5 one; convert it first: "
                f"fat5 convert {model} OUT_DIR"
            )
        return str(folder.resolve())
    if folder.exists() or not _HUB_ID.match(model) or model.startswith((".", "/", "~")):
        raise FAT5Error(f"model: {model} is not a model folder (no such directory) nor a Hub repo id")
    _refuse_an_unreachable_hub(model)
    _model_config(model)
    return model


def check_local_model(settings: FinetuneConfig) -> None:
    """A model folder, checked without torch or transformers: a FAT5 one (`resolve_model_path`), holding the
    tokenizer the job loads from it when the config names none. A Hub id is checked once transformers loads."""
    folder = Path(settings.model).expanduser()
    if not folder.is_dir():
        return
    resolve_model_path(settings.model)
    if settings.tokenizer is None and not any((folder / name).is_file() for name in TOKENIZER_VOCABULARY_FILES):
        raise FAT5Error(
            f"model: {folder} holds no tokenizer (none of {', '.join(TOKENIZER_VOCABULARY_FILES)}), and the config "
            "names none: save the tokenizer of the checkpoint it was converted from into it, "
            f"AutoTokenizer.from_pretrained(NAME).save_pretrained('{folder}') (NAME: e.g. google-t5/t5-small for "
            "T5), or name one with `tokenizer:` in the config"
        )


def _refuse_an_unreachable_hub(model: str) -> None:
    """transformers' download retries a connection error with backoff for about 30 s before it fails; one request
    (``model_info`` makes one, without retries) says at once that a name found neither here nor in the Hub's cache
    cannot be looked up on the Hub."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(model, "config.json"), str):
        return
    try:
        HfApi().model_info(model)
    except HfHubHTTPError:
        return  # the Hub answered: transformers' own error says what it said
    except Exception as error:  # noqa: BLE001  (connection refused, DNS, timeouts, proxies: the HTTP stack's errors)
        raise FAT5Error(f"model: {model}: no such folder here, and the Hub at {constants.ENDPOINT} cannot be reached "
                        f"to look for a repo of that name ({type(error).__name__}: {error})") from None


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


def apply_lora(model, task: str, lora: LoraSection):
    """Wrap ``model`` in a PEFT LoRA model; the base weights freeze, the adapters (and a task head) train."""
    from peft import LoraConfig, get_peft_model

    target_modules = lora.target_modules or default_lora_targets(model)
    check_lora_targets(model, target_modules)
    modules_to_save = lora.modules_to_save if lora.modules_to_save is not None else HEAD_MODULES[task]
    peft_config = LoraConfig(
        task_type=PEFT_TASK_TYPES[task],
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=target_modules,
        modules_to_save=modules_to_save,
        bias=lora.bias,
        use_rslora=lora.use_rslora,
    )
    try:
        return get_peft_model(model, peft_config)
    except ValueError as error:
        raise FAT5Error(f"lora: {error}") from None
