"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Megatron's output layer leaves each tensor-parallel rank with a slice of the (padded) vocabulary:
rank r holds logits of ids ``[r * V/tp, (r+1) * V/tp)``. Rows at ids ``>= vocab_size`` exist only
because megatron pads the vocabulary to a multiple of 128 * tp; they must not take probability
mass, or the trainer's log-probs differ from HF's and SGLang's (by up to 0.25 nats on a tiny
model). They are left out of every sum here (and get zero gradient).

One autograd function does the work in blocks of rows, so no full-vocabulary intermediate
(shifted logits, exponentials, probabilities) is ever materialised: the forward keeps the logits
it was given plus three numbers per token, and the backward writes the logits' gradient block by
block in closed form,

    d log p(t) / dz = onehot(t) - p,        d H / dz = -p * (log p + H).

On CPU the blocks stay in cache; on GPUs the peak is the logits and their gradient instead of
half a dozen logits-sized temporaries. The entropy's term is skipped when nothing differentiates
the entropy (the usual case: a metric, ``entropy_coef = 0``).

Across tensor parallelism the per-token sums are all-reduced in the forward; the backward needs
no communication: every TP rank computes the same downstream loss, so the upstream gradients are
already identical everywhere and each rank writes its own vocabulary slice.
"""

from __future__ import annotations

import torch

# Elements of one block of rows: 4 MiB of fp32 on CPU (cache-sized), 256 MiB on GPUs (few kernels).
_BLOCK_ELEMENTS = {"cpu": 1 << 20}
_DEFAULT_BLOCK_ELEMENTS = 1 << 26


def _tp_group_info() -> tuple[int, int]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def _row_blocks(logits: torch.Tensor):
    """Slices of rows of the 2-D ``logits`` sized to the device's block budget."""
    budget = _BLOCK_ELEMENTS.get(logits.device.type, _DEFAULT_BLOCK_ELEMENTS)
    rows = max(1, budget // max(1, logits.shape[1]))
    return [slice(start, start + rows) for start in range(0, logits.shape[0], rows)]


class _VocabParallelLogProbs(torch.autograd.Function):
    """(log p(targets), entropy) of 2-D ``logits`` ``[N, V/tp]`` whose first ``valid`` columns
    are real ids; ``targets`` are local column indices, -1 where another TP rank holds the id."""

    @staticmethod
    def forward(ctx, logits, targets, valid: int, group):
        z = logits[:, :valid]
        dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32 at least
        here = targets >= 0
        # per token, relative to this rank's max m: sum exp(z - m), sum exp(z - m) (z - m), z[target] - m
        shift = torch.full((len(z),), float("-inf"), dtype=dtype, device=z.device)
        sums = torch.zeros(3, len(z), dtype=dtype, device=z.device)
        for rows in _row_blocks(z) if valid else ():
            block = z[rows].to(dtype)
            shift[rows] = block.max(dim=-1).values
            block = block - shift[rows].unsqueeze(-1)
            weights = torch.exp(block)
            sums[0, rows] = weights.sum(dim=-1)
            sums[1, rows] = (weights * block).sum(dim=-1)
            sums[2, rows] = block.gather(-1, targets[rows].clamp(min=0).unsqueeze(-1)).squeeze(-1)
        if group is not None:  # re-base every rank's sums on the global max, then add them up
            local_shift = shift.clone()
            torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX, group=group)
            if valid:
                offset = local_shift - shift
                sums[1] = torch.exp(offset) * (sums[1] + sums[0] * offset)
                sums[0] = sums[0] * torch.exp(offset)
                sums[2] = sums[2] + offset
        sums[2] = torch.where(here, sums[2], 0.0)
        if group is not None:
            torch.distributed.all_reduce(sums, group=group)
        log_normalizer = torch.log(sums[0])
        log_probs = sums[2] - log_normalizer
        entropy = log_normalizer - sums[1] / sums[0]
        ctx.save_for_backward(logits, targets, shift + log_normalizer, entropy)
        ctx.valid = valid
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, targets, log_partition, entropy = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        if grad_log_probs is None and grad_entropy is None:
            return grad, None, None, None
        z, out = logits[:, : ctx.valid], grad[:, : ctx.valid]
        for rows in _row_blocks(z) if ctx.valid else ():
            log_p = z[rows].to(log_partition.dtype) - log_partition[rows].unsqueeze(-1)
            p = torch.exp(log_p)
            # dz = -p * (g + g_H (log p + H)), plus g at the target
            if grad_entropy is not None:
                coef = log_p.add_(entropy[rows].unsqueeze(-1)).mul_(grad_entropy[rows].to(log_p.dtype).unsqueeze(-1))
                if grad_log_probs is not None:
                    coef.add_(grad_log_probs[rows].to(log_p.dtype).unsqueeze(-1))
            else:
                coef = grad_log_probs[rows].to(log_p.dtype).unsqueeze(-1)
            block = p.mul_(coef).neg_()
            if grad_log_probs is not None:
                target = targets[rows]
                block.scatter_add_(-1, target.clamp(min=0).unsqueeze(-1),
                                   torch.where(target >= 0, grad_log_probs[rows].to(log_p.dtype), 0.0).unsqueeze(-1))
            out[rows] = block
        return grad, None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(targets)`` and (optionally) the entropy of each position's distribution.

    ``logits`` is ``[..., V/tp]`` (this TP rank's vocabulary slice, any dtype; computed in fp32,
    or fp64 for fp64 logits),
    ``targets`` ``[...]`` global token ids. Differentiable; identical on every TP rank.
    """
    from megatron.core import parallel_state

    tp, rank = _tp_group_info()
    local_vocab = logits.shape[-1]
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits.shape[:-1])}")
    start = rank * local_vocab
    valid = max(0, min(local_vocab, vocab_size - start))
    local_target = targets - start
    local_target = torch.where((local_target >= 0) & (local_target < valid), local_target, -1)
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    flat = logits.reshape(-1, local_vocab)
    log_probs, entropy = _VocabParallelLogProbs.apply(flat, local_target.reshape(-1), valid, group)
    log_probs = log_probs.reshape(targets.shape)
    return log_probs, entropy.reshape(targets.shape) if with_entropy else None
