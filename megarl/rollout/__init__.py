"""Rollout engines. :class:`SGLangEngine` is the production one (real SGLang, also on CPU)."""

from megarl.rollout.sglang_engine import EngineDiedError, EngineError, EngineTimeoutError, SGLangEngine

__all__ = ["SGLangEngine", "EngineError", "EngineDiedError", "EngineTimeoutError"]
