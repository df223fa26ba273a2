"""megarl: Megatron-first RL post-training. Pins live in requirements/*.txt (one source of truth)."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def requirements(name: str) -> list[str]:
    lines = (HERE / "requirements" / name).read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-first reinforcement-learning post-training for LLMs (Megatron + SGLang + Ray)",
    python_requires=">=3.11",
    packages=find_packages(include=["megarl*", "model_specs*", "parallel*"]),
    # A directory put on the engine processes' PYTHONPATH, not a package: find_packages skips it.
    package_data={"megarl.rollout.sglang": ["engine_site/sitecustomize.py"]},
    install_requires=requirements("base.txt"),
    extras_require={
        # On CPU, sglang must be installed with --no-deps (ci/setup_env.sh does it); on GPU
        # clusters `pip install megarl[sglang]` pulls the real CUDA stack.
        "sglang": requirements("sglang-nodeps.txt") + requirements("sglang-deps.txt"),
        # Transformer Engine needs CUDA; never installed on CPU. NVIDIA apex is not on PyPI:
        # build it from NVIDIA's apex repository on the cluster (see README).
        "gpu": ["transformer-engine[pytorch]"],
        "dev": requirements("dev.txt"),
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
