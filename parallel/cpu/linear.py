"""fp32 linear layers on the CPU through oneDNN's matmul instead of MKL's SGEMM.

Why: on this project's CPUs (AMD EPYC, AVX-512) MKL's SGEMM, which ``F.linear``/``torch.matmul``
use, runs the model's shapes at 70-150 GFLOP/s on 2 threads; oneDNN's matmul (the
``mkldnn::_linear_pointwise`` op that inductor emits for CPU linears) runs the same shapes at
110-190, up to near the cores' peak (``tools/bench_cpu_gemm.py`` prints both on any machine). Both are
fp32 with fp32 accumulation; results differ only by summation order (~1e-6 relative).

Used by the Megatron workers' linear layers (``parallel.cpu.compat``'s ``onednn_linear`` patch:
forward and input gradient) and by the CPU SGLang engine's unquantized linears
(:func:`patch_sglang_unquant_module`). ``MEGARL_CPU_LINEAR=aten`` switches both back to ATen's
default (MKL), e.g. on a CPU where MKL is the faster one.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

ENV_VAR = "MEGARL_CPU_LINEAR"
CHOICES = ("onednn", "aten")
SGLANG_UNQUANT_MODULE = "sglang.srt.layers.quantization.unquant"


@functools.cache
def backend() -> str:
    """The configured CPU linear backend (``MEGARL_CPU_LINEAR``, default ``onednn``; read once per
    process); ``aten`` where this torch build has no oneDNN."""
    choice = os.environ.get(ENV_VAR, "onednn") or "onednn"
    if choice not in CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r} is not one of {CHOICES}: unset it (oneDNN, the "
                         f"default) or set {ENV_VAR}=aten for ATen's own (MKL) matmul")
    if choice == "onednn" and not (torch.backends.mkldnn.is_available()
                                   and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "aten"
    return choice


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` takes the oneDNN path for these operands: fp32 CPU tensors, a 2-D
    weight, and the ``onednn`` backend."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.dim() == 2 and backend() == "onednn")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x @ weight.T + bias``) without autograd, through oneDNN
    when :func:`applies`. Operands may be strided views (``weight.t()``): nothing is copied."""
    if not applies(x, weight):
        return F.linear(x, weight, bias)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
    # Not a view of the 2-D result (as torch.matmul's isn't): megatron's cross entropy modifies
    # its logits in place, which autograd forbids on a view made inside a custom Function.
    return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], out.shape[-1]))


class LinearFunction(torch.autograd.Function):
    """``x @ weight.T + bias`` with the forward and input-gradient GEMMs through :func:`linear`
    (the weight gradient, a reduction over all tokens, is as fast on ATen's: bench_cpu_gemm).
    ``allreduce_dgrad`` all-reduces the input gradient over ``tp_group`` (a column-parallel
    layer's backward, as megatron's own linear does). The input is kept for the backward only
    when the weight needs a gradient (a frozen weight keeps just itself)."""

    @staticmethod
    def forward(ctx, x, weight, bias, allreduce_dgrad=False, tp_group=None):
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        ctx.has_bias, ctx.allreduce_dgrad, ctx.tp_group = bias is not None, allreduce_dgrad, tp_group
        return linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        handle = None
        if ctx.needs_input_grad[0]:
            grad_input = linear(grad_output, weight.t())
            if ctx.allreduce_dgrad:
                handle = torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        if ctx.needs_input_grad[1]:  # ATen's: oneDNN is no faster when tokens are the reduction
            grad_weight = rows.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(dim=0)
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None


def patch_sglang_unquant_module(module) -> None:
    """Route SGLang's ``UnquantizedLinearMethod.apply`` (every unquantized linear of its models)
    through :func:`linear` for fp32 CPU operands; other devices, dtypes and its AMX-packed weights
    keep SGLang's own path. Idempotent."""
    method = getattr(module, "UnquantizedLinearMethod", None)
    if method is None or getattr(method.apply, "_megarl_cpu_linear", False):
        return
    original = method.apply
    amx = getattr(module, "use_intel_amx_backend", lambda layer: False)

    def apply(self, layer, x, bias=None):
        if applies(x, layer.weight) and not amx(layer):
            return linear(x, layer.weight, bias)
        return original(self, layer, x, bias)

    apply._megarl_cpu_linear = True
    method.apply = apply
