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
