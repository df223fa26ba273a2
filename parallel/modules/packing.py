"""Sequence packing: several variable-length sequences in one row instead of a padded batch.

The RL trainer scores many prompt+response sequences of different lengths; padding each to the
longest wastes compute. A packed row concatenates them, and megatron's ``PackedSeqParams`` ("thd"
format) makes attention stay within each sequence and RoPE positions restart per sequence, so each
sequence gets exactly the logits it gets alone. The model must be built with
``build_model_chunks(..., packed_sequences=True)``: megatron's local attention refuses packed
sequences, the project's (parallel.modules.context_parallel) handles them, at any TP/PP/SP/CP.

Layout of a row: sequence i occupies a slot of its length rounded up to ``pad_to_multiple``, its
real tokens first, then ``pad_id`` padding. ``cu_seqlens`` holds the cumulative real lengths and
``cu_seqlens_padded`` the slot boundaries (megatron's/TE's convention). Padding belongs to its
sequence's slot and comes after its real tokens, so causally no real token sees it. Use
``pad_to_multiple=layout.sequence_length_multiple()``: CP splits every sequence into 2*CP chunks
(as TE's thd split and megatron's thd RoPE do), and sequence parallelism splits the row over TP.
A micro-batch is one packed row (the thd format has batch size 1).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One packed row (see the module docstring for the layout)."""

    tokens: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long: 0, 1, ... restarting at each sequence's slot
    cu_seqlens: torch.Tensor  # int32 [n+1]: cumulative real lengths
    cu_seqlens_padded: torch.Tensor  # int32 [n+1]: slot boundaries in the row; [-1] == T
    lengths: list[int]  # real length of each sequence

    def packed_seq_params(self):
        """megatron's PackedSeqParams for this row: thd format, padded boundaries (used by the
        attention and RoPE), max_seqlen the longest slot (the RoPE table's length)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        max_slot = int((self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).max())
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded, cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=max_slot, max_seqlen_kv=max_slot,
        )

    def to(self, device: torch.device) -> "PackedBatch":
        """This row with its tensors on ``device`` (the model's: TE's thd attention wants its
        ``cu_seqlens`` there too)."""
        return dataclasses.replace(self, tokens=self.tokens.to(device), position_ids=self.position_ids.to(device),
                                   cu_seqlens=self.cu_seqlens.to(device),
                                   cu_seqlens_padded=self.cu_seqlens_padded.to(device))

    def local_positions(self, cp_size: int | None = None, cp_rank: int | None = None) -> torch.Tensor:
        """Row positions of the tokens a CP rank holds (default: this rank; all at CP=1). Index
        any per-token [1, T] tensor (labels, masks) with it to get that rank's share."""
        from parallel.modules.context_parallel import packed_token_positions

        if cp_size is None or cp_rank is None:
            from megatron.core import parallel_state

            cp_size = parallel_state.get_context_parallel_world_size()
            cp_rank = parallel_state.get_context_parallel_rank()
        return packed_token_positions(self.cu_seqlens_padded, cp_size, cp_rank)

    def model_inputs(self) -> dict:
        """Keyword arguments of GPTModel.forward for this rank's share of the row."""
        positions = self.local_positions()
        return dict(input_ids=self.tokens[:, positions], position_ids=self.position_ids[:, positions],
                    attention_mask=None, packed_seq_params=self.packed_seq_params())

    def next_token_targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels, mask), both [1, T]: the token each position predicts within its own sequence,
        and True where that is a real token (not at a sequence's last token or in padding)."""
        labels = torch.zeros_like(self.tokens)
        mask = torch.zeros_like(self.tokens, dtype=torch.bool)
        for start, length in zip(self.cu_seqlens_padded[:-1].tolist(), self.lengths):
            labels[0, start: start + length - 1] = self.tokens[0, start + 1: start + length]
            mask[0, start: start + length - 1] = True
        return labels, mask


def pack_sequences(sequences: Sequence[Sequence[int] | torch.Tensor], pad_to_multiple: int = 1,
                   pad_id: int = 0) -> PackedBatch:
    """Pack token sequences (lists or 1-D tensors) into one row, each in a slot padded at its end
    to a multiple of ``pad_to_multiple`` with ``pad_id``."""
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple={pad_to_multiple} must be >= 1 (1: no padding)")
    if not sequences:
        raise ValueError("pack_sequences got no sequences; pass at least one")
    tokens, positions, lengths, slots = [], [], [], []
    for index, sequence in enumerate(sequences):
        sequence = torch.as_tensor(sequence)
        if sequence.dim() != 1 or sequence.numel() == 0 or sequence.is_floating_point():
            raise ValueError(
                f"sequence {index} has shape {list(sequence.shape)} and dtype {sequence.dtype}: each sequence "
                f"must be a non-empty 1-D list or tensor of token ids"
            )
        length = sequence.numel()
        slot = -(-length // pad_to_multiple) * pad_to_multiple
        tokens += [sequence.long(), torch.full((slot - length,), pad_id, dtype=torch.long)]
        positions.append(torch.arange(slot))
        lengths.append(length)
        slots.append(slot)

    def cumulative(values):
        return torch.tensor([0, *values], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    return PackedBatch(tokens=torch.cat(tokens).unsqueeze(0), position_ids=torch.cat(positions).unsqueeze(0),
                       cu_seqlens=cumulative(lengths), cu_seqlens_padded=cumulative(slots), lengths=lengths)


def unpack(per_token: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    """Each sequence's values (its real tokens only) from per-token values of the whole row,
    [1, T, ...] or [T, ...] (e.g. logits or log-probs)."""
    total = int(batch.cu_seqlens_padded[-1])
    if per_token.dim() >= 2 and per_token.shape[0] == 1 and per_token.shape[1] == total:
        per_token = per_token[0]
    elif per_token.shape[0] != total:
        raise ValueError(
            f"unpack: per-token values of shape {list(per_token.shape)} do not cover the packed row of "
            f"{total} tokens; pass [1, {total}, ...] or [{total}, ...] (CP ranks: gather the row first)"
        )
    return [per_token[start: start + length]
            for start, length in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.lengths)]
