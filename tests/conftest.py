"""Fixtures shared across test directories: tiny HF models and prompt files, each made once per
test session and reused by every test that asks for the same one (no downloads). Also the test
tiers: the ``quick`` marker on every single-process test (``pytest_collection_modifyitems``)."""

from __future__ import annotations

import inspect
import json
import types
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory):
    """``tiny_hf_model(preset, seed=0, reward_model=False, **config_overrides)`` -> the directory of
    a randomly initialised HF checkpoint of that preset (``model_specs.presets.save_tiny_hf_model``),
    built once per session for each distinct request. Tests must not modify it: copy it first."""
    from model_specs.presets import save_tiny_hf_model

    made: dict[str, str] = {}

    def build(preset: str, seed: int = 0, reward_model: bool = False, **overrides) -> str:
        key = json.dumps([preset, seed, reward_model, overrides], sort_keys=True)
        if key not in made:
            path = tmp_path_factory.mktemp(f"{preset}-seed{seed}") / "hf"
            made[key] = str(save_tiny_hf_model(preset, path, seed=seed, reward_model=reward_model, **overrides))
        return made[key]

    return build


@pytest.fixture(scope="session")
def arith_prompts(tmp_path_factory):
    """``arith_prompts(num)`` -> a parquet file of ``num`` synthetic arithmetic prompts (seed 0,
    partial credit 5: the quickstart's data), made once per session for each size."""
    from megarl.data.prepare import write_synthetic_arith

    made: dict[int, str] = {}

    def build(num: int) -> str:
        if num not in made:
            path = Path(tmp_path_factory.mktemp("arith")) / f"arith{num}.parquet"
            write_synthetic_arith(path, num, seed=0, partial_credit_scale=5)
            made[num] = str(path)
        return made[num]

    return build



@pytest.fixture
def onednn_linears(monkeypatch):
    """CPU linears through oneDNN (``MEGARL_CPU_LINEAR=onednn``) in this process and in the ranks
    it starts (they inherit the environment), whichever backend this machine would choose."""
    from parallel.cpu import linear as cpu_linear

    monkeypatch.setenv(cpu_linear.ENV_VAR, "onednn")
    cpu_linear.backend.cache_clear()
    yield
    cpu_linear.backend.cache_clear()  # the next reader takes the environment as restored


# Test tiers. `bash ci/run_tests.sh -m quick` runs the single-process tests (a few minutes, for
# local iteration); CI runs everything (no marker is filtered by default). A test is `quick`
# unless something it runs can start another process. The rule reads code, not timings, so a new
# test is placed by what it does: the test function, every fixture it uses that is defined under
# tests/, and the test-suite helpers they call (functions, classes and their methods under tests/,
# followed transitively) are scanned for the names in PROCESS_STARTERS. Code outside tests/ (the
# project's and libraries') is not followed: a test reaches a process through one of these names.
# (Found by one timed run of the whole suite: the tests this leaves quick took ~30 s of its 20 min.)
PROCESS_STARTERS = frozenset({
    "subprocess",  # `megarl ...` commands, `python -c`, Slurm clients, ci/*.sh
    "multiprocessing",
    "ray",
    "run_on_ranks",  # parallel.spawn: N torch.distributed ranks
    "SGLangEngine",  # an SGLang server process
})
_TESTS_PACKAGE = __name__.split(".")[0]  # this file is tests.conftest


def _in_tests(obj) -> bool:
    module = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    return isinstance(module, str) and module.split(".")[0] == _TESTS_PACKAGE


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names ``code`` and the functions nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _starts_processes(obj, seen: dict, owner: type | None = None) -> bool:
    """Whether ``obj`` (a test, a fixture, a helper function or class of the test suite) names a
    process starter, itself or through the test-suite helpers it names."""
    obj = getattr(obj, "__func__", obj)  # bound methods, staticmethod, classmethod
    if isinstance(obj, property):
        return any(_starts_processes(f, seen, owner) for f in (obj.fget, obj.fset) if f is not None)
    if id(obj) in seen:
        return seen[id(obj)]
    seen[id(obj)] = False  # a cycle adds nothing
    if isinstance(obj, type):
        found = any(_starts_processes(member, seen, obj) for member in vars(obj).values()
                    if inspect.isfunction(getattr(member, "__func__", member)) or isinstance(member, property))
    elif inspect.isfunction(obj):
        found = _function_starts_processes(inspect.unwrap(obj), seen, owner)
    else:
        found = False
    seen[id(obj)] = found
    return found


def _function_starts_processes(fn: types.FunctionType, seen: dict, owner: type | None) -> bool:
    names = _names(fn.__code__)
    if any(name.split(".")[0] in PROCESS_STARTERS for name in names):  # also `import ray` inside
        return True
    for name in names:
        target = fn.__globals__.get(name)
        if target is None and owner is not None:
            target = getattr(owner, name, None)  # self.helper()
        if target is None:
            continue
        home = str(getattr(target, "__module__", "")).split(".")[0]  # `from subprocess import run`
        if getattr(target, "__name__", None) in PROCESS_STARTERS or home in PROCESS_STARTERS:
            return True
        if isinstance(target, types.ModuleType):
            if _in_tests(target):  # rank_fns.work(...): follow the attributes this code names
                members = (getattr(target, attr, None) for attr in names)
                if any(_in_tests(m) and not isinstance(m, types.ModuleType) and _starts_processes(m, seen)
                       for m in members):
                    return True
        elif _in_tests(target) and _starts_processes(target, seen, owner):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    seen: dict = {}
    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        used = [function] + [defs[-1].func for defs in fixtures.values() if defs and _in_tests(defs[-1].func)]
        try:
            single_process = not any(_starts_processes(f, seen, getattr(item, "cls", None)) for f in used)
        except Exception:  # code this reading cannot follow: not quick
            single_process = False
        if single_process:
            item.add_marker(pytest.mark.quick)
