"""Megatron's process groups for a layout (``parallel.layout.MegatronLayout``) on ranks whose
torch.distributed is initialised, and its model-parallel RNG seeds."""

from __future__ import annotations

import torch

from parallel.layout import MegatronLayout


def distributed_backend(cuda_available: bool | None = None) -> str:
    """The ``torch.distributed.init_process_group`` backend of every rank: ``"gloo"`` without CUDA,
    else ``"cpu:gloo,cuda:nccl"`` (default: whether CUDA is available now).

    NCCL serves CUDA tensors only, and the code runs collectives on CPU tensors on GPU ranks too
    (the data-parallel loss all-reduce, the reshard executor's send/recv buffers, the HF export's
    gathers, the conversion checks): the device-mapped string sends each tensor to the backend of
    its device, so neither kind raises on a GPU machine."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    return "cpu:gloo,cuda:nccl" if cuda_available else "gloo"


def initialize_megatron(layout: MegatronLayout, seed: int = 1234) -> None:
    """Create megatron's process groups for ``layout`` (torch.distributed must be initialised)
    and seed its model-parallel RNG tracker."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from parallel.cpu import compat as cpu_compat
    from parallel.modules import local_spec

    cpu_compat.apply()
    local_spec.apply()  # on every device: the local spec's SP norms and TE-less MoE router
    layout.validate(dist.get_world_size())
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
