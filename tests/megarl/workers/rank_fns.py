"""Functions that run on each rank of a multi-process test here (``parallel.spawn.run_on_ranks``
imports them by module path in every rank)."""


import torch
import torch.distributed as dist


def worker_logprobs_and_updates(hf_dir, layout_kwargs, batch, steps, lr, micro_batch_size, batching=None):
    """A MegatronWorker (actor + reference) at a layout: the reference's log-probs/entropy of
    ``batch``, then ``steps`` PPO updates of the actor on it and the actor's log-probs after.
    ``batching``: MicroBatching options, e.g. {"packed": True} (thd rows) or {"shared_prompts": True}."""
    from megarl.config.schema import OptimSettings
    from megarl.workers.batch import MicroBatching, response_mask
    from megarl.workers.losses import LossSettings
    from megarl.workers.megatron_worker import MegatronWorker, ModelSpec
    from parallel.layout import MegatronLayout

    layout = MegatronLayout(**layout_kwargs)
    worker = MegatronWorker()
    batching = MicroBatching(micro_batch_size=micro_batch_size, **(batching or {}))
    loss = LossSettings(loss_agg_mode="seq-mean-token-mean", entropy_coef=0.01, kl_coef=0.1)
    worker.setup(ModelSpec("ref", hf_dir, layout, batching), seed=7)
    worker.setup(ModelSpec("actor", hf_dir, layout, batching, OptimSettings(lr=lr, weight_decay=0.0),
                           total_optimizer_steps=steps, loss=loss), seed=7)
    ref = worker.forward("ref", batch, with_entropy=True)
    mask = response_mask(batch)
    counts = {"tokens": float(mask.sum()), "sequences": float((mask.sum(-1) > 0).sum())}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ref)  # what the controller does: collect the output ranks'
    parts = [part for part in everyone if part is not None]
    order = torch.cat([part["rows"] for part in parts]).argsort()
    batch = dict(batch, ref_logp=torch.cat([part["logp"] for part in parts])[order])
    metrics = []
    for _ in range(steps):
        metrics.append(worker.update("actor", batch, counts))
    after = worker.forward("actor", batch)
    worker.shutdown()
    return {"ref": ref, "metrics": metrics, "after": after}


def worker_routing_replay(hf_dir, layout_kwargs, batch, micro_batch_size, batching=None):
    """A MegatronWorker's MoE actor built for routing replay: its log-probs of ``batch`` with the
    batch's ``routed_experts`` replayed and (the same model, the routes left out) with its own
    routing, then the metrics of one update with them replayed."""
    from megarl.config.schema import OptimSettings
    from megarl.workers.batch import MicroBatching, response_mask
    from megarl.workers.losses import LossSettings
    from megarl.workers.megatron_worker import MegatronWorker, ModelSpec
    from parallel.layout import MegatronLayout

    worker = MegatronWorker()
    batching = MicroBatching(micro_batch_size=micro_batch_size, **(batching or {}))
    worker.setup(ModelSpec("actor", hf_dir, MegatronLayout(**layout_kwargs), batching, OptimSettings(lr=1e-3),
                           loss=LossSettings(loss_agg_mode="seq-mean-token-mean"), routing_replay=True), seed=7)
    replayed = worker.forward("actor", batch)
    own = worker.forward("actor", {k: v for k, v in batch.items() if k != "routed_experts"})
    mask = response_mask(batch)
    counts = {"tokens": float(mask.sum()), "sequences": float((mask.sum(-1) > 0).sum())}
    metrics = worker.update("actor", dict(batch, old_logp=torch.zeros_like(mask)), counts)
    worker.shutdown()
    return {"replayed": replayed, "own": own, "metrics": metrics}


def worker_replay_mismatch(replay_dir, plain_dir, replay_batch, plain_batch, dtype):
    """One rank's log-probs in ``dtype``: of ``replay_batch`` by ``replay_dir``'s MoE model with the
    batch's ``routed_experts`` replayed and without them (its own routing); of ``plain_batch`` by
    ``plain_dir``'s model."""
    from megarl.workers.batch import MicroBatching
    from megarl.workers.megatron_worker import MegatronWorker, ModelSpec
    from parallel.layout import MegatronLayout

    def in_order(out):
        return out["logp"][out["rows"].argsort()]

    worker = MegatronWorker()
    batching = MicroBatching(micro_batch_size=32)
    worker.setup(ModelSpec("actor", replay_dir, MegatronLayout(), batching, dtype=dtype, routing_replay=True), seed=7)
    worker.setup(ModelSpec("ref", plain_dir, MegatronLayout(), batching, dtype=dtype), seed=7)
    logp = {"replay": in_order(worker.forward("actor", replay_batch)),
            "own routing": in_order(worker.forward("actor", {k: v for k, v in replay_batch.items()
                                                             if k != "routed_experts"})),
            "no routing choice": in_order(worker.forward("ref", plain_batch))}
    worker.shutdown()
    return logp


def worker_reward_values(rm_dir, layout_kwargs, batch, micro_batch_size, batching=None):
    """A MegatronWorker running a reward model at a layout: its per-response-token values of
    ``batch`` (the score of a sample is the value at its last token); ``batching`` as above."""
    from megarl.workers.batch import MicroBatching
    from megarl.workers.megatron_worker import MegatronWorker, ModelSpec
    from parallel.layout import MegatronLayout

    worker = MegatronWorker()
    worker.setup(ModelSpec("reward_model", rm_dir, MegatronLayout(**layout_kwargs),
                           MicroBatching(micro_batch_size=micro_batch_size, **(batching or {}))), seed=7)
    values = worker.forward("reward_model", batch)
    worker.shutdown()
    return {"scores": values}


def _main_param_pairs(optimizer):
    """(the part of a bf16/fp16 model parameter that this rank's optimizer updates, its fp32 main
    parameter) for every main parameter of megatron's mixed-precision optimizers: the whole
    parameter (Float16OptimizerWithFloat16Params) or this rank's shard of it (DistributedOptimizer)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for inner in optimizer.chained_optimizers:
        if isinstance(inner, DistributedOptimizer):
            for models, mains in zip(inner.model_float16_groups, inner.shard_fp32_from_float16_groups):
                for model, main in zip(models, mains):
                    span = inner._get_model_param_range_map(model)["param"]
                    yield model.detach().view(-1)[span.start:span.end], main.detach()
        else:
            for models, mains in zip(getattr(inner, "float16_groups", []), getattr(inner, "fp32_from_float16_groups", [])):
                for model, main in zip(models, mains):
                    yield model.detach().view(-1), main.detach().view(-1)


def worker_mixed_precision_updates(hf_dir, layout_kwargs, dtype, batch, steps, lr, rollout_tp=None,
                                   round_main_params=False):
    """A MegatronWorker's actor built in ``dtype`` trains ``steps`` updates on ``batch`` (vanilla
    policy gradient: with unit advantages its loss is the responses' mean NLL). Returns the
    losses, what precision each part holds (parameters, DDP grad buffers, optimizer main
    parameters) and, with ``rollout_tp``, this device's SGLang shards (packed for transport) and
    the trained weights under their HF names (rank 0). ``round_main_params``: the main parameters
    are rounded to ``dtype`` after every step, as if the optimizer kept no fp32 copy."""
    from megarl.config.schema import OptimSettings
    from megarl.workers.batch import MicroBatching, response_mask
    from megarl.workers.losses import LossSettings
    from megarl.workers.megatron_worker import MegatronWorker, ModelSpec
    from parallel.checkpoint.convert import gather_hf_tensors
    from parallel.layout import MegatronLayout
    from parallel.reshard.plan import plan_megatron_to_sglang

    layout = MegatronLayout(**layout_kwargs)
    worker = MegatronWorker()
    loss = LossSettings(policy_loss="vanilla", loss_agg_mode="token-mean")
    worker.setup(ModelSpec("actor", hf_dir, layout, MicroBatching(micro_batch_size=2),
                           OptimSettings(lr=lr, weight_decay=0.0), total_optimizer_steps=steps, loss=loss,
                           dtype=dtype), seed=7)
    model = worker.models["actor"]
    mask = response_mask(batch)
    counts = {"tokens": float(mask.sum()), "sequences": float((mask.sum(-1) > 0).sum())}
    metrics = []
    for _ in range(steps):
        metrics.append(worker.update("actor", batch, counts))
        if round_main_params:
            for _, main in _main_param_pairs(model.optimizer):
                main.copy_(main.to(getattr(torch, dtype)))
    pairs = list(_main_param_pairs(model.optimizer))
    inner = model.optimizer.chained_optimizers
    out = {
        "metrics": metrics,
        "optimizers": [type(o).__name__ for o in inner],
        "param_dtypes": {str(p.dtype) for module in model.modules for p in module.parameters()},
        "grad_buffers": {(str(b.param_dtype), str(b.grad_dtype)) for chunk in model.chunks for b in chunk.buffers},
        "main_param_dtypes": {str(main.dtype) for _, main in pairs},
        "main_param_numel": sum(main.numel() for _, main in pairs),
        "model_is_rounded_main": all(torch.equal(part, main.to(part.dtype)) for part, main in pairs),
        "main_finer_than_model": sum(int((main != part.float()).sum()) for part, main in pairs),
        "fused_adam": [group["fused"] for o in inner for group in o.optimizer.param_groups],
        "param_numel": sum(p.numel() for module in model.modules for p in module.parameters()),
        "params": {name: p.detach().clone() for name, p in model.modules[0].named_parameters()},
    }
    if rollout_tp:
        plan = plan_megatron_to_sglang(model.hf_config, layout, dist.get_world_size(), rollout_tp, element_size=2)
        out["shards"] = worker.rollout_shards(plan)
        out["hf"] = {name: tensor for name, tensor in gather_hf_tensors(model.chunks, model.hf_config, layout)
                     if tensor is not None}
    worker.shutdown()
    return out


def _actor_worker(hf_dir, layout_kwargs, lr):
    """A MegatronWorker training a vanilla policy-gradient actor at a layout (seed 7)."""
    from megarl.config.schema import OptimSettings
    from megarl.workers.batch import MicroBatching
    from megarl.workers.losses import LossSettings
    from megarl.workers.megatron_worker import MegatronWorker, ModelSpec
    from parallel.layout import MegatronLayout

    worker = MegatronWorker()
    worker.setup(ModelSpec("actor", hf_dir, MegatronLayout(**layout_kwargs), MicroBatching(micro_batch_size=2),
                           OptimSettings(lr=lr, weight_decay=0.0), total_optimizer_steps=4,
                           loss=LossSettings(policy_loss="vanilla", loss_agg_mode="token-mean")), seed=7)
    return worker


def _step_and_look(worker, batch) -> dict:
    """The actor's log-probs of ``batch`` (output ranks), one update on it, and the weights after
    it under their HF names (rank 0)."""
    from megarl.workers.batch import response_mask
    from parallel.checkpoint.convert import gather_hf_tensors

    mask = response_mask(batch)
    counts = {"tokens": float(mask.sum()), "sequences": float((mask.sum(-1) > 0).sum())}
    logp = worker.forward("actor", batch)
    metrics = worker.update("actor", batch, counts)
    model = worker.models["actor"]
    weights = {name: t for name, t in gather_hf_tensors(model.chunks, model.hf_config, model.spec.layout)
               if t is not None}
    return {"logp": logp, "metrics": metrics, "weights": weights}


def worker_save_and_continue(hf_dir, layout_kwargs, batch, directory, lr):
    """An actor at a layout: one update, a checkpoint into ``directory``, then the next step as an
    uninterrupted run takes it ("continued") and again after loading that checkpoint into the
    same ranks ("resumed", a same-layout resume)."""
    worker = _actor_worker(hf_dir, layout_kwargs, lr)
    _step_and_look(worker, batch)
    worker.save_checkpoint(directory)
    continued = _step_and_look(worker, batch)
    restored_rng = worker.load_checkpoint(directory)
    resumed = _step_and_look(worker, batch)
    worker.shutdown()
    return {"continued": continued, "resumed": resumed, "restored_rng": restored_rng}


def worker_resume_each(hf_dir, layout_kwargs, batch, directories, lr):
    """An actor at a layout that resumes from each checkpoint of ``directories`` in turn and takes
    the next step from it."""
    worker = _actor_worker(hf_dir, layout_kwargs, lr)
    out = []
    for directory in directories:
        restored_rng = worker.load_checkpoint(directory)
        out.append(dict(_step_and_look(worker, batch), restored_rng=restored_rng))
    worker.shutdown()
    return out


def worker_sft_step(hf_dir, layout_kwargs, batch, micro_batch_size, batching=None):
    """One ``sft`` update of a MegatronWorker's actor at a layout on ``batch`` (with a
    ``loss_mask``): its metrics (the masked NLL before the step, the gradient norm)."""
    from megarl.config.schema import OptimSettings
    from megarl.workers.batch import MicroBatching, response_mask
    from megarl.workers.losses import LossSettings
    from megarl.workers.megatron_worker import MegatronWorker, ModelSpec
    from parallel.layout import MegatronLayout

    worker = MegatronWorker()
    batching = MicroBatching(micro_batch_size=micro_batch_size, **(batching or {}))
    worker.setup(ModelSpec("actor", hf_dir, MegatronLayout(**layout_kwargs), batching,
                           OptimSettings(lr=1e-3, weight_decay=0.0, clip_grad=0.0), total_optimizer_steps=1,
                           loss=LossSettings(policy_loss="sft")), seed=7)
    mask = response_mask(batch)
    metrics = worker.update("actor", batch, {"tokens": float(mask.sum()), "sequences": float((mask.sum(-1) > 0).sum())})
    worker.shutdown()
    return metrics


def worker_forward_on_a_stand_in_gpu(hf_dir, batch, micro_batch_size):
    """A MegatronWorker's reference model moved to the ``meta`` device (a GPU stand-in,
    ``tests.megarl.workers.stand_in_gpu``), asked for the log-probs and entropies of ``batch``:
    returns where and in which shape they came back, or the error that stopped the forward."""
    from megarl.workers.batch import MicroBatching
    from megarl.workers.megatron_worker import MegatronWorker, ModelSpec
    from parallel.layout import MegatronLayout
    from parallel.models import place_chunks
    from tests.megarl.workers.stand_in_gpu import META, HostCrossings

    worker = MegatronWorker()
    worker.setup(ModelSpec("ref", hf_dir, MegatronLayout(), MicroBatching(micro_batch_size=micro_batch_size)), seed=7)
    place_chunks(worker.models["ref"].chunks, META)
    try:
        with HostCrossings():
            out = worker.forward("ref", batch, with_entropy=True)
        return {key: (value.device.type, tuple(value.shape)) for key, value in out.items()}
    except RuntimeError as error:
        return {"error": str(error)}
    finally:
        worker.shutdown()


def worker_update_with_settings(hf_dir, layout_kwargs, batch, settings, batching=None):
    """One PPO update of a MegatronWorker's actor on ``batch`` with the ``ModelSpec`` training
    ``settings`` (recompute, overlap_grad_reduce, moe_token_dispatcher): its metrics, the actor's
    log-probs after it, what megatron's config was built with, the shapes of this replica's
    micro-batches, and how often each decoder layer and core attention ran forward in the update
    (activation recompute runs them again in the backward)."""
    from collections import Counter

    from megarl.config.schema import OptimSettings
    from megarl.workers.batch import MicroBatching, response_mask
    from megarl.workers.losses import LossSettings
    from megarl.workers.megatron_worker import MegatronWorker, ModelSpec
    from parallel.layout import MegatronLayout

    worker = MegatronWorker()
    worker.setup(ModelSpec("actor", hf_dir, MegatronLayout(**layout_kwargs),
                           MicroBatching(micro_batch_size=2, **(batching or {})), OptimSettings(lr=1e-3, weight_decay=0.0),
                           loss=LossSettings(loss_agg_mode="seq-mean-token-mean"), **settings), seed=7)
    model = worker.models["actor"]
    calls = Counter()
    for module in model.modules:
        for name, sub in module.named_modules():
            kind = name.rsplit(".", 1)[-1] if name.endswith("core_attention") else "layer" if name.split(".")[-2:-1] == [
                "layers"] and name.startswith("decoder.") else None
            if kind:
                sub.register_forward_hook(lambda *_, kind=kind: calls.update([kind]))
    mask = response_mask(batch)
    counts = {"tokens": float(mask.sum()), "sequences": float((mask.sum(-1) > 0).sum())}
    shapes = [tuple(mb["tokens"].shape) for mb in worker._micro_batches(model, batch)]
    metrics = worker.update("actor", dict(batch, old_logp=torch.zeros_like(mask)), counts)
    update_calls = dict(calls)
    after = worker.forward("actor", batch)
    config = model.modules[0].config
    built = {key: getattr(config, key) for key in ("recompute_granularity", "recompute_method", "recompute_num_layers",
                                                   "variable_seq_lengths", "moe_token_dispatcher_type")}
    built["init_method"] = config.init_method.__name__
    built["overlap_grad_reduce"] = model.chunks[0].ddp_config.overlap_grad_reduce
    worker.shutdown()
    return {"metrics": metrics, "after": after, "built": built, "shapes": shapes, "calls": update_calls,
            "micro_batches": len(shapes)}


def loaded_params_with_and_without_init(hf_dir, layout_kwargs, value_model=False):
    """This rank's parameters, and the tensor-parallel attributes megatron tags them with, after
    an HF load into chunks built with megatron's random init and into chunks built without it
    (``random_init=False``) whose every element was set to NaN first: equal only if the load
    writes every element, vocab padding rows included, and the build tags them alike."""
    from parallel.checkpoint.convert import load_hf_into_chunks, load_hf_into_value_chunks
    from parallel.checkpoint.hf_io import HFCheckpoint
    from parallel.layout import MegatronLayout
    from parallel.models import build_model_chunks, build_value_model_chunks
    from parallel.process_groups import initialize_megatron

    layout = MegatronLayout(**layout_kwargs)
    initialize_megatron(layout, seed=7)
    ckpt = HFCheckpoint(hf_dir)
    build, load = ((build_value_model_chunks, load_hf_into_value_chunks) if value_model
                   else (build_model_chunks, load_hf_into_chunks))
    tags = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce", "sequence_parallel")
    out = {}
    for init in (True, False):
        chunks = build(ckpt.config, layout, random_init=init)
        if not init:
            with torch.no_grad():
                for chunk in chunks:
                    for param in chunk.parameters():
                        param.fill_(float("nan"))
        load(chunks, ckpt, layout)
        named = [(f"{i}.{name}", p) for i, chunk in enumerate(chunks) for name, p in chunk.named_parameters()]
        out[init] = {name: p.detach().clone() for name, p in named}
        out[("tags", init)] = {name: {tag: getattr(p, tag, None) for tag in tags} for name, p in named}
    return out
