"""Reading checkpoints (local folders or Hub ids) and writing output folders atomically.

Everything here turns a low-level failure (a missing file, a truncated safetensors, an unreachable Hub) into a
`ConversionError` that names the file and the problem, so the `fat5` command can print it without a traceback.
"""

import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from fat5.errors import FAT5Error
from fat5.folder_contents import TOKENIZER_FILES, read_config_json

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_FILE = "pytorch_model.bin"
PYTORCH_INDEX = "pytorch_model.bin.index.json"

GENERATION_CONFIG_FILE = "generation_config.json"


class ConversionError(FAT5Error):
    """A checkpoint that cannot be converted as asked: unreadable, inconsistent, or failing verification."""


@dataclass
class ResolvedSource:
    """A checkpoint folder on disk, and the Hub id it came from when it was downloaded."""

    path: Path
    repo_id: str | None = None
    revision: str | None = None


def resolve_source(source: str | os.PathLike, revision: str | None = None) -> ResolvedSource:
    """A local folder as is, or a Hub model id downloaded into the Hugging Face cache (config, weights, tokenizer).

    Raises `ConversionError` for a path that is neither, and for a Hub that cannot be reached or refuses the request.
    """
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConversionError(f"{source}: expected a checkpoint folder (with config.json), got a file")
        return ResolvedSource(path=path.resolve())
    repo_id = str(source)
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ConversionError(f"{source}: no such folder, and not a Hugging Face Hub model id") from None
    if repo_id.startswith((".", "/", "~")) or repo_id.count("/") > 1:
        raise ConversionError(f"{source}: no such folder")
    return ResolvedSource(path=_download_from_hub(repo_id, revision), repo_id=repo_id, revision=revision)


def _download_from_hub(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = constants.ENDPOINT
    try:
        # model_info makes one request (no retries with backoff), so an unreachable Hub fails at once
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision)
        files = [sibling.rfilename for sibling in info.siblings or []]
        weights = [name for name in files if name.endswith(".safetensors") or name == SAFETENSORS_INDEX]
        if not weights:
            weights = [name for name in files if name.startswith("pytorch_model") and name.endswith((".bin", ".json"))]
        if not weights:
            raise ConversionError(f"{repo_id} on the Hub holds no safetensors or pytorch_model.bin weights")
        wanted = ["config.json", GENERATION_CONFIG_FILE, "README.md", *TOKENIZER_FILES, *weights]
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=wanted, endpoint=endpoint)
    except ConversionError:
        raise
    except GatedRepoError:
        raise ConversionError(
            f"{repo_id} is gated on the Hub: accept its terms there and log in (`hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise ConversionError(
            f"{repo_id}: no such model on the Hub at {endpoint} (or it is private: log in with `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise ConversionError(f"{repo_id} has no revision {revision!r} on the Hub") from None
    except OfflineModeIsEnabled:
        raise ConversionError(
            f"{repo_id} is not a local folder and the Hub is disabled (HF_HUB_OFFLINE=1): "
            "pass a local checkpoint folder"
        ) from None
    except HfHubHTTPError as error:
        raise ConversionError(f"the Hub refused to serve {repo_id}: {error}") from None
    except Exception as error:  # noqa: BLE001  (connection refused, DNS, timeouts, proxies: the HTTP stack's errors)
        raise ConversionError(
            f"could not download {repo_id} from the Hub at {endpoint} ({type(error).__name__}: {error}). "
            "Check the network (or HF_ENDPOINT), or pass a local checkpoint folder."
        ) from None
    return Path(folder)


def read_raw_config(folder: Path) -> dict:
    """config.json exactly as written: transformers 5 rewrites some T5 fields on load, so conversion reads the file."""
    return read_config_json(folder, f"{folder}: no config.json, so this is not a transformers checkpoint folder",
                            ConversionError)


def weight_files(folder: Path) -> list[Path]:
    """The files holding a checkpoint's weights: safetensors preferred, pytorch_model.bin otherwise, shards by index."""
    for single, index in ((SAFETENSORS_FILE, SAFETENSORS_INDEX), (PYTORCH_FILE, PYTORCH_INDEX)):
        if (folder / index).is_file():
            weight_map = _read_index(folder / index)
            return [folder / name for name in sorted(set(weight_map.values()))]
        if (folder / single).is_file():
            return [folder / single]
    raise ConversionError(
        f"{folder}: no weights found "
        f"(expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX}, {PYTORCH_FILE} or {PYTORCH_INDEX})"
    )


def _read_index(path: Path) -> dict[str, str]:
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise ConversionError(f"{path} is not a valid shard index (JSON with a 'weight_map'): {error}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConversionError(f"{path}: 'weight_map' must map tensor names to file names")
    return weight_map


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `folder`, on the CPU, by name; unreadable or inconsistent files raise."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        if not path.is_file():
            raise ConversionError(f"{path} is listed in the shard index but missing")
        shard = _read_weight_file(path)
        duplicated = sorted(tensors.keys() & shard.keys())
        if duplicated:
            raise ConversionError(f"{path} repeats tensors already read from another shard: {duplicated}")
        tensors.update(shard)
    for index_name in (SAFETENSORS_INDEX, PYTORCH_INDEX):
        if (folder / index_name).is_file():
            indexed = _read_index(folder / index_name)
            absent = sorted(indexed.keys() - tensors.keys())
            if absent:
                raise ConversionError(f"{folder / index_name} lists tensors that its shards do not hold: {absent}")
            break
    return tensors


def _read_weight_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu")
        except (SafetensorError, OSError, RuntimeError, ValueError) as error:
            raise ConversionError(
                f"{path} is not a readable safetensors file (truncated or corrupted?): {error}"
            ) from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  (pickle, zip and storage errors of a damaged file all end here)
        raise ConversionError(
            f"{path} is not a readable PyTorch checkpoint (truncated or corrupted?): {error}"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConversionError(f"{path} does not hold a state dict of tensors")
    return state


def predominant_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The floating dtype most of the checkpoint's parameters are stored in (what `--dtype` defaults to)."""
    counts = Counter(t.dtype for t in tensors.values() if t.is_floating_point())
    return counts.most_common(1)[0][0] if counts else torch.float32


def copy_side_files(source: Path, destination: Path, model_config=None) -> list[str]:
    """Copy the tokenizer files and generation_config.json present in `source`; return the names copied.

    With `model_config`, the special tokens generation needs (decoder start, pad, eos) that the copied
    generation_config.json leaves unset are filled in from it: transformers 5 saves T5 generation configs without
    `decoder_start_token_id`, and `generate` then refuses to run.
    """
    copied = []
    for name in (*TOKENIZER_FILES, GENERATION_CONFIG_FILE):
        if (source / name).is_file():
            shutil.copyfile(source / name, destination / name)
            copied.append(name)
    if model_config is not None and (destination / GENERATION_CONFIG_FILE).is_file():
        path = destination / GENERATION_CONFIG_FILE
        try:
            generation = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ConversionError(f"{source / GENERATION_CONFIG_FILE} is not valid JSON: {error}") from None
        filled = False
        for key in ("decoder_start_token_id", "pad_token_id", "eos_token_id"):
            value = getattr(model_config, key, None)
            if generation.get(key) is None and value is not None:
                generation[key] = value
                filled = True
        if filled:
            path.write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return copied
