"""What the `fat5 pretrain` and `fat5 finetune` configurations share: keys declared as dataclass fields, each with
its default, its meaning and its check, read from YAML (or a mapping) with unknown keys refused, updated by overrides,
and listed for ``--help``.

A configuration is a dataclass of its keys on `JobConfig`. A field's metadata is ``about(help, check)``; a check takes
the value and the key's name as messages say it, and returns the value to keep or raises FAT5Error. A field whose
default is a dataclass is a section, checked key by key in turn; ``about(help, section=cls)`` marks a section that
stays None unless the config gives it.

The checks of this module import neither torch nor transformers, so that a job says what is wrong with its config
in its first second (`JobConfig.read`); what only transformers' classes can check (the ``training`` section against
FAT5TrainingArguments, a model section against FAT5Config) is `JobConfig.check_with_the_classes`, which
`JobConfig.load` adds.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import yaml

from ..errors import FAT5Error
from .training_fields import training_argument_names, unknown_training_fields


def about(help: str, check=None, section=None) -> dict:
    """A key's field metadata: what it means (`reference_lines` prints it) and its check (None: any value), or the
    dataclass of a section that stays None unless given."""
    return {"help": help, "check": check, "section": section}


# ----------------------------------------------------------------------------------------------- checks


def number(*, integer: bool, minimum: float, maximum: float | None = None, exclusive=False, optional=False):
    def check(value, name):
        if value is None and optional:
            return value
        kind_ok = isinstance(value, int) if integer else isinstance(value, (int, float))
        below = kind_ok and (value <= minimum if exclusive else value < minimum)
        if not kind_ok or isinstance(value, bool) or below or (maximum is not None and value >= maximum):
            bound = f"> {minimum}" if exclusive else f">= {minimum}"
            bound += f" and < {maximum}" if maximum is not None else ""
            null = " or null" if optional else ""
            raise FAT5Error(f"{name} must be {'an integer' if integer else 'a number'} {bound}{null}, got {value!r}")
        return value

    return check


def one_of(choices: tuple, said: str | None = None):
    def check(value, name):
        if value not in choices:
            raise FAT5Error(f"{name} must be {said or f'one of {choices}'}, got {value!r}")
        return value

    return check


def mapping_of(what: str):
    def check(value, name):
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise FAT5Error(f"{name} must be a mapping of {what}")
        return dict(value)

    return check


def boolean(value, name):
    if not isinstance(value, bool):
        raise FAT5Error(f"{name} must be true or false, got {value!r}")
    return value


def string(value, name):
    if not isinstance(value, str):
        raise FAT5Error(f"{name} must be a string, got {value!r}")
    return value


def optional_path(value, name):
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise FAT5Error(f"{name} must be a path or null, got {value!r}")
    return str(value) if value else None


POSITIVE = number(integer=True, minimum=1)
POSITIVE_OR_NULL = number(integer=True, minimum=1, optional=True)


def training_section(refused: dict):
    """The check of a ``training`` section: a mapping of FAT5TrainingArguments fields, named as the classes' source
    names them (`training_argument_names`; their types and values are checked against the class itself by
    `JobConfig.check_with_the_classes`), but the keys of ``refused``, each said with where its value is set
    instead."""

    def check(value, name):
        value = mapping_of("FAT5TrainingArguments fields")(value, name)
        # YAML 1.1 reads an unquoted `no` as false, and no *_strategy field is a boolean
        value = {key: "no" if key.endswith("_strategy") and setting is False else setting
                 for key, setting in value.items()}
        for key in sorted(set(value) & set(refused)):
            raise FAT5Error(f"{name}.{key} is not set here: {refused[key]}")
        known = training_argument_names()
        if known is not None:
            unknown_training_fields(value, known, name)
        return value

    return check


# ----------------------------------------------------------------------------------------------- building


def section_class(key):
    """The dataclass of a section field (its default's, or for an optional section its metadata's), else None."""
    if key.default_factory is not MISSING and is_dataclass(key.default_factory):
        return key.default_factory
    return key.metadata.get("section")


def default(key):
    return key.default_factory() if key.default is MISSING else key.default


def checked(cls, mapping: dict, where: str, prefix: str = ""):
    """``cls`` built from ``mapping``: unknown keys refused (the message names them and ``where``), each value
    (given or default) through its key's check, whose messages name it ``prefix`` + key; each section built the same
    way from its own mapping (absent or null: its defaults, or None for an optional section)."""
    known = [key.name for key in fields(cls)]
    unknown = sorted(set(mapping) - set(known))
    if unknown:
        raise FAT5Error(f"{where}: unknown key(s) {unknown}; known keys: {sorted(known)}")
    values = {}
    for key in fields(cls):
        inner = section_class(key)
        given = mapping.get(key.name)
        if inner is None:
            value = given if key.name in mapping else default(key)
            check = key.metadata["check"]
            values[key.name] = check(value, prefix + key.name) if check else value
        elif given is None and key.default is None:
            values[key.name] = None
        elif given is None or isinstance(given, dict):
            values[key.name] = checked(inner, given or {}, f"{where}: {key.name}", f"{prefix}{key.name}.")
        else:
            raise FAT5Error(f"{where}: {key.name} must be a mapping, got {type(given).__name__}")
    return cls(**values)


def shallow_dict(instance) -> dict:
    """The fields of a dataclass instance, sections as nested dicts; not dataclasses.asdict, which deep-copies every
    value (a datasets.Dataset given as a finetuning train_file among them)."""
    return {key.name: shallow_dict(value) if is_dataclass(value := getattr(instance, key.name)) else value
            for key in fields(instance)}


# ----------------------------------------------------------------------------------------------- reading, listing


def read_yaml(path: Path, what: str) -> dict:
    """The mapping a YAML file holds; a missing, unreadable or non-mapping file raises FAT5Error naming ``what``."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FAT5Error(f"{what} {path}: no such file") from None
    except OSError as error:
        raise FAT5Error(f"{what} {path}: cannot read it ({error})") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise FAT5Error(f"{what} {path} is not valid YAML: {error}") from None
    if not isinstance(config, dict):
        raise FAT5Error(f"{what} {path} must be a YAML mapping of keys and sections")
    return config


def read_config(config, what: str) -> dict:
    """The raw mapping of a config: a YAML path's, or a copy of a mapping (None: empty)."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, os.PathLike)):
        return read_yaml(Path(config).expanduser(), what)
    raise FAT5Error(f"a {what} is a YAML path or a mapping, got {type(config).__name__}")


def overrides_as_sections(overrides) -> dict:
    """``overrides`` as a mapping of sections: a mapping as it is; ``KEY=VALUE`` strings, dotted keys reaching into
    sections and values read as YAML (``["training.max_steps=10", "lora=null"]``: ``{"training": {"max_steps": 10},
    "lora": None}``)."""
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        return copy.deepcopy(dict(overrides))
    if isinstance(overrides, str) or not isinstance(overrides, Iterable):
        raise FAT5Error(f"overrides are a mapping of sections or KEY=VALUE strings, got {overrides!r}")
    sections = {}
    for override in overrides:
        key, equals, value = str(override).partition("=")
        if not equals or not key.strip():
            raise FAT5Error(f"override {override!r} must read KEY=VALUE, e.g. training.max_steps=100")
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as error:
            raise FAT5Error(f"override {override!r}: the value is not valid YAML ({error})") from None
        *path, name = key.strip().split(".")
        target = sections
        for part in path:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise FAT5Error(f"override {override!r}: {part} is not a section")
        target[name] = value
    return sections


def update(config: dict, overrides: dict) -> dict:
    """``config`` updated in place by ``overrides``: a mapping given for a mapping updates it key by key (so
    ``{"training": {"max_steps": 10}}`` keeps the section's other keys); any other value replaces what was there."""
    for name, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(name), dict):
            update(config[name], value)
        else:
            config[name] = copy.deepcopy(value)
    return config


def reference_lines(cls, indent: str = "") -> list[str]:
    """Every key of ``cls`` with its default and meaning, as commented YAML; the sections' keys indented below."""
    lines = []
    for key in fields(cls):
        inner = section_class(key)
        if inner is not None:
            lines.append(f"{indent}{key.name}:  # {key.metadata['help']}")
            lines += reference_lines(inner, indent + "  ")
            continue
        value = yaml.safe_dump(default(key), default_flow_style=True, width=1 << 16, sort_keys=False)
        value = value.removesuffix("...\n").strip()
        lines.append(f"{indent}{key.name}: {value}  # {key.metadata['help']}")
    return lines


class JobConfig:
    """What a job's configuration does, whichever the job: read from a YAML path or a mapping and updated by overrides
    (`load`), checked key by key (`from_mapping`, the subclass's), written back as nested plain dicts (`to_dict`, as
    the job's output folder records it) and listed with each key's default and meaning for ``--help``
    (`reference`). A subclass is a dataclass of its keys; ``WHAT`` names it in messages."""

    WHAT = "config"

    @classmethod
    def load(cls, config=None, overrides=None):
        """The checked configuration: ``config`` (a YAML path, a mapping, or None for the defaults) updated by
        ``overrides`` (a mapping of sections, e.g. ``{"training": {"max_steps": 50}}``, or ``KEY=VALUE`` strings,
        e.g. ``["training.max_steps=50"]``), key by key; a mistake raises FAT5Error naming the key."""
        loaded = cls.read(config, overrides)
        loaded.check_with_the_classes()
        return loaded

    @classmethod
    def read(cls, config=None, overrides=None):
        """`load` but `check_with_the_classes`: every check that imports neither torch nor transformers."""
        return cls.from_mapping(cls.updated(read_config(config, cls.WHAT), overrides_as_sections(overrides)))

    def check_with_the_classes(self) -> None:
        """The checks that need transformers' classes: the ``training`` section's fields, types and ranges
        (`fat5.trainer.trainer.check_training_arguments`)."""
        from .trainer import check_training_arguments

        check_training_arguments(self.training, where="training")

    @classmethod
    def updated(cls, raw: dict, overrides: dict) -> dict:
        """``raw`` updated by ``overrides`` (`update`)."""
        return update(raw, overrides)

    @classmethod
    def from_mapping(cls, raw: dict):
        raise NotImplementedError

    def to_dict(self) -> dict:
        """The configuration as nested plain dicts, in the keys' order."""
        return shallow_dict(self)

    @classmethod
    def reference(cls) -> str:
        """Every key with its default and meaning, as commented YAML."""
        return "\n".join(reference_lines(cls))
