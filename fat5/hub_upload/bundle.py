"""Turn a FAT5 model folder into a flat, self-contained folder the Hub serves as-is to `trust_remote_code=True`.

The flat remote code is what every FAT5 `save_pretrained` writes (`fat5.remote_code`: the package's remote-code
files as siblings, relative imports rewritten, `auto_map` and `custom_pipelines` in config.json). A bundle adds the
tokenizer, the conversion report, a model card and a manifest, and is checked before it is kept: no file imports
`fat5`, every sibling import resolves to a bundled file, and the folder loads in a fresh Python process in which
neither `fat5` nor `triton` can be imported, giving the in-package model's outputs.
"""

import ast
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fat5.conversion_defaults import DEFAULT_MAX_SHARD_SIZE
from fat5.errors import FAT5Error
from fat5.folder_contents import MANIFEST_FILE, REPORT_FILE  # `push` refuses a folder that differs from its manifest

PACKAGE = "fat5"
VALIDATION_TOLERANCE = 1e-5
VALIDATION_TIMEOUT_S = 900

class BundleError(FAT5Error):
    """A model folder that cannot be bundled, or a bundle that fails its checks."""


@dataclass
class BundleResult:
    """What `bundle` wrote, and the figures of its load check."""

    output: Path
    architecture: str
    auto_map: dict
    files: list[str]
    validation: dict | None = None
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------- flattening


def flatten_remote_code(package_dir: Path | None = None) -> dict[str, str]:
    """File name -> text of the flat remote code (`fat5.remote_code.remote_code_files`), checked."""
    from fat5.remote_code import RemoteCodeError, remote_code_files

    try:
        files = remote_code_files(package_dir or Path(__file__).parents[1])
    except RemoteCodeError as error:
        raise BundleError(str(error)) from None
    check_flat_code(files)
    return files


def check_flat_code(files: dict[str, str]) -> None:
    """Raise unless the flat files import no `fat5` and every sibling they import is bundled and visible to
    transformers (imported as `from .name import`, the form its remote-code loader follows)."""
    from transformers.dynamic_module_utils import get_relative_imports

    siblings = {name[:-3] for name in files}
    problems = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, text in files.items():
            tree = ast.parse(text)
            imported = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Import) and any(a.name.split(".")[0] == PACKAGE for a in node.names):
                    problems.append(f"{name}:{node.lineno} imports fat5")
                elif isinstance(node, ast.ImportFrom):
                    if node.level == 0 and node.module and node.module.split(".")[0] == PACKAGE:
                        problems.append(f"{name}:{node.lineno} imports fat5")
                    elif node.level > 1:
                        problems.append(f"{name}:{node.lineno} has a parent-relative import")
                    elif node.level == 1:
                        imported.update([node.module] if node.module else [a.name for a in node.names])
            missing = sorted(imported - siblings)
            if missing:
                problems.append(f"{name} imports siblings that are not bundled: {missing}")
            path = Path(scratch) / name
            path.write_text(text, encoding="utf-8")
            seen = {module.split(".")[0] for module in get_relative_imports(path)}
            hidden = sorted(imported - seen)
            if hidden:
                problems.append(f"{name} imports siblings transformers would not copy: {hidden}")
    if problems:
        raise BundleError("the flattened remote code is not self-contained:\n  " + "\n  ".join(problems))


# ----------------------------------------------------------------------------------------------- validation

_VALIDATION_SCRIPT = r"""
import json, sys
# Make `fat5` and `triton` unimportable: a None entry makes `import` fail and `find_spec` answer None.
sys.modules["fat5"] = sys.modules["triton"] = None
folder, batch_file, out_file = sys.argv[1:4]
import glob, os
import torch
import transformers
from transformers.dynamic_module_utils import check_imports

for path in sorted(glob.glob(os.path.join(folder, "*.py"))):
    check_imports(path)
config = json.load(open(os.path.join(folder, "config.json")))
batch = torch.load(batch_file)
results = {}
for auto_name in ("AutoModelForSeq2SeqLM", "AutoModel"):
    if auto_name not in config.get("auto_map", {}):
        continue
    model = getattr(transformers, auto_name).from_pretrained(folder, trust_remote_code=True, dtype="auto")
    module = type(model).__module__
    if not module.startswith("transformers_modules."):
        raise SystemExit(f"{auto_name} resolved to {module}, not to the folder's remote code")
    model.eval()
    seq2seq = auto_name == "AutoModelForSeq2SeqLM" or "decoder_input_ids" in model.forward.__code__.co_varnames
    inputs = batch if seq2seq else {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        output = model(**inputs)
    results[auto_name] = output.logits if auto_name == "AutoModelForSeq2SeqLM" else output.last_hidden_state
    if auto_name == "AutoModelForSeq2SeqLM":
        results["generate"] = model.generate(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=4, do_sample=False
        )
loaded = sorted(name for name in sys.modules if name.split(".")[0] == "fat5" and sys.modules[name] is not None)
if loaded:
    raise SystemExit(f"the package fat5 was imported: {loaded}")
torch.save(results, out_file)
"""


def run_in_clean_process(folder: Path, timeout: float = VALIDATION_TIMEOUT_S) -> dict[str, torch.Tensor]:
    """Load `folder` with transformers' Auto classes and `trust_remote_code=True` in a fresh Python process where
    `fat5` and `triton` cannot be imported, run `check_imports` on its code files, a forward on a padded batch and
    a short greedy `generate`; return the outputs by auto class (and `"generate"`). Raises `BundleError` on failure.

    The model runs on the CPU in the dtype of its weights (`dtype="auto"`), so this needs about the weights' size
    in memory.
    """
    from fat5.conversion.verify import comparison_batch

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory(prefix="fat5-validate-") as scratch:
        scratch = Path(scratch)
        batch_file, out_file = scratch / "batch.pt", scratch / "outputs.pt"
        torch.save(comparison_batch(int(config.get("vocab_size", 2))), batch_file)
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(
            HF_MODULES_CACHE=str(scratch / "modules"),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_VERBOSITY="error",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
        )
        command = [sys.executable, "-I", "-c", _VALIDATION_SCRIPT, str(folder), str(batch_file), str(out_file)]
        try:
            completed = subprocess.run(
                command, check=False, env=env, cwd=scratch, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise BundleError(f"loading {folder} in a fresh process took more than {timeout:.0f} s") from None
        if completed.returncode != 0:
            # the child's last line is its exception (or SystemExit's message): the reason, without a traceback
            lines = (completed.stderr or completed.stdout).strip().splitlines()
            reason = lines[-1] if lines else f"exit status {completed.returncode}"
            raise BundleError(
                f"{folder} does not load with trust_remote_code=True in a fresh Python process without fat5 and "
                f"triton: {reason}"
            )
        return torch.load(out_file)


@torch.no_grad()
def _in_package_outputs(folder: Path, auto_names) -> dict[str, torch.Tensor]:
    import transformers

    import fat5  # noqa: F401  (registers the Auto classes)
    from fat5.conversion.verify import comparison_batch, quiet_transformers

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    batch = comparison_batch(int(config["vocab_size"]))
    outputs = {}
    for auto_name in auto_names:
        with quiet_transformers():
            model = getattr(transformers, auto_name).from_pretrained(folder, dtype="auto").eval()
        seq2seq = "decoder_input_ids" in model.forward.__code__.co_varnames
        output = model(**(batch if seq2seq else {k: batch[k] for k in ("input_ids", "attention_mask")}))
        outputs[auto_name] = output.logits if auto_name == "AutoModelForSeq2SeqLM" else output.last_hidden_state
        if auto_name == "AutoModelForSeq2SeqLM":
            outputs["generate"] = model.generate(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=4, do_sample=False
            )
    return outputs


def validate_bundle(folder, compare_with_package: bool = True, tolerance: float = VALIDATION_TOLERANCE) -> dict:
    """Check a bundled folder: it loads as remote code in a clean process and, when `compare_with_package`, gives
    the in-package model's outputs (same dtype, same CPU: relative error within `tolerance`) and generated ids.
    Returns the figures."""
    from fat5.conversion.verify import comparison_batch, relative_error

    folder = Path(folder)
    remote = run_in_clean_process(folder)
    figures = {"loaded_with": sorted(name for name in remote if name != "generate")}
    for name, tensor in remote.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise BundleError(f"{folder}: {name} gives non-finite outputs")
    if not compare_with_package:
        return figures
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    from fat5.remote_code import SEQ2SEQ_ARCHITECTURES

    seq2seq = (config.get("architectures") or [""])[0] in SEQ2SEQ_ARCHITECTURES
    batch = comparison_batch(int(config["vocab_size"]))
    mask = batch["decoder_attention_mask" if seq2seq else "attention_mask"]
    local = _in_package_outputs(folder, figures["loaded_with"])
    for name in figures["loaded_with"]:
        error = relative_error(remote[name], local[name], mask)
        figures[f"{name}_relative_error"] = error
        if not error <= tolerance:
            raise BundleError(
                f"{folder}: {name} as remote code differs from the fat5 package (relative error {error:.3g})"
            )
    if "generate" in remote:
        if not torch.equal(remote["generate"], local["generate"]):
            raise BundleError(f"{folder}: remote code generates other ids than the fat5 package")
        figures["generate_equal"] = True
    return figures


# ----------------------------------------------------------------------------------------------- manifest


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest_files(folder: Path) -> list[str]:
    """The files of ``folder`` the manifest covers: the remote code, the weights (and their index) and config.json;
    the model card, tokenizer and generation config stay free to edit."""
    return sorted(
        path.name for path in folder.iterdir()
        if path.is_file() and (path.suffix in (".py", ".safetensors") or path.name == "config.json"
                               or path.name.endswith(".safetensors.index.json"))
    )


def write_manifest(folder: Path) -> None:
    from fat5 import __version__

    manifest = {
        "fat5_version": __version__, "sha256": {name: _sha256(folder / name) for name in manifest_files(folder)}
    }
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def manifest_differences(folder: Path) -> list[str]:
    """One line per file of ``folder`` that differs from the manifest `bundle` wrote (changed, missing, added), or
    one line saying there is no readable manifest; empty when the folder is what `bundle` wrote."""
    path = folder / MANIFEST_FILE
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))["sha256"]
    except FileNotFoundError:
        return [f"{folder} has no {MANIFEST_FILE}: it was not written by `fat5 bundle`"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return [f"{path} is damaged ({error})"]
    differences = []
    for name, digest in sorted(recorded.items()):
        if not (folder / name).is_file():
            differences.append(f"{name} is missing")
        elif _sha256(folder / name) != digest:
            differences.append(f"{name} differs from what `fat5 bundle` wrote")
    differences += [f"{name} was added after `fat5 bundle`" for name in manifest_files(folder) if name not in recorded]
    return differences


# ----------------------------------------------------------------------------------------------- bundle


def _weights_and_config(model_dir: Path, folder: Path, max_shard_size) -> tuple[str, dict]:
    from fat5.conversion.checkpoint import read_raw_config

    raw = read_raw_config(model_dir)
    if raw.get("model_type") != "fat5":
        raise BundleError(
            f"{model_dir} holds a {raw.get('model_type')!r} model, not a FAT5 one: convert it first (`fat5 convert`)"
        )
    architectures = raw.get("architectures") or ["FAT5ForConditionalGeneration"]
    from fat5 import modeling_fat5

    model_class = getattr(modeling_fat5, architectures[0], None)
    if model_class is None:
        raise BundleError(f"{model_dir}: unknown FAT5 architecture {architectures[0]!r}")
    from safetensors import SafetensorError

    from fat5.conversion.verify import check_loading_info, quiet_transformers

    with quiet_transformers():
        try:
            model, info = model_class.from_pretrained(model_dir, dtype="auto", output_loading_info=True)
        except pickle.UnpicklingError:
            # torch.load(weights_only=True) refuses a pickle holding more than tensors, and never runs it
            raise BundleError(
                f"{model_dir}: refusing to load its pytorch_model.bin: it holds Python objects besides tensors (an "
                "unsafe pickle could run code). Save the weights as safetensors where you trust the file"
            ) from None
        # a truncated or corrupted weights file raises SafetensorError, which derives from none of the others
        except (SafetensorError, OSError, ValueError, RuntimeError) as error:
            raise BundleError(f"{model_dir} does not load as {architectures[0]}: {error}") from None
        check_loading_info(info, model_dir)
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    return architectures[0], raw


def bundle(
    model_dir,
    out,
    *,
    overwrite: bool = False,
    repo_id: str | None = None,
    license: str | None = None,
    base_model: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    validate: bool = True,
    source_prefix: str | None = None,
) -> BundleResult:
    """Write `out`: `model_dir`'s FAT5 model as a folder that loads anywhere with `trust_remote_code=True`.

    `out` holds config.json (with `auto_map` for AutoConfig, AutoModel, AutoModelForSeq2SeqLM and the task-head
    auto classes), the flattened remote code, the weights as safetensors (sharded with an index above
    `max_shard_size`), generation_config.json, the tokenizer files and conversion report when `model_dir` has them,
    and a README.md model card. `repo_id`, `license` and `base_model` go into the card (`base_model` and `license`
    default to what the conversion report recorded); the card's example input starts with `source_prefix` (by
    default the prefix of the model's finetuning, if `fat5 finetune` trained it: see `example_input`). With
    `validate`, the folder is loaded in a fresh process that cannot import fat5 or triton and must reproduce the
    in-package model's outputs; `out` appears (atomically) only after that.
    """
    from fat5.conversion.checkpoint import copy_side_files
    from fat5.output_folder import atomic_directory

    from .model_card import build_model_card, example_input

    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        raise BundleError(f"{model_dir}: no such folder")
    code = flatten_remote_code()
    # a bundle may go inside the model's folder (`fat5 finetune` writes one there), never around it
    with atomic_directory(out, overwrite=overwrite, inputs=[model_dir], inside_inputs_ok=True) as folder:
        # save_pretrained writes the remote code and names it in config.json; the checked copy goes over it
        architecture, _ = _weights_and_config(model_dir, folder, max_shard_size)
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        auto_map = config["auto_map"]
        for name, text in code.items():
            (folder / name).write_text(text, encoding="utf-8")
        copy_side_files(model_dir, folder)
        report = None
        if (model_dir / REPORT_FILE).is_file():
            shutil.copyfile(model_dir / REPORT_FILE, folder / REPORT_FILE)
            report = json.loads((model_dir / REPORT_FILE).read_text(encoding="utf-8"))
        card = build_model_card(
            config, architecture=architecture, report=report, repo_id=repo_id, license=license, base_model=base_model,
            example_input=example_input(model_dir, report, source_prefix),
        )
        card.save(folder / "README.md")
        validation = validate_bundle(folder) if validate else None
        write_manifest(folder)
        files = sorted(path.name for path in folder.iterdir())
    return BundleResult(
        output=Path(out).expanduser().absolute(),
        architecture=architecture,
        auto_map=auto_map,
        files=files,
        validation=validation,
    )
