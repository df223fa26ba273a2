"""SGLang's own model classes for the families megarl trains, as an SGLang "external model
package" (``SGLANG_EXTERNAL_MODEL_PACKAGE``, set by :class:`megarl.rollout.sglang.engine.SGLangEngine`).

Why: SGLang's model registry imports every module of ``sglang.srt.models`` (well over a hundred
architectures) when it is first imported, in each scheduler process: ~1.8 s of CPU per engine
start here, for one model class. Given an external package, the registry imports only that
package's modules and resolves an architecture it lists without loading its defaults; any other
architecture still resolves, from the defaults, loaded on first need.
"""
