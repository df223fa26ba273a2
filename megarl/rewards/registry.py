"""Name -> reward function registry, data source -> reward mapping, and user-function loading.

A reward function is called by keyword and returns a float (or a dict with a ``"score"`` float
plus other numbers, which are averaged into the step's statistics)::

    fn(*, data_source: str, solution_str: str, ground_truth, extra_info: dict) -> float | dict

which is verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)``, so such
functions work unchanged. Three ways to name one:

* a registered name (``"gsm8k"``, ``"math"``, ``"exact_match"``, ``"arithmetic"``, ... or your
  own, registered with ``@register_reward("name", data_sources=("my/dataset",))``);
* ``"package.module:function"`` (imported with importlib) or ``"path/to/file.py:function"``;
* the callable itself.

Each data source maps to at most one registered name; ``reward_for_data_source`` answers it.
A missing module or function fails at once with a ValueError that quotes the string.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable, Iterable

_REWARDS: dict[str, Callable] = {}
_DATA_SOURCES: dict[str, str] = {}
_TRUSTED: set[str] = set()
_LOADED: dict[str, Callable] = {}


def register_reward(
    name: str, data_sources: Iterable[str] = (), override: bool = False, trusted: bool = False
) -> Callable[[Callable], Callable]:
    """Decorator: register a reward function as ``name`` and route ``data_sources`` to it.

    ``trusted`` rewards (fast pure functions, e.g. the built-ins) run in the calling process
    under the dispatcher's ``backend="auto"``; all others run in worker processes with a
    timeout. Re-registering a taken name or data source raises unless ``override=True``.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"a reward name must be a non-empty string without ':', got {name!r}")
    data_sources = (data_sources,) if isinstance(data_sources, str) else tuple(data_sources)

    def decorator(fn: Callable) -> Callable:
        if name in _REWARDS and not override and _REWARDS[name] is not fn:
            raise ValueError(
                f"reward {name!r} is already registered (to {_describe(_REWARDS[name])}); "
                "pick another name or pass override=True"
            )
        for source in data_sources:
            taken = _DATA_SOURCES.get(source)
            if taken is not None and taken != name and not override:
                raise ValueError(
                    f"data source {source!r} already maps to reward {taken!r}; pass override=True to remap it"
                )
        _REWARDS[name] = fn
        _TRUSTED.discard(name)
        if trusted:
            _TRUSTED.add(name)
        for source in data_sources:
            _DATA_SOURCES[source] = name
        return fn

    return decorator


def get_reward(name: str) -> Callable:
    """The reward registered as ``name``; ValueError listing the names otherwise."""
    try:
        return _REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; registered: {sorted(_REWARDS)}") from None


def is_trusted(name: str) -> bool:
    """Whether the registered reward ``name`` was registered with ``trusted=True``."""
    return name in _TRUSTED


def registered_rewards() -> list[str]:
    """Sorted registered reward names."""
    return sorted(_REWARDS)


def data_source_mapping() -> dict[str, str]:
    """A copy of the data source -> reward name table."""
    return dict(_DATA_SOURCES)


def reward_for_data_source(data_source: str) -> str | None:
    """The reward name registered for ``data_source``, or None."""
    return _DATA_SOURCES.get(data_source)


def _describe(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def load_reward_function(spec: str) -> Callable:
    """Import ``"package.module:function"`` or ``"path/to/file.py:function"`` and return the function.

    ValueError, quoting ``spec``, when it is malformed, the module cannot be imported, the
    function is missing or is not callable. Results are cached per spec.
    """
    if spec in _LOADED:
        return _LOADED[spec]
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise ValueError(
            f"reward function {spec!r} must be a registered name ({registered_rewards()}) or "
            "'package.module:function' / 'path/to/file.py:function'"
        )
    module_name, _, fn_name = spec.rpartition(":")
    if not module_name or not fn_name:
        raise ValueError(f"reward function {spec!r}: expected 'package.module:function', got an empty part")
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"reward function {spec!r}: file {str(path)!r} does not exist")
        mod_key = "megarl_user_reward_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        try:
            module = sys.modules.get(mod_key)
            if module is None:
                file_spec = importlib.util.spec_from_file_location(mod_key, path)
                module = importlib.util.module_from_spec(file_spec)
                sys.modules[mod_key] = module
                try:
                    file_spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[mod_key]
                    raise
        except Exception as exc:
            raise ValueError(f"reward function {spec!r}: importing {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise ValueError(
                f"reward function {spec!r}: module {module_name!r} not found ({exc}); check the spelling and that "
                "it is importable (installed, or on PYTHONPATH)"
            ) from exc
        except Exception as exc:
            raise ValueError(f"reward function {spec!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, fn_name, None)
    if fn is None:
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(
            f"reward function {spec!r}: module {module_name!r} has no attribute {fn_name!r}; "
            f"its public callables: {names}"
        )
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {module_name}.{fn_name} is a {type(fn).__name__}, not callable")
    _LOADED[spec] = fn
    return fn


def resolve_reward(spec: str | Callable) -> Callable:
    """A callable for a registered name, a ``"module:function"`` string or a callable."""
    if callable(spec):
        return spec
    if isinstance(spec, str) and spec in _REWARDS:
        return _REWARDS[spec]
    return load_reward_function(spec)
