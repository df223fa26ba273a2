"""Token-budget micro-batches, balanced across data-parallel ranks.

RL batches have sequences of very different lengths. Cutting them into fixed-size micro-batches
wastes compute on padding and leaves some data-parallel ranks with far more tokens than
others (everyone waits for the slowest). ``balanced_micro_batches`` instead:

1. splits the samples over ``dp_size`` ranks so that the ranks' token totals are as equal as
   possible (multi-way Karmarkar-Karp largest differencing, or greedy longest-first if that is
   better; the spread between ranks is then at most the longest sample);
2. gives every rank the same number of micro-batches ``k`` (pipeline schedules and gradient
   accumulation need it), the smallest ``k`` for which each rank's samples fit the budget,
   with the rank's samples spread evenly over its ``k`` micro-batches;
3. keeps every micro-batch's total tokens within ``max_tokens`` (the budget).

A sample longer than the budget on its own raises ValueError (it could not be run without
exceeding the memory the budget stands for): raise the budget or cap the sequence length.
When the per-rank split cannot give every rank ``k`` non-empty micro-batches (few, long
samples), whole micro-batches are packed first and then dealt to the ranks (coarser
balance); if even that cannot give each rank the same count, ValueError.
"""

from __future__ import annotations

import heapq
from typing import Sequence


def _spread(loads: Sequence[int]) -> int:
    return max(loads) - min(loads)


def karmarkar_karp(lengths: Sequence[int], k: int, items: Sequence[int] | None = None) -> list[list[int]]:
    """Split ``items`` (default: all indices) into ``k`` groups with near-equal length sums
    (multi-way largest differencing method). Groups are non-empty when there are >= k items."""
    items = list(range(len(lengths))) if items is None else list(items)
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for tie, i in enumerate(items):
        parts = [(int(lengths[i]), [i])] + [(0, []) for _ in range(k - 1)]
        heap.append((-int(lengths[i]), tie, parts))
    if not heap:
        return [[] for _ in range(k)]
    heapq.heapify(heap)
    tie = len(items)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda p: -p[0])
        b = sorted(b, key=lambda p: p[0])
        merged = sorted(((sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)), key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    return [sorted(idx) for _, idx in heap[0][2]]


def greedy_partition(lengths: Sequence[int], k: int, items: Sequence[int] | None = None) -> list[list[int]]:
    """Longest first, each to the group with the smallest sum (max - min <= longest item)."""
    items = list(range(len(lengths))) if items is None else list(items)
    groups: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, g) for g in range(k)]
    for i in sorted(items, key=lambda i: (-lengths[i], i)):
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + int(lengths[i]), g))
    return [sorted(g) for g in groups]


def _balanced(lengths: Sequence[int], k: int, items: Sequence[int]) -> list[list[int]]:
    candidates = [karmarkar_karp(lengths, k, items), greedy_partition(lengths, k, items)]
    return min(candidates, key=lambda groups: _spread([sum(lengths[i] for i in g) for g in groups]))


def first_fit_decreasing(lengths: Sequence[int], budget: int, items: Sequence[int]) -> list[list[int]]:
    """Pack ``items`` into as few bins of total <= ``budget`` as first-fit-decreasing finds."""
    bins: list[list[int]] = []
    totals: list[int] = []
    for i in sorted(items, key=lambda i: (-lengths[i], i)):
        for b, total in enumerate(totals):
            if total + lengths[i] <= budget:
                bins[b].append(i)
                totals[b] += lengths[i]
                break
        else:
            bins.append([i])
            totals.append(int(lengths[i]))
    return bins


def _split_into(lengths: Sequence[int], budget: int, items: Sequence[int], k: int) -> list[list[int]] | None:
    """``items`` in exactly ``k`` non-empty micro-batches within the budget, balanced; None if
    there are fewer than ``k`` items."""
    if len(items) < k:
        return None
    groups = _balanced(lengths, k, items)
    if all(g for g in groups) and max(sum(lengths[i] for i in g) for g in groups) <= budget:
        return groups
    bins = first_fit_decreasing(lengths, budget, items)
    while len(bins) < k:  # split the fullest bin in two (halves of a balanced split)
        b = max((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: sum(lengths[i] for i in bins[b]))
        bins.extend(_balanced(lengths, 2, bins.pop(b)))
    return bins


def balanced_micro_batches(
    seq_lens: Sequence[int], max_tokens: int, dp_size: int = 1
) -> list[list[list[int]]]:
    """Sample indices as ``plan[dp_rank][micro_batch] -> [indices]``.

    Every index appears exactly once; each micro-batch's ``sum(seq_lens)`` is ``<= max_tokens``;
    every rank has the same number of micro-batches, each non-empty; rank token totals are
    balanced (see the module docstring). Indices within a micro-batch are ascending.
    """
    lengths = [int(x) for x in seq_lens]
    n = len(lengths)
    if dp_size < 1 or max_tokens < 1:
        raise ValueError(f"need dp_size >= 1 and max_tokens >= 1, got dp_size={dp_size}, max_tokens={max_tokens}")
    if any(x < 0 for x in lengths):
        raise ValueError("sequence lengths must be >= 0")
    if n < dp_size:
        raise ValueError(f"{n} samples cannot give each of {dp_size} data-parallel ranks a micro-batch")
    too_long = [i for i, x in enumerate(lengths) if x > max_tokens]
    if too_long:
        i = max(too_long, key=lambda i: lengths[i])
        raise ValueError(
            f"{len(too_long)} sample(s) exceed the micro-batch token budget max_tokens={max_tokens} (sample {i} has "
            f"{lengths[i]} tokens); raise the budget to at least the longest prompt+response length"
        )

    ranks = _balanced(lengths, dp_size, range(n))
    k = max(len(first_fit_decreasing(lengths, max_tokens, r)) for r in ranks)
    plan = [_split_into(lengths, max_tokens, r, k) for r in ranks]
    if any(p is None for p in plan):
        plan = _deal_micro_batches(lengths, max_tokens, dp_size)
    return [sorted((sorted(mb) for mb in rank), key=lambda mb: mb[0]) for rank in plan]


def _deal_micro_batches(lengths: Sequence[int], budget: int, dp_size: int) -> list[list[list[int]]]:
    """Fallback: pack all samples into micro-batches, split some until their count is a multiple
    of ``dp_size``, then deal an equal number to each rank, largest first to the lightest rank."""
    bins = first_fit_decreasing(lengths, budget, range(len(lengths)))
    target = -(-len(bins) // dp_size) * dp_size
    while len(bins) < target:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            raise ValueError(
                f"cannot give each of {dp_size} data-parallel ranks the same number of micro-batches: "
                f"{len(lengths)} samples pack into {len(bins)} micro-batches of at most {budget} tokens and none can be "
                "split further; raise the token budget or use a batch size divisible by the DP size"
            )
        b = max(splittable, key=lambda b: sum(lengths[i] for i in bins[b]))
        bins.extend(_balanced(lengths, 2, bins.pop(b)))
    per_rank = len(bins) // dp_size
    plan: list[list[list[int]]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for mb in sorted(bins, key=lambda mb: -sum(lengths[i] for i in mb)):
        r = min((r for r in range(dp_size) if len(plan[r]) < per_rank), key=lambda r: loads[r])
        plan[r].append(mb)
        loads[r] += sum(lengths[i] for i in mb)
    return plan
