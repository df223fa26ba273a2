"""Rollout engines. :class:`SGLangEngine` is the production one (real SGLang, also on CPU)."""

from megarl.rollout.sglang_engine import (
    EngineDiedError,
    EngineError,
    EngineTimeoutError,
    SGLangEngine,
    SharedMemoryStaging,
    serialize_rank_tensors,
    staged_tensors,
    weight_checksum,
)

__all__ = ["SGLangEngine", "EngineError", "EngineDiedError", "EngineTimeoutError", "SharedMemoryStaging",
           "serialize_rank_tensors", "staged_tensors", "weight_checksum"]
