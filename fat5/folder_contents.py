"""The names of what FAT5 writes in a folder: a model folder's files (the weights, config and tokenizer a training job
saves, and what `fat5 convert`, `export-hf` and `bundle` add: the model card, the conversion report, the bundle's
manifest) and a training run's (its final model, checkpoints, records and temporary folders). Whatever else a folder
holds is its user's: `fat5.output_folder` replaces or removes only what these name.

It imports neither torch nor transformers, so that what reads it (the commands' checks) stays quick.
"""

import functools
import json
import re
import uuid
from pathlib import Path

from .errors import FAT5Error

# transformers' Trainer names its checkpoints PREFIX_CHECKPOINT_DIR-N (transformers.trainer_utils, which takes seconds
# to import; tests/test_saved_folders.py checks that the two agree). FAT5Trainer writes each in CHECKPOINT_STAGING,
# inside the run folder (same disk), and renames it to checkpoint-N once complete.
CHECKPOINT_PREFIX = "checkpoint"
CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")
CHECKPOINT_STAGING = ".checkpoint-staging"
# a training job's final model is written in a folder named `temporary_name(FINAL_MODEL_STAGING)` inside its output
# folder, then its files are moved to the top
FINAL_MODEL_STAGING = "final-model"
# the same for a LoRA job's adapter merged back into its base model
MERGED_MODEL_STAGING = "merged-model"
# the lock a live training job holds on its output folder (`fat5.output_folder.lock_run_folder`): neither the user's
# nor what a run leaves, whatever a killed job left of it
RUN_LOCK = ".fat5-run.lock"
# what makes a folder hold a model (or a PEFT adapter) that a training job would overwrite
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "adapter_config.json")
# what a training job (`fat5 pretrain`, `fat5 finetune`) writes at the top of its output folder, besides
# checkpoint-N, the shards of a large model and the remote code a saved model carries (`remote_code_file_names`):
# the final model and its tokenizer, the jobs' records and their temporary folders. `--overwrite` removes these only.
RUN_FILES = frozenset({
    *MODEL_FILES, "adapter_model.safetensors", "generation_config.json", "training_args.bin",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "spiece.model",
    "chat_template.jinja", CHECKPOINT_STAGING, FINAL_MODEL_STAGING, "runs",
    # fat5 pretrain
    "tokenizer", "pretrain_config.yaml", "pretrain_summary.json", "loss_curve.png", "compile_cache_artifacts.bin",
    # fat5 finetune
    "adapter", "bundle", "metrics.json", "finetune_config.yaml", MERGED_MODEL_STAGING,
})
_SHARD = re.compile(r"^(model|adapter_model)-\d+-of-\d+\.safetensors$")
# the conversion's record of what it converted and how closely the result matched (`fat5 convert`, kept by `bundle`)
REPORT_FILE = "fat5_conversion.json"
# the sha256 of every file that decides what a bundle computes (code, weights, config), as `bundle` wrote them
MANIFEST_FILE = "fat5_manifest.json"
# what `fat5 convert`, `export-hf` and `bundle` write beside a training job's files: the model card, the conversion
# report and the bundle's manifest, a pytorch checkpoint's index, the Hub's attributes
MODEL_FOLDER_FILES = frozenset({"README.md", REPORT_FILE, MANIFEST_FILE, "pytorch_model.bin.index.json",
                                ".gitattributes"})
# the files a tokenizer may consist of: whichever are present travel with a converted model
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "spiece.model", "sentencepiece.bpe.model", "vocab.json", "merges.txt", "chat_template.jinja")
# those that hold a vocabulary: a folder with none of them holds no tokenizer (the others only configure one)
TOKENIZER_VOCABULARY_FILES = ("tokenizer.json", "spiece.model", "sentencepiece.bpe.model", "vocab.json")
_PYTORCH_SHARD = re.compile(r"^pytorch_model-\d+-of-\d+\.bin$")
# a file or folder being written (`.NAME.tmp`) or replaced (output_folder's `.NAME.tmp-HEX`, `.NAME.old-HEX`)
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(tmp|tmp-[0-9a-f]{8}|old-[0-9a-f]{8})$")
# what file managers leave in any folder they show, and a job's lock: neither the user's work nor a run's
_NEITHER_USERS_NOR_RUNS = frozenset({".DS_Store", "Thumbs.db", "desktop.ini", RUN_LOCK})


def temporary_name(name: str, kind: str = "tmp") -> str:
    """The name of ``name`` while one process writes it (``kind`` "tmp") or removes it ("old"): hidden, and unique to
    that process, so that no other process writes the same path; `is_run_file` knows it for ``name``'s."""
    return f".{name}.{kind}-{uuid.uuid4().hex[:8]}"


@functools.cache
def _remote_code_names() -> frozenset[str]:
    from .remote_code import remote_code_file_names

    return frozenset(remote_code_file_names())


def is_temporary(name: str) -> bool:
    """Whether an entry of this name is a file or folder being written or removed (`temporary_name`'s, or the
    ``.NAME.tmp`` of older releases): one that no live process of the job holding the folder writes is a leftover."""
    return _TEMPORARY.match(name) is not None


def is_run_file(name: str) -> bool:
    """Whether a training job writes an entry of this name at the top of its output folder."""
    if name in RUN_FILES or name in _remote_code_names() or CHECKPOINT_NAME.match(name) or _SHARD.match(name):
        return True
    temporary = _TEMPORARY.match(name)
    return bool(temporary) and is_run_file(temporary["name"])


def is_model_folder_file(name: str) -> bool:
    """Whether FAT5 writes an entry of this name at the top of a model folder: what a training job writes there, and
    what `fat5 convert`, `export-hf` and `bundle` add (the model card, their records, other tokenizers' files, the
    shards of a pytorch checkpoint)."""
    return (name in MODEL_FOLDER_FILES or name in TOKENIZER_FILES or _PYTORCH_SHARD.match(name) is not None
            or is_run_file(name))


def user_files(folder: Path, written_by_fat5=is_run_file) -> list[str]:
    """The entries of ``folder`` that FAT5 does not write (by default: that no training job writes): the user's, never
    to be removed."""
    return sorted(path.name for path in folder.iterdir() if not written_by_fat5(path.name)
                  and path.name not in _NEITHER_USERS_NOR_RUNS)


def read_config_json(folder: Path, missing: str, error: type[FAT5Error] = FAT5Error) -> dict:
    """A model folder's config.json exactly as written (transformers 5 rewrites some T5 fields on load); ``error``
    saying ``missing`` when there is none, or naming the file when it cannot be read or holds no JSON object."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise error(missing)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as problem:
        raise error(f"cannot read {path} ({problem.strerror or problem})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as problem:
        raise error(f"{path} is not valid JSON: {problem}") from None
    if not isinstance(config, dict):
        raise error(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config
