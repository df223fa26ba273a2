"""Context-parallel causal attention for megatron's local (non-Transformer-Engine) layer spec.

With context parallelism (CP) each sequence of S tokens is cut into 2*CP chunks and CP rank r
holds chunks r and 2*CP-1-r (megatron's ``get_batch_on_this_cp_rank``: the "zig-zag" split that
gives every rank the same share of causal work). Everything in a transformer layer is per token
except attention, and megatron's local ``DotProductAttention`` refuses CP > 1 (only TE's attention
implements it). ``ContextParallelAttention`` is the stand-in, with DotProductAttention's
constructor and forward signature so it drops into the layer spec's ``core_attention`` slot:

- keys and values are all-gathered over the CP group by an autograd function whose backward
  reduce-scatters their gradients, so every rank's K/V gradient receives the contributions of
  all ranks' queries;
- each rank attends its S/CP local queries to all S keys, with the causal mask computed on
  GLOBAL token positions; the gathered keys stay in rank order (the zig-zag is never undone),
  which is fine because the mask only looks at positions;
- GQA: K/V are gathered with their num_query_groups heads and repeated to the query heads
  afterwards (the gather moves only groups/heads of the bytes);
- TP splits heads and sequence parallelism only changes what the projections gather, so neither
  concerns this module.

Memory: each rank holds K/V of the whole sequence and a [b, heads/tp, S/cp, S] score matrix.
That is fine for tests and moderate lengths; long contexts want ring attention (TE's "p2p"
cp_comm_type: K/V blocks circulate and a rank never holds all of them). On GPUs with Transformer
Engine installed, use TE's attention instead (see parallel.layout.layer_spec).

Packing (THD, cu_seqlens) is not supported yet; ``allowed_keys`` takes positions of any leading
shape, so per-token segment ids (attend only within the same sequence) can be added there.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule

_SPLITS = ("zigzag", "contiguous")
# torch >= 2.13 renames the tensor collectives (the old names warn); older torch has only those.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 (the sequence) over ``group``; backward reduce-scatters the grads."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.new_empty((dist.get_world_size(group) * tensor.shape[0], *tensor.shape[1:]))
        _all_gather(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


def token_positions(local_len: int, cp_size: int, cp_rank: int, split: str = "zigzag") -> torch.Tensor:
    """Global positions of the ``local_len`` tokens CP rank ``cp_rank`` holds.

    "zigzag": chunks r and 2*cp-1-r of 2*cp (megatron's get_batch_on_this_cp_rank);
    "contiguous": the r-th of cp equal slices.
    """
    if split == "contiguous":
        return torch.arange(cp_rank * local_len, (cp_rank + 1) * local_len)
    if split != "zigzag" or local_len % 2:
        raise ValueError(f"split={split!r} with local length {local_len}: need one of {_SPLITS} and an even length")
    chunk = local_len // 2
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def allowed_keys(query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """Causal mask on global positions: True where query i may attend key j (key_pos <= query_pos).
    Positions are [..., s]; a same-segment condition for packed sequences belongs here."""
    return key_pos.unsqueeze(-2) <= query_pos.unsqueeze(-1)


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    softmax_scale: float,
    cp_group: Optional[dist.ProcessGroup],
    split: str = "zigzag",
    dropout: Optional[torch.nn.Module] = None,
) -> torch.Tensor:
    """Causal attention of local queries [sq, b, np, hn] over the whole CP group's keys/values
    [sk, b, ng, hn] (sq == sk: self-attention); returns the context [sq, b, np * hn].
    ``split`` names how the sequence is distributed over the CP ranks (see token_positions)."""
    cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
    cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0
    local_len = query.shape[0]
    if key.shape[0] != local_len:
        raise ValueError(f"self-attention only: {local_len} queries but {key.shape[0]} local keys")
    if cp_size > 1:
        key, value = _GatherSequence.apply(key, cp_group), _GatherSequence.apply(value, cp_group)
    query_pos = token_positions(local_len, cp_size, cp_rank, split)
    key_pos = torch.cat([token_positions(local_len, cp_size, r, split) for r in range(cp_size)])
    heads, groups = query.shape[2], key.shape[2]
    if heads != groups:  # GQA: [S, b, ng, hn] -> [S, b, np, hn]
        key = key.repeat_interleave(heads // groups, dim=2)
        value = value.repeat_interleave(heads // groups, dim=2)
    # [b, np, sq, hn] @ [b, np, hn, S] -> scores [b, np, sq, S]
    scores = torch.matmul(query.permute(1, 2, 0, 3), key.permute(1, 2, 3, 0)) * softmax_scale
    scores = scores.float().masked_fill(~allowed_keys(query_pos, key_pos), torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    if dropout is not None:
        probs = dropout(probs)
    context = torch.matmul(probs, value.permute(1, 2, 0, 3))  # [b, np, sq, hn]
    return context.permute(2, 0, 1, 3).reshape(local_len, query.shape[1], -1)


class ContextParallelAttention(MegatronModule):
    """Drop-in ``core_attention`` for megatron's local spec that supports CP (zig-zag split).

    Causal self-attention only; ``cp_comm_type`` is ignored (K/V are always all-gathered, TE's
    "all_gather" mode); attention masks, biases and packed sequences are refused, not ignored.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        from megatron.core import parallel_state
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.utils import is_layer_window_attention

        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"ContextParallelAttention is causal only (got {attn_mask_type})")
        if config.softmax_type != "vanilla" or is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number
        ):
            raise NotImplementedError("ContextParallelAttention: no sliding window or softmax variants yet")
        self.config = config
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group()
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        # (apply_query_key_layer_scaling divides and re-multiplies the scores: a no-op in fp32.)
        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core import tensor_parallel

        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError(
                "ContextParallelAttention takes no attention_mask, attention_bias or packed_seq_params "
                "(the causal mask is built from global positions)"
            )
        dropout = self.attention_dropout if self.attention_dropout.p > 0 and self.training else None
        if dropout is not None and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():  # as DotProductAttention does
                return context_parallel_attention(query, key, value, self.softmax_scale, self.cp_group,
                                                  dropout=dropout)
        return context_parallel_attention(query, key, value, self.softmax_scale, self.cp_group, dropout=dropout)


def split_for_context_parallel(batch: dict) -> dict:
    """This CP rank's share of a micro-batch ([mbs, seq] tensors): megatron's zig-zag split
    (chunks r and 2*cp-1-r of 2*cp). A copy; the input dict is left alone. Identity at CP=1."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return dict(batch)
    seq_length = batch["tokens"].shape[1]
    if seq_length % (2 * cp):
        raise ValueError(
            f"micro-batch sequence length {seq_length} is not divisible by 2*cp={2 * cp} "
            f"(context-parallel zig-zag split); pad sequences to a multiple of {2 * cp}"
        )
    return get_batch_on_this_cp_rank({key: value.contiguous() for key, value in batch.items()})
