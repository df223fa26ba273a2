"""The GPU install (`pip install -e '.[sglang,gpu]'`, docs/install_gpu.md) is consistent, checked
offline and without installing anything: what setup.py asks pip for against what SGLang 0.5.23 and
megatron-core 0.16.1 declare in their installed METADATA (importlib.metadata.requires).

- torch is pinned to SGLang's own torch pin (SGLang declares `torch==X`: any other pin is a
  ResolutionImpossible);
- Transformer Engine is pinned inside the range megatron-core declares for it (its `dev` extra),
  with the same extras (core_cu13: the CUDA 13 build that SGLang's torch uses);
- no package is asked for by the project and by SGLang or megatron-core with specifiers that no
  version satisfies together;
- the torch pins in docs/install_gpu.md's commands are SGLang's.

The CPU stack (ci/setup_env.sh: requirements/base.txt with the torch CPU wheel, SGLang --no-deps)
is not checked here: it installs SGLang without its dependencies on purpose."""

import importlib.metadata
import re
import runpy
from itertools import product
from pathlib import Path

import pytest
import setuptools
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
GPU_EXTRAS = ("sglang", "gpu")  # docs/install_gpu.md: pip install ... -e '.[sglang,gpu]'
# The GPU nodes the install targets: Linux x86_64, CPython 3.11 or 3.12.
GPU_ENVIRONMENTS = [
    {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
     "os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython",
     "python_version": python, "python_full_version": f"{python}.0"}
    for python in ("3.11", "3.12")
]


def setup_kwargs() -> dict:
    """What setup.py passes to setuptools.setup, read by running it with setup() captured."""
    captured = {}
    original = setuptools.setup
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="setup_py_under_test")
    finally:
        setuptools.setup = original
    return captured


def gpu_requirements() -> list[Requirement]:
    """Everything `pip install -e '.[sglang,gpu]'` asks for directly."""
    kwargs = setup_kwargs()
    lines = list(kwargs.get("install_requires", []))
    for extra in GPU_EXTRAS:
        lines += kwargs.get("extras_require", {}).get(extra, [])
    return [Requirement(line) for line in lines]


def declared(dist: str, extra: str = "") -> list[Requirement]:
    """An installed distribution's Requires-Dist that apply on a GPU node, for one of its extras
    ("" for its unconditional requirements)."""
    out = []
    for line in importlib.metadata.requires(dist) or []:
        requirement = Requirement(line)

        def holds(name: str, marker=requirement.marker) -> bool:
            return marker is None or any(marker.evaluate({**env, "extra": name}) for env in GPU_ENVIRONMENTS)

        if holds(extra) and (extra == "" or not holds("")):
            out.append(requirement)
    return out


def by_name(requirements: list[Requirement]) -> dict[str, list[Requirement]]:
    named: dict[str, list[Requirement]] = {}
    for requirement in requirements:
        named.setdefault(canonicalize_name(requirement.name), []).append(requirement)
    return named


def pins(specifiers: SpecifierSet) -> list[str]:
    return [s.version for s in specifiers if s.operator in ("==", "===") and "*" not in s.version]


def candidates(*specifier_sets: SpecifierSet) -> set[Version]:
    """Versions around every boundary the specifiers name: enough to find a version in an
    intersection of ranges, or one in a range but outside another."""
    out = set()
    for specifiers in specifier_sets:
        for spec in specifiers:
            text = spec.version.removesuffix(".*")
            try:
                version = Version(text)
            except InvalidVersion:
                continue
            release = list(version.release) + [0] * (3 - len(version.release))
            out.add(version)
            out.add(Version(".".join(map(str, release)) + ".post1"))
            out.add(Version(".".join(map(str, release)) + "a0"))
            for i in range(3):
                up = release[:i] + [release[i] + 1] + [0] * (2 - i)
                out.add(Version(".".join(map(str, up))))
                if release[i] > 0:
                    down = release[:i] + [release[i] - 1] + [99] * (2 - i)
                    out.add(Version(".".join(map(str, down))))
    return out


def compatible(a: SpecifierSet, b: SpecifierSet) -> bool:
    """Whether some version satisfies both specifier sets (pre-releases allowed)."""
    pinned = pins(a) + pins(b)
    if not pinned and not (len(a) and len(b)):
        return True  # one side accepts any version
    versions = [Version(v) for v in pinned] if pinned else candidates(a, b)
    return any(a.contains(v, prereleases=True) and b.contains(v, prereleases=True) for v in versions)


def within(inner: SpecifierSet, outer: SpecifierSet) -> bool:
    """Whether every version `inner` allows is one `outer` allows (checked at the boundaries)."""
    if not len(inner):
        return not len(outer)
    return all(outer.contains(v, prereleases=True)
               for v in candidates(inner, outer) if inner.contains(v, prereleases=True))


def test_the_checks_themselves():
    assert not compatible(SpecifierSet("==2.13.0"), SpecifierSet("==2.14.1"))
    assert compatible(SpecifierSet("==2.14.1"), SpecifierSet(">=2.6.0"))
    assert compatible(SpecifierSet(">=1.7.6,<2.0.0"), SpecifierSet(">=1.9"))
    assert not compatible(SpecifierSet("<2"), SpecifierSet(">=2.1"))
    assert compatible(SpecifierSet(""), SpecifierSet("==1.0"))
    assert within(SpecifierSet(">=2.9,<2.12"), SpecifierSet(">=2.9.0a0,<2.12.0"))
    assert not within(SpecifierSet(">=2.9,<2.13"), SpecifierSet(">=2.9.0a0,<2.12.0"))
    assert not within(SpecifierSet(">=2.8"), SpecifierSet(">=2.9.0a0,<2.12.0"))
    assert not within(SpecifierSet(""), SpecifierSet(">=2.9.0a0,<2.12.0"))
    assert not within(SpecifierSet("==2.12.0"), SpecifierSet(">=2.9.0a0,<2.12.0"))
    assert within(SpecifierSet("==2.11.0"), SpecifierSet(">=2.9.0a0,<2.12.0"))


def sglang_torch() -> str:
    (torch,) = by_name(declared("sglang"))["torch"]
    (pin,) = pins(torch.specifier)
    return pin


def test_torch_is_sglangs_pin():
    want = sglang_torch()
    ours = by_name(gpu_requirements()).get("torch", [])
    assert any(pins(r.specifier) == [want] for r in ours), (
        f"the GPU install must pin torch=={want} (SGLang {importlib.metadata.version('sglang')}'s "
        f"own pin); it asks for {[str(r) for r in ours] or 'no torch pin'}")
    wrong = [str(r) for r in ours if not r.specifier.contains(want, prereleases=True)]
    assert not wrong, f"torch requirements that exclude SGLang's torch=={want}: {wrong}"


def test_transformer_engine_is_in_megatron_cores_range():
    (theirs,) = by_name(declared("megatron-core", extra="dev"))["transformer-engine"]
    ours = by_name(gpu_requirements()).get("transformer-engine", [])
    assert ours, "the GPU install asks for no Transformer Engine"
    for requirement in ours:
        assert len(requirement.specifier) and within(requirement.specifier, theirs.specifier), (
            f"{requirement} allows Transformer Engine versions outside megatron-core "
            f"{importlib.metadata.version('megatron-core')}'s declared range {theirs.specifier}")
        assert {canonicalize_name(e) for e in theirs.extras} <= {
                canonicalize_name(e) for e in requirement.extras}, (
            f"{requirement}: megatron-core declares {theirs} (extras {sorted(theirs.extras)})")


def conflicts(ours: list[Requirement], theirs: list[Requirement]) -> list[str]:
    mine, other = by_name(ours), by_name(theirs)
    return [f"{a} vs {b}" for name in sorted(mine.keys() & other.keys())
            for a, b in product(mine[name], other[name]) if not compatible(a.specifier, b.specifier)]


@pytest.mark.parametrize("dist", ["sglang", "megatron-core"])
def test_no_package_pinned_incompatibly(dist):
    found = conflicts(gpu_requirements(), declared(dist))
    assert not found, f"the GPU install and {dist}'s own requirements cannot both hold: {found}"


def test_sglang_and_megatron_core_agree():
    assert not conflicts(declared("sglang"), declared("megatron-core"))


def test_docs_install_sglangs_torch():
    """The commands of docs/install_gpu.md (its fenced blocks) pin SGLang's torch."""
    want = sglang_torch()
    text = (ROOT / "docs" / "install_gpu.md").read_text()
    commands = "\n".join(re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S))
    pinned = re.findall(r"\btorch==([0-9][0-9A-Za-z.+]*)", commands)
    assert pinned, "docs/install_gpu.md's commands pin no torch"
    assert set(pinned) == {want}, f"docs/install_gpu.md installs torch {sorted(set(pinned))}, SGLang pins {want}"
