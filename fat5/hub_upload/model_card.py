"""The README.md model card of a bundled FAT5 folder, written with huggingface_hub's ModelCard / ModelCardData."""

import json
from pathlib import Path

import yaml
from huggingface_hub import ModelCard, ModelCardData

from ..errors import FAT5Error

PIPELINE_TAGS = {
    "FAT5ForConditionalGeneration": "text2text-generation",
    "FAT5Model": "feature-extraction",
    "FAT5EncoderModel": "feature-extraction",
    "FAT5ForSequenceClassification": "text-classification",
    "FAT5ForTokenClassification": "token-classification",
    "FAT5ForQuestionAnswering": "question-answering",
}
AUTO_CLASS_FOR = {
    "FAT5ForConditionalGeneration": "AutoModelForSeq2SeqLM",
    "FAT5Model": "AutoModel",
    "FAT5EncoderModel": "AutoModel",
    "FAT5ForSequenceClassification": "AutoModelForSequenceClassification",
    "FAT5ForTokenClassification": "AutoModelForTokenClassification",
    "FAT5ForQuestionAnswering": "AutoModelForQuestionAnswering",
}
FAMILY_TAGS = {"t5": "t5", "mt5": "mt5", "umt5": "umt5"}
# the text of the card's example, after the prefix the model was trained with (`example_input`)
SAMPLE_TEXT = "The house is wonderful."
# what `fat5 finetune` writes beside the model it saves: its resolved configuration, the source prefix included
FINETUNE_CONFIG_FILE = "finetune_config.yaml"
# UL2's prefix-LM mode token: `fat5 pretrain` puts it before the texts its model learns to continue
PREFIX_LM_MODE = "[S] "


def _check_section(report: dict) -> str:
    verification = report.get("verification")
    if not verification:
        return (
            "This model was converted without the numerical check (`--no-verify`): its outputs were not compared "
            "with transformers'.\n"
        )
    rows = [
        f"| {name.removesuffix('_relative_error').replace('_', ' ')} | {value:.2e} |"
        for name, value in verification.items()
        if name.endswith("_relative_error")
    ]
    notes = "".join(f"\n- {note}" for note in report.get("notes", []))
    return (
        f"`fat5 convert` ran `{verification['reference']}` on the source checkpoint and this FAT5 model on the same "
        f"random batch with padding ({verification.get('compute_dtype', 'float32')}, CPU) and wrote the model only "
        f"because their outputs agreed within a relative error of {verification['tolerance']:g} "
        f"(‖FAT5 − transformers‖ / ‖transformers‖ over the non-padded positions):\n\n"
        "| output | relative error |\n|---|---|\n" + "\n".join(rows) + "\n\n"
        f"Weights stored in {report.get('dtype', 'their source dtype')}; checked with transformers "
        f"{report.get('transformers_version', '?')} and torch {report.get('torch_version', '?')} on "
        f"{report.get('date', '?')}.{notes}\n"
    )


NO_REPORT = "No conversion report: this model was not produced by `fat5 convert`."
# The card's text below the YAML header; every {field} is filled by build_model_card.
CARD_BODY = """
# {title}

This is {origin}. FAT5 (Flash Attention T5) runs T5's attention in fused Triton kernels that add the relative
position bias inside the kernel, so memory grows linearly with sequence length, with fused RMSNorm and
cross-entropy; on a CPU, or without Triton, it runs the same model in plain PyTorch.

Architecture: {sizes}.

## How to load

The modelling code ships with the weights, so only `transformers` and `torch` are needed (`triton` >= 3.3 for the fused
kernels on a GPU):

```python
from transformers import AutoTokenizer, {auto_class}

tokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)
model = {auto_class}.from_pretrained("{name}", trust_remote_code=True)
{usage_inputs}
```

The tokenizer is a plain fast tokenizer (`tokenizer.json`): `PreTrainedTokenizerFast.from_pretrained("{name}")` loads it
without the shipped code. `AutoTokenizer` first reads `config.json`, whose model type `fat5` the shipped code defines,
hence `trust_remote_code=True` there too (without it, transformers asks on the terminal whether to run that code).

With the `fat5` package installed, `import fat5` registers the same classes with transformers' Auto classes{export}.

## Conversion check

{check}
"""


def _title(repo_id: str | None, base_model: str | None, architecture: str) -> str:
    """The repo's name; before it has one, the base model's in FAT5, else what the folder holds."""
    if repo_id:
        return repo_id.split("/")[-1]
    if base_model:
        return f"{base_model.split('/')[-1]} in FAT5"
    return f"A FAT5 model ({architecture})"


def build_model_card(
    config: dict,
    *,
    architecture: str,
    report: dict | None = None,
    repo_id: str | None = None,
    license: str | None = None,
    base_model: str | None = None,
    example_input: str = SAMPLE_TEXT,
) -> ModelCard:
    """A model card for a bundled FAT5 folder with `config` (its config.json) and `architecture`.

    `report` is the conversion report (`fat5_conversion.json`) when the model was converted: it gives the base
    model (its Hub id), the licence and the check's figures unless `base_model` / `license` are passed.
    `example_input` is the text the card's code gives the model (`example_input` finds the one that fits a folder).
    """
    report = report or {}
    base_model = base_model or report.get("repo_id")
    auto_class = AUTO_CLASS_FOR.get(architecture, "AutoModel")
    card_data = ModelCardData(
        license=license or report.get("license"),
        base_model=base_model,
        library_name="transformers",
        pipeline_tag=PIPELINE_TAGS.get(architecture, "text2text-generation"),
        tags=_tags(report.get("source_model_type")),
    )
    body = CARD_BODY.format(
        title=_title(repo_id, base_model, architecture),
        origin=_origin(base_model, report),
        sizes=_architecture_summary(config),
        auto_class=auto_class,
        name=repo_id or "path/to/this/folder",
        usage_inputs=_usage_lines(auto_class, example_input),
        export=_export_clause(config),
        check=_check_section(report) if report else NO_REPORT,
    )
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n{body}")


def _tags(family: str | None) -> list[str]:
    family_tags = [FAMILY_TAGS[family]] if family in FAMILY_TAGS else []
    return ["fat5", "flash-attention", "triton", "remote-code", *family_tags]


def _origin(base_model: str | None, report: dict) -> str:
    """What the model is, for the card's first sentence: a conversion of `base_model`, of a checkpoint, or neither."""
    if base_model:
        return f"a FAT5 conversion of [{base_model}](https://huggingface.co/{base_model})"
    return "a FAT5 conversion of a " + report["source_architecture"] + " checkpoint" if report else "a FAT5 model"


def example_input(model_dir, report: dict | None = None, source_prefix: str | None = None) -> str:
    """The card's example text in the form the model in `model_dir` was trained on: after `source_prefix`, or the
    source prefix of its finetuning (`finetune_config.yaml` beside it); after UL2's prefix-LM mode token for a model
    that `fat5 pretrain` trained (its tokenizer has the mode tokens), which then continues the text; as a
    translation instruction for a converted FLAN checkpoint (`report`, its conversion report); else bare."""
    model_dir = Path(model_dir)
    if source_prefix is None and (model_dir / FINETUNE_CONFIG_FILE).is_file():
        source_prefix = _finetuning_prefix(model_dir / FINETUNE_CONFIG_FILE)
    if source_prefix is not None:
        return source_prefix + SAMPLE_TEXT
    if PREFIX_LM_MODE.strip() in _tokenizer_tokens(model_dir):
        return PREFIX_LM_MODE + SAMPLE_TEXT
    if "flan" in str((report or {}).get("repo_id", "")).lower():
        return "translate English to German: " + SAMPLE_TEXT
    return SAMPLE_TEXT


def _finetuning_prefix(path: Path) -> str:
    try:
        finetuning = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise FAT5Error(f"{path} is not valid YAML{where}; fix it or remove it from the model folder") from None
    data = finetuning.get("data") if isinstance(finetuning, dict) else None
    return str((data.get("source_prefix") if isinstance(data, dict) else None) or "")


def _tokenizer_tokens(model_dir: Path) -> set[str]:
    """The added tokens of the folder's fast tokenizer (where the mode tokens are), none without tokenizer.json."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return set()
    try:
        tokenizer = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FAT5Error(f"{path} is not valid JSON ({error}); fix it or remove it from the model folder") from None
    added = tokenizer.get("added_tokens") if isinstance(tokenizer, dict) else None
    return {token.get("content") for token in added or [] if isinstance(token, dict)}


def _usage_lines(auto_class: str, text: str) -> str:
    """The lines of the loading example that run the model on `text`: generation for a seq2seq LM, else one
    forward."""
    # a JSON string is a Python string literal too, whatever quotes or backslashes the text holds
    literal = json.dumps(text, ensure_ascii=False)
    if auto_class == "AutoModelForSeq2SeqLM":
        return (
            f'inputs = tokenizer({literal}, return_tensors="pt")\n'
            "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=32)[0], skip_special_tokens=True))"
        )
    return f'outputs = model(**tokenizer({literal}, return_tensors="pt"))'


def _architecture_summary(config: dict) -> str:
    return (
        f"d_model {config.get('d_model')}, {config.get('num_layers')} encoder / {config.get('num_decoder_layers')} "
        f"decoder layers, {config.get('num_heads')} heads of {config.get('d_kv')}, feed-forward {config.get('d_ff')} "
        f"({config.get('feed_forward_proj')}), vocabulary {config.get('vocab_size')}, position encoding "
        f"`{config.get('position_encoding')}`"
        + (" (a bias table in every layer)" if config.get("position_bias_per_layer") else "")
    )


def _export_clause(config: dict) -> str:
    """The end of the sentence on `fat5`'s Auto classes: `fat5 export-hf` when the model has a T5 equivalent."""
    if config.get("position_encoding") == "t5" and config.get("attention_scale", 1.0) == 1.0:
        return ", and `fat5 export-hf` writes the model back as a plain transformers T5 checkpoint"
    return ""
