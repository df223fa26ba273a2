"""Megatron training primitives shared by every trainable role (SFT warm-up, actor, critic).

Wraps model chunks in megatron's DDP, builds megatron's optimizer (Adam, gradient clipping,
optional distributed optimizer) and runs one optimizer step through megatron's own
forward-backward schedules (no pipelining, 1F1B or interleaved, chosen from the layout). A bf16
model (``parallel.models.build_model_chunks`` with ``params_dtype=torch.bfloat16``: every
parameter bf16) trains as megatron's bf16 path does: grads accumulated and reduced in fp32, fp32
main parameters in the optimizer.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterator, Protocol

import torch

from parallel.layout import MegatronLayout
from parallel.modules.context_parallel import split_for_context_parallel


class AdamSettings(Protocol):
    """What ``build_optimizer`` reads of a model's optimizer settings: ``megarl.config.schema.OptimSettings``
    (the one optimizer type; this module sits below ``megarl.config`` and cannot import it)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    clip_grad: float  # max global grad norm; 0 = no clipping


def wrap_ddp(chunks: list, layout: MegatronLayout, overlap_grad_reduce: bool = False) -> list:
    """Wrap each model chunk in megatron's DistributedDataParallel (fp32 grads, bucketed reduce).
    ``overlap_grad_reduce``: each bucket's data-parallel all-reduce (reduce-scatter with the
    distributed optimizer) starts as soon as the last micro-batch's backward has filled it,
    during the rest of the backward, instead of after the whole backward."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=layout.use_distributed_optimizer,
    )
    wrapped = []
    for index, chunk in enumerate(chunks):
        wrapped.append(
            DistributedDataParallel(
                config=chunk.config, ddp_config=ddp_config, module=chunk,
                # Only the first chunk's buckets are used by the schedule for grad sync timing.
                disable_bucketing=index > 0,
            )
        )
    return wrapped


def build_optimizer(chunks: list, optim: AdamSettings, layout: MegatronLayout):
    """megatron's optimizer over DDP-wrapped chunks (torch Adam underneath when TE/apex are absent)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=optim.clip_grad,
        params_dtype=chunks[0].config.params_dtype, bf16=chunks[0].config.params_dtype == torch.bfloat16,
        use_distributed_optimizer=layout.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, chunks)
    _fuse_cpu_adam(optimizer)
    _attach_schedule_hooks(chunks, optimizer)
    return optimizer


def _fuse_cpu_adam(optimizer) -> None:
    """Run torch's Adam as its fused kernel where every parameter of a group is an fp32 CPU tensor
    (megatron builds it unfused when TE/apex are absent): one pass per tensor instead of about ten
    ops; 20M parameters on 2 threads: 87 -> 23 ms a step. Same update up to rounding."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = getattr(inner, "optimizer", None)
        if not isinstance(adam, torch.optim.Adam):  # AdamW is a subclass
            continue
        for group in adam.param_groups:
            if not group["differentiable"] and all(p.device.type == "cpu" and p.dtype == torch.float32
                                                   for p in group["params"]):
                group["fused"], group["foreach"] = True, False


def _attach_schedule_hooks(chunks: list, optimizer) -> None:
    """What megatron's schedules read from the config to sync grads: without
    finalize_model_grads, DP grads are never reduced and tied embeddings drift across PP stages."""
    from megatron.core.distributed import finalize_model_grads

    config = chunks[0].config
    no_sync = [chunk.no_sync for chunk in chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss


def causal_lm_loss(output_tensor: torch.Tensor, loss_mask: torch.Tensor, num_tokens: torch.Tensor | None = None):
    """Token-mean cross entropy for megatron's schedules: (loss, logging dict).

    ``num_tokens`` is the micro-batch's token count over the whole context-parallel group (the
    local count when None, i.e. without CP): each CP rank returns its local token-sum over the
    global count, the schedule multiplies that by cp_size and DDP averages over DP x CP, which
    gives the micro-batch's mean. The logging dict holds local (sum, count), which the caller
    adds up over DP x CP into the true mean.
    """
    mask = loss_mask.float().view(-1)
    total = torch.sum(output_tensor.float().view(-1) * mask)
    tokens = mask.sum()
    denominator = tokens if num_tokens is None else num_tokens.float()
    return total / denominator.clamp(min=1), {"lm loss": (total.detach(), tokens.detach())}


def lm_forward_step(data_iterator: Iterator[dict], model) -> tuple[torch.Tensor, Callable]:
    """One micro-batch forward: tokens -> per-token losses (last stage) or hidden states.

    Every CP rank receives the whole micro-batch and keeps its zig-zag share; position ids are the
    global positions of the kept tokens. (RoPE in megatron slices its table for the CP rank by
    itself; the position ids matter for learned position embeddings.)
    """
    batch = next(data_iterator)
    tokens = batch["tokens"]
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    local = split_for_context_parallel(
        {"tokens": tokens, "labels": batch["labels"], "loss_mask": batch["loss_mask"], "position_ids": position_ids}
    )
    output = model(local["tokens"], local["position_ids"], attention_mask=None, labels=local["labels"])
    num_tokens = batch["loss_mask"].float().sum()  # over the full sequence: the CP group's count
    return output, partial(causal_lm_loss, loss_mask=local["loss_mask"], num_tokens=num_tokens)


def train_step(
    chunks: list,
    optimizer,
    micro_batches: list[dict],
    seq_length: int,
    forward_step: Callable = lm_forward_step,
) -> dict:
    """One optimizer step over ``micro_batches`` (dicts of [mbs, seq] tensors) on this rank.

    ``seq_length`` is the FULL sequence length (megatron's schedule divides it by cp, and by tp
    under sequence parallel, for the pipeline's activation shapes); with CP every rank of a CP
    group gets the same micro-batches and ``forward_step`` keeps its share.

    Returns {"loss": mean loss over micro-batches (last pipeline stage, else nan), "grad_norm",
    "update_successful"}.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    iterators = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=micro_batches[0]["tokens"].shape[0],
        forward_only=False,
    )
    update_successful, grad_norm, _ = optimizer.step()
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        # Token-weighted mean over this step's micro-batches on every data- and context-parallel
        # rank (each CP rank logged the sum and count of its own tokens).
        sums = torch.tensor(  # on the GPU with NCCL (where this process's current device is)
            [sum(float(item["lm loss"][0]) for item in losses), sum(float(item["lm loss"][1]) for item in losses)],
            dtype=torch.float64, device=micro_batches[0]["tokens"].device,
        )
        torch.distributed.all_reduce(sums, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        loss = float(sums[0] / sums[1].clamp(min=1.0))
    else:
        loss = float("nan")
    return {"loss": loss, "grad_norm": float(grad_norm or 0.0), "update_successful": bool(update_successful)}
