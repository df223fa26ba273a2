"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Megatron's output layer leaves each tensor-parallel rank with a slice of the (padded) vocabulary:
rank r holds logits of ids ``[r * V/tp, (r+1) * V/tp)``. Rows at ids ``>= vocab_size`` exist only
because megatron pads the vocabulary to a multiple of 128 * tp; they must not take probability
mass, or the trainer's log-probs differ from HF's and SGLang's (by up to 0.25 nats on a tiny
model). They are masked to -inf here, before the softmax.

The reductions over the vocabulary are all-reduces over the TP group whose backward is the
identity (megatron's ``reduce_from_tensor_model_parallel_region``): every TP rank computes the
same downstream loss, so each rank's share of the gradient is the upstream gradient itself.
"""

from __future__ import annotations

import torch


def _tp_group_info() -> tuple[int, int]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def vocab_parallel_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(targets)`` and (optionally) the entropy of each position's distribution.

    ``logits`` is ``[..., V/tp]`` (this TP rank's vocabulary slice, any dtype; computed in fp32),
    ``targets`` ``[...]`` global token ids. Differentiable; identical on every TP rank.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    tp, rank = _tp_group_info()
    local_vocab = logits.shape[-1]
    start = rank * local_vocab
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits.shape[:-1])}")
    logits = logits.float()
    padded = torch.arange(start, start + local_vocab, device=logits.device) >= vocab_size
    if bool(padded.any()):
        logits = logits.masked_fill(padded, float("-inf"))

    def total(x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_model_parallel_region(x) if tp > 1 else x

    with torch.no_grad():  # the shift only stabilises exp(); it carries no gradient
        shift = logits.max(dim=-1).values
        if tp > 1:
            torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX,
                                         group=parallel_state.get_tensor_model_parallel_group())
    shifted = logits - shift.unsqueeze(-1)
    log_normalizer = torch.log(total(torch.exp(shifted).sum(dim=-1)))
    local_target = targets - start
    here = (local_target >= 0) & (local_target < local_vocab)
    picked = shifted.gather(-1, local_target.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    log_probs = total(torch.where(here, picked, torch.zeros((), dtype=picked.dtype))) - log_normalizer
    if not with_entropy:
        return log_probs, None
    probs = torch.exp(shifted - log_normalizer.unsqueeze(-1))
    finite = torch.where(padded, torch.zeros((), dtype=shifted.dtype), shifted)  # p = 0 there; avoid 0 * -inf
    entropy = log_normalizer - total((probs * finite).sum(dim=-1))
    return log_probs, entropy
