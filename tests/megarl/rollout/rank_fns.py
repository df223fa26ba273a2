"""Functions that run on each rank of a multi-process test here (``parallel.spawn.run_on_ranks``
imports them by module path in every rank)."""


import torch
import torch.distributed as dist


def train_one_step_then_reshard(hf_dir, layout_kwargs, rollout_tps, export_dir):
    """A Megatron actor loads an HF checkpoint, trains one optimizer step, exports the trained
    weights as HF (rank 0) and reshards them for SGLang engines of each TP in ``rollout_tps``.
    Returns {rollout_tp: this device's SGLang buffers}."""
    from megatron.core import parallel_state

    from megarl.config.schema import OptimSettings
    from megarl.data.synthetic import arithmetic_sequence_batches
    from megarl.training import build_optimizer, train_step, wrap_ddp
    from parallel.checkpoint.convert import export_hf_checkpoint, load_hf_into_chunks
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
    chunks = wrap_ddp(chunks, layout)
    optimizer = build_optimizer(chunks, OptimSettings(lr=1e-2, weight_decay=0.0), layout)
    batches = arithmetic_sequence_batches(ckpt.config["vocab_size"], 2, 2, 16, seed=9)
    train_step(chunks, optimizer, batches, 16)
    export_hf_checkpoint(chunks, ckpt.config, layout, export_dir)
    device = dist.get_rank()
    sources = {(i, name): p.data for i, chunk in enumerate(chunks) for name, p in chunk.module.named_parameters()}
    buffers = {}
    for rollout_tp in rollout_tps:
        plan = plan_megatron_to_sglang(ckpt.config, layout, dist.get_world_size(), rollout_tp)
        plan.check()
        mine = {name: torch.empty(t.shape) for name, t in plan.destinations.get(device, {}).items()}
        execute_plan(plan, device, sources, mine)
        buffers[rollout_tp] = mine
    parallel_state.destroy_model_parallel()
    return buffers
