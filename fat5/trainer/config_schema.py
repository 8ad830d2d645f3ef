"""What the `fat5 pretrain` and `fat5 finetune` configurations share: keys declared as dataclass fields, each with
its default, its meaning and its check, read from YAML with unknown keys refused, and listed for ``--help``.

A field's metadata is ``about(help, check)``; a check takes the value and the key's name as messages say it, and
returns the value to keep or raises FAT5Error. Fields whose default is a dataclass are sections, built apart.
"""

from __future__ import annotations

import copy
import os
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import yaml

from ..errors import FAT5Error


def about(help: str, check=None) -> dict:
    """A key's field metadata: what it means (`reference_lines` prints it) and its check (None: any value)."""
    return {"help": help, "check": check}


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


# ----------------------------------------------------------------------------------------------- building


def is_section(key) -> bool:
    """Whether a dataclass field is a section (its default a dataclass, built by `checked` apart)."""
    return key.default_factory is not MISSING and is_dataclass(key.default_factory)


def default(key):
    return key.default_factory() if key.default is MISSING else key.default


def checked(cls, mapping: dict, where: str, prefix: str, skip=()):
    """``cls`` built from ``mapping``: unknown keys refused (the message names them and ``where``), each value
    (given or default) through its key's check, whose messages name it ``prefix`` + key; the keys in ``skip`` and
    the sections are left at their defaults, for the caller to build."""
    known = [key.name for key in fields(cls)]
    unknown = sorted(set(mapping) - set(known))
    if unknown:
        raise FAT5Error(f"{where}: unknown key(s) {unknown}; known keys: {sorted(known)}")
    values = {}
    for key in fields(cls):
        if key.name in skip or is_section(key):
            continue
        value = mapping[key.name] if key.name in mapping else default(key)
        check = key.metadata["check"]
        values[key.name] = check(value, prefix + key.name) if check else value
    return cls(**values)


def section(raw: dict, name: str, where: str) -> dict:
    """``raw[name]`` as a mapping ({} when absent or null)."""
    value = raw.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise FAT5Error(f"{where}: {name} must be a mapping, got {type(value).__name__}")
    return value


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


def apply_overrides(config: dict, overrides) -> dict:
    """Set ``KEY=VALUE`` overrides in a copy of ``config``: dotted keys reach into sections, values are YAML.

    ``["training.max_steps=10", "lora=null"]`` sets ``config["training"]["max_steps"] = 10`` and removes LoRA.
    """
    config = copy.deepcopy(config)
    for override in overrides:
        key, equals, value = override.partition("=")
        if not equals or not key.strip():
            raise FAT5Error(f"override {override!r} must read KEY=VALUE, e.g. training.max_steps=100")
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as error:
            raise FAT5Error(f"override {override!r}: the value is not valid YAML ({error})") from None
        *sections, name = key.strip().split(".")
        target = config
        for part in sections:
            if target.get(part) is None:
                target[part] = {}
            if not isinstance(target[part], dict):
                raise FAT5Error(f"override {override!r}: {part} is not a section")
            target = target[part]
        target[name] = value
    return config


def reference_lines(cls, indent: str = "", sections: dict | None = None) -> list[str]:
    """Every key of ``cls`` with its default and meaning, as commented YAML; the sections' keys indented below
    them (``sections``: name -> dataclass, for sections whose default is null)."""
    lines = []
    for key in fields(cls):
        inner = (sections or {}).get(key.name) or (key.default_factory if is_section(key) else None)
        if inner is not None:
            lines.append(f"{indent}{key.name}:  # {key.metadata['help']}")
            lines += reference_lines(inner, indent + "  ")
            continue
        value = yaml.safe_dump(default(key), default_flow_style=True, width=1 << 16, sort_keys=False)
        value = value.removesuffix("...\n").strip()
        lines.append(f"{indent}{key.name}: {value}  # {key.metadata['help']}")
    return lines
