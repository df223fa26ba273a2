"""SGLang's unquantized linears through megarl's CPU linear (:mod:`parallel.cpu.linear`: oneDNN or
MKL, whichever is faster on this CPU), so a CPU engine computes its fp32 linears as the Megatron
workers do. Installed in the engine's processes by
:func:`megarl.rollout.sglang.patches.install_scheduler_patch` (the module is patched right after
SGLang imports it)."""

from __future__ import annotations

from parallel.cpu import linear as cpu_linear

SGLANG_UNQUANT_MODULE = "sglang.srt.layers.quantization.unquant"


def patch_sglang_unquant_module(module) -> None:
    """Route SGLang's ``UnquantizedLinearMethod.apply`` (every unquantized linear of its models)
    through :func:`parallel.cpu.linear.linear` for fp32 CPU operands; other devices, dtypes and
    its AMX-packed weights keep SGLang's own path. Idempotent."""
    method = getattr(module, "UnquantizedLinearMethod", None)
    if method is None or getattr(method.apply, "_megarl_cpu_linear", False):
        return
    original = method.apply
    amx = getattr(module, "use_intel_amx_backend", lambda layer: False)

    def apply(self, layer, x, bias=None):
        if cpu_linear.applies(x, layer.weight) and not amx(layer):
            return cpu_linear.linear(x, layer.weight, bias)
        return original(self, layer, x, bias)

    apply._megarl_cpu_linear = True
    method.apply = apply
