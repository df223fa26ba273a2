"""The patches megarl installs into the processes of an SGLang engine (:func:`install_scheduler_patch`).

They run in SGLang's scheduler processes (and, inert, in every other process of the engine), put
in place at interpreter start, before SGLang is imported, by the ``sitecustomize`` in
``megarl/rollout/sglang/engine_site`` (:data:`megarl.rollout.sglang.engine.SITE_DIR`) when
``MEGARL_SGLANG_SCHEDULER_PATCH=1``: SGLang spawns its schedulers, so a patch made in the engine
handle's process would not reach them. Each patch waits for its module's import
(:class:`_PostImportPatch`) and imports nothing of SGLang itself.

Reproducible sampling: SGLang samples with each scheduler's global RNGs (torch, plus python
``random``/numpy), seeded only once at startup; its per-request ``sampling_seed`` needs
``enable_deterministic_inference``, which the CPU path cannot use. So a ``megarl_reseed`` method
is added to SGLang's ``Scheduler`` class (:func:`_scheduler_reseed`), which
:meth:`megarl.rollout.sglang.engine.SGLangEngine.reseed` calls on every rank with SGLang's
``Engine.collective_rpc``: every scheduler (TP rank) gets the sampling state of a freshly started
engine whose ``random_seed`` is the given seed, so a resumed run (new engine) samples the same
tokens as an uninterrupted one.

The other patches: SGLang's weight checker fingerprints with :func:`weight_checksum` (what the
trainer computes for what it sends), its direct weight load takes flat buckets
(:func:`_patch_weight_updater_module`), the torch-native
expert path computes a rank's own experts under expert parallelism (:func:`_patch_moe_native_module`), host
buffers are not pinned without CUDA (:func:`_patch_host_pool_module`), the torch-native
attention backend batches its attention (:mod:`megarl.rollout.sglang.cpu.batched_attention`), the
sampler samples by inverse CDF (:mod:`megarl.rollout.sglang.cpu.inverse_cdf_sampling`) and fp32 CPU
linears run through oneDNN or MKL, whichever is faster here (:mod:`megarl.rollout.sglang.cpu.linear`).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

RESEED_RPC = "megarl_reseed"  # the Scheduler method SGLangEngine.reseed() calls on every rank
_SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
_WEIGHT_CHECKER_MODULE = "sglang.srt.utils.weight_checker"
_WEIGHT_UPDATER_MODULE = "sglang.srt.model_executor.model_runner_components.weight_updater"
_MOE_NATIVE_MODULE = "sglang.srt.layers.moe.fused_moe_native"
_HOST_POOL_MODULE = "sglang.srt.mem_cache.pool_host.common"
RESEED_BUSY = "megarl_reseed: scheduler not idle"  # in the error of a scheduler that refused (busy)


def _scheduler_reseed(self, seed: int) -> None:
    """``Scheduler.megarl_reseed``: the sampling state of a fresh engine with ``random_seed=seed``
    (see :meth:`megarl.rollout.sglang.engine.SGLangEngine.reseed`). Refuses while requests run."""
    from sglang.srt.utils.common import set_random_seed

    # False while requests are queued or running; then nothing changed. empty_cache=False: on CPU
    # it is a full gc.collect() of the scheduler's heap (~0.3 s here), on GPUs a CUDA cache release;
    # neither changes what is sampled.
    if not self.flush_cache(empty_cache=False):
        raise RuntimeError(f"{RESEED_BUSY} (requests queued or running)")
    self.new_token_ratio_tracker.reset()  # what an idle scheduler resets; fresh engines start there
    set_random_seed(seed)  # python random, numpy, torch (CPU and every accelerator): as at startup
    self.random_seed = seed


def _patch_scheduler_module(module) -> None:
    scheduler = getattr(module, "Scheduler", None)
    if scheduler is None:  # a future SGLang moved it: reseed() will say the method is missing
        print(f"megarl: {module.__name__} has no Scheduler class; {RESEED_RPC} not installed",
              file=sys.stderr, flush=True)
        return
    setattr(scheduler, RESEED_RPC, _scheduler_reseed)


_FINGERPRINT_CHUNK = 1 << 11  # elements per exact float64 dot product (see weight_checksum)
_FINGERPRINT_SLAB = 1 << 22  # elements converted at a time: bounds the memory to 32 MB per call
_FINGERPRINT_MASK = (1 << 50) - 1  # the sums are kept modulo 2**50


def weight_checksum(tensor) -> str:
    """The parity probe's fingerprint of one tensor's BIT PATTERN, computed where the tensor lives
    (CPU or GPU; only the result, a few bytes, leaves the device). The trainer fingerprints what it
    sends with it (:mod:`megarl.rollout.weight_sync`), and SGLang's weight checker fingerprints
    what each engine rank holds with it (:func:`install_scheduler_patch` puts it in place of the
    checker's own hash, which copies every parameter to the host).

    Each element's bits, read as a signed integer ``v`` (int8/int16/int32 by element size; 8-byte
    elements as two int32 lanes, each fingerprinted on its own), weighted by ``c = 1 + (i mod
    2048)`` for element ``i``: per lane the sum of ``c * v`` modulo 2**50, with the dtype and the
    shape. Exact on any device and in any summation order: each block of 2048 products is a
    float64 dot product of integers below 2**53 (``|v| <= 2**31``, ``c <= 2**11``), the blocks add
    up as int64. So any single changed element changes its lane's sum by ``c * dv``, nonzero and
    below 2**42: detected, always."""
    import torch

    t = tensor.detach()
    t = t if t.is_contiguous() else t.contiguous()
    word = {1: torch.int8, 2: torch.int16}.get(t.element_size(), torch.int32)
    lanes = t.reshape(-1).view(word).view(t.numel(), t.element_size() // word.itemsize)  # (elements, lanes)
    coefficients = torch.arange(1, _FINGERPRINT_CHUNK + 1, dtype=torch.float64, device=t.device)
    sums = []
    for lane in lanes.unbind(1):
        total = torch.zeros((), dtype=torch.int64, device=t.device)
        for start in range(0, lane.numel(), _FINGERPRINT_SLAB):  # a multiple of the chunk: c stays i mod 2048
            values = lane[start: start + _FINGERPRINT_SLAB].to(torch.float64)
            whole = values.numel() // _FINGERPRINT_CHUNK * _FINGERPRINT_CHUNK
            blocks = torch.mv(values[:whole].view(-1, _FINGERPRINT_CHUNK), coefficients).to(torch.int64)
            tail = torch.dot(values[whole:], coefficients[: values.numel() - whole]).to(torch.int64)
            total = (total + (blocks & _FINGERPRINT_MASK).sum() + (tail & _FINGERPRINT_MASK)) & _FINGERPRINT_MASK
        sums.append(total)
    digits = "".join(f"{value:013x}" for value in torch.stack(sums).tolist()) if sums else ""
    return f"{t.dtype}:{tuple(t.shape)}:{digits}"


def _patch_weight_checker_module(module) -> None:
    """SGLang's weight checker fingerprints with :func:`weight_checksum` (what the trainer computes)."""
    if not hasattr(module, "_hash_tensor"):  # a future SGLang renamed it: every parity probe fails, loudly
        print(f"megarl: {module.__name__} has no _hash_tensor; weight checksums left as SGLang computes them",
              file=sys.stderr, flush=True)
        return
    module._hash_tensor = weight_checksum


def _patch_weight_updater_module(module) -> None:
    """SGLang's direct load (``update_weights_from_tensor(load_format="direct")``) takes flat
    buckets (:mod:`megarl.rollout.sglang.transport`): their entries are expanded into the
    parameters' views before its in-place copies, and a GPU is synchronised after them, so the
    update's reply means the producer may reuse or free the bucket."""
    direct = getattr(module, "_model_load_weights_direct", None)
    if direct is None or getattr(direct, "megarl_patched", False):
        if direct is None:  # a future SGLang renamed it: flat buckets then fail by name, loudly
            print(f"megarl: {module.__name__} has no _model_load_weights_direct; flat buckets not expanded",
                  file=sys.stderr, flush=True)
        return

    def load_direct(model, named_tensors):
        import torch

        from megarl.rollout.sglang.transport import expand_flat_entries

        named_tensors = expand_flat_entries(named_tensors)
        direct(model, named_tensors)
        if any(t.is_cuda for _, t in named_tensors):
            torch.cuda.current_stream().synchronize()

    load_direct.megarl_patched = True
    module._model_load_weights_direct = load_direct


def _patch_moe_native_module(module) -> None:
    """SGLang's torch-native expert path (what its CPU engine runs without AMX kernels) assumes
    every expert is on the rank: under expert parallelism the dispatcher marks the top-k slots of
    other ranks' experts with id -1, which ``moe_forward_native`` indexes with. With such slots the
    patched function computes this rank's experts only (:func:`_local_experts_forward`) and the
    layer's all-reduce over the ranks adds the shares up, as SGLang's GPU kernels do."""
    native = getattr(module, "moe_forward_native", None)
    if native is None or getattr(native, "megarl_patched", False):
        return

    def moe_forward_native(layer, x, topk_output, moe_runner_config):
        if (topk_output.topk_ids < 0).any():
            return _local_experts_forward(layer, x, topk_output, moe_runner_config)
        return native(layer, x, topk_output, moe_runner_config)

    moe_forward_native.megarl_patched = True
    module.moe_forward_native = moe_forward_native


def _local_experts_forward(layer, x, topk_output, moe_runner_config):
    """sum over a token's top-k slots held here of weight * w2 silu-gated(w13 x): SGLang's
    native expert math for the unquantised SiLU experts megarl's families have."""
    import torch
    import torch.nn.functional as F

    if moe_runner_config.activation != "silu" or moe_runner_config.gemm1_alpha is not None \
            or getattr(layer, "w13_weight_bias", None) is not None or moe_runner_config.apply_router_weight_on_input:
        raise NotImplementedError("megarl's expert-parallel CPU path computes unquantised SiLU experts without "
                                  "biases; this layer is configured otherwise")
    ids, weights = topk_output.topk_ids, topk_output.topk_weights
    out = torch.zeros(x.shape[0], layer.w2_weight.shape[1], dtype=weights.dtype)
    for expert in range(layer.w13_weight.shape[0]):
        token, slot = (ids == expert).nonzero(as_tuple=True)
        if token.numel():
            gate, up = F.linear(x[token], layer.w13_weight[expert]).chunk(2, dim=-1)
            expert_out = F.linear(F.silu(gate) * up, layer.w2_weight[expert])
            out.index_add_(0, token, expert_out.to(weights.dtype) * weights[token, slot, None])
    return out.to(x.dtype)


def _patch_host_pool_module(module) -> None:
    """Without CUDA, SGLang's host buffers (the routed-experts capture's among them) are allocated
    unpinned: pinning registers them with cudaHostRegister, which a CPU build of torch lacks."""
    import torch

    functions = getattr(module, "ALLOC_MEMORY_FUNCS", None)
    if functions is None or torch.cuda.is_available():
        return

    def alloc_unpinned(dims, dtype, device, pin_memory=False, allocator=None, **_):
        return allocator.allocate(dims, dtype=dtype, device=device)

    functions["cpu"] = alloc_unpinned


class _PostImportPatch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for one module it asks the finders after it for the spec and wraps
    the loader's ``exec_module`` so the module is patched right after it executes. Removes itself
    once used."""

    def __init__(self, fullname: str, patch):
        self.fullname, self.patch = fullname, patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.fullname or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)  # one-shot; also keeps the lookup below from finding us
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # this spec's own loader instance
        return spec


def install_scheduler_patch() -> None:
    """Add ``Scheduler.megarl_reseed`` (:func:`_scheduler_reseed`) to SGLang's scheduler class,
    fingerprint with :func:`weight_checksum` in SGLang's weight checker, expand flat buckets in its
    direct weight load (:func:`_patch_weight_updater_module`), keep the torch-native expert path to
    a rank's own experts (:func:`_patch_moe_native_module`), allocate host buffers unpinned without
    CUDA (:func:`_patch_host_pool_module`), batch the torch-native backend's attention
    (:mod:`megarl.rollout.sglang.cpu.batched_attention`), sample by inverse CDF
    (:mod:`megarl.rollout.sglang.cpu.inverse_cdf_sampling`) and run fp32 CPU linears through the
    faster of oneDNN and MKL (:mod:`megarl.rollout.sglang.cpu.linear`) in this process: now for a
    module imported already, otherwise right after its import. Run at interpreter start (before SGLang
    is imported) in every process of an engine by the ``sitecustomize`` in
    ``megarl/rollout/sglang/engine_site`` when ``MEGARL_SGLANG_SCHEDULER_PATCH=1``.
    Also keeps megatron out of the process: SGLang's debug dumper imports ``megatron.core`` when it
    is installed (for a plugin used inside Megatron training processes, never in an engine) and
    reads its absence as "not installed": ~2 s of CPU less per engine start.
    Imports nothing of SGLang itself. Idempotent."""
    sys.modules.setdefault("megatron", None)  # "import megatron..." raises ModuleNotFoundError
    from megarl.rollout.sglang.cpu.batched_attention import BACKEND_MODULE, patch_backend_module
    from megarl.rollout.sglang.cpu.inverse_cdf_sampling import SAMPLER_MODULE, patch_sampler_module
    from megarl.rollout.sglang.cpu.linear import SGLANG_UNQUANT_MODULE, patch_sglang_unquant_module

    for name, patch in ((_SCHEDULER_MODULE, _patch_scheduler_module),
                        (_WEIGHT_CHECKER_MODULE, _patch_weight_checker_module),
                        (_WEIGHT_UPDATER_MODULE, _patch_weight_updater_module), (BACKEND_MODULE, patch_backend_module),
                        (SAMPLER_MODULE, patch_sampler_module), (_MOE_NATIVE_MODULE, _patch_moe_native_module),
                        (_HOST_POOL_MODULE, _patch_host_pool_module),
                        (SGLANG_UNQUANT_MODULE, patch_sglang_unquant_module)):
        if name in sys.modules:
            patch(sys.modules[name])
        elif not any(isinstance(f, _PostImportPatch) and f.fullname == name for f in sys.meta_path):
            sys.meta_path.insert(0, _PostImportPatch(name, patch))
