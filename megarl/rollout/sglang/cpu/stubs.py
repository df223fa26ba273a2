"""Import-time stubs that let the real SGLang engine run on a CPU-only machine.

SGLang 0.5.23's CPU path (``SGLANG_USE_CPU_ENGINE=1``, torch-native attention, pytorch sampling)
never runs a CUDA kernel, but importing it pulls in modules that do not exist, or do not work,
without CUDA (see docs/cpu.md). This is the one place that stubs them:

``sgl_kernel``
    SGLang's CUDA kernel library; there is no CPU wheel. Dozens of SGLang modules import names
    from it at import time (``from sgl_kernel import silu_and_mul``,
    ``from sgl_kernel.scalar_type import scalar_types``). The stub answers every import and every
    attribute access with a placeholder; calling any placeholder raises :class:`StubCalledError`
    naming the function. The CPU path never calls one; if it ever does, the error says which.
``torchvision``
    ``sglang.srt.configs`` imports ``torchvision.transforms`` unconditionally (DeepSeek-OCR config),
    and the PyPI torchvision wheel is built against CUDA torch ("operator torchvision::nms does not
    exist" on a CPU torch). The stub is a tree of modules whose CamelCase names are classes that
    answer class-level attribute access (transformers reads ``InterpolationMode.NEAREST_EXACT``);
    instantiating one raises. Text-only models run no image code. Its ``__version__`` (like every
    stub root's) is ``0.0.0+cpustub``: transformers parses it, and version-gated features read as
    absent.
``triton``
    Only used when triton is not installed (a 286 MB wheel the CPU path never runs; xgrammar lists
    it, but SGLang is installed with --no-deps on CPU). SGLang's kernel modules decorate with
    ``@triton.jit`` / ``@triton.autotune(...)`` at import, and torch's inductor (imported by
    module-level ``@torch.compile``) probes triton's API when triton is importable. The stub keeps
    decorated functions as they are, resolves every name, makes CamelCase names subclassable
    classes, and ``triton.runtime.driver.active`` raises (no GPU backend, as on real triton).

Deliberately NOT stubbed: ``vllm``. With ``SGLANG_USE_CPU_ENGINE=1`` SGLang never needs it; it
imports ``vllm._custom_ops`` only inside ``try/except ImportError`` with a native fallback (MoE
runner), and ``vllm.logger`` the same way. A stub would switch those to raising placeholders.

A stub is installed only for a module that is NOT importable for real (the finder sits at the end
of ``sys.meta_path``) unless named in ``override`` (e.g. a CUDA-built torchvision on a CPU torch),
and only when asked: :func:`install` does nothing when a CUDA device is present unless
``force=True``. On a GPU machine nothing changes.

SGLang's Engine spawns scheduler and detokenizer processes, which need the stubs before their
first import: :func:`install_from_env` installs them at interpreter start in every Python process
started with ``MEGARL_CPU_STUBS=1`` (plus ``MEGARL_CPU_STUBS_OVERRIDE=name,...``). The hook that
calls it is not here: it is the ``sitecustomize`` of megarl's engine processes
(``megarl/rollout/sglang/engine_site``, which also installs megarl's patches of SGLang), and
``megarl.rollout.sglang.engine.child_env`` builds such an environment. The variables are deliberately not
named ``SGL_*``: SGLang treats ``SGL_*`` as deprecated aliases of ``SGLANG_*``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

ENV_VAR = "MEGARL_CPU_STUBS"
OVERRIDE_ENV_VAR = "MEGARL_CPU_STUBS_OVERRIDE"


class StubCalledError(RuntimeError):
    """A CPU import stub was called: a code path that needs a real CUDA library ran on CPU."""


# --------------------------------------------------------------------------- sgl_kernel


class _Raising:
    """Placeholder for anything of a missing kernel library. Attribute access returns another
    placeholder (``scalar_types.uint4b8`` works at import time); calling one raises."""

    __slots__ = ("_stub_name",)

    def __init__(self, name: str):
        object.__setattr__(self, "_stub_name", name)

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Raising(f"{self._stub_name}.{name}")

    def __call__(self, *args, **kwargs):
        raise StubCalledError(
            f"{self._stub_name}() was called, but it is a CPU import stub from megarl.rollout.sglang.cpu.stubs "
            f"(the real library is not installed). This code path needs the CUDA build; SGLang on "
            f"CPU must run with attention_backend='torch_native' and sampling_backend='pytorch'.")

    def __repr__(self) -> str:
        return f"<cpu stub {self._stub_name}>"


class _RaisingModule(types.ModuleType):
    """Module whose unknown attributes are :class:`_Raising` placeholders."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _Raising(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


# --------------------------------------------------------------------------- torchvision


class _StubClassMeta(type):
    """Stub classes: class-level attribute access returns a stable sentinel string;
    instantiation raises."""

    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = f"{cls.__module__}.{cls.__name__}.{name}"
        setattr(cls, name, value)
        return value

    def __call__(cls, *args, **kwargs):
        raise StubCalledError(f"{cls.__module__}.{cls.__name__}(...) was instantiated, but it is "
                              f"a CPU import stub from megarl.rollout.sglang.cpu.stubs")


class _TreeModule(types.ModuleType):
    """Module whose CamelCase attributes are stub classes and lowercase ones submodules (registered
    in ``sys.modules`` too, so ``import torchvision.transforms.v2.functional`` works)."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = (self._stub_class(name) if name[:1].isupper()
                 else _make_module(f"{self.__name__}.{name}", type(self)))
        setattr(self, name, value)
        return value

    def _stub_class(self, name: str) -> type:
        return _StubClassMeta(name, (), {"__module__": self.__name__})


# --------------------------------------------------------------------------- triton


def _passthrough_decorator(*args, **kwargs):
    """``@triton.jit``, ``@triton.jit(...)``, ``@triton.autotune(...)``: keep the function."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda fn: fn


class _TritonConfig:
    def __init__(self, kwargs=None, num_warps=4, num_stages=2, **extra):
        self.kwargs, self.num_warps, self.num_stages = dict(kwargs or {}), num_warps, num_stages
        self.__dict__.update(extra)


class _Constexpr:
    def __init__(self, value=None):
        self.value = value


class _NoActiveDriver:
    """``triton.runtime.driver``: its ``active`` (and everything else) raises, as real triton does
    on a machine without a GPU backend."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"triton.runtime.driver.{name}: no active triton driver (CPU stub)")


class _TritonModule(_TreeModule):
    """triton stub tree: lowercase names are submodules that are also callable as pass-through
    decorators (``tl.sum`` and friends only appear in kernel bodies that never run; inductor calls
    ``inspect.signature(triton.language.core.view)``); CamelCase names are plain subclassable
    classes (``class K(triton.runtime.KernelInterface)``)."""

    __call__ = staticmethod(_passthrough_decorator)

    def _stub_class(self, name: str) -> type:
        return type(name, (Exception,) if name.endswith("Error") else (), {"__module__": self.__name__})


def _fill_triton(mod: types.ModuleType) -> None:
    if mod.__name__ == "triton":
        mod.jit = mod.autotune = mod.heuristics = _passthrough_decorator
        mod.Config = _TritonConfig
        mod.cdiv = lambda a, b: -(a // -b)
        mod.next_power_of_2 = lambda n: 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
    elif mod.__name__ == "triton.language":
        mod.constexpr = _Constexpr
    elif mod.__name__ == "triton.runtime":
        mod.driver = _NoActiveDriver()
    elif mod.__name__ == "triton.backends":
        # torch's has_triton() asks which devices triton can compile for: none, so dynamo and
        # inductor take their triton-free paths (C++ codegen on CPU) instead of probing the stub.
        mod.backends = {}
    elif mod.__name__ == "triton.runtime.autotuner":
        mod.OutOfResources = type("OutOfResources", (Exception,), {})


# --------------------------------------------------------------------------- finders

_MODULE_CLASS = {"sgl_kernel": _RaisingModule, "torchvision": _TreeModule, "triton": _TritonModule}
STUBBED = tuple(_MODULE_CLASS)  # the top-level modules that have a stub


def _make_module(fullname: str, cls: type) -> types.ModuleType:
    if fullname in sys.modules:
        return sys.modules[fullname]
    mod = cls(fullname)
    mod.__path__ = []  # a package: submodule imports come back to the finders
    mod.__spec__ = importlib.machinery.ModuleSpec(fullname, _LOADER, is_package=True)
    mod.__loader__ = _LOADER
    mod.__file__ = __file__
    mod.__megarl_cpu_stub__ = True
    if "." not in fullname:
        mod.__version__ = "0.0.0+cpustub"
    if cls is _TritonModule:
        _fill_triton(mod)
    sys.modules[fullname] = mod
    parent, _, child = fullname.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    return mod


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return _make_module(spec.name, _MODULE_CLASS[spec.name.partition(".")[0]])

    def exec_module(self, module):
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    """Answers imports of its ``roots`` (and their submodules) with stubs."""

    def __init__(self):
        self.roots: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, _LOADER, is_package=True)
        return None


_LOADER = _StubLoader()
_FALLBACK = _StubFinder()  # appended to sys.meta_path: only sees what nothing installed provides
_OVERRIDE = _StubFinder()  # inserted first: shadows an installed (e.g. broken) library


def is_stub(module: object) -> bool:
    """True when ``module`` is one of these stubs rather than the real library."""
    return bool(getattr(module, "__megarl_cpu_stub__", False))


def cuda_available() -> bool:
    """Whether a CUDA device is usable (imports torch)."""
    import torch

    return torch.cuda.is_available()


def install(force: bool = False, roots: tuple[str, ...] = STUBBED,
            override: tuple[str, ...] = ()) -> list[str]:
    """Stub those of ``roots`` that are not importable for real, and those in ``override`` even if
    they are; return the stubbed names. Does nothing with CUDA present unless ``force``.
    Idempotent; a module already imported for real is never replaced."""
    if not force and cuda_available():
        return []
    stubbed = []
    for root in dict.fromkeys(tuple(roots) + tuple(override)):
        if root not in _MODULE_CLASS:
            raise ValueError(f"no CPU stub for {root!r}; stubs exist for {sorted(_MODULE_CLASS)}")
        if root in sys.modules and not is_stub(sys.modules[root]):
            continue
        if root in override:
            _OVERRIDE.roots.add(root)
        elif root not in _FALLBACK.roots and importlib.util.find_spec(root) is not None:
            continue  # the real library is installed
        _FALLBACK.roots.add(root)
        stubbed.append(root)
    if _OVERRIDE.roots and _OVERRIDE not in sys.meta_path:
        sys.meta_path.insert(0, _OVERRIDE)
    if _FALLBACK not in sys.meta_path:
        sys.meta_path.append(_FALLBACK)
    return stubbed


def install_from_env() -> list[str]:
    """Run at interpreter start (by megarl's engine ``sitecustomize``): install when
    ``MEGARL_CPU_STUBS=1``. The parent already decided that stubs are needed, so no torch import
    (CUDA probe) happens here."""
    if os.environ.get(ENV_VAR, "") != "1":
        return []
    override = tuple(n for n in os.environ.get(OVERRIDE_ENV_VAR, "").split(",") if n)
    return install(force=True, override=override)
