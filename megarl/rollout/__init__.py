"""Rollout engines. :class:`SGLangEngine` is the production one (real SGLang, also on CPU)."""

from megarl.rollout.engine import EngineDiedError, EngineError, EngineTimeoutError, SGLangEngine
from megarl.rollout.weight_sync import weight_checksum

__all__ = ["SGLangEngine", "EngineError", "EngineDiedError", "EngineTimeoutError", "weight_checksum"]
