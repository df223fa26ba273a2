"""Rollout routing replay: an MoE model's routers use given experts instead of their own top-k.

An RL rollout engine and the trainer compute the same router logits up to rounding, and where
two experts' logits are close the engine and the trainer pick different experts: the trainer's
log-probs of the engine's tokens then differ by more than rounding (the train/rollout
mismatch). Replaying the experts the engine chose (recorded per token and layer) makes the
trainer route every token as the rollout did; the router's probabilities are still its own
(softmax of its logits over the replayed experts), so gradients reach the router.

megatron-core's routers carry a ``RouterReplay`` when the model's config sets
``moe_enable_routing_replay``; this module gives each of a chunk's routers its layer's experts
for one forward, in the router's own token order: the chunk's tokens ``[s, b]`` flattened
s-major, this TP rank's sequence share under sequence parallelism (the caller has already cut
the CP rank's share, as it does the tokens).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def chunk_routers(model) -> tuple:
    """The top-k routers of a model chunk (a GPTModel) in layer order; found once per chunk, not
    at every micro-batch (a walk over every module: tens of thousands in a 128-expert model)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return tuple(m for m in model.modules() if isinstance(m, TopKRouter))


def replay_routes(model, routes: torch.Tensor | None) -> None:
    """Make the routers of ``model`` (a chunk's GPTModel) route the next forward's tokens to
    ``routes`` ``[rows, seq, layers, top-k]`` (global expert ids of every layer of the model, at
    this CP rank's positions), or, with None, to their own top-k. The model must have been built
    with ``moe_enable_routing_replay=True``."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = chunk_routers(model)
    if any(router.router_replay is None for router in routers):
        raise ValueError("routing replay needs a model built with moe_enable_routing_replay=True")
    if routes is None:
        for router in routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
        return
    tokens = routes.transpose(0, 1)  # [seq, rows, layers, k]: the hidden states' order
    if routers and routers[0].config.sequence_parallel:
        tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
        tokens = tokens.chunk(tp)[rank]
    tokens = tokens.reshape(-1, *tokens.shape[2:])
    for router in routers:
        replay = router.router_replay
        replay.clear_indices()  # also the indices kept for a backward recompute (not used here)
        replay.set_target_indices(tokens[:, router.layer_number - 1].long())
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
