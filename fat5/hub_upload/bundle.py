"""Turn a FAT5 model folder into a flat, self-contained folder the Hub serves as-is to `trust_remote_code=True`.

transformers loads remote code from files beside `config.json` and follows only relative imports written
`from .name import ...` (it finds them with a regular expression, then copies `name.py` next to the module); it
has no sub-packages. So the package's remote-code files (`REMOTE_CODE_ROOT_FILES`: the configuration, the
modelling, the position encoding, the token layout and the graphed decoding; and `kernels/*.py`) become sibling
files, their relative imports are rewritten to name the sibling, and every import of a sibling is made visible to
that regular expression. A bundle is checked before it
is kept: no file imports `fat5`, every sibling import resolves to a bundled file, and the folder loads in a fresh
Python process in which neither `fat5` nor `triton` can be imported, giving the in-package model's outputs.
"""

import ast
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fat5.errors import FAT5Error

PACKAGE = "fat5"
REMOTE_CODE_ROOT_FILES = ("configuration_fat5.py", "modeling_fat5.py", "position_encoding.py", "token_layout.py",
                          "graphed_decoding.py")
KERNELS_PACKAGE = "kernels"
REPORT_FILE = "fat5_conversion.json"
# the sha256 of every file that decides what the bundle computes (code, weights, config), as `bundle` wrote them:
# `push` refuses a folder whose files differ from it
MANIFEST_FILE = "fat5_manifest.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
VALIDATION_TOLERANCE = 1e-5
VALIDATION_TIMEOUT_S = 900

# auto class -> FAT5 class, for folders whose weights hold a decoder and for encoder-only ones
SEQ2SEQ_AUTO_MAP = {
    "AutoModel": "FAT5Model",
    "AutoModelForSeq2SeqLM": "FAT5ForConditionalGeneration",
    # what the "text-generation" pipeline loads (it serves T5 through config.architectures, which remote code lacks)
    "AutoModelForCausalLM": "FAT5ForConditionalGeneration",
    "AutoModelForTextEncoding": "FAT5EncoderModel",
    "AutoModelForSequenceClassification": "FAT5ForSequenceClassification",
    "AutoModelForTokenClassification": "FAT5ForTokenClassification",
    "AutoModelForQuestionAnswering": "FAT5ForQuestionAnswering",
}
ENCODER_AUTO_MAP = {**SEQ2SEQ_AUTO_MAP, "AutoModel": "FAT5EncoderModel"}
del ENCODER_AUTO_MAP["AutoModelForSeq2SeqLM"], ENCODER_AUTO_MAP["AutoModelForCausalLM"]
SEQ2SEQ_ARCHITECTURES = ("FAT5ForConditionalGeneration", "FAT5Model")


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


def _package_dir() -> Path:
    import fat5

    return Path(fat5.__file__).parent


def _remote_modules(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every file that ships as remote code."""
    modules = {f"{PACKAGE}.{name[:-3]}": package_dir / name for name in REMOTE_CODE_ROOT_FILES}
    for path in sorted((package_dir / KERNELS_PACKAGE).glob("*.py")):
        if path.name != "__init__.py":
            modules[f"{PACKAGE}.{KERNELS_PACKAGE}.{path.stem}"] = path
    for path in modules.values():
        if not path.is_file():
            raise BundleError(f"remote-code file {path} is missing from the fat5 package")
    flat_names = [name.rpartition(".")[2] for name in modules]
    duplicated = sorted({name for name in flat_names if flat_names.count(name) > 1})
    if duplicated:
        raise BundleError(f"remote-code files would collide once flattened: {duplicated}")
    return modules


def _resolve(module_name: str, node: ast.ImportFrom) -> str:
    """The absolute module a relative `from` import in `module_name` names."""
    package_parts = module_name.split(".")[:-1]
    if node.level - 1 > len(package_parts) - 1:
        raise BundleError(f"{module_name}: relative import beyond the fat5 package (line {node.lineno})")
    base = package_parts[: len(package_parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _flatten_source(module_name: str, source: str, flat: dict[str, str]) -> str:
    """`source` of `module_name` with every import of a fat5 module rewritten to its flat sibling.

    `flat` maps dotted module names to flat names. `from .kernels.attention import f` becomes
    `from .attention import f`; `from . import x as y` (a sibling module imported whole, which transformers does not
    see) is kept and preceded by `from .x import __name__ as _remote_code_x`, which makes transformers copy `x.py`.
    """
    lines = source.splitlines(keepends=True)
    replacements: dict[int, tuple[int, list[str]]] = {}  # first line index -> (last line index, new lines)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.level == 0):
            _check_not_absolute_fat5_import(module_name, node)
        elif isinstance(node, ast.ImportFrom):
            replacements[node.lineno - 1] = _flat_import(module_name, node, lines, flat)
    output, index = [], 0
    while index < len(lines):
        if index in replacements:
            last, new_lines = replacements[index]
            output.extend(new_lines)
            index = last + 1
        else:
            output.append(lines[index])
            index += 1
    return "".join(output)


def _check_not_absolute_fat5_import(module_name: str, node: ast.Import | ast.ImportFrom) -> None:
    names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    for name in names:
        if name.split(".")[0] == PACKAGE:
            raise BundleError(f"{module_name} imports {name} absolutely (line {node.lineno})")


def _flat_import(
    module_name: str, node: ast.ImportFrom, lines: list[str], flat: dict[str, str]
) -> tuple[int, list[str]]:
    """The relative import `node` of `module_name` rewritten for the flat folder, as (the index of its last line,
    the lines that replace it); a `BundleError` when it imports something that does not ship as remote code."""
    target = _resolve(module_name, node)
    first = lines[node.lineno - 1]
    if target in flat:
        match = re.compile(r"from\s+\.+[\w.]*\s+import").match(first, node.col_offset)
        if match is None:
            raise BundleError(f"{module_name}: cannot rewrite the import on line {node.lineno}: {first.strip()}")
        return node.lineno - 1, [first[: match.start()] + f"from .{flat[target]} import" + first[match.end() :]]
    if target in {PACKAGE, f"{PACKAGE}.{KERNELS_PACKAGE}"}:
        indent = first[: len(first) - len(first.lstrip())]
        statements = []
        for alias in node.names:
            submodule = f"{target}.{alias.name}"
            if submodule not in flat:
                raise BundleError(
                    f"{module_name} imports {alias.name} from {target} (line {node.lineno}), which is not a "
                    "remote-code module"
                )
            name = flat[submodule]
            statements.append(f"{indent}from .{name} import __name__ as _remote_code_{name}\n")
            statements.append(f"{indent}from . import {name} as {alias.asname or alias.name}\n")
        return node.end_lineno - 1, statements
    if target.startswith(f"{PACKAGE}.{KERNELS_PACKAGE}."):
        raise BundleError(
            f"{module_name} imports {target} (line {node.lineno}), but fat5/{KERNELS_PACKAGE}/"
            f"{target.rpartition('.')[2]}.py does not exist: the remote code would fail to load"
        )
    raise BundleError(f"{module_name} imports {target} (line {node.lineno}), which does not ship as remote code")


def flatten_remote_code(package_dir: Path | None = None) -> dict[str, str]:
    """File name -> text of the flat remote code: configuration, modeling and kernel files as siblings."""
    modules = _remote_modules(package_dir or _package_dir())
    flat = {name: name.rpartition(".")[2] for name in modules}
    files = {
        f"{flat[name]}.py": _flatten_source(name, path.read_text(encoding="utf-8"), flat)
        for name, path in modules.items()
    }
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


def auto_map_for(architecture: str, modeling_source: str) -> dict[str, str]:
    """`auto_map` for a folder holding `architecture` weights: AutoConfig plus every auto class FAT5 defines."""
    defined = {node.name for node in ast.parse(modeling_source).body if isinstance(node, ast.ClassDef)}
    mapping = SEQ2SEQ_AUTO_MAP if architecture in SEQ2SEQ_ARCHITECTURES else ENCODER_AUTO_MAP
    auto_map = {"AutoConfig": "configuration_fat5.FAT5Config"}
    auto_map.update({auto: f"modeling_fat5.{name}" for auto, name in mapping.items() if name in defined})
    required = ["AutoModel"] + (["AutoModelForSeq2SeqLM"] if architecture in SEQ2SEQ_ARCHITECTURES else [])
    absent = [auto for auto in required if auto not in auto_map]
    if absent:
        raise BundleError(f"modeling_fat5.py lacks the classes for {absent}")
    return auto_map


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
) -> BundleResult:
    """Write `out`: `model_dir`'s FAT5 model as a folder that loads anywhere with `trust_remote_code=True`.

    `out` holds config.json (with `auto_map` for AutoConfig, AutoModel, AutoModelForSeq2SeqLM and the task-head
    auto classes), the flattened remote code, the weights as safetensors (sharded with an index above
    `max_shard_size`), generation_config.json, the tokenizer files and conversion report when `model_dir` has them,
    and a README.md model card. `repo_id`, `license` and `base_model` go into the card (`base_model` and `license`
    default to what the conversion report recorded). With `validate`, the folder is loaded in a fresh process that
    cannot import fat5 or triton and must reproduce the in-package model's outputs; `out` appears (atomically) only
    after that.
    """
    from fat5.conversion.checkpoint import copy_side_files
    from fat5.output_folder import atomic_directory

    from .model_card import build_model_card

    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        raise BundleError(f"{model_dir}: no such folder")
    code = flatten_remote_code()
    # a bundle may go inside the model's folder (`fat5 finetune` writes one there), never around it
    with atomic_directory(out, overwrite=overwrite, inputs=[model_dir], inside_inputs_ok=True) as folder:
        architecture, _ = _weights_and_config(model_dir, folder, max_shard_size)
        auto_map = auto_map_for(architecture, code["modeling_fat5.py"])
        config_path = folder / "config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["auto_map"] = auto_map
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for name, text in code.items():
            (folder / name).write_text(text, encoding="utf-8")
        copy_side_files(model_dir, folder)
        report = None
        if (model_dir / REPORT_FILE).is_file():
            shutil.copyfile(model_dir / REPORT_FILE, folder / REPORT_FILE)
            report = json.loads((model_dir / REPORT_FILE).read_text(encoding="utf-8"))
        card = build_model_card(
            config, architecture=architecture, report=report, repo_id=repo_id, license=license, base_model=base_model
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
