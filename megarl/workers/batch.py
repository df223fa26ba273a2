"""How a rollout batch travels to the Megatron workers and is cut into micro-batches.

A batch is a dict of tensors over ``B`` samples:

- ``input_ids`` ``[B, T]``: prompt then response, right-padded (padding never influences the
  real tokens: attention is causal);
- ``prompt_lengths`` / ``response_lengths`` ``[B]``;
- optionally ``input_lengths`` ``[B]``: how many of each sample's tokens the model reads (all by
  default; ``without_last_tokens``), the rest of the sequence only serving as targets;
- response-shaped ``[B, R]`` fields (``R`` = the longest response), aligned with response
  token ``j`` of each sample: ``advantages``, ``old_logp``, ``ref_logp``, ``rollout_logp``,
  ``returns``, ``old_values`` (each optional, as the step needs);
- optionally ``loss_mask`` ``[B, R]``: 1 on the response tokens the model is trained on, 0 on
  tokens it reads but did not produce (a multi-turn trajectory's tool outputs and user turns,
  an SFT conversation's non-assistant tokens). Every loss, advantage, KL and metric sees it
  through ``response_mask``; log-probs and values there are returned as 0.

Every micro-batch carries ``padding_mask`` (True on positions that hold no token of a sample):
an MoE model's load-balancing loss leaves them out, as every other term does by construction.

Optionally ``routed_experts`` ``[B, T, layers, top-k]``: the experts the rollout engine routed
token ``t`` of each sample to in every layer (rollout routing replay); its micro-batches then
carry them as ``routes`` ``[rows, length, layers, top-k]`` at each token's position, padding
routed to experts ``0 .. top-k - 1`` (whose outputs are never read).

Every rank of a data-parallel replica gets the same rows; which rows a replica gets and how they
form micro-batches is a pure function of the batch and the layout, so every rank computes it
itself and no rank waits for another to tell it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

RESPONSE_FIELDS = ("advantages", "old_logp", "ref_logp", "rollout_logp", "returns", "old_values")


@dataclass(frozen=True)
class MicroBatching:
    """How rows become micro-batches: ``micro_batch_size`` rows each, or a token budget."""

    micro_batch_size: int = 1
    max_tokens: int | None = None
    packed: bool = False  # a micro-batch is one packed row (thd) instead of padded rows
    shared_prompts: bool = False  # one row per prompt: the prompt once, then each sample's response


def sequence_lengths(batch: dict) -> torch.Tensor:
    return batch["prompt_lengths"] + batch["response_lengths"]


def without_last_tokens(batch: dict) -> dict:
    """``batch`` whose samples the model reads without their last token (at least one token):
    a response token's log-prob or value comes from the position before it, so the last token's
    own output is never used (only a reward model's, which scores the sequence there). Saves
    one token per sample: 10% of a 128 x (5 + 8)-token update."""
    return dict(batch, input_lengths=(sequence_lengths(batch) - 1).clamp(min=1))


def input_lengths(batch: dict) -> torch.Tensor:
    """``[B]`` tokens of each sample the model reads: the whole sequence unless the batch says
    otherwise (``without_last_tokens``)."""
    return batch["input_lengths"] if "input_lengths" in batch else sequence_lengths(batch)


def _segment_index(segments: list[tuple[int, int, int, int]]) -> tuple[torch.Tensor, ...]:
    """Per token of ``segments`` ``(position, row, column, count)`` (the ``count`` tokens of sample
    ``row`` from ``column`` on, placed from flat ``position`` on): its flat position, its row, its
    column and its segment's index, as four 1-D tensors."""
    positions, rows, columns, counts = (torch.tensor(values, dtype=torch.long).reshape(-1)
                                        for values in (zip(*segments) if segments else ((), (), (), ())))
    which = torch.repeat_interleave(torch.arange(len(counts)), counts)
    offset = torch.arange(len(which)) - (torch.cumsum(counts, 0) - counts)[which]
    return positions[which] + offset, rows[which], columns[which] + offset, which


def _placed(batch: dict, num_rows: int, length: int, index: tuple[torch.Tensor, ...]) -> dict:
    """``tokens``, ``targets`` and ``padding_mask`` (and ``routes``) ``[num_rows, length]`` of a
    micro-batch holding the tokens of ``index`` (``_segment_index``) at their flat positions; a
    position's target is the token that follows it in its sample (none past ``input_ids``' end).
    One gather per field instead of a copy per sample: 128 samples took 26 ms per update in a
    Python loop (a fifth of a 300k-parameter model's update)."""
    position, row, column, _ = index
    ids = batch["input_ids"]
    tokens = torch.zeros(num_rows * length, dtype=torch.long)
    tokens[position] = ids[row, column].long()
    targets = torch.zeros_like(tokens)
    followed = column + 1 < ids.shape[1]
    targets[position[followed]] = ids[row[followed], column[followed] + 1].long()
    padding = torch.ones(num_rows * length, dtype=torch.bool)
    padding[position] = False
    placed = {"tokens": tokens.view(num_rows, length), "targets": targets.view(num_rows, length),
              "padding_mask": padding.view(num_rows, length)}
    routes = _padding_routes(batch, num_rows, length)
    if routes is not None:
        routes.view(num_rows * length, *routes.shape[2:])[position] = batch["routed_experts"][row, column]
        placed["routes"] = routes
    return placed


def unrouted(rows: int, length: int, layers: int, topk: int, dtype=torch.int16) -> torch.Tensor:
    """Routes ``[rows, length, layers, top-k]`` of positions no engine routed (padding, a sample's
    last token): experts ``0 .. top-k - 1``, distinct as a router's top-k are; no output read."""
    return torch.arange(topk, dtype=dtype).expand(rows, length, layers, topk).clone()


def routed_experts(per_sample: list[torch.Tensor], width: int) -> torch.Tensor:
    """A batch's ``routed_experts`` ``[samples, width, layers, top-k]`` (int16) from each sample's
    engine routes ``[positions, layers, top-k]`` (its prompt and response but the last token)."""
    layers, topk = per_sample[0].shape[1:]
    routes = unrouted(len(per_sample), width, layers, topk)
    for i, sample in enumerate(per_sample):
        routes[i, : min(len(sample), width)] = sample[:width].to(routes.dtype)
    return routes


def _padding_routes(batch: dict, num_rows: int, length: int) -> torch.Tensor | None:
    """A micro-batch's ``routes`` before its samples are placed; None when ``batch`` has none."""
    if "routed_experts" not in batch:
        return None
    return unrouted(num_rows, length, *batch["routed_experts"].shape[2:], dtype=batch["routed_experts"].dtype)


def response_mask(batch: dict) -> torch.Tensor:
    """``[B, R]`` float mask of the response tokens trained on: real ones, times ``loss_mask``."""
    width = int(batch["response_lengths"].max()) if len(batch["response_lengths"]) else 0
    mask = (torch.arange(width).unsqueeze(0) < batch["response_lengths"].unsqueeze(1)).float()
    return mask * batch["loss_mask"][:, :width].float() if "loss_mask" in batch else mask


def data_parallel_rows(batch: dict, dp_size: int, batching: MicroBatching) -> list[list[list[int]]]:
    """``plan[dp_rank][micro_batch] -> row indices``: contiguous shares cut into micro-batches of
    ``micro_batch_size``, or token-budget micro-batches balanced over the replicas."""
    from megarl.data.micro_batching import balanced_micro_batches

    rows = int(batch["input_ids"].shape[0])
    if rows < dp_size:
        raise ValueError(f"a batch of {rows} samples cannot feed {dp_size} data-parallel replicas; "
                         "raise data.batch_size * rollout.n (or the mini-batch size) to at least that")
    if batching.max_tokens is not None:
        return balanced_micro_batches(input_lengths(batch).tolist(), batching.max_tokens, dp_size)
    shares = [share.tolist() for share in torch.arange(rows).tensor_split(dp_size)]
    size = batching.micro_batch_size
    plan = [[share[i:i + size] for i in range(0, len(share), size)] for share in shares]
    # Every replica runs the same number of micro-batches (an empty one is all padding).
    most = max(len(p) for p in plan)
    return [p + [[] for _ in range(most - len(p))] for p in plan]


def make_micro_batch(batch: dict, rows: list[int], length: int, num_rows: int) -> dict:
    """Rows ``rows`` of ``batch`` as one micro-batch of ``num_rows`` rows and ``length`` tokens
    (filler rows and positions are padding with no response), plus the index that picks each
    response token's predicting position out of per-token outputs."""
    lengths = input_lengths(batch)[list(rows)].tolist()
    index = _segment_index([(slot * length, row, 0, total) for slot, (row, total) in enumerate(zip(rows, lengths))])
    return {**_placed(batch, num_rows, length, index), **_response_rows(batch, rows, num_rows, [0] * len(rows)),
            "rows": torch.tensor(list(rows) + [-1] * (num_rows - len(rows)))}


def _response_rows(batch: dict, rows: list[int], num_rows: int, starts: list[int]) -> dict:
    """The response-shaped fields of a micro-batch of ``num_rows`` rows: ``gather_index`` (where
    row ``rows[i]``'s sequence starts at token position ``starts[i]``), ``response_mask`` and the
    batch's RESPONSE_FIELDS; filler rows are zeros."""
    width = response_mask(batch).shape[1]
    picked = torch.tensor(list(rows), dtype=torch.long)
    prompt, response = batch["prompt_lengths"][picked].long(), batch["response_lengths"][picked].long()
    real = torch.arange(width) < response.unsqueeze(1)  # [rows, width]
    # Response token j sits at position prompt + j; the logits that predict it at prompt + j - 1.
    first = torch.tensor(list(starts), dtype=torch.long) + prompt - 1
    gather = torch.zeros(num_rows, width, dtype=torch.long)
    gather[: len(rows)] = torch.where(real, first.unsqueeze(1) + torch.arange(width), 0)
    mask = torch.zeros(num_rows, width)
    mask[: len(rows)] = real.float() * (batch["loss_mask"][picked, :width].float() if "loss_mask" in batch else 1.0)
    fields = {k: torch.zeros(num_rows, width) for k in RESPONSE_FIELDS if k in batch}
    for key, value in fields.items():
        value[: len(rows)] = batch[key][picked, :width].float()
    return {"gather_index": gather, "response_mask": mask, **fields}


def on_device(micro_batch: dict, device: torch.device) -> dict:
    """``micro_batch`` with every tensor (a packed row's too) on ``device``, the model's.
    Micro-batches are cut on the host (a pure function of the batch); the model may live on a GPU."""
    from parallel.modules.packing import PackedBatch

    return {key: value.to(device) if isinstance(value, (torch.Tensor, PackedBatch)) else value
            for key, value in micro_batch.items()}


def padded_length(length: int, multiple: int) -> int:
    return max(multiple, math.ceil(length / multiple) * multiple)


def packed_row_length(batch: dict, rows: list[int], slot_multiple: int) -> int:
    """Tokens of ``rows`` packed into one row, each sequence's slot rounded up to ``slot_multiple``."""
    return sum(padded_length(int(input_lengths(batch)[r]), slot_multiple) for r in rows)


def make_packed_micro_batch(batch: dict, rows: list[int], length: int, slot_multiple: int) -> dict:
    """Rows ``rows`` of ``batch`` packed into ONE row of ``length`` tokens (``parallel.modules.packing``:
    slots rounded up to ``slot_multiple``, a padding sequence filling the rest), with the same
    fields as ``make_micro_batch``: ``gather_index`` holds row positions, ``packed`` the row."""
    from parallel.modules.packing import pack_sequences

    sequences = [batch["input_ids"][r, : int(input_lengths(batch)[r])] for r in rows]
    filler = length - packed_row_length(batch, rows, slot_multiple)
    if filler < 0 or filler % slot_multiple:
        raise ValueError(f"a packed row of {length} tokens cannot hold rows {rows} in slots of {slot_multiple}")
    if filler:
        sequences.append(torch.zeros(filler, dtype=torch.long))  # no response: never gathered
    packed = pack_sequences(sequences, pad_to_multiple=slot_multiple)
    starts = packed.cu_seqlens_padded.tolist()[: len(rows)]
    index = _segment_index([(start, row, 0, len(sequence)) for row, start, sequence in zip(rows, starts, sequences)])
    return {**_placed(batch, 1, packed.tokens.shape[1], index),
            **_response_rows(batch, rows, max(len(rows), 1), starts),
            "rows": torch.tensor(list(rows) or [-1]), "packed": packed}


def prompt_groups(batch: dict, rows: list[int]) -> list[list[int]]:
    """``rows`` grouped by identical prompt tokens, groups and rows in order of appearance. A
    prompt that occurs more often than the most common group size (the same question drawn twice
    in a step) is cut into groups of that size, so that one long row does not set the padded
    length of all the others."""
    from collections import Counter

    groups: dict[tuple, list[int]] = {}
    for row in rows:
        prompt = batch["input_ids"][row, : int(batch["prompt_lengths"][row])]
        groups.setdefault(tuple(prompt.tolist()), []).append(row)
    sizes = Counter(len(group) for group in groups.values())
    size = max(sizes, key=lambda s: (sizes[s], -s)) if sizes else 1
    return [group[i:i + size] for group in groups.values() for i in range(0, len(group), size)]


def shared_prompt_row_length(batch: dict, group: list[int]) -> int:
    """Tokens of one shared-prompt row: the prompt but its last token once, then per sample that
    last token and the rest of its input (so every response token's predicting position is its own)."""
    prompt = int(batch["prompt_lengths"][group[0]])
    return prompt - 1 + sum(int(input_lengths(batch)[row]) - (prompt - 1) for row in group)


def make_shared_prompt_micro_batch(batch: dict, groups: list[list[int]], length: int, num_groups: int) -> dict:
    """The rows of ``groups`` (``prompt_groups`` of a micro-batch's rows) as ``num_groups``
    shared-prefix rows of ``length`` tokens (``parallel.modules.shared_prefix``): one per group, each
    sample a branch made of the prompt's last token and its response, at the positions it has in
    its own sequence. Same fields as ``make_micro_batch`` (samples in group order) plus
    ``position_ids`` and ``segments`` (PREFIX, branch ids, PADDING: what the attention needs);
    ``gather_index`` holds positions in the flattened ``[num_groups * length]`` outputs."""
    from parallel.modules.shared_prefix import PADDING, PREFIX

    rows = [row for group in groups for row in group]
    if len(groups) > num_groups:
        raise ValueError(f"rows {rows} hold {len(groups)} prompts, more than the {num_groups} rows asked for")
    prompts, lengths = batch["prompt_lengths"].tolist(), input_lengths(batch).tolist()
    segments, labels = [], []  # (position, row, column, count) and the segment id of each
    starts = {}  # sample row -> where its sequence would start in the flattened outputs
    for g, group in enumerate(groups):
        needed = shared_prompt_row_length(batch, group)
        if needed > length:
            raise ValueError(f"prompt group {group} needs {needed} tokens, more than the row's {length}")
        prefix = prompts[group[0]] - 1  # the prompt but its last token, once
        segments.append((g * length, group[0], 0, prefix))
        labels.append(PREFIX)
        cursor = prefix
        for branch, row in enumerate(group, start=PREFIX + 1):
            segments.append((g * length + cursor, row, prefix, lengths[row] - prefix))
            labels.append(branch)
            starts[row] = g * length + cursor - prefix
            cursor += lengths[row] - prefix
    index = _segment_index(segments)
    position, _, column, which = index
    positions = torch.zeros(num_groups * length, dtype=torch.long)
    positions[position] = column  # each token at the position it has in its own sequence
    segment_ids = torch.full((num_groups * length,), PADDING, dtype=torch.long)
    segment_ids[position] = torch.tensor(labels, dtype=torch.long)[which]
    placed = _placed(batch, num_groups, length, index)
    return {**placed, "position_ids": positions.view(num_groups, length),
            "segments": segment_ids.view(num_groups, length),
            **_response_rows(batch, rows, max(len(rows), 1), [starts[r] for r in rows]),
            "rows": torch.tensor(list(rows) or [-1])}
