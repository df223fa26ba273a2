"""DAPO's dynamic sampling (Yu et al. 2025, eq. 11): a step's batch is filled with groups whose
samples do not all score the same, drawing and generating more prompts until it is full or
``algorithm.dynamic_sampling.max_rounds`` generations were made.

A group whose samples all score alike has a group-relative advantage of 0: it trains nothing and
only dilutes the batch. Groups are judged on the task's scores (before reward shaping such as the
overlong penalty, as DAPO judges accuracy). When the rounds run out first, the batch is topped up
with dropped groups, in the order they were generated, so every step trains on ``data.batch_size``
prompts; ``dynamic_sampling/filler_groups`` counts them.
"""

from __future__ import annotations

import torch

from megarl.algorithms.filters import dynamic_sampling_mask


class GroupFiller:
    """Collects generated batches (``rollout.n`` consecutive rows per prompt, ``uid`` numbering the
    prompts of each batch) until ``groups`` informative groups are in."""

    def __init__(self, groups: int):
        self.groups = groups
        self.rounds = 0
        self._batches: list[tuple[dict, torch.Tensor, dict]] = []
        self._kept: list[tuple[int, list[int]]] = []  # (batch, its rows) of each informative group
        self._dropped: list[tuple[int, list[int]]] = []

    def add(self, batch: dict, scores: torch.Tensor, reward_stats: dict) -> None:
        """One round's batch, its task scores and the reward functions' statistics."""
        keep = dynamic_sampling_mask(scores, batch["uid"])
        rows: dict = {}
        for row, uid in enumerate(batch["uid"]):
            rows.setdefault(uid, []).append(row)
        index = len(self._batches)
        for group in rows.values():
            (self._kept if bool(keep[group[0]]) else self._dropped).append((index, group))
        self._batches.append((batch, scores, reward_stats))
        self.rounds += 1

    @property
    def full(self) -> bool:
        return len(self._kept) >= self.groups

    def batch(self) -> tuple[dict, torch.Tensor, dict, dict[str, float]]:
        """The step's batch of ``groups`` groups (informative ones first, in generation order, then
        fillers), their scores, the reward statistics (counts summed over rounds, the rest as the
        first round's) and the ``dynamic_sampling/*`` metrics."""
        fillers = min(max(0, self.groups - len(self._kept)), len(self._dropped))
        chosen = self._kept[: self.groups] + self._dropped[:fillers]
        batch = _take_groups([b for b, _, _ in self._batches], chosen)
        scores = torch.cat([self._batches[i][1][rows] for i, rows in chosen])
        stats = dict(self._batches[0][2])
        for _, _, more in self._batches[1:]:
            for key, value in more.items():
                if key.startswith("num_"):
                    stats[key] = stats.get(key, 0.0) + value
        metrics = {"dynamic_sampling/rounds": float(self.rounds),
                   "dynamic_sampling/kept_groups": float(min(len(self._kept), self.groups)),
                   "dynamic_sampling/dropped_groups": float(len(self._dropped)),
                   "dynamic_sampling/filler_groups": float(fillers)}
        return batch, scores, stats, metrics


def _take_groups(batches: list[dict], chosen: list[tuple[int, list[int]]]) -> dict:
    """The rows of ``chosen`` (batch index, rows) as one batch: tensors padded with zeros to the
    widest batch's shape, lists concatenated, ``uid`` renumbered 0..len(chosen)-1, the batches'
    ``rollout_metrics`` combined (times and restarts summed)."""
    out: dict = {}
    for key, first in batches[0].items():
        if key == "rollout_metrics":
            continue
        if isinstance(first, torch.Tensor):
            shape = [max(b[key].shape[d] for b in batches) for d in range(first.dim())]
            parts = []
            for i, rows in chosen:
                part = batches[i][key][rows]
                pad = [0] * (2 * part.dim())
                for d in range(1, part.dim()):
                    pad[2 * (part.dim() - 1 - d) + 1] = shape[d] - part.shape[d]
                parts.append(torch.nn.functional.pad(part, pad))
            out[key] = torch.cat(parts)
        else:
            out[key] = [batches[i][key][row] for i, rows in chosen for row in rows]
    out["uid"] = [g for g, (_, rows) in enumerate(chosen) for _ in rows]
    metrics = dict(batches[0]["rollout_metrics"])
    for b in batches[1:]:
        for key in ("time/generation_s", "rollout/engine_restarts"):
            metrics[key] = metrics.get(key, 0.0) + b["rollout_metrics"].get(key, 0.0)
    out["rollout_metrics"] = metrics
    return out
