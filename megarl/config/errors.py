"""The one exception of the config package, how a value is shown in a message, and the one
translator of pydantic's ValidationError into those messages (``problems_of``)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from typing import Any, Iterable, Literal

from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python


class ConfigError(ValueError):
    """A run configuration that cannot work. ``str(error)`` is one self-contained line per
    problem (dotted key, bad value, fix); ``error.problems`` is the list of those lines."""

    def __init__(self, problems: str | Iterable[str]):
        problems = [problems] if isinstance(problems, str) else list(problems)
        # One line per problem, whatever the wrapped messages looked like.
        self.problems = [" ".join(str(p).split()) for p in problems]
        super().__init__("\n".join(self.problems))


def show(value: Any, limit: int = 80) -> str:
    """A value as it would be written in YAML/JSON (strings quoted, null, true/false), shortened."""
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# pydantic's errors -> one line each: ``key=value: problem; fix`` (``key: unknown key; hint``)

# A value of the right type that breaks a bound declared on its field (``schema.bounded``):
# reported by validate_config with the cross-field checks, not by the loader.
BOUND_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal",
                          "string_too_short", "string_pattern_mismatch", "too_short", "out_of_range"})
_UNKNOWN_KEY = ("unexpected_keyword_argument", "extra_forbidden")


def _plain(tp: Any) -> Any:
    """``tp`` without ``Annotated[...]`` and ``| None``."""
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp):
            (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
        else:
            return tp


def _nullable(tp: Any) -> bool:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


@dataclasses.dataclass
class _Place:
    """Where an error's location points in the schema."""

    key: str  # the dotted key as a user writes it: actor.optim.betas[1], cluster.pools.train
    tp: Any  # the declared type there (may be Annotated / Optional)
    field: FieldInfo | None = None  # the innermost section field on the way
    field_path: tuple[str, ...] = ()  # the section fields leading to (and naming) it
    valid: list[str] | None = None  # set for an unknown key: the section's keys


def section_fields(cls: type) -> dict[str, FieldInfo]:
    """A section's fields as pydantic sees them: a pydantic dataclass's own, or those pydantic
    makes of a plain dataclass's (``parallel.layout.MegatronLayout``: annotation, default and
    ``metadata``)."""
    fields = getattr(cls, "__pydantic_fields__", None)
    if fields is None:
        hints = typing.get_type_hints(cls)
        fields = {f.name: FieldInfo.from_annotated_attribute(hints[f.name], f) for f in dataclasses.fields(cls)}
    return fields


def _place(root: type, loc: tuple) -> _Place:
    place = _Place("", root)
    for part in loc:
        tp = _plain(place.tp)
        name = str(part)
        if dataclasses.is_dataclass(tp):
            fields = section_fields(tp)
            place.key += ("." if place.key else "") + name
            if name not in fields:
                place.valid = list(fields)
                return place
            place.field, place.tp = fields[name], fields[name].annotation
            place.field_path += (name,)
        elif typing.get_origin(tp) in (list, tuple) and isinstance(part, int):
            args = typing.get_args(tp)
            place.key += f"[{part}]"
            place.tp = args[part] if typing.get_origin(tp) is tuple and part < len(args) else args[0]
        elif typing.get_origin(tp) is dict:
            place.key += f".{name}"
            place.tp = typing.get_args(tp)[1]
        # else a pydantic-internal step of the location ("[key]", a validator's name): no key of its own
    return place


def field_path(root: type, loc: tuple) -> tuple[str, ...]:
    """The section fields leading to an error's location (``("actor", "optim", "betas")``)."""
    return _place(root, loc).field_path


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key (sections and leaves) of a section class."""
    keys = []
    for name, info in section_fields(cls).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(_plain(info.annotation)):
            keys.extend(_all_keys(_plain(info.annotation), f"{prefix}{name}."))
    return keys


def _describe(tp: Any) -> str:
    inner = _plain(tp)
    origin = typing.get_origin(inner)
    text = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(inner)
    if text is None:
        text = ("one of " + ", ".join(show(a) for a in typing.get_args(inner)) if origin is Literal
                else "a list" if origin is list else f"a list of {len(typing.get_args(inner))} numbers"
                if origin is tuple else "a mapping" if origin is dict
                else "a mapping (a section)" if dataclasses.is_dataclass(inner) else str(inner))
    return f"{text} or null" if _nullable(tp) else text


def _type_name(value: Any) -> str:
    for kind, name in ((type(None), "null"), (bool, "a boolean"), (int, "an integer"), (float, "a number"),
                       (str, "a string"), (list, "a list"), (dict, "a mapping")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _numeric(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _bounds_text(place: _Place) -> str:
    """``must be >= 1`` / ``must be in [0, 1)`` from the bounds declared at the error's place."""
    metadata = list(place.field.metadata) if place.field is not None and place.tp is place.field.annotation else []
    tp = place.tp
    while typing.get_origin(tp) is typing.Annotated:
        metadata += [m for a in typing.get_args(tp)[1:] for m in (getattr(a, "metadata", None) or [a])]
        tp = typing.get_args(tp)[0]
    lo = hi = None
    for m in metadata:
        for attr, side in (("gt", "("), ("ge", "[")):
            if getattr(m, attr, None) is not None:
                lo = (side, getattr(m, attr))
        for attr, side in (("lt", ")"), ("le", "]")):
            if getattr(m, attr, None) is not None:
                hi = (side, getattr(m, attr))
    if lo and hi:
        return f"must be in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
    if lo or hi:
        op = {"(": ">", "[": ">=", ")": "<", "]": "<="}[(lo or hi)[0]]
        return f"must be {op} {(lo or hi)[1]}"
    return "is out of range"


def _lookup(tree: Any, loc: tuple) -> Any:
    for part in loc:
        if isinstance(tree, dict) and part in tree:
            tree = tree[part]
        elif isinstance(tree, (list, tuple)) and isinstance(part, int) and part < len(tree):
            tree = tree[part]
    return tree


def _problem(root: type, err: dict, tree: Any, all_keys: list[str]) -> str:
    kind, loc, value = err["type"], tuple(err["loc"]), err["input"]
    if kind == "missing":  # only a too-short tuple has required items
        loc = loc[:-1]
        value = _lookup(tree, loc)
    place = _place(root, loc)
    key = place.key or "<top level>"
    if kind in _UNKNOWN_KEY or place.valid is not None:
        name = str(loc[-1])
        parent = key[: -len(name)].rstrip(".")
        valid = place.valid or []
        elsewhere = [k for k in all_keys if k.rsplit(".", 1)[-1] == name]
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
        if elsewhere:  # the right name in the wrong section
            hint = f"did you mean {' or '.join(elsewhere)}? (it lives in another section)"
        elif close:
            hint = f"did you mean {(parent + '.' if parent else '') + close[0]}?"
        else:
            hint = f"valid keys {f'under {parent}' if parent else 'at the top level'}: {', '.join(valid)}"
        return f"{key}: unknown key; {hint}"
    if loc and loc[-1] == "[key]":
        return (f"{key}={show(_lookup(tree, loc[:-1]))}: the key {show(value)} must be a string; quote the key")

    inner = _plain(place.tp)
    origin = typing.get_origin(inner)
    extra = (place.field.json_schema_extra if place.field is not None else None) or {}
    default = place.field.default if place.field is not None and place.tp is place.field.annotation else None
    default = None if default is PydanticUndefined else default
    if kind in BOUND_ERRORS and origin is not tuple:
        if inner is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        fix = extra.get("fix") or (f"e.g. the default {show(default)}" if default is not None else "change it")
        return f"{key}={show(value)}: {extra.get('problem') or _bounds_text(place)}; {fix}"

    fix = f"e.g. the default {show(default)}" if default is not None else f"set {_describe(inner)}"
    if value is None:
        problem, fix = (f"must not be null (expected {_describe(inner)})",
                        f"set a value or delete the key (default: {show(default)})")
    elif origin is Literal:
        choices = [str(c) for c in typing.get_args(inner)]
        close = difflib.get_close_matches(str(value), choices, n=1)
        problem = f"must be one of {show(list(typing.get_args(inner)))}"
        fix = f"did you mean {show(close[0])}?" if close else "pick one of those"
    elif origin is tuple:
        problem = f"expected a list of {len(typing.get_args(inner))} values"
    elif inner in (int, float, bool, str) or origin in (list, dict) or dataclasses.is_dataclass(inner):
        problem = f"expected {_describe(inner)}, got {_type_name(value)}"
        if inner in (int, float) and isinstance(value, str) and _numeric(value):
            fix = "write the number without quotes"
        else:
            fix = {bool: "write true or false", str: 'quote it, e.g. "..."'}.get(inner, fix)
            fix = ("write [a, b, ...]" if origin is list else "write {name: value, ...}" if origin is dict
                   else f"write it as a block of {place.key + '.' if place.key else ''}* keys"
                   if dataclasses.is_dataclass(inner) else fix)
    else:  # an error this translator does not know (a schema using a new kind of check)
        problem = err["msg"][:1].lower() + err["msg"][1:]
    return f"{key}={show(value)}: {problem}; {fix}"


def problems_of(root: type, errors: Iterable[dict], tree: Any) -> list[str]:
    """One line per pydantic error (``ValidationError.errors()``) of validating ``tree`` into
    ``root`` (a section class): the dotted key, the user's value, the problem and the fix
    declared next to the field (``schema.bounded``) or derived from its type."""
    all_keys = _all_keys(root)
    return [_problem(root, err, tree, all_keys) for err in errors]


def field_problems(config: Any) -> list[str]:
    """The lines of every field of a built config (a section) whose value breaks the field's
    own declared bounds (or type): the config re-validated as plain data."""
    tree = to_jsonable_python(config)
    try:
        TypeAdapter(type(config)).validate_python(tree)
    except ValidationError as exc:
        return problems_of(type(config), exc.errors(), tree)
    return []


class Problems:
    """The problems of one validation, each a line ``key=value: problem; fix``."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, key: str, value: Any, problem: str, fix: str) -> None:
        self.lines.append(f"{key}={show(value)}: {problem}; {fix}")

    def line(self, text: str) -> None:
        self.lines.append(text)

    def check(self, ok: bool, key: str, value: Any, problem: str, fix: str) -> bool:
        if not ok:
            self.add(key, value, problem, fix)
        return ok
