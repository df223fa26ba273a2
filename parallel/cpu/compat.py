"""Run real megatron-core on CPU (torch.distributed gloo) by mapping its CUDA-only calls to the CPU.

megatron-core assumes CUDA in a handful of places. On a machine without a CUDA device,
``apply()`` installs the patches below, process-wide and idempotently; on a GPU machine it does
nothing. Every patch is small, named, and has a test in tests/parallel/cpu/test_compat.py. Facts behind
them: docs/cpu.md. (The local spec's sequence-parallel norm and TE-less MoE router fixes are not
CPU patches: ``parallel.modules.local_spec`` applies them on every device.)

Patches (name -> why):
- ``device_mode``: a TorchFunctionMode maps ``device="cuda"|"cuda:N"|N`` arguments of tensor
  factories and ``Tensor.to`` to the CPU, turns ``Tensor.cuda()`` / ``Tensor.pin_memory()`` into
  no-ops and drops ``pin_memory=True``. Megatron allocates buffers with
  ``device=torch.cuda.current_device()`` everywhere. The autograd engine clears the mode stack
  while it runs custom Functions' backward (megatron's TP/SP layers allocate there, and
  activation recompute re-runs forward there), so the mode is re-entered around those.
- ``cuda_runtime``: ``torch.cuda.current_device/set_device/synchronize/empty_cache/memory_*`` and
  ``Stream``/``Event``/``stream()`` become CPU no-ops (DDP's grad-reduce overlap uses streams).
- ``rng``: the "CUDA" RNG is the CPU default generator: ``torch.cuda.manual_seed``,
  ``get_rng_state``/``set_rng_state`` and megatron's ``_get_cuda_rng_state``/``_set_cuda_rng_state``
  read and write it, so the model-parallel RNG tracker forks work. (``torch.cuda.manual_seed`` must
  not call ``torch.manual_seed``: that calls ``torch.cuda.manual_seed_all`` and recurses.)
- ``tensor_type``: ``Tensor.type()`` with no argument reports ``torch.cuda.FloatTensor`` (etc.) for
  CPU tensors: gradient clipping and the distributed optimizer assert that name.
- ``GLOO_CONFIG_OVERRIDES`` (TransformerConfig fields, applied by parallel.models on CPU):
  ``batch_p2p_comm=False``. With PP=2 a rank's previous and next stage are the same peer; gloo
  matches batched isend/irecv by order with one tag, so under the interleaved (VPP) schedule
  an activation and a gradient sent together are swapped (grads 100x off). Megatron's unbatched
  path sends the two directions on two different groups and is exact.
- ``onednn_linear``: megatron's linear layers (``linear_with_grad_accumulation_and_async_allreduce``
  and ``linear_with_frozen_weight``) run their fp32 forward and input-gradient GEMMs through
  oneDNN (:class:`parallel.cpu.linear.LinearFunction`) where it is faster than MKL's SGEMM on
  this CPU (``parallel.cpu.linear.backend``: 1.1-1.7x on AVX-512 EPYCs, slower on AVX2 ones).
  Sequence parallelism, gradient-accumulation fusion and deferred weight gradients keep
  megatron's own function. Tested in tests/parallel/cpu/test_linear.py (TP=1/2 against a float64
  oracle).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

_APPLIED: set[str] = set()
GLOO_CONFIG_OVERRIDES = {"batch_p2p_comm": False}
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def needed() -> bool:
    """True when there is no usable CUDA device, i.e. when megatron must be run on the CPU."""
    return not torch.cuda.is_available()


def _to_cpu_device(device):
    """Map a CUDA device spec (str, torch.device or a bare int index) to 'cpu'; leave others alone."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call of the process comes through here (about 2,300 in one update of a
        # 300k-parameter model): calls with nothing to rewrite go straight through.
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        if not kwargs:
            return func(*args)
        if "device" in kwargs or kwargs.get("pin_memory"):
            kwargs = dict(kwargs)
            if "device" in kwargs:
                kwargs["device"] = _to_cpu_device(kwargs["device"])
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
        return func(*args, **kwargs)


_MODE = CudaToCpuMode()


def _patch_device_mode() -> None:
    # Entered once for the life of the process: every torch call on this thread goes through it.
    _MODE.__enter__()
    # The autograd engine runs custom Functions' backward with the mode stack cleared, so
    # megatron's backward allocations (and activation recompute) would escape: re-enter it there.
    from torch.autograd.function import BackwardCFunction

    original_apply = BackwardCFunction.apply

    def apply_with_mode(self, *args):
        if _get_current_function_mode_stack():
            return original_apply(self, *args)
        with CudaToCpuMode():
            return original_apply(self, *args)

    BackwardCFunction.apply = apply_with_mode


class _CpuStream:
    """Stands in for torch.cuda.Stream: CPU work is synchronous, so every method is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _CpuEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _CpuEvent:
    """Stands in for torch.cuda.Event (records nothing; CPU work is already complete)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _patch_cuda_runtime() -> None:
    cuda = torch.cuda
    default_stream = _CpuStream()
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.Stream = _CpuStream
    cuda.Event = _CpuEvent
    cuda.current_stream = lambda device=None: default_stream
    cuda.default_stream = lambda device=None: default_stream
    cuda.stream = lambda stream: contextlib.nullcontext()


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def manual_seed(seed):
        torch.default_generator.manual_seed(int(seed))

    def get_rng_state(device="cuda", *args, **kwargs):
        return torch.get_rng_state()

    def set_rng_state(new_state, device=-1, *args, **kwargs):
        torch.set_rng_state(new_state)

    torch.cuda.manual_seed = manual_seed
    torch.cuda.manual_seed_all = manual_seed
    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.random.get_rng_state = get_rng_state
    torch.cuda.set_rng_state = set_rng_state
    mrandom._get_cuda_rng_state = get_rng_state
    mrandom._set_cuda_rng_state = set_rng_state


def _patch_tensor_type() -> None:
    original = torch.Tensor.type

    @functools.wraps(original)
    def tensor_type(self, *args, **kwargs):
        if not args and not kwargs and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return original(self, *args, **kwargs)

    torch.Tensor.type = tensor_type


def _patch_onednn_linear() -> None:
    from megatron.core.tensor_parallel import layers

    from parallel.cpu import linear as cpu_linear

    with_grad, frozen = layers.linear_with_grad_accumulation_and_async_allreduce, layers.linear_with_frozen_weight

    @functools.wraps(with_grad)  # also copies its ``warned`` flag, which megatron reads by name
    def linear_with_grad(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                         sequence_parallel, grad_output_buffer=None, wgrad_deferral_limit=0,
                         async_grad_allreduce=None, tp_group=None):
        if (sequence_parallel or gradient_accumulation_fusion or grad_output_buffer is not None
                or not cpu_linear.applies(input, weight)):
            return with_grad(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                             sequence_parallel, grad_output_buffer, wgrad_deferral_limit,
                             async_grad_allreduce, tp_group)
        return cpu_linear.LinearFunction.apply(input, weight, bias, allreduce_dgrad,
                                               layers.get_tensor_model_parallel_group_if_none(tp_group))

    @functools.wraps(frozen)
    def linear_with_frozen_weight(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                                  sequence_parallel, tp_group, grad_output_buffer=None,
                                  wgrad_deferral_limit=None, async_grad_allreduce=None):
        if sequence_parallel or not cpu_linear.applies(input, weight):
            return frozen(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                          sequence_parallel, tp_group, grad_output_buffer, wgrad_deferral_limit,
                          async_grad_allreduce)
        return cpu_linear.LinearFunction.apply(input, weight, bias, allreduce_dgrad,
                                               layers.get_tensor_model_parallel_group_if_none(tp_group))

    layers.linear_with_grad_accumulation_and_async_allreduce = linear_with_grad
    layers.linear_with_frozen_weight = linear_with_frozen_weight


PATCHES = {
    "device_mode": _patch_device_mode,
    "cuda_runtime": _patch_cuda_runtime,
    "rng": _patch_rng,
    "tensor_type": _patch_tensor_type,
    "onednn_linear": _patch_onednn_linear,
}


def apply(only: tuple[str, ...] | None = None) -> bool:
    """Install the CPU patches (all, or the named ones) if no CUDA device exists. Returns whether
    megatron now runs in CPU mode. Safe to call many times; a no-op on GPU machines."""
    if not needed():
        return False
    # Expected on CPU and meaningless there: no TE/apex (documented in the README), CUDA-graph
    # and CUDA_DEVICE_MAX_CONNECTIONS advice. Megatron repeats them in every rank.
    for message in (
        ".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*",
        ".*CUDA_DEVICE_MAX_CONNECTIONS.*",
        "full scope is deprecated.*",
        r".*torch\.distributed\.\w+` is deprecated.*",  # megatron's collectives, not ours
    ):
        warnings.filterwarnings("ignore", message=message)
    for name in only or tuple(PATCHES):
        if name not in _APPLIED:
            PATCHES[name]()
            _APPLIED.add(name)
    return True
