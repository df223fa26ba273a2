"""Module-level functions run on spawned ranks by the tests (spawn needs importable targets)."""

import os
import subprocess
import time

import torch
import torch.distributed as dist


def all_reduce_rank(scale):
    """Sum of (rank+1)*scale over all ranks, plus who this rank is."""
    value = torch.tensor([float(dist.get_rank() + 1) * scale])
    dist.all_reduce(value)
    return {"rank": dist.get_rank(), "sum": float(value), "threads": torch.get_num_threads()}


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank one")
    dist.barrier()  # rank 0 waits for a peer that never comes: the harness must not hang
    return "unreachable"


def start_grandchild_then_hang(pid_file):
    """Start a helper process (like the dist-checkpoint writer), record its pid, then hang."""
    child = subprocess.Popen(["sleep", "600"])
    with open(f"{pid_file}.{os.getpid()}", "w") as handle:
        handle.write(str(child.pid))
    time.sleep(600)


def megatron_device_calls():
    """What megatron-style CUDA calls produce on a rank after the CPU layer is applied."""
    a = torch.empty(3, device=torch.cuda.current_device())
    b = torch.zeros(2, device="cuda").cuda()
    c = torch.ones(2).to("cuda:0", non_blocking=True)
    return [str(t.device) for t in (a, b, c)]


def first_step_grad_norm(layout_kwargs, untag_sequence_parallel_norms=False, config_overrides=None):
    """Grad norm of one training step of the tiny model from the layout-independent init, and
    the norm of the RMSNorm weights' gradients alone (replicated across TP, so per-rank)."""
    from megarl.data.synthetic import arithmetic_sequence_batches
    from megarl.training import OptimConfig, build_optimizer, train_step, wrap_ddp
    from model_specs.presets import hf_config_dict
    from parallel.layout import MegatronLayout, build_model_chunks, init_params_layout_independent, initialize_megatron

    layout = MegatronLayout(**layout_kwargs)
    hf = hf_config_dict("tiny-llama")
    initialize_megatron(layout)
    chunks = build_model_chunks(hf, layout, **(config_overrides or {}))
    init_params_layout_independent(chunks, seed=7, vocab_size=hf["vocab_size"])
    if untag_sequence_parallel_norms:
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                if "layernorm" in name:
                    param.sequence_parallel = False
    chunks = wrap_ddp(chunks, layout)
    optimizer = build_optimizer(chunks, OptimConfig(lr=0.0, clip_grad=1e9), layout)
    batches = arithmetic_sequence_batches(hf["vocab_size"], 4, 2, 16, seed=3)
    grad_norm = train_step(chunks, optimizer, batches, 16)["grad_norm"]
    norm_grads = [p.main_grad for c in chunks for n, p in c.module.named_parameters() if "layernorm" in n]
    return {"grad_norm": grad_norm, "norm_grad_norm": float(torch.stack([g.norm() for g in norm_grads]).norm())}


def compat_patches_in_isolation():
    """Exercise each CPU patch and report what megatron would observe."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from parallel import cpu_compat

    out = {"applied": cpu_compat.apply()}

    class AllocatesInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad + torch.zeros(grad.shape, device=torch.cuda.current_device())

    x = torch.ones(3, requires_grad=True)
    AllocatesInBackward.apply(x).sum().backward()
    out["backward_grad"] = x.grad.tolist()
    out["pinned"] = torch.empty(2, pin_memory=True).is_pinned()

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda.current_stream().wait_stream(stream)
    event = torch.cuda.Event()
    event.record()
    torch.cuda.synchronize()
    out["runtime"] = (torch.cuda.current_device(), torch.cuda.memory_allocated(), event.query())

    tensor_parallel.random.initialize_rng_tracker(force_reset=True)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(5)
    tracker.add("model-parallel-rng", 99)
    before = torch.get_rng_state()
    with tracker.fork():
        forked = torch.rand(3)
    out["rng_default_untouched"] = torch.equal(before, torch.get_rng_state())
    out["rng_fork_is_seed_99"] = torch.equal(forked, torch.rand(3, generator=torch.Generator().manual_seed(99)))

    out["types"] = (torch.ones(1).type(), torch.ones(1, dtype=torch.bfloat16).type(),
                    torch.ones(1).type(torch.float64).dtype == torch.float64)

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                               tensor_model_parallel_size=2, sequence_parallel=True)
    norm = WrappedTorchNorm(config, 8)
    out["sp_norm"] = (type(norm).__name__, all(p.sequence_parallel for p in norm.parameters()),
                      config.sequence_parallel)
    return out


def convert_roundtrip(jobs, layout_kwargs, tokens):
    """For each (hf_dir, export_dir): HF -> Megatron (this rank's shards) -> logits on ``tokens``
    -> HF export at ``export_dir``. Returns the logits per job (last pipeline stage, else None)."""
    from megatron.core import parallel_state

    from parallel.convert import export_hf_checkpoint, load_hf_into_chunks, megatron_logits
    from parallel.hf_io import HFCheckpoint
    from parallel.layout import MegatronLayout, build_model_chunks, initialize_megatron

    layout = MegatronLayout(**layout_kwargs)
    initialize_megatron(layout)
    results = []
    for hf_dir, export_dir in jobs:
        ckpt = HFCheckpoint(hf_dir)
        chunks = build_model_chunks(ckpt.config, layout)
        for chunk in chunks:
            chunk.eval()
        load_hf_into_chunks(chunks, ckpt, layout)
        logits = megatron_logits(chunks, tokens)
        export_hf_checkpoint(chunks, ckpt.config, layout, export_dir)
        results.append(None if logits is None else logits[..., : ckpt.config["vocab_size"]])
    parallel_state.destroy_model_parallel()
    return results


def checkpoint_logits(hf_dir, ckpt_dir, layout_kwargs, tokens):
    """Load weights (from HF if ``hf_dir`` else from the Megatron checkpoint ``ckpt_dir``) at a
    layout, save them to ``ckpt_dir`` when coming from HF, and return the logits on ``tokens``."""
    from megatron.core import parallel_state

    from parallel.convert import load_hf_into_chunks, megatron_logits
    from parallel.dist_ckpt import load_megatron_checkpoint, read_checkpoint_metadata, save_megatron_checkpoint
    from parallel.hf_io import HFCheckpoint
    from parallel.layout import MegatronLayout, build_model_chunks, initialize_megatron

    layout = MegatronLayout(**layout_kwargs)
    initialize_megatron(layout)
    if hf_dir:
        ckpt = HFCheckpoint(hf_dir)
        chunks = build_model_chunks(ckpt.config, layout)
        load_hf_into_chunks(chunks, ckpt, layout)
        save_megatron_checkpoint(chunks, ckpt_dir, ckpt.config, layout)
    else:
        chunks = build_model_chunks(read_checkpoint_metadata(ckpt_dir)["hf_config"], layout)
        load_megatron_checkpoint(chunks, ckpt_dir)
    logits = megatron_logits(chunks, tokens)
    parallel_state.destroy_model_parallel()
    return logits


def reshard_megatron_to_sglang(hf_dir, layout_kwargs, rollout_tp, bucket_bytes):
    """Load HF weights into real Megatron chunks at a layout, run this rank's part of the
    Megatron -> SGLang plan over gloo, and return (this device's SGLang tensors, traffic stats)."""
    from megatron.core import parallel_state

    from parallel.convert import load_hf_into_chunks
    from parallel.hf_io import HFCheckpoint
    from parallel.layout import MegatronLayout, build_model_chunks, initialize_megatron
    from parallel.plan import execute_plan, plan_megatron_to_sglang

    layout = MegatronLayout(**layout_kwargs)
    ckpt = HFCheckpoint(hf_dir)
    initialize_megatron(layout)
    chunks = build_model_chunks(ckpt.config, layout)
    load_hf_into_chunks(chunks, ckpt, layout)
    plan = plan_megatron_to_sglang(ckpt.config, layout, dist.get_world_size(), rollout_tp)
    plan.check()
    device = dist.get_rank()
    sources = {(i, name): p.data for i, chunk in enumerate(chunks) for name, p in chunk.named_parameters()}
    buffers = {name: torch.full(t.shape, float("nan")) for name, t in plan.destinations.get(device, {}).items()}
    stats = execute_plan(plan, device, sources, buffers, bucket_bytes=bucket_bytes)
    parallel_state.destroy_model_parallel()
    return buffers, stats, plan.network_bytes


def train_one_step_then_reshard(hf_dir, layout_kwargs, rollout_tps, export_dir):
    """A Megatron actor loads an HF checkpoint, trains one optimizer step, exports the trained
    weights as HF (rank 0) and reshards them for SGLang engines of each TP in ``rollout_tps``.
    Returns {rollout_tp: this device's SGLang buffers}."""
    from megatron.core import parallel_state

    from megarl.data.synthetic import arithmetic_sequence_batches
    from megarl.training import OptimConfig, build_optimizer, train_step, wrap_ddp
    from parallel.convert import export_hf_checkpoint, load_hf_into_chunks
    from parallel.hf_io import HFCheckpoint
    from parallel.layout import MegatronLayout, build_model_chunks, initialize_megatron
    from parallel.plan import execute_plan, plan_megatron_to_sglang

    layout = MegatronLayout(**layout_kwargs)
    ckpt = HFCheckpoint(hf_dir)
    initialize_megatron(layout)
    chunks = build_model_chunks(ckpt.config, layout)
    load_hf_into_chunks(chunks, ckpt, layout)
    chunks = wrap_ddp(chunks, layout)
    optimizer = build_optimizer(chunks, OptimConfig(lr=1e-2), layout)
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
