"""megarl: Megatron-first RL post-training. Pins live in requirements/*.txt (one source of truth)."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def requirements(name: str) -> list[str]:
    lines = (HERE / "requirements" / name).read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def dist_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;@]", requirement, maxsplit=1)[0].lower()


# torch's pin depends on the target, so it is not a requirement of megarl itself: on CPU,
# ci/setup_env.sh installs base.txt's torch==2.13.0 (the CPU wheel) first; on GPU, the `gpu`
# extra pins SGLang's torch==2.14.1 (requirements/gpu.txt). Both in one install cannot resolve.
RUNTIME = [r for r in requirements("base.txt") if dist_name(r) != "torch"]


setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-first reinforcement-learning post-training for LLMs (Megatron + SGLang + Ray)",
    python_requires=">=3.11",
    packages=find_packages(include=["megarl*", "model_specs*", "parallel*"]),
    # A directory put on the engine processes' PYTHONPATH, not a package: find_packages skips it.
    package_data={"megarl.rollout.sglang": ["engine_site/sitecustomize.py"]},
    install_requires=RUNTIME,
    extras_require={
        # On CPU, sglang must be installed with --no-deps (ci/setup_env.sh does it); on GPU
        # clusters `pip install -e '.[sglang,gpu]'` pulls the real CUDA stack.
        "sglang": requirements("sglang-nodeps.txt") + requirements("sglang-deps.txt"),
        # GPU only, never installed on CPU: SGLang's torch pin and Transformer Engine within
        # megatron-core's range (tests/test_gpu_pins.py). NVIDIA apex is not on PyPI: build it
        # from NVIDIA's apex repository on the cluster (docs/install_gpu.md).
        "gpu": requirements("gpu.txt"),
        "dev": requirements("dev.txt"),
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
