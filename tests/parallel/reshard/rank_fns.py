"""Functions that run on each rank of a multi-process test here (``parallel.spawn.run_on_ranks``
imports them by module path in every rank)."""


import torch
import torch.distributed as dist


def reshard_megatron_to_sglang(hf_dir, layout_kwargs, rollout_tp, bucket_bytes, rollout_ep=1):
    """Load HF weights into real Megatron chunks at a layout, run this rank's part of the
    Megatron -> SGLang plan over gloo, and return (this device's SGLang tensors, traffic stats)."""
    from megatron.core import parallel_state

    from parallel.checkpoint.convert import load_hf_into_chunks
    from parallel.checkpoint.hf_io import HFCheckpoint
    from parallel.layout import MegatronLayout
    from parallel.models import build_model_chunks
    from parallel.process_groups import initialize_megatron
    from parallel.reshard.execute import execute_plan
    from parallel.reshard.plan import plan_megatron_to_sglang

    layout = MegatronLayout(**layout_kwargs)
    ckpt = HFCheckpoint(hf_dir)
    initialize_megatron(layout)
    chunks = build_model_chunks(ckpt.config, layout)
    load_hf_into_chunks(chunks, ckpt, layout)
    plan = plan_megatron_to_sglang(ckpt.config, layout, dist.get_world_size(), rollout_tp, rollout_ep=rollout_ep)
    plan.check()
    device = dist.get_rank()
    sources = {(i, name): p.data for i, chunk in enumerate(chunks) for name, p in chunk.named_parameters()}
    buffers = {name: torch.full(t.shape, float("nan")) for name, t in plan.destinations.get(device, {}).items()}
    stats = execute_plan(plan, device, sources, buffers, bucket_bytes=bucket_bytes)
    parallel_state.destroy_model_parallel()
    return buffers, stats, plan.network_bytes
