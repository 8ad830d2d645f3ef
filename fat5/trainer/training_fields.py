"""The names of FAT5TrainingArguments' fields, known without importing it: the class and those it extends
(Seq2SeqTrainingArguments, TrainingArguments) import torch and transformers' Trainer, seconds that the check of a
job's config, in its first second, does not wait for. Their source is read instead, each dataclass field being an
annotated class attribute; tests/test_job_configs.py holds the names read to the class's own fields.
"""

import ast
import functools
import importlib.util
from pathlib import Path

from ..errors import FAT5Error


def _class_sources() -> list[tuple[Path, str]]:
    """(source file, class name) of FAT5TrainingArguments and the classes it extends, where they are installed."""
    transformers = importlib.util.find_spec("transformers")  # found, not imported
    if transformers is None or not transformers.submodule_search_locations:
        return []
    package = Path(next(iter(transformers.submodule_search_locations)))
    return [(Path(__file__).with_name("trainer.py"), "FAT5TrainingArguments"),
            (package / "training_args_seq2seq.py", "Seq2SeqTrainingArguments"),
            (package / "training_args.py", "TrainingArguments")]


@functools.cache
def training_argument_names() -> frozenset[str] | None:
    """The fields of FAT5TrainingArguments, read from the source of each class it is made of; None when a source
    cannot be found or read that way (the job's check against the class itself still runs)."""
    names = set()
    sources = _class_sources()
    for path, class_name in sources:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            return None
        found = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
        if not found:
            return None
        names |= {node.target.id for node in found[0].body
                  if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    return frozenset(names) if sources else None


def unknown_training_fields(names, known, where: str) -> None:
    """Raise FAT5Error, naming them and ``where`` they were given, for the ``names`` that are not in ``known``, the
    fields of FAT5TrainingArguments."""
    unknown = sorted(set(names) - set(known))
    if unknown:
        hint = (" (transformers 5 writes it train_sampling_strategy: group_by_length)"
                if "group_by_length" in unknown else "")
        raise FAT5Error(f"{where}: {unknown} not FAT5TrainingArguments field(s){hint}")
