"""Everything that knows SGLang: the engine handle and the process it drives, what megarl installs
into SGLang's processes, and how tensors reach an engine rank. Nothing outside this package
imports ``sglang``; the rest of ``megarl.rollout`` (the Ray worker, the weight sync, the stream)
uses it through :class:`engine.SGLangEngine`.

- ``engine``          :class:`SGLangEngine`, the owner's side of an engine in its own process group
- ``engine_process``  the engine process's main and the handlers of its requests
- ``patches``         what megarl installs into SGLang's processes (reseed, weight checksum, ...)
- ``transport``       a rank's tensors as the payload SGLang's weight update decodes
- ``models/``         SGLang's model classes of megarl's families (SGLang's external model package)
- ``cpu/``            SGLang on CPU: import stubs for its CUDA-only modules and faster CPU kernels
- ``engine_site/``    not a package: the ``sitecustomize`` every engine process starts with

Kept light on import: the engine processes import ``cpu.stubs`` and ``patches`` at interpreter
start, before torch and SGLang.
"""
