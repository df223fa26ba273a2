"""YAML -> RunConfig: composable presets, dotted overrides, typed conversion, and back to YAML.

Composition, lowest priority first:

1. the dataclass defaults (``megarl.config.schema``);
2. each entry of the file's ``defaults:`` list, in order (``group/name`` is
   ``configs/group/name.yaml``; a preset may have ``defaults:`` of its own, merged before it);
3. the file itself;
4. command-line overrides ``dotted.key=value``, in order, each value parsed as YAML
   (``rollout.n=8``, ``actor.optim.lr=1e-6``, ``data.train_files=[a.parquet,b.parquet]``,
   ``critic.layout=null``).

Mappings merge key by key; anything else (lists included) replaces. ``defaults`` entries are
looked up next to the top-level file first, then in the repository's ``configs/`` directory (or
the ``search_path`` given); an entry ending in ``.yaml`` is a path relative to the file naming it.

YAML is read with PyYAML's safe loader extended so that ``1e-6`` is a float (YAML 1.1 without a
dot reads it as a string, a classic learning-rate trap).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

import yaml

from megarl.config.errors import ConfigError, show
from megarl.config.schema import RunConfig

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
RESOLVED_NAME = "resolved_config.yaml"


# ---------------------------------------------------------------------------------------------
# YAML reading


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-6`` / ``3E5`` (no dot) as floats, as YAML 1.2 does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_value(text: str) -> Any:
    """One override value, parsed as YAML (``8`` -> 8, ``1e-6`` -> 1e-06, ``[a,b]`` -> list)."""
    return yaml.load(text, Loader=_Loader)


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist; check the path") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}; fix the syntax there") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, actor:, ...), "
                          f"got a {type(data).__name__}")
    return data


# ---------------------------------------------------------------------------------------------
# Composition


def deep_merge(base: dict, top: dict) -> dict:
    """A new dict: ``top`` over ``base``, mappings merged recursively, everything else replaced."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _available(search_path: Sequence[Path], group: str) -> list[str]:
    names = set()
    for root in search_path:
        folder = root / group
        if folder.is_dir():
            names.update(f"{group}/{p.stem}" for p in folder.glob("*.yaml"))
    return sorted(names)


def _find_preset(entry: str, including: Path, search_path: Sequence[Path]) -> Path:
    if entry.endswith((".yaml", ".yml")):
        path = Path(entry).expanduser()
        path = path if path.is_absolute() else including.parent / path
        if path.is_file():
            return path
        raise ConfigError(f"{including}: defaults entry {entry!r} does not exist (looked for {path})")
    for root in search_path:
        candidate = root / f"{entry}.yaml"
        if candidate.is_file():
            return candidate
    group = entry.rsplit("/", 1)[0] if "/" in entry else ""
    known = _available(search_path, group) if group else []
    close = difflib.get_close_matches(entry, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    listing = f"available: {', '.join(known)}" if known else f"no presets in group {group!r}"
    raise ConfigError(
        f"{including}: defaults entry {entry!r} not found in {[str(p) for p in search_path]}; {hint}{listing}"
    )


def _compose_file(path: Path, search_path: Sequence[Path], chain: tuple[Path, ...]) -> dict:
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(p.name for p in (*chain, path))
        raise ConfigError(f"{path}: defaults form a cycle ({cycle}); remove one of the entries")
    data = _read_yaml(path)
    defaults = data.pop("defaults", [])
    if defaults is None:
        defaults = []
    if isinstance(defaults, str) or not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise ConfigError(f"{path}: defaults={show(defaults)} must be a list of preset names like "
                          "[algorithm/grpo, model/tiny-qwen2]")
    merged: dict = {}
    for entry in defaults:
        preset = _find_preset(entry, path, search_path)
        merged = deep_merge(merged, _compose_file(preset, search_path, (*chain, path)))
    return deep_merge(merged, data)


def apply_override(tree: dict, override: str) -> dict:
    """``tree`` with one ``dotted.key=value`` override applied (a new dict)."""
    if not isinstance(override, str) or "=" not in override:
        raise ConfigError(f"override {override!r} is not key=value; write e.g. rollout.n=8 or actor.optim.lr=1e-6")
    key, _, text = override.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"override {override!r}: the key {key!r} is not a dotted path like actor.optim.lr")
    if parts[0] == "defaults":
        raise ConfigError(f"override {override!r}: defaults can only be set in a YAML file, not overridden")
    try:
        value = parse_value(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"override {override!r}: the value {text!r} is not valid YAML ({problem}); "
                          "quote it or fix the brackets") from None
    nested: Any = value
    for part in reversed(parts):
        nested = {part: nested}
    node = tree
    for depth, part in enumerate(parts[:-1]):
        node = node.get(part) if isinstance(node, dict) else None
        if node is not None and not isinstance(node, dict):
            prefix = ".".join(parts[: depth + 1])
            raise ConfigError(f"override {override!r}: {prefix}={show(node)} is a value, not a section; "
                              f"override {prefix} itself")
    return deep_merge(tree, nested)


def compose(
    path: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
    search_path: Sequence[str | os.PathLike] | None = None,
) -> dict:
    """The merged raw tree of a YAML file (with its presets) and overrides, before typing."""
    tree: dict = {}
    if path is not None:
        path = Path(path).expanduser()
        roots = [Path(p) for p in search_path] if search_path is not None else [path.resolve().parent, CONFIGS_DIR]
        tree = _compose_file(path, roots, ())
    for override in overrides:
        tree = apply_override(tree, override)
    return tree


# ---------------------------------------------------------------------------------------------
# Typed conversion: raw tree -> RunConfig, collecting every unknown key and wrong type

_BAD = object()  # a value that failed conversion (its error is recorded)


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != len(typing.get_args(tp)):
            return True, args[0] if len(args) == 1 else typing.Union[tuple(args)]
    return False, tp


def _describe(tp: Any) -> str:
    optional, inner = _is_optional(tp)
    if optional:
        return f"{_describe(inner)} or null"
    origin = typing.get_origin(inner)
    if inner is int:
        return "an integer"
    if inner is float:
        return "a number"
    if inner is bool:
        return "true or false"
    if inner is str:
        return "a string"
    if origin is Literal:
        return "one of " + ", ".join(show(a) for a in typing.get_args(inner))
    if origin is list:
        return "a list"
    if origin is tuple:
        return f"a list of {len(typing.get_args(inner))} numbers"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(inner):
        return "a mapping (a section)"
    return str(inner)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _schema_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key (sections and leaves) of a dataclass tree."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        _, inner = _is_optional(hints[f.name])
        if dataclasses.is_dataclass(inner):
            keys.extend(_schema_keys(inner, key + "."))
    return keys


class _Converter:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.all_keys = _schema_keys(RunConfig)

    def error(self, key: str, value: Any, problem: str, fix: str) -> object:
        self.errors.append(f"{key}={show(value)}: {problem}; {fix}")
        return _BAD

    def unknown(self, key: str, name: str, valid: list[str]) -> None:
        parent = key[: -len(name)].rstrip(".")
        elsewhere = [k for k in self.all_keys if k.rsplit(".", 1)[-1] == name]
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
        if elsewhere:  # the right name in the wrong section
            hint = f"did you mean {' or '.join(elsewhere)}? (it lives in another section)"
        elif close:
            hint = f"did you mean {(parent + '.' if parent else '') + close[0]}?"
        else:
            where = f"under {parent}" if parent else "at the top level"
            hint = f"valid keys {where}: {', '.join(valid)}"
        self.errors.append(f"{key}: unknown key; {hint}")

    def section(self, cls: type, data: Any, prefix: str) -> Any:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            return self.error(prefix.rstrip(".") or "<top level>", data, f"expected a mapping (a section), got "
                              f"{_type_name(data)}", f"write it as a block of {prefix}* keys")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for raw_name, value in data.items():
            name = str(raw_name)
            key = f"{prefix}{name}"
            if name not in fields:
                self.unknown(key, name, list(fields))
                continue
            default = _field_default(fields[name])
            converted = self.value(hints[name], value, key, default)
            if converted is not _BAD:
                kwargs[name] = converted
        return cls(**kwargs)

    def value(self, tp: Any, value: Any, key: str, default: Any = None) -> Any:
        optional, inner = _is_optional(tp)
        if value is None:
            if optional:
                return None
            if dataclasses.is_dataclass(inner):
                return self.section(inner, {}, key + ".")
            return self.error(key, value, f"must not be null (expected {_describe(inner)})",
                              f"set a value or delete the key (default: {show(default)})")
        origin = typing.get_origin(inner)
        fix = f"e.g. the default {show(default)}" if default is not None else f"set {_describe(inner)}"
        if dataclasses.is_dataclass(inner):
            return self.section(inner, value, key + ".")
        if inner is bool:
            if isinstance(value, bool):
                return value
            return self.error(key, value, f"expected true or false, got {_type_name(value)}", "write true or false")
        if inner is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
            hint = "write the number without quotes" if isinstance(value, str) and _numeric(value) else fix
            return self.error(key, value, f"expected an integer, got {_type_name(value)}", hint)
        if inner is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            hint = "write the number without quotes" if isinstance(value, str) and _numeric(value) else fix
            return self.error(key, value, f"expected a number, got {_type_name(value)}", hint)
        if inner is str:
            if isinstance(value, str):
                return value
            return self.error(key, value, f"expected a string, got {_type_name(value)}", "quote it, e.g. \"...\"")
        if origin is Literal:
            choices = typing.get_args(inner)
            if value in choices and type(value) is type(choices[0]):
                return value
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"did you mean {show(close[0])}?" if close else "pick one of those"
            return self.error(key, value, f"must be one of {show(list(choices))}", hint)
        if origin is list:
            (item_tp,) = typing.get_args(inner)
            if isinstance(value, str) and item_tp is str:
                value = [value]  # a single file name for a list of files
            if not isinstance(value, (list, tuple)):
                return self.error(key, value, f"expected a list, got {_type_name(value)}", "write [a, b, ...]")
            items = [self.value(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
            return _BAD if any(v is _BAD for v in items) else items
        if origin is tuple:
            item_tps = typing.get_args(inner)
            if not isinstance(value, (list, tuple)) or len(value) != len(item_tps):
                return self.error(key, value, f"expected a list of {len(item_tps)} values", fix)
            items = [self.value(t, v, f"{key}[{i}]") for i, (t, v) in enumerate(zip(item_tps, value))]
            return _BAD if any(v is _BAD for v in items) else tuple(items)
        if origin is dict:
            key_tp, item_tp = typing.get_args(inner)
            if not isinstance(value, dict):
                return self.error(key, value, f"expected a mapping, got {_type_name(value)}", "write {name: value, ...}")
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    self.error(f"{key}.{k}", v, f"the key {show(k)} must be a string", "quote the key")
                    continue
                out[k] = self.value(item_tp, v, f"{key}.{k}")
            return _BAD if any(v is _BAD for v in out.values()) else out
        raise TypeError(f"config schema type {tp!r} of {key} is not supported")  # a schema bug


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return None


def _numeric(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def from_dict(tree: dict) -> RunConfig:
    """A RunConfig from a raw tree; ConfigError listing every unknown key and wrong type."""
    converter = _Converter()
    config = converter.section(RunConfig, tree, "")
    if converter.errors:
        raise ConfigError(converter.errors)
    return config


# ---------------------------------------------------------------------------------------------
# Back to plain data / YAML


def to_dict(config: Any) -> Any:
    """A plain tree (dicts, lists, scalars) of a config or any section of one."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return config


class _Dumper(yaml.SafeDumper):
    """Lists of scalars on one line (``betas: [0.9, 0.999]``), everything else in blocks."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(not isinstance(v, (dict, list)) for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def to_yaml(config: RunConfig) -> str:
    """The resolved config as YAML (every key, in schema order); ``load_config`` reads it back."""
    return yaml.dump(to_dict(config), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def save_resolved(config: RunConfig, run_dir: str | os.PathLike) -> Path:
    """Write ``run_dir/resolved_config.yaml`` atomically (temp file in the same dir, fsync, rename)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / RESOLVED_NAME
    text = "# megarl resolved run config (every key); load with megarl.config.load_config\n" + to_yaml(config)
    fd, tmp = tempfile.mkstemp(prefix=f".{RESOLVED_NAME}.", suffix=".tmp", dir=run_dir)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
    *,
    search_path: Sequence[str | os.PathLike] | None = None,
    validate: bool = True,
    check_files: bool = True,
) -> RunConfig:
    """Compose, type and (by default) validate a run config; ConfigError on any problem.

    ``check_files=False`` skips the existence checks of data files and the resume checkpoint
    (for checking a config on a machine that does not hold the data).
    """
    config = from_dict(compose(path, overrides, search_path))
    if validate:
        from megarl.config.validate import validate_config

        validate_config(config, check_files=check_files)
    return config
