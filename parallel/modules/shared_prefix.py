"""Rows that hold a prefix once and several continuations of it, for Megatron's local layer spec.

GRPO-style training scores ``n`` samples of every prompt: ``n`` sequences that start with the
same prompt tokens. Laid out as ``n`` rows, the prompt's hidden states are computed ``n`` times.
A shared-prefix row holds the prefix once, then each continuation as a *branch*:

    [prefix][branch 1][branch 2]...[branch n][padding]

and every token sees exactly what it would see in its own row: a branch token attends to the
prefix and to its own branch up to itself (:func:`branch_attention`), at the position it would
have there (RoPE at per-token positions, :func:`rotary_positions`). Outputs are then those of
the separate rows (within float rounding), and so are the gradients: the prefix's activations
receive the sum of what the ``n`` copies would have received.

Attention is computed per branch, over [prefix keys ; own branch keys]: n * L * (P + L) scores
per row, fewer than the n * (P + L)^2 of n separate rows (a dense tree mask over the row would
cost (P + n * L)^2, more than the separate rows once responses are long). On CUDA the scores are
never stored: the SDPA call may run only torch's memory-efficient kernel (flash attention takes
no mask), so a call it refused would raise rather than fall back to the math kernel's fp32
[n, heads, L, P + L] score matrix. That kernel has no GQA (torch 2.13), so the K/V heads are
expanded to the query's first (on every device: one code path). What a layer keeps for its
backward: the gathered queries, the expanded keys and values (heads/tp per key, n * (P + L) keys
per row), SDPA's output, and the mask as an additive bias in the activation dtype (n * L * (P + L)
per row), counted by ``parallel.memory``.

Megatron's GPTModel takes ``position_ids`` but computes RoPE for positions ``0..s-1`` of every
row; :func:`rotary_positions` makes one forward use the given per-token positions instead. The
rows' segment ids go in as ``attention_mask``, which megatron hands to the core attention as is;
``transformer_layer_spec(..., shared_prompts=True)`` puts :class:`SharedPrefixAttention` there. Works at any
TP/PP/VPP and with sequence parallelism (the core attention sees whole rows), not with context
parallelism or packed (thd) rows.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from parallel.modules.context_parallel import ContextParallelAttention, memory_efficient_kernel, repeat_kv_heads
from parallel.modules.memo import reuse_while_unchanged

PADDING = -1  # segment id of padding tokens
PREFIX = 0  # segment id of the shared prefix; branches are 1, 2, ...


@dataclasses.dataclass
class BranchIndex:
    """Where the prefix and the branches of shared-prefix rows are, as positions in megatron's
    sequence-major tokens (``[s, rows]`` flattened: token t of row r at ``t * rows + r``):
    ``prefix`` [rows, P] (each row's prefix, padded to the longest P), ``branches`` [n, L] (every
    branch of every row, padded to the longest L), ``branch_row`` [n] (the row of each branch);
    the ``*_valid`` masks tell real slots from padding. What each query may attend to:
    ``prefix_allowed`` [rows, P, P] over its row's prefix, ``branch_keys`` [n, P + L] (its row's
    prefix, then its own branch) and ``branch_allowed`` [n, L, P + L]. ``context_source`` [s * rows]:
    where each token's context is in [prefix outputs (rows * P); branch outputs (n * L); a zero
    row], padding tokens taking the zero row."""

    prefix: torch.Tensor
    prefix_valid: torch.Tensor
    branches: torch.Tensor
    branch_valid: torch.Tensor
    branch_row: torch.Tensor
    prefix_allowed: torch.Tensor
    branch_keys: torch.Tensor
    branch_allowed: torch.Tensor
    context_source: torch.Tensor

    @classmethod
    def from_segments(cls, segments: torch.Tensor) -> "BranchIndex":
        """From ``segments`` [rows, s]: each row's PREFIX tokens first, then its branches (ids
        1, 2, ... in contiguous runs), then PADDING."""
        rows, s = segments.shape
        device = segments.device
        flat = torch.arange(s, device=device)[None, :] * rows + torch.arange(rows, device=device)[:, None]
        prefix_len = (segments == PREFIX).sum(1)
        span = torch.arange(max(int(prefix_len.max()), 1), device=device)
        prefix, prefix_valid = flat[:, span.clamp(max=s - 1)], span[None] < prefix_len[:, None]
        in_branch = segments > PREFIX
        row_of = torch.arange(rows, device=device)[:, None].expand(rows, s)[in_branch]
        branch_key = row_of * (int(segments.max()) + 1) + segments[in_branch]  # (row, branch), in token order
        _, branch_of, counts = torch.unique_consecutive(branch_key, return_inverse=True, return_counts=True)
        starts = counts.cumsum(0) - counts
        within = torch.arange(len(branch_key), device=device) - starts[branch_of]
        branches = torch.zeros(len(counts), int(counts.max()) if len(counts) else 1, dtype=torch.long,
                               device=device)
        branch_valid = torch.zeros(branches.shape, dtype=torch.bool, device=device)
        branches[branch_of, within] = flat[in_branch]
        branch_valid[branch_of, within] = True
        branch_row = row_of[starts]

        def causal(valid):  # [n, L] -> [n, L, L]: key j <= query i and real (key 0 always: no empty row)
            earlier = torch.ones(valid.shape[1], valid.shape[1], dtype=torch.bool, device=valid.device).tril()
            keep = valid.clone()
            keep[:, 0] = True
            return earlier[None] & keep[:, None, :]

        branch_allowed = torch.cat([prefix_valid[branch_row][:, None, :].expand(-1, branches.shape[1], -1),
                                    causal(branch_valid)], dim=2)
        slots = torch.cat([prefix.reshape(-1), branches.reshape(-1)])  # the attention outputs' tokens, in order
        valid = torch.cat([prefix_valid.reshape(-1), branch_valid.reshape(-1)])
        context_source = torch.full((rows * s,), len(slots), dtype=torch.long, device=device)  # the zero row
        context_source[slots[valid]] = torch.arange(len(slots), device=device)[valid]
        return cls(prefix, prefix_valid, branches, branch_valid, branch_row, causal(prefix_valid),
                   torch.cat([prefix[branch_row], branches], 1), branch_allowed, context_source)


# Every layer of a forward gets the same segments tensor (megatron passes ``attention_mask``
# through); building the index reads sizes back from the device (a sync on GPUs) several times.
branch_index = reuse_while_unchanged(BranchIndex.from_segments)


def branch_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: torch.Tensor,
                     softmax_scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal self-attention of shared-prefix rows: ``query`` [s, rows, np, hn], ``key``/``value``
    [s, rows, ng, hn], ``segments`` [rows, s] -> context [s, rows, np * hn].

    A prefix token attends to the prefix up to itself; a branch token to the whole prefix and to
    its own branch up to itself; padding tokens get a zero context. Computed per branch (one SDPA
    over [prefix keys ; branch keys] for all branches at once), so the scores cost
    n * L * (P + L) per row instead of the (P + n * L)^2 of the row's dense mask."""
    from torch.nn.functional import scaled_dot_product_attention

    s, rows, heads, dim = query.shape
    index = branch_index(segments)
    # [s * rows, heads, dim] tokens: views of megatron's [s, rows, ...] tensors, not copies
    q, k, v = (t.reshape(s * rows, t.shape[2], dim) for t in (query, key, value))

    def attend(queries, keys, allowed):  # [n, Lq], [n, Lk] token positions; allowed [n, Lq, Lk]
        # index_select, not t[at]: its backward is an index_add, where advanced indexing's is a
        # sorting index_put; the heads are repeated after the gather, on the fewer bytes
        gather = lambda t, at: t.index_select(0, at.reshape(-1)).view(*at.shape, *t.shape[1:])  # noqa: E731
        keys_, values_ = repeat_kv_heads(gather(k, keys), gather(v, keys), heads)  # [n, Lk, np, hn]
        queries_ = gather(q, queries)
        with memory_efficient_kernel(queries_):
            return scaled_dot_product_attention(queries_.transpose(1, 2), keys_.transpose(1, 2),
                                                values_.transpose(1, 2), attn_mask=allowed[:, None],
                                                dropout_p=dropout_p, scale=softmax_scale).transpose(1, 2)

    outputs = torch.cat([attend(index.prefix, index.prefix, index.prefix_allowed).reshape(-1, heads, dim),
                         attend(index.branches, index.branch_keys, index.branch_allowed).reshape(-1, heads, dim),
                         q.new_zeros(1, heads, dim)])
    return outputs.index_select(0, index.context_source).view(s, rows, heads * dim)


class SharedPrefixAttention(ContextParallelAttention):
    """Drop-in ``core_attention`` for megatron's local spec (``transformer_layer_spec(..., shared_prompts=True)``):
    given the rows' ``segments`` [rows, s] as ``attention_mask``, :func:`branch_attention`; without
    one, plain causal attention (ContextParallelAttention's, at CP 1)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_mask is None:
            return super().forward(query, key, value, None, attn_mask_type, attention_bias, packed_seq_params)
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("shared-prefix rows take no attention_bias or packed_seq_params")
        if attention_mask.dtype == torch.bool or attention_mask.shape != (query.shape[1], query.shape[0]):
            raise ValueError(f"SharedPrefixAttention takes the rows' segment ids [rows, s] as attention_mask, "
                             f"got {attention_mask.dtype} {tuple(attention_mask.shape)}")
        dropout_p = self.attention_dropout.p if self.training else 0.0
        with self.dropout_rng():
            return branch_attention(query, key, value, attention_mask, self.softmax_scale, dropout_p)


@contextlib.contextmanager
def rotary_positions(model, position_ids: torch.Tensor):
    """During this block, ``model``'s (a GPTModel, unwrapped: ``parallel.models.unwrap_model``)
    rotary embedding is taken at ``position_ids`` [b, s] per token instead of at 0..s-1 for every
    row: ``[s, b, 1, dim]`` frequencies, which megatron's bshd RoPE broadcasts over heads. No CP or
    packed rows."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:
        raise ValueError("rotary_positions: the model has no rotary embedding (position_embedding_type='rope')")

    def per_token(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        if packed_seq or (cp_group is not None and cp_group.size() > 1):
            raise NotImplementedError("per-token RoPE positions: no packed (thd) rows or context parallelism")
        table = rope.get_emb(int(position_ids.max()) + 1)  # [positions, 1, 1, dim]
        if isinstance(table, tuple):  # YaRN: (table, attention factor), as YarnRotaryEmbedding returns it
            table, mscale = table
            return table[:, 0][position_ids.t()], mscale
        return table[:, 0][position_ids.t()]  # [s, b, 1, dim]

    rope.forward = per_token
    try:
        yield
    finally:
        del rope.forward
