"""Rollout: generation for the trainer. ``sglang/`` holds everything that knows SGLang (the engine
handle and its process, the patches, CPU stubs and kernels, the payload transport); above it,
``weight_sync`` (a sync and its parity probe), ``engine_worker`` (an engine as a Ray actor) and
``stream`` (generation ahead of training).

:class:`SGLangEngine` is the production engine (real SGLang, also on CPU). The names below are
imported on first use: the engine processes import ``megarl.rollout.sglang.cpu.stubs`` at
interpreter start, before torch, and importing this package must not import torch for them.
"""

__all__ = ["SGLangEngine", "EngineError", "EngineDiedError", "EngineTimeoutError", "weight_checksum"]


def __getattr__(name: str):
    if name in ("SGLangEngine", "EngineError", "EngineDiedError", "EngineTimeoutError"):
        from megarl.rollout.sglang import engine

        return getattr(engine, name)
    if name == "weight_checksum":
        from megarl.rollout.sglang.patches import weight_checksum

        return weight_checksum
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
