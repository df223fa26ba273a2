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

import difflib
import functools
import os
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml
from pydantic import TypeAdapter, ValidationError
from pydantic_core import to_jsonable_python

from megarl.config.errors import BOUND_ERRORS, ConfigError, field_path, problems_of, show
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
# Typed conversion (pydantic): raw tree -> RunConfig, collecting every unknown key and wrong type

_RUN_CONFIG = TypeAdapter(RunConfig)


def _without(tree: dict, path: tuple[str, ...]) -> dict:
    head, *rest = path
    out = dict(tree)
    if rest:
        out[head] = _without(out[head], tuple(rest))
    else:
        out.pop(head, None)
    return out


def from_dict(tree: dict) -> RunConfig:
    """A RunConfig from a raw tree; ConfigError listing every unknown key and wrong type.

    A value of the right type that breaks its field's declared bounds is kept as given:
    ``validate_config`` reports it, together with the cross-field checks of the same config.
    """
    try:
        return _RUN_CONFIG.validate_python(tree)
    except ValidationError as exc:
        errors = exc.errors()
    structural = [e for e in errors if e["type"] not in BOUND_ERRORS]
    if structural:
        raise ConfigError(problems_of(RunConfig, structural, tree))
    # Only bounds broken: build the config with those fields at their defaults, then put the
    # user's values back (converted to the field's type, or as given where its items break bounds).
    paths = {field_path(RunConfig, tuple(e["loc"])) for e in errors}
    trimmed = tree
    for path in paths:
        trimmed = _without(trimmed, path)
    config = _RUN_CONFIG.validate_python(trimmed)
    for path in paths:
        section = functools.reduce(getattr, path[:-1], config)
        raw = functools.reduce(lambda node, key: node[key], path, tree)
        try:
            raw = TypeAdapter(type(section).__pydantic_fields__[path[-1]].annotation).validate_python(raw)
        except ValidationError:
            pass
        setattr(section, path[-1], raw)
    return config


# ---------------------------------------------------------------------------------------------
# Back to plain data / YAML


def to_dict(config: Any) -> Any:
    """A plain tree (dicts, lists, scalars) of a config or any section of one."""
    return to_jsonable_python(config)


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
    from parallel.checkpoint.atomic import atomic_file

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / RESOLVED_NAME
    text = "# megarl resolved run config (every key); load with megarl.config.load_config\n" + to_yaml(config)
    with atomic_file(target) as tmp:
        tmp.write_text(text)
    return target


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
    *,
    search_path: Sequence[str | os.PathLike] | None = None,
    validate: bool = True,
    check_files: bool = True,
    mode: str = "rl",
) -> RunConfig:
    """Compose, type and (by default) validate a run config; ConfigError on any problem.

    ``check_files=False`` skips the existence checks of data files and the resume checkpoint
    (for checking a config on a machine that does not hold the data). ``mode="sft"``: the config
    of ``megarl sft`` (``RunConfig.for_sft``), validated as such.
    """
    config = from_dict(compose(path, overrides, search_path))
    if validate:
        from megarl.config.validate import validate_config

        validate_config(config, check_files=check_files, mode=mode)
    return config.for_sft() if mode == "sft" else config
