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

Memory: each rank holds K/V of the whole sequence and the [S/cp, S] causal mask on global
positions, which torch's SDPA (memory-efficient kernel on CUDA) turns into a bias shared by the
heads; no [b, heads/tp, S/cp, S] score matrix is kept. Long contexts want ring attention (TE's
"p2p" cp_comm_type: K/V blocks circulate and a rank never holds all of them). On GPUs with
Transformer Engine installed, use TE's attention instead (see parallel.models.transformer_layer_spec).

Packed sequences (megatron's "thd" format, ``PackedSeqParams`` with cu_seqlens; built by
``parallel.modules.packing``): several sequences share one row, each query attends causally within its own
sequence only. Attention is computed per sequence (sum of L_i^2 scores, not T^2 for the row); with
CP each sequence is zig-zag split on its own (TE's thd layout, which megatron's thd RoPE assumes),
so every sequence's padded length must be a multiple of 2*CP. Megatron's local
DotProductAttention refuses packed_seq_params, so ``transformer_layer_spec(..., packed_sequences=True)`` uses
this module at CP=1 too.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule
from torch.nn.attention import SDPBackend, sdpa_kernel

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
    if split not in _SPLITS:
        raise ValueError(f"split={split!r}: need one of {_SPLITS}")
    if split == "contiguous" or cp_size == 1:
        return torch.arange(cp_rank * local_len, (cp_rank + 1) * local_len)
    if local_len % 2:
        raise ValueError(f"zigzag split of local length {local_len}: needs an even one (sequence a multiple of 2*cp)")
    chunk = local_len // 2
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def packed_token_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Row positions of the tokens CP rank ``cp_rank`` holds of a packed row whose sequences'
    (padded) boundaries are ``cu_seqlens``: each sequence is zig-zag split on its own (chunks r and
    2*cp-1-r of its 2*cp), sequences in row order, as TE's thd split and megatron's thd RoPE lay
    them out. All positions at CP=1."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if cp_size == 1:
        return torch.arange(bounds[-1])
    parts = []
    for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if (end - start) % (2 * cp_size):
            raise ValueError(
                f"packed sequence {index} occupies {end - start} tokens, not a multiple of 2*cp={2 * cp_size} "
                f"(per-sequence zig-zag split); pack with pad_to_multiple={2 * cp_size}"
            )
        parts.append(start + token_positions((end - start) // cp_size, cp_size, cp_rank))
    return torch.cat(parts)


def allowed_keys(query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """Causal mask on global positions: True where query i may attend key j (key_pos <= query_pos).
    Positions are [..., s]. Packed sequences never meet here: attention runs per sequence."""
    return key_pos.unsqueeze(-2) <= query_pos.unsqueeze(-1)


def repeat_kv_heads(key: torch.Tensor, value: torch.Tensor, heads: int, dim: int = 2):
    """GQA's key and value heads (``dim``) each repeated to the query's ``heads``, in megatron's
    order (query head i reads group i // (heads / groups)). torch's one fused CUDA kernel that takes a
    mask (memory-efficient attention) refuses fewer K/V heads than query heads (torch 2.13), and
    SDPA then falls back to the math kernel and its [b, heads, sq, sk] fp32 score matrix: masked
    attention expands the heads first."""
    groups = key.shape[dim]
    if groups == heads:
        return key, value

    def repeat(t):  # a copy through expand: its backward is a sum, ~4x faster than repeat_interleave's
        return t.unsqueeze(dim + 1).expand(*t.shape[:dim + 1], heads // groups, *t.shape[dim + 1:]).flatten(dim, dim + 1)

    return repeat(key), repeat(value)


def memory_efficient_kernel(query: torch.Tensor):
    """Where a masked SDPA call on ``query`` may run: on CUDA only torch's memory-efficient kernel
    (``sdpa_kernel``), so that a call it refuses raises instead of silently running the math
    kernel; elsewhere torch's own choice (on CPU its fused kernel, or math with dropout). An empty
    call (a micro-batch of filler rows has no branches) computes nothing and is left to torch."""
    if query.is_cuda and query.numel():
        return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])
    return contextlib.nullcontext()


def _causal_attention(query, key, value, query_pos, key_pos, softmax_scale, dropout_p):
    """Queries [sq, b, np, hn] over keys/values [sk, b, np, hn], masked on positions -> [sq, b, np*hn].
    torch's SDPA with the boolean mask: on CUDA its memory-efficient kernel keeps a [sq, sk] bias
    shared by the heads, not a [b, np, sq, sk] score matrix."""
    from torch.nn.functional import scaled_dot_product_attention

    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, hn]
    with memory_efficient_kernel(q):
        context = scaled_dot_product_attention(q, k, v, attn_mask=allowed_keys(query_pos, key_pos),
                                               dropout_p=dropout_p, scale=softmax_scale)
    return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    softmax_scale: float,
    cp_group: Optional[dist.ProcessGroup],
    split: str = "zigzag",
    dropout_p: float = 0.0,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of local queries [sq, b, np, hn] over the whole CP group's keys/values
    [sk, b, ng, hn] (sq == sk: self-attention); returns the context [sq, b, np * hn].
    ``split`` names how the sequence is distributed over the CP ranks (see token_positions).
    With ``cu_seqlens`` (the packed row's sequence boundaries, padding included; b must be 1)
    each query attends only within its own sequence, split per sequence (packed_token_positions)."""
    cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
    cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0
    local_len = query.shape[0]
    if key.shape[0] != local_len:
        raise ValueError(f"self-attention only: {local_len} queries but {key.shape[0]} local keys")
    if cu_seqlens is not None and int(cu_seqlens[-1]) != cp_size * local_len:
        raise ValueError(
            f"packed_seq_params cu_seqlens end at {int(cu_seqlens[-1])} tokens but the row holds "
            f"{cp_size * local_len} (cp={cp_size} x {local_len} local); the padding must belong to a "
            f"sequence: pass cu_seqlens_q_padded (parallel.modules.packing.PackedBatch.packed_seq_params)"
        )
    if cp_size > 1:
        key, value = _GatherSequence.apply(key, cp_group), _GatherSequence.apply(value, cp_group)
    key, value = repeat_kv_heads(key, value, query.shape[2])  # GQA: [S, b, ng, hn] -> [S, b, np, hn]
    if cu_seqlens is None:
        query_pos = token_positions(local_len, cp_size, cp_rank, split)
        key_pos = torch.cat([token_positions(local_len, cp_size, r, split) for r in range(cp_size)])
        return _causal_attention(query, key, value, query_pos, key_pos, softmax_scale, dropout_p)
    query_pos = packed_token_positions(cu_seqlens, cp_size, cp_rank)
    # Gathered keys are in CP-rank order and each rank's share is grouped by sequence in row
    # order, so sequence i's keys are slice i of every rank's share.
    keys, values = (t.view(cp_size, local_len, *t.shape[1:]) for t in (key, value))
    key_pos = torch.stack([packed_token_positions(cu_seqlens, cp_size, r) for r in range(cp_size)])
    contexts, offset = [], 0
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        part = slice(offset, offset + (end - start) // cp_size)
        offset = part.stop
        contexts.append(_causal_attention(query[part], keys[:, part].flatten(0, 1), values[:, part].flatten(0, 1),
                                          query_pos[part], key_pos[:, part].flatten(), softmax_scale, dropout_p))
    return torch.cat(contexts)


class ContextParallelAttention(MegatronModule):
    """Drop-in ``core_attention`` for megatron's local spec that supports CP (zig-zag split) and
    packed sequences (``packed_seq_params`` in megatron's "thd" format).

    Causal self-attention only; ``cp_comm_type`` is ignored (K/V are always all-gathered, TE's
    "all_gather" mode); attention masks and biases are refused, not ignored.
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
        """q [s, b, np, hn], k/v [s, b, ng, hn] -> [s, b, np*hn]; packed ("thd"): q [t, np, hn],
        k/v [t, ng, hn] -> [t, np*hn], as megatron's SelfAttention passes and expects them."""
        if attention_mask is not None or attention_bias is not None:
            raise NotImplementedError(
                "ContextParallelAttention takes no attention_mask or attention_bias (the causal mask is "
                "built from global positions; packed sequences come as packed_seq_params)"
            )
        cu_seqlens = None
        if packed_seq_params is not None:
            cu_seqlens = packed_boundaries(packed_seq_params)
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))  # thd: batch dim 1
        dropout_p = self.attention_dropout.p if self.training else 0.0
        with self.dropout_rng():
            context = context_parallel_attention(query, key, value, self.softmax_scale, self.cp_group,
                                                 dropout_p=dropout_p, cu_seqlens=cu_seqlens)
        return context if cu_seqlens is None else context.squeeze(1)

    def dropout_rng(self):
        """Where attention dropout draws its randoms: megatron's model-parallel RNG (a fork of the
        tracker) when dropout is on and sequence parallelism off, as DotProductAttention does;
        otherwise the default generator."""
        from megatron.core import tensor_parallel

        if self.training and self.attention_dropout.p > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()


def packed_boundaries(packed_seq_params) -> torch.Tensor:
    """The packed row's sequence boundaries, padding included (``cu_seqlens_q_padded`` when set,
    as megatron's thd RoPE uses it), after checking the params describe packed self-attention."""
    if packed_seq_params.qkv_format != "thd":
        raise NotImplementedError(
            f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: only 'thd' is supported "
            f"(megatron restarts RoPE positions per sequence only for thd); build the params with "
            f"parallel.modules.packing.pack_sequences"
        )
    params = packed_seq_params
    cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    if cu_q is None or cu_kv is None or not torch.equal(cu_q, cu_kv):
        raise ValueError(
            f"packed_seq_params: self-attention needs equal query and key cu_seqlens (got {cu_q} and {cu_kv})"
        )
    return cu_q


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


class _GatherContextParallel(torch.autograd.Function):
    """All-gather per-token values over the CP group into global token order. Backward keeps this
    rank's own positions: the caller computes the same loss on every CP rank from the gathered
    values, and megatron's schedule and DDP already account for the CP replicas."""

    @staticmethod
    def forward(ctx, local, positions):
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
        cp = parallel_state.get_context_parallel_world_size()
        values = [torch.empty_like(local) for _ in range(cp)]
        where = [torch.empty_like(positions) for _ in range(cp)]
        dist.all_gather(values, local.contiguous(), group=group)
        dist.all_gather(where, positions.contiguous(), group=group)
        values, where = torch.cat(values, dim=1), torch.cat(where, dim=1)
        index = where.reshape(*where.shape, *([1] * (values.dim() - 2))).expand_as(values)
        ctx.save_for_backward(positions)
        ctx.trailing = values.dim() - 2
        return torch.empty_like(values).scatter_(1, index, values)

    @staticmethod
    def backward(ctx, grad):
        (positions,) = ctx.saved_tensors
        index = positions.reshape(*positions.shape, *([1] * ctx.trailing)).expand(
            *positions.shape, *grad.shape[2:])
        return grad.gather(1, index), None



def undo_context_parallel_split(local: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[b, s/cp, ...] per-rank values -> [b, s, ...] in global token order (identity at CP=1).
    ``positions`` [b, s/cp] are the global positions of the local tokens. Differentiable."""
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() == 1:
        return local
    return _GatherContextParallel.apply(local, positions)
