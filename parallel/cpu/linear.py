"""fp32 linear layers on the CPU through oneDNN's matmul or MKL's SGEMM, whichever is faster here.

Why: which library runs the model's shapes faster depends on the CPU. On AVX-512 AMD EPYC
machines MKL's SGEMM, which ``F.linear``/``torch.matmul`` use, ran them at 70-150 GFLOP/s on 2
threads and oneDNN's matmul (the ``mkldnn::_linear_pointwise`` op that inductor emits for CPU
linears) at 110-190; on an AVX2-only EPYC MKL was the faster one, by 1.25-1.35x
(``tools/bench_cpu_gemm.py`` prints both on any machine). Both are fp32 with fp32 accumulation;
results differ only by summation order (~1e-6 relative).

``MEGARL_CPU_LINEAR`` chooses: ``auto`` (the default) times both once per machine
(:func:`measured_backend`: CPU model, instruction set and torch version) and keeps the answer in
``cpu_linear.json`` under ``MEGARL_CACHE_DIR`` (default ``$XDG_CACHE_HOME/megarl`` or
``~/.cache/megarl``), so every process of a run, and every later run, takes the same path and
computes the same bits; ``onednn`` or ``aten`` (ATen's default, MKL) force one.

Used by the Megatron workers' linear layers (``parallel.cpu.compat``'s ``onednn_linear`` patch:
forward and input gradient); a CPU SGLang engine routes its unquantized linears here too
(``megarl.rollout.sglang.cpu.linear``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ENV_VAR = "MEGARL_CPU_LINEAR"
CHOICES = ("auto", "onednn", "aten")
CACHE_DIR_ENV_VAR = "MEGARL_CACHE_DIR"
CACHE_FILE = "cpu_linear.json"
# (tokens, in, out) of the timed linears: a 20M model's attention and MLP projections.
_TIMED_SHAPES = ((1024, 512, 1536), (1024, 1664, 512), (1024, 512, 3328))


@functools.cache
def backend() -> str:
    """``onednn`` or ``aten``: the CPU linear backend of this process (``MEGARL_CPU_LINEAR``, read
    once); ``aten`` where this torch build has no oneDNN."""
    choice = os.environ.get(ENV_VAR, "auto") or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r} is not one of {CHOICES}: unset it (auto: the faster of the "
                         f"two on this CPU), or force oneDNN (onednn) or ATen's own MKL matmul (aten)")
    if not onednn_available():
        return "aten"
    return measured_backend() if choice == "auto" else choice


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a 2-D ``x`` through oneDNN's matmul, without autograd."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def cache_dir() -> Path:
    """Where megarl keeps what it measured about this machine (``MEGARL_CACHE_DIR``)."""
    configured = os.environ.get(CACHE_DIR_ENV_VAR)
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megarl"


def machine_key() -> str:
    """What the choice depends on: the CPU model, the instruction set torch uses, torch's version."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__}"


def measured_backend() -> str:
    """The faster of oneDNN and ATen for fp32 linears on this machine: read from the cache
    (:func:`cache_dir`), else timed (:func:`time_backends`, 1-2 s) and written there under a file
    lock, so processes starting together wait for one measurement instead of each making their
    own (and perhaps choosing differently). Without a writable cache it is timed in-process."""
    key = machine_key()
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / (CACHE_FILE + ".lock"), "a")
    except OSError:
        return _faster(time_backends())
    import fcntl

    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = directory / CACHE_FILE
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        if key not in known or known[key].get("backend") not in CHOICES[1:]:
            seconds = time_backends()
            known[key] = {"backend": _faster(seconds), **{f"{name}_s": value for name, value in seconds.items()}}
            with tempfile.NamedTemporaryFile("w", dir=directory, prefix=CACHE_FILE, delete=False) as out:
                out.write(json.dumps(known, indent=1) + "\n")
            os.replace(out.name, path)
        return known[key]["backend"]


def time_backends(repeats: int = 3) -> dict[str, float]:
    """Seconds each backend takes for the GEMMs it would run for ``_TIMED_SHAPES`` (forward and
    input gradient, whose weight is a transposed view) on this process's threads, the best of
    ``repeats`` alternating rounds."""
    operands = []
    for tokens, fan_in, fan_out in _TIMED_SHAPES:
        weight = torch.randn(fan_out, fan_in)
        operands += [(torch.randn(tokens, fan_in), weight), (torch.randn(tokens, fan_out), weight.t())]
    calls = {"onednn": onednn_linear, "aten": F.linear}
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats + 1):  # the first round warms both up
        for name, call in calls.items():
            start = time.perf_counter()
            for x, w in operands:
                call(x, w)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _faster(seconds: dict[str, float]) -> str:
    return min(seconds, key=seconds.get)


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
    out = onednn_linear(x.reshape(-1, x.shape[-1]), weight, bias)
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

