"""The code a saved FAT5 folder carries, so that it loads with ``trust_remote_code=True`` where fat5 is not installed.

transformers loads remote code from files beside ``config.json`` and follows only relative imports written
``from .name import ...`` (it finds them with a regular expression, then copies ``name.py`` next to the module); it
has no sub-packages. So the remote-code files (``ROOT_FILES`` and ``kernels/*.py``) become sibling files, their
relative imports are rewritten to name the sibling, and every import of a sibling is made visible to that regular
expression. This module ships as remote code itself: ``FAT5Config.save_pretrained`` (which every FAT5 model's
``save_pretrained``, ``push_to_hub`` and both Trainers' saves go through) calls :func:`write_remote_code`, in the
package and in a folder loaded as remote code; ``fat5 bundle`` writes the same files.
"""

import ast
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Never run: this line is for transformers' scan of the remote code's imports (a regular expression), which
    # makes it copy pipeline_fat5.py wherever it saves a model loaded as remote code (save_pretrained, Trainer
    # checkpoints, push_to_hub, PEFT's merged save: its custom_object_save), as the config's custom_pipelines name it
    from .pipeline_fat5 import Text2TextGenerationPipeline  # noqa: F401

PACKAGE = "fat5"
ROOT_FILES = ("configuration_fat5.py", "modeling_fat5.py", "position_encoding.py", "token_layout.py",
              "graphed_decoding.py", "remote_code.py", "pipeline_fat5.py")
KERNELS_PACKAGE = "kernels"

# auto class -> FAT5 class, for folders whose weights hold a decoder and for encoder-only ones
SEQ2SEQ_AUTO_MAP = {
    "AutoModel": "FAT5Model",
    "AutoModelForSeq2SeqLM": "FAT5ForConditionalGeneration",
    # what the "text-generation" pipeline of transformers without the custom pipeline loads
    "AutoModelForCausalLM": "FAT5ForConditionalGeneration",
    "AutoModelForTextEncoding": "FAT5EncoderModel",
    "AutoModelForSequenceClassification": "FAT5ForSequenceClassification",
    "AutoModelForTokenClassification": "FAT5ForTokenClassification",
    "AutoModelForQuestionAnswering": "FAT5ForQuestionAnswering",
}
ENCODER_AUTO_MAP = {**SEQ2SEQ_AUTO_MAP, "AutoModel": "FAT5EncoderModel"}
del ENCODER_AUTO_MAP["AutoModelForSeq2SeqLM"], ENCODER_AUTO_MAP["AutoModelForCausalLM"]
SEQ2SEQ_ARCHITECTURES = ("FAT5ForConditionalGeneration", "FAT5Model")
# transformers 5.24 dropped "text2text-generation" and serves T5 as "text-generation", which cuts the prompt's length
# off the decoder's output: a folder's `custom_pipelines` give both names the seq2seq pipeline (a custom task wins
# over transformers' own and over its list of removed ones)
PIPELINE_TASKS = ("text2text-generation", "text-generation")
# module.class of that pipeline in the folder, named rather than imported: importing transformers' pipelines costs
# seconds that loading a model or `fat5 pretrain` should not pay
PIPELINE_CLASS = "pipeline_fat5.Text2TextGenerationPipeline"


class RemoteCodeError(ValueError):
    """Remote code that cannot be written as flat siblings."""


def auto_map_for(architecture: str | None) -> dict[str, str]:
    """``auto_map`` for a folder holding ``architecture`` weights: AutoConfig plus every auto class FAT5 defines."""
    mapping = SEQ2SEQ_AUTO_MAP if architecture in (None, *SEQ2SEQ_ARCHITECTURES) else ENCODER_AUTO_MAP
    return {"AutoConfig": "configuration_fat5.FAT5Config",
            **{auto: f"modeling_fat5.{name}" for auto, name in mapping.items()}}


def custom_pipelines() -> dict[str, dict]:
    """config.json's ``custom_pipelines``: ``pipeline(task, model=folder, trust_remote_code=True)`` builds the
    seq2seq pipeline shipped in pipeline_fat5.py for each of ``PIPELINE_TASKS``."""
    pipeline = {"impl": PIPELINE_CLASS, "pt": ["AutoModelForSeq2SeqLM"], "tf": [], "type": "text"}
    return {task: dict(pipeline) for task in PIPELINE_TASKS}


def write_remote_code(folder, config) -> None:
    """Name the remote code in ``config``: ``auto_map`` (for the architecture that ``config.architectures`` names)
    and, for models with a decoder, ``custom_pipelines``; from the package, also write the flat code into
    ``folder``. Code that runs as remote code is flat already, and transformers copies it on saving (its
    ``custom_object_save``: the configuration's files, and the modelling's with all they import)."""
    package_dir = Path(__file__).parent
    if (package_dir / KERNELS_PACKAGE).is_dir():
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in remote_code_files(package_dir).items():
            (folder / name).write_text(text, encoding="utf-8")
    architecture = (getattr(config, "architectures", None) or [None])[0]
    config.auto_map = auto_map_for(architecture)
    if architecture in (None, *SEQ2SEQ_ARCHITECTURES):
        config.custom_pipelines = custom_pipelines()


def remote_code_file_names() -> list[str]:
    """The names of the files `write_remote_code` writes beside a saved model's config.json."""
    return [path.name for path in _remote_modules(Path(__file__).parent).values()]


def remote_code_files(package_dir) -> dict[str, str]:
    """File name -> text of the remote code of the package in ``package_dir``, flattened."""
    package_dir = Path(package_dir)
    modules = _remote_modules(package_dir)
    flat = {name: name.rpartition(".")[2] for name in modules}
    return {
        f"{flat[name]}.py": _flatten_source(name, path.read_text(encoding="utf-8"), flat)
        for name, path in modules.items()
    }


def _remote_modules(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every file that ships as remote code."""
    modules = {f"{PACKAGE}.{name[:-3]}": package_dir / name for name in ROOT_FILES}
    for path in sorted((package_dir / KERNELS_PACKAGE).glob("*.py")):
        if path.name != "__init__.py":
            modules[f"{PACKAGE}.{KERNELS_PACKAGE}.{path.stem}"] = path
    for path in modules.values():
        if not path.is_file():
            raise RemoteCodeError(f"remote-code file {path} is missing from the fat5 package")
    flat_names = [name.rpartition(".")[2] for name in modules]
    duplicated = sorted({name for name in flat_names if flat_names.count(name) > 1})
    if duplicated:
        raise RemoteCodeError(f"remote-code files would collide once flattened: {duplicated}")
    return modules


def _resolve(module_name: str, node: ast.ImportFrom) -> str:
    """The absolute module a relative `from` import in `module_name` names."""
    package_parts = module_name.split(".")[:-1]
    if node.level - 1 > len(package_parts) - 1:
        raise RemoteCodeError(f"{module_name}: relative import beyond the fat5 package (line {node.lineno})")
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
            raise RemoteCodeError(f"{module_name} imports {name} absolutely (line {node.lineno})")


def _flat_import(
    module_name: str, node: ast.ImportFrom, lines: list[str], flat: dict[str, str]
) -> tuple[int, list[str]]:
    """The relative import `node` of `module_name` rewritten for the flat folder, as (the index of its last line,
    the lines that replace it); a `RemoteCodeError` when it imports something that does not ship as remote code."""
    target = _resolve(module_name, node)
    first = lines[node.lineno - 1]
    if target in flat:
        match = re.compile(r"from\s+\.+[\w.]*\s+import").match(first, node.col_offset)
        if match is None:
            raise RemoteCodeError(f"{module_name}: cannot rewrite the import on line {node.lineno}: {first.strip()}")
        return node.lineno - 1, [first[: match.start()] + f"from .{flat[target]} import" + first[match.end() :]]
    if target in {PACKAGE, f"{PACKAGE}.{KERNELS_PACKAGE}"}:
        indent = first[: len(first) - len(first.lstrip())]
        statements = []
        for alias in node.names:
            submodule = f"{target}.{alias.name}"
            if submodule not in flat:
                raise RemoteCodeError(
                    f"{module_name} imports {alias.name} from {target} (line {node.lineno}), which is not a "
                    "remote-code module"
                )
            name = flat[submodule]
            statements.append(f"{indent}from .{name} import __name__ as _remote_code_{name}\n")
            statements.append(f"{indent}from . import {name} as {alias.asname or alias.name}\n")
        return node.end_lineno - 1, statements
    if target.startswith(f"{PACKAGE}.{KERNELS_PACKAGE}."):
        raise RemoteCodeError(
            f"{module_name} imports {target} (line {node.lineno}), but fat5/{KERNELS_PACKAGE}/"
            f"{target.rpartition('.')[2]}.py does not exist: the remote code would fail to load"
        )
    raise RemoteCodeError(f"{module_name} imports {target} (line {node.lineno}), which does not ship as remote code")
