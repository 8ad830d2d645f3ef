"""T5-family checkpoints (T5 v1.0, T5 v1.1 / FLAN-T5, mT5, UMT5) to FAT5, and FAT5 back to transformers' T5 / UMT5.

A conversion is a config translation plus a by-name tensor mapping, since FAT5 keeps T5's parameter names. What
needs care is what transformers 5 does not keep on load, so it is read from the raw `config.json`:

- Whether `lm_head` shares the embedding: T5 v1.0 does; v1.1, FLAN-T5, mT5 and UMT5 do not, and their Hub configs
  say `"tie_word_embeddings": false`, which transformers 5's config classes overwrite with `True` (its loader then
  keeps the two tensors apart when the checkpoint holds different values). FAT5 ties exactly when the raw config
  asks for it and the checkpoint's `lm_head` (when present) equals the embedding.
- Whether the decoder output is scaled by `d_model**-0.5` before `lm_head`: original T5 does it when embeddings are
  tied. The raw `scale_decoder_outputs` (written by transformers 5) decides when present; otherwise the raw
  `tie_word_embeddings` (absent: T5's default, tied), except for mT5, which never scales (no mT5 was trained tied,
  and transformers 5's MT5 classes never scale).

transformers' UMT5 classes of 5.17 and before scale the decoder output whatever the checkpoint (they read the forced
`tie_word_embeddings=True`), unlike the original UMT5 and transformers 4; those of 5.24 read `scale_decoder_outputs`
(from the raw `tie_word_embeddings`, or the raw `scale_decoder_outputs` that they write). The verification runs
transformers' own class with the switch it reads set to what the raw config says, and records it in the report; an
export writes `scale_decoder_outputs` for T5 and UMT5.
"""

import functools
import inspect
import json
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..conversion_defaults import DEFAULT_MAX_SHARD_SIZE, DEFAULT_TOLERANCE
from ..dtypes import torch_dtype
from ..errors import FAT5Error
from ..folder_contents import REPORT_FILE, TOKENIZER_FILES
from ..output_folder import atomic_directory, check_output_folder
from .checkpoint import (
    ConversionError,
    ResolvedSource,
    copy_side_files,
    predominant_dtype,
    read_raw_config,
    read_state_dict,
    resolve_source,
)
from .verify import check_agreement, check_loading_info, compare_outputs, quiet_transformers

# transformers' class-name prefix for each supported `model_type`
FAMILY_PREFIX = {"t5": "T5", "mt5": "MT5", "umt5": "UMT5"}
# T5-like families whose computation FAT5 does not have, with why and what runs them
REFUSED_FAMILIES = {
    "longt5": "LongT5's encoder attends locally / through transient global tokens, which FAT5's attention does not "
              "compute; use transformers' LongT5ForConditionalGeneration",
    "switch_transformers": "Switch Transformers' feed-forward layers are mixtures of experts, which FAT5 does not "
                           "have; use transformers' SwitchTransformersForConditionalGeneration",
    "t5gemma": "T5Gemma uses grouped-query attention, sliding windows and logit soft-capping, which FAT5 does not; "
               "use transformers' T5GemmaForConditionalGeneration",
}
# the architectures conversion handles, by the suffix shared by transformers' and FAT5's class names
ARCHITECTURE_SUFFIXES = ("ForConditionalGeneration", "EncoderModel", "Model")
# T5's config fields that FAT5Config takes over unchanged
CONFIG_FIELDS = (
    "vocab_size",
    "d_model",
    "d_kv",
    "d_ff",
    "num_layers",
    "num_decoder_layers",
    "num_heads",
    "relative_attention_num_buckets",
    "relative_attention_max_distance",
    "dropout_rate",
    "layer_norm_epsilon",
    "initializer_factor",
    "feed_forward_proj",
    "classifier_dropout",
    "use_cache",
    "pad_token_id",
    "eos_token_id",
    "decoder_start_token_id",
)
# Tensors some T5 checkpoints carry that no model uses: the original T5 code created a bias table for the first
# block's cross-attention too (transformers ignores it on load).
UNUSED_SOURCE_TENSORS = (r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight",)
EMBEDDING_NAMES = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


@dataclass
class ConversionResult:
    """What `convert` or `export_hf` produced, and the figures of its verification."""

    output: Path
    source: str
    source_model_type: str
    source_architecture: str
    target_architecture: str
    dtype: str
    tie_word_embeddings: bool
    scale_decoder_outputs: bool
    verification: dict | None = None
    notes: list[str] = field(default_factory=list)
    repo_id: str | None = None
    revision: str | None = None
    license: str | None = None

    def to_json(self) -> dict:
        data = asdict(self)
        data["output"] = str(self.output)
        return data


def _parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None:
        return None
    try:
        return torch_dtype(dtype)
    except FAT5Error as error:
        raise ConversionError(str(error)) from None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _transformers_class(name: str):
    import transformers

    return getattr(transformers, name)


def _fat5_class(suffix: str):
    from fat5 import modeling_fat5

    return getattr(modeling_fat5, f"FAT5{suffix}")


# ----------------------------------------------------------------------------------------------- tensor mapping


def map_state_dict(
    source: dict[str, torch.Tensor], target: torch.nn.Module, unused_source_tensors: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Give every entry of `target.state_dict()` its tensor from `source`, by name, or raise with every problem.

    Entries of `target` that share one tensor (tied embeddings) form a group: any of the group's names in `source`
    supplies it, and when several are present they must hold equal values. Problems reported together: entries with
    no tensor in `source`, tensors of `source` nothing uses (except those matching `unused_source_tensors`), shape
    mismatches, and tied entries whose copies in `source` differ.
    """
    entries = target.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, tensor in entries.items():
        groups.setdefault(id(tensor), []).append(name)
    mapped, used = {}, set()
    missing, mismatched, inconsistent = [], [], []
    for names in groups.values():
        present = [name for name in names if name in source]
        used.update(present)
        if not present:
            missing.append(" = ".join(names))
            continue
        tensor = source[present[0]]
        expected_shape = tuple(entries[names[0]].shape)
        if tuple(tensor.shape) != expected_shape:
            mismatched.append(f"{present[0]}: checkpoint {tuple(tensor.shape)}, model {expected_shape}")
            continue
        for other in present[1:]:
            if source[other].shape != tensor.shape or not torch.equal(source[other], tensor):
                inconsistent.append(f"{other} != {present[0]}")
        mapped.update(dict.fromkeys(names, tensor))
    unexpected = sorted(
        name
        for name in source
        if name not in used and not any(re.fullmatch(pattern, name) for pattern in unused_source_tensors)
    )
    problems = []
    for title, items in (
        ("missing from the checkpoint", missing),
        ("unexpected in the checkpoint", unexpected),
        ("wrong shape", mismatched),
        ("tied in the model but different in the checkpoint", inconsistent),
    ):
        if items:
            problems.append(f"{title} ({len(items)}): " + ", ".join(items))
    if problems:
        raise ConversionError(
            f"the checkpoint does not match a {type(target).__name__} built from its config:\n  "
            + "\n  ".join(problems)
        )
    return mapped


# ----------------------------------------------------------------------------------------------- T5 -> FAT5


def _architecture_suffix(architectures: list[str], prefix: str) -> str | None:
    """The suffix (`ForConditionalGeneration`, `EncoderModel`, `Model`) of the first of `architectures` that is
    `prefix` + a supported suffix, or None."""
    for architecture in architectures:
        if prefix == "T5" and architecture == "T5WithLMHeadModel":  # the name of the first T5 checkpoints' class
            return "ForConditionalGeneration"
        for suffix in ARCHITECTURE_SUFFIXES:
            if architecture == prefix + suffix:
                return suffix
    return None


def _source_architecture(raw: dict, tensors: dict[str, torch.Tensor], prefix: str) -> str:
    """The suffix of the checkpoint's transformers class, from config.json or, without one there, the tensors."""
    architectures = raw.get("architectures") or []
    suffix = _architecture_suffix(architectures, prefix)
    if suffix:
        return suffix
    if architectures:
        supported = ", ".join(prefix + suffix for suffix in ARCHITECTURE_SUFFIXES)
        raise ConversionError(
            f"cannot convert a {architectures[0]} checkpoint: supported architectures are {supported}"
        )
    has_decoder = any(name.startswith("decoder.") for name in tensors)
    return "ForConditionalGeneration" if has_decoder else "EncoderModel"


def _embedding(tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    return next((tensors[name] for name in EMBEDDING_NAMES if name in tensors), None)


def _note_a_missing_tokenizer(copied: list[str], source, notes: list[str]) -> None:
    """A model without its tokenizer converts, but cannot be used, finetuned or shared as it is: the user is told at
    once, and how to add it."""
    if not set(copied) & set(TOKENIZER_FILES):
        notes.append(f"{source} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:5])}, ...): the output holds "
                     "the model alone; before finetuning, using or pushing it, save the tokenizer the checkpoint was "
                     "trained with into it: AutoTokenizer.from_pretrained(NAME).save_pretrained(OUT), NAME its Hub "
                     "name or folder (google-t5/t5-small for T5's, google/mt5-small for mT5's)")


def _tie_and_scale(raw: dict, tensors: dict[str, torch.Tensor], notes: list[str]) -> tuple[bool, bool]:
    model_type = raw["model_type"]
    raw_tie = raw.get("tie_word_embeddings", model_type != "mt5")
    if not isinstance(raw_tie, bool):
        raise ConversionError(f"config.json: tie_word_embeddings must be true or false, got {raw_tie!r}")
    if "scale_decoder_outputs" in raw:
        scale = raw["scale_decoder_outputs"]
        if not isinstance(scale, bool):
            raise ConversionError(f"config.json: scale_decoder_outputs must be true or false, got {scale!r}")
    else:
        scale = raw_tie and model_type != "mt5"
    tie = raw_tie
    head, embedding = tensors.get("lm_head.weight"), _embedding(tensors)
    differs = (
        head is not None
        and embedding is not None
        and (head.shape != embedding.shape or not torch.equal(head, embedding))
    )
    if raw_tie and differs:
        tie = False
        notes.append("config.json asks for tied embeddings but lm_head.weight differs from the embedding: kept apart")
    return tie, scale


def fat5_config_from_t5(raw: dict, tie_word_embeddings: bool, scale_decoder_outputs: bool):
    """The FAT5Config equivalent to a T5 / mT5 / UMT5 raw `config.json` (tie and scale decided by the caller)."""
    from fat5.configuration_fat5 import FAT5Config

    model_type = raw["model_type"]
    config_class = _transformers_class(FAMILY_PREFIX[model_type] + "Config")
    try:
        family_config = config_class.from_dict(dict(raw))
    except Exception as error:  # noqa: BLE001  (transformers' strict dataclass validation raises several types)
        raise ConversionError(f"config.json is not a valid {config_class.__name__}: {error}") from None
    values = {name: getattr(family_config, name) for name in CONFIG_FIELDS if hasattr(family_config, name)}
    values["decoder_start_token_id"] = raw.get("decoder_start_token_id", 0)
    if raw.get("task_specific_params"):
        values["task_specific_params"] = raw["task_specific_params"]
    try:
        return FAT5Config(
            **values,
            tie_word_embeddings=tie_word_embeddings,
            scale_decoder_outputs=scale_decoder_outputs,
            position_encoding="t5",
            position_bias_per_layer=model_type == "umt5",
            attention_scale=1.0,
            # how these checkpoints were first drawn (Mesh TensorFlow's and T5X's T5), and how the heads a finetuning
            # adds (task heads, resized vocabularies) are drawn; the converted weights themselves are never drawn
            initialization="t5x",
        )
    except ValueError as error:
        raise ConversionError(f"config.json cannot be represented as a FAT5Config: {error}") from None


def _build_model(model_class, config, tensors, unused_source_tensors=()):
    """`model_class(config)` holding `tensors` (strictly mapped by name), in fp32."""
    with quiet_transformers():
        model = model_class(config)
    mapped = map_state_dict(tensors, model, unused_source_tensors)
    model.load_state_dict(mapped, strict=True)
    return model.float().eval()


def _make_umt5_decoder_causal(reference, notes: list[str]) -> None:
    """Some transformers 5 releases (5.17 among them) build UMT5's decoder self-attention with ``is_causal=False``:
    without a decoder mask, SDPA then lets each position see the later ones. UMT5 is causal, as the fixed releases
    and FAT5 are; the reference is made so for the check."""
    decoder = getattr(reference, "decoder", None)
    if decoder is None:
        return
    attentions = [block.layer[0].SelfAttention for block in decoder.block]
    if any(getattr(attention, "is_causal", True) is False for attention in attentions):
        for attention in attentions:
            attention.is_causal = True
        notes.append("this transformers' UMT5 decoder self-attention was not causal (is_causal=False, a transformers "
                     "bug fixed in later releases); the check ran it causal, as UMT5 is")


@functools.cache
def _umt5_scaling_switch() -> str:
    """The config field the installed UMT5ForConditionalGeneration scales its decoder output by: the forced
    `tie_word_embeddings` in transformers 5.17 and before, `scale_decoder_outputs` in 5.24."""
    source = inspect.getsource(_transformers_class("UMT5ForConditionalGeneration").forward)
    return "scale_decoder_outputs" if "scale_decoder_outputs" in source else "tie_word_embeddings"


def _align_reference(reference, model_type: str, scale_decoder_outputs: bool, notes: list[str]) -> None:
    """Make transformers' class scale the decoder output as the raw config says (see the module docstring), and
    its UMT5 decoder causal."""
    if model_type == "umt5":
        _make_umt5_decoder_causal(reference, notes)
    if not hasattr(reference, "lm_head"):
        return
    if model_type == "t5":
        reference.config.scale_decoder_outputs = scale_decoder_outputs
    elif model_type == "umt5":
        switch = _umt5_scaling_switch()
        if getattr(reference.config, switch) != scale_decoder_outputs:
            notes.append(
                f"this transformers' UMT5 class scales the decoder output by d_model**-0.5 as its {switch} says "
                f"({getattr(reference.config, switch)}); the check ran it with scaling "
                f"{'on' if scale_decoder_outputs else 'off'}, as the raw config says"
            )
        setattr(reference.config, switch, scale_decoder_outputs)
    elif scale_decoder_outputs:
        raise ConversionError(
            "scale_decoder_outputs=true for an mT5 checkpoint: transformers' MT5 classes never scale, so it cannot be "
            "checked against them"
        )


def _round_through(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round the parameters of an fp32 `model` to `dtype` and back, as the written weights are."""
    if dtype != torch.float32:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(parameter.to(dtype).float())


def _verify_conversion(
    source: Path, model_type: str, suffix: str, written: Path, scale: bool, dtype: torch.dtype, tolerance: float, notes
) -> dict:
    reference_name = FAMILY_PREFIX[model_type] + suffix
    with quiet_transformers():
        reference = _transformers_class(reference_name).from_pretrained(source, dtype=torch.float32)
        converted, info = _fat5_class(suffix).from_pretrained(written, dtype=torch.float32, output_loading_info=True)
    check_loading_info(info, written)
    _align_reference(reference, model_type, scale, notes)
    _round_through(reference, dtype)
    errors = compare_outputs(reference, converted, converted.config.vocab_size, seq2seq=suffix != "EncoderModel")
    check_agreement(errors, tolerance, f"transformers' {reference_name} and the converted FAT5{suffix}")
    return {**errors, "tolerance": tolerance, "reference": f"transformers.{reference_name}", "compute_dtype": "float32"}


def _source_license(folder: Path) -> str | None:
    readme = folder / "README.md"
    if not readme.is_file():
        return None
    from huggingface_hub.repocard import metadata_load

    try:
        metadata = metadata_load(readme) or {}
    except Exception:  # noqa: BLE001  (a README without valid YAML front matter just has no licence to report)
        return None
    license_ = metadata.get("license")
    return license_ if isinstance(license_, str) else None


def _convert_into(
    resolved: ResolvedSource,
    folder: Path,
    *,
    dtype: torch.dtype | None,
    verify: bool,
    tolerance: float,
    max_shard_size,
    source_name: str,
) -> ConversionResult:
    raw = read_raw_config(resolved.path)
    model_type = raw.get("model_type")
    if model_type == "fat5":
        raise ConversionError(f"{source_name} is already a FAT5 checkpoint")
    if model_type in REFUSED_FAMILIES:
        raise ConversionError(f"{source_name}: cannot convert a {model_type!r} model: {REFUSED_FAMILIES[model_type]}")
    if model_type not in FAMILY_PREFIX:
        raise ConversionError(
            f"{source_name}: model_type {model_type!r} is not supported (supported: {', '.join(FAMILY_PREFIX)})"
        )
    tensors = read_state_dict(resolved.path)
    notes: list[str] = []
    prefix = FAMILY_PREFIX[model_type]
    suffix = _source_architecture(raw, tensors, prefix)
    tie, scale = _tie_and_scale(raw, tensors, notes)
    config = fat5_config_from_t5(raw, tie, scale)
    model = _build_model(_fat5_class(suffix), config, tensors, UNUSED_SOURCE_TENSORS)
    out_dtype = dtype or predominant_dtype(tensors)
    del tensors
    with quiet_transformers():
        model.to(out_dtype).save_pretrained(folder, max_shard_size=max_shard_size)
    del model
    _note_a_missing_tokenizer(copy_side_files(resolved.path, folder, config), source_name, notes)
    verification = None
    if verify:
        verification = _verify_conversion(resolved.path, model_type, suffix, folder, scale, out_dtype, tolerance, notes)
    result = ConversionResult(
        output=folder,
        source=source_name,
        source_model_type=model_type,
        source_architecture=prefix + suffix,
        target_architecture="FAT5" + suffix,
        dtype=_dtype_name(out_dtype),
        tie_word_embeddings=tie,
        scale_decoder_outputs=scale,
        verification=verification,
        notes=notes,
        repo_id=resolved.repo_id,
        revision=resolved.revision,
        license=_source_license(resolved.path),
    )
    _write_report(folder, result)
    return result


def _write_report(folder: Path, result: ConversionResult) -> None:
    import transformers

    report = result.to_json()
    del report["output"]
    report["transformers_version"] = transformers.__version__
    report["torch_version"] = torch.__version__
    report["date"] = time.strftime("%Y-%m-%d")
    (folder / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def convert(
    src,
    out,
    *,
    dtype: str | torch.dtype | None = None,
    verify: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
    overwrite: bool = False,
    revision: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> ConversionResult:
    """Convert a T5 / T5 v1.1 / FLAN-T5 / mT5 / UMT5 checkpoint into a FAT5 folder at `out`.

    Args:
        src: a local checkpoint folder (config.json + safetensors or pytorch_model.bin, sharded or not) or a Hub
            model id (downloaded when the Hub is reachable).
        out: the folder to create. It appears only once everything succeeded: a temporary folder beside it is
            written, verified, then renamed; on any failure nothing is left.
        dtype: `"float32"`, `"float16"` or `"bfloat16"` for the written weights; default: the source's dtype.
        verify: run transformers' own class on the source and the converted FAT5 model on one random padded batch
            (fp32, CPU) and refuse to write unless logits and encoder states agree within `tolerance` (relative).
        overwrite: replace an existing non-empty `out`.
        revision: the Hub revision when `src` is a Hub id.
        max_shard_size: weights above this size are written as safetensors shards with an index.

    Returns:
        a `ConversionResult` (also written to `out/fat5_conversion.json`), with the verification's relative errors.

    Raises:
        ConversionError (a `FAT5Error`): unreadable, inconsistent or unsupported checkpoint, failed verification.
    """
    resolved, out, options = _checked_conversion(
        src, out, dtype=dtype, verify=verify, tolerance=tolerance, overwrite=overwrite, revision=revision,
        max_shard_size=max_shard_size,
    )
    with atomic_directory(out, overwrite=overwrite, inputs=[resolved.path]) as folder:
        result = _convert_into(resolved, folder, **options)
    result.output = out
    return result


@contextmanager
def staged_conversion(src, out, **options) -> Iterator[ConversionResult]:
    """`convert(src, out, **options)` for a job that makes `out` from the converted folder itself (`fat5 convert
    --bundle`): `out` is checked as `convert` checks it, the conversion is written to a staging folder beside `out`,
    and the result, whose `output` is that folder, is yielded; the staging folder is removed afterwards."""
    resolved, out, conversion_options = _checked_conversion(src, out, **options)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.convert-", dir=out.parent))
    except OSError as error:
        raise ConversionError(f"cannot create a folder beside {out}: {error}") from None
    try:
        yield _convert_into(resolved, staging, **conversion_options)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _checked_conversion(src, out, *, dtype=None, verify=True, tolerance=DEFAULT_TOLERANCE, overwrite=False,
                        revision=None, max_shard_size=DEFAULT_MAX_SHARD_SIZE) -> tuple[ResolvedSource, Path, dict]:
    """The source resolved, `out` (absolute) checked against it, and the options of `_convert_into`."""
    out = Path(out).expanduser().absolute()
    # before a Hub download that may take minutes
    check_output_folder(out, overwrite=overwrite)
    resolved = resolve_source(src, revision)
    check_output_folder(out, overwrite=overwrite, inputs=[resolved.path])
    options = {
        "dtype": _parse_dtype(dtype),
        "verify": verify,
        "tolerance": tolerance,
        "max_shard_size": max_shard_size,
        "source_name": resolved.repo_id or str(resolved.path),
    }
    return resolved, out, options


# ----------------------------------------------------------------------------------------------- FAT5 -> T5


def _hf_config_for(fat5_config, model_type: str, suffix: str) -> dict:
    """The raw config.json of the transformers T5 / MT5 / UMT5 equivalent of `fat5_config`."""
    values = {name: getattr(fat5_config, name) for name in CONFIG_FIELDS}
    config_class = _transformers_class(FAMILY_PREFIX[model_type] + "Config")
    raw = config_class(**values).to_dict()
    raw.pop("auto_map", None)
    raw["model_type"] = model_type
    raw["architectures"] = [FAMILY_PREFIX[model_type] + suffix]
    # written as the model is, not as transformers 5 forces them (see the module docstring)
    raw["tie_word_embeddings"] = fat5_config.tie_word_embeddings
    if model_type in ("t5", "umt5"):
        raw["scale_decoder_outputs"] = fat5_config.scale_decoder_outputs
    else:
        raw.pop("scale_decoder_outputs", None)
    return raw


def _export_family(fat5_config, folder: Path, family: str | None) -> str:
    if fat5_config.position_encoding != "t5":
        raise ConversionError(
            f"export-hf needs the T5 position encoding; this model uses position_encoding="
            f"{fat5_config.position_encoding!r}, which transformers' T5 classes cannot run"
        )
    if fat5_config.effective_attention_scale != 1.0:
        raise ConversionError(
            f"export-hf needs attention_scale=1.0 (T5's); this model scales attention scores by "
            f"{fat5_config.effective_attention_scale:g}"
        )
    if family is None:
        report = folder / REPORT_FILE
        recorded = json.loads(report.read_text()).get("source_model_type") if report.is_file() else None
        family = "umt5" if fat5_config.position_bias_per_layer else ("mt5" if recorded == "mt5" else "t5")
    if family not in FAMILY_PREFIX:
        raise ConversionError(f"family must be one of {', '.join(FAMILY_PREFIX)}, got {family!r}")
    if (family == "umt5") != bool(fat5_config.position_bias_per_layer):
        raise ConversionError(
            "a position-bias table in every layer (position_bias_per_layer=true) is UMT5's layout and only UMT5's: "
            f"cannot export this model as {family}"
        )
    if family == "mt5" and fat5_config.scale_decoder_outputs:
        raise ConversionError("transformers' MT5 classes never scale the decoder output: export this model as t5")
    return family


def export_hf(
    fat5_dir,
    out,
    *,
    family: str | None = None,
    dtype: str | torch.dtype | None = None,
    verify: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> ConversionResult:
    """Write a FAT5 folder back as a transformers T5 / MT5 / UMT5 checkpoint folder at `out`.

    Only models with the T5 position encoding and attention scale 1.0 have an equivalent. `family` defaults to
    `umt5` for a bias table per layer, else to the family recorded at conversion (`mt5`), else `t5`. The export is
    verified like `convert` (transformers' class loading `out` against the FAT5 model) and written atomically;
    tokenizer files and generation_config.json are copied.
    """
    dtype = _parse_dtype(dtype)
    source, raw, fat5_config = _read_fat5_folder(fat5_dir)
    family = _export_family(fat5_config, source, family)
    check_output_folder(out, overwrite=overwrite, inputs=[source])
    suffix = _export_suffix(raw)
    tensors = read_state_dict(source)
    out_dtype = dtype or predominant_dtype(tensors)
    hf_raw, target = _transformers_model_for(fat5_config, family, suffix)
    mapped = map_state_dict(tensors, target)
    del tensors
    notes: list[str] = []
    if family == "umt5" and not fat5_config.scale_decoder_outputs and hasattr(target, "lm_head"):
        notes.append(
            "the export says scale_decoder_outputs=false, which transformers 5.24's UMT5 classes follow; those of "
            "5.17 and before scale the decoder output of every checkpoint, and transformers 4 follows "
            f"tie_word_embeddings ({'true: scaling' if fat5_config.tie_word_embeddings else 'false: no scaling'})"
        )
    with atomic_directory(out, overwrite=overwrite, inputs=[source]) as folder:
        _write_hf_weights(target, mapped, folder, out_dtype, max_shard_size)
        (folder / "config.json").write_text(json.dumps(hf_raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        _note_a_missing_tokenizer(copy_side_files(source, folder, fat5_config), source, notes)
        verification = None
        if verify:
            verification = _verify_export(source, folder, family, suffix, fat5_config, out_dtype, tolerance)
    return ConversionResult(
        output=Path(out).expanduser().absolute(),
        source=str(source),
        source_model_type="fat5",
        source_architecture="FAT5" + suffix,
        target_architecture=FAMILY_PREFIX[family] + suffix,
        dtype=_dtype_name(out_dtype),
        tie_word_embeddings=fat5_config.tie_word_embeddings,
        scale_decoder_outputs=fat5_config.scale_decoder_outputs,
        verification=verification,
        notes=notes,
    )


def _read_fat5_folder(fat5_dir) -> tuple:
    """The FAT5 folder `fat5_dir` as (its path, its raw config.json, its FAT5Config), or a ConversionError saying
    why it is not one."""
    from fat5.configuration_fat5 import FAT5Config

    source = Path(fat5_dir).expanduser()
    if not source.is_dir():
        raise ConversionError(f"{fat5_dir}: no such folder")
    raw = read_raw_config(source)
    if raw.get("model_type") != "fat5":
        raise ConversionError(f"{fat5_dir} is not a FAT5 model folder (model_type {raw.get('model_type')!r})")
    try:
        fat5_config = FAT5Config.from_dict(raw)
    except ValueError as error:
        raise ConversionError(f"{source / 'config.json'} is not a valid FAT5Config: {error}") from None
    return source, raw, fat5_config


def _export_suffix(raw: dict) -> str:
    """The architecture suffix shared by the FAT5 folder's class and its transformers equivalent."""
    suffix = _architecture_suffix(raw.get("architectures") or ["FAT5ForConditionalGeneration"], "FAT5")
    if suffix is None:
        raise ConversionError(
            f"export-hf handles {', '.join('FAT5' + s for s in ARCHITECTURE_SUFFIXES)}; "
            f"this folder holds {raw.get('architectures')}"
        )
    return suffix


def _transformers_model_for(fat5_config, family: str, suffix: str) -> tuple[dict, torch.nn.Module]:
    """The raw config.json of the transformers equivalent of `fat5_config`, and that model, freshly built."""
    hf_raw = _hf_config_for(fat5_config, family, suffix)
    hf_config = _transformers_class(FAMILY_PREFIX[family] + "Config").from_dict(hf_raw)
    with quiet_transformers():
        target = _transformers_class(FAMILY_PREFIX[family] + suffix)(hf_config)
    if hasattr(target, "lm_head") and not fat5_config.tie_word_embeddings:
        # transformers 5 ties lm_head whatever the config says; an untied model needs its own tensor
        target.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.detach().clone())
    return hf_raw, target


def _write_hf_weights(target, mapped: dict, folder: Path, dtype: torch.dtype, max_shard_size) -> None:
    """One tensor per group of tied entries (under its first name, `shared.weight` for the embeddings)."""
    from huggingface_hub import save_torch_state_dict

    entries = target.state_dict(keep_vars=True)
    seen, tensors = set(), {}
    for name, entry in entries.items():
        if id(entry) not in seen:
            seen.add(id(entry))
            tensors[name] = mapped[name].to(dtype).contiguous().clone()
    save_torch_state_dict(tensors, folder, max_shard_size=max_shard_size, metadata={"format": "pt"})


def _verify_export(source, folder, family, suffix, fat5_config, dtype, tolerance) -> dict:
    reference_name = FAMILY_PREFIX[family] + suffix
    with quiet_transformers():
        fat5_model = _fat5_class(suffix).from_pretrained(source, dtype=torch.float32)
        exported, info = _transformers_class(reference_name).from_pretrained(
            folder, dtype=torch.float32, output_loading_info=True
        )
    check_loading_info(info, folder)
    _align_reference(exported, family, fat5_config.scale_decoder_outputs, [])
    _round_through(fat5_model, dtype)
    errors = compare_outputs(fat5_model, exported, fat5_config.vocab_size, seq2seq=suffix != "EncoderModel")
    check_agreement(errors, tolerance, f"the FAT5{suffix} and the exported transformers {reference_name}")
    return {**errors, "tolerance": tolerance, "reference": f"FAT5{suffix}", "compute_dtype": "float32"}
