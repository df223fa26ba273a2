"""Rows that hold a prefix once and several continuations of it, for Megatron's local layer spec.

GRPO-style training scores ``n`` samples of every prompt: ``n`` sequences that start with the
same prompt tokens. Laid out as ``n`` rows, the prompt's hidden states are computed ``n`` times.
A shared-prefix row holds the prefix once, then each continuation as a *branch*:

    [prefix][branch 1][branch 2]...[branch n][padding]

and every token sees exactly what it would see in its own row: a branch token attends to the
prefix and to its own branch up to itself (a tree mask, :func:`tree_attention_mask`), at the
position it would have there (RoPE at per-token positions, :func:`rotary_positions`). Outputs
are then those of the separate rows (within float rounding), and so are the gradients: the
prefix's activations receive the sum of what the ``n`` copies would have received.

Megatron's GPTModel takes ``position_ids`` but computes RoPE for positions ``0..s-1`` of every
row; :func:`rotary_positions` makes one forward use the given per-token positions instead.
The tree mask goes in as ``attention_mask`` (megatron's local ``DotProductAttention`` applies a
given mask as is), so this works at any TP/PP/VPP and with sequence parallelism, not with
context parallelism or packed (thd) rows, whose attention builds its own causal mask.
"""

from __future__ import annotations

import contextlib

import torch

PADDING = -1  # segment id of padding tokens
PREFIX = 0  # segment id of the shared prefix; branches are 1, 2, ...


def tree_attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """``[rows, 1, s, s]`` bool, True where query i must NOT see key j, for rows whose tokens
    carry ``segments`` [rows, s] (PREFIX, branch ids, PADDING): key j is visible when it comes
    first (j <= i) and is in the prefix or in query i's own segment. Padding sees padding and the
    prefix (never a branch), so no query's row is empty and no real token sees padding."""
    s = segments.shape[1]
    index = torch.arange(s)
    earlier = index[None, :] <= index[:, None]  # [q, k]
    keys, queries = segments[:, None, :], segments[:, :, None]
    visible = earlier & ((keys == PREFIX) | (keys == queries))
    return ~visible[:, None]


@contextlib.contextmanager
def rotary_positions(model, position_ids: torch.Tensor):
    """During this block, ``model``'s (a GPTModel chunk, wrapped or not) rotary embedding is taken
    at ``position_ids`` [b, s] per token instead of at 0..s-1 for every row: ``[s, b, 1, dim]``
    frequencies, which megatron's bshd RoPE broadcasts over heads. No CP or packed rows."""
    from parallel.layout import unwrap_model

    rope = getattr(unwrap_model(model), "rotary_pos_emb", None)
    if rope is None:
        raise ValueError("rotary_positions: the model has no rotary embedding (position_embedding_type='rope')")

    def per_token(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        if packed_seq or (cp_group is not None and cp_group.size() > 1):
            raise NotImplementedError("per-token RoPE positions: no packed (thd) rows or context parallelism")
        table = rope.get_emb(int(position_ids.max()) + 1)  # [positions, 1, 1, dim]
        return table[:, 0][position_ids.t()]  # [s, b, 1, dim]

    rope.forward = per_token
    try:
        yield
    finally:
        del rope.forward
