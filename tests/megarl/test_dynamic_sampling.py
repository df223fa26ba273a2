"""DAPO's dynamic sampling fill (``megarl.controller.dynamic_sampling.GroupFiller``) against a
direct reading of its rule: the batch is the first ``groups`` groups whose scores are not all
equal, in generation order, topped up with the first dropped groups when the rounds ran out;
every field of a chosen row is that row's, tensors padded with zeros to the widest round."""

import random

import torch

from megarl.controller.dynamic_sampling import GroupFiller


def _round(prompts: int, n: int, width: int, scores: list[float], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = prompts * n
    return {
        "input_ids": torch.randint(1, 50, (rows, width), generator=g),
        "rollout_logp": torch.randn(rows, width - 2, generator=g),
        "response_lengths": torch.randint(1, width - 2, (rows,), generator=g),
        "uid": [p for p in range(prompts) for _ in range(n)],
        "responses": [f"r{seed}-{i}" for i in range(rows)],
        "scores": torch.tensor(scores),  # kept beside the batch to check the rows move together
        "rollout_metrics": {"time/generation_s": 1.0, "rollout/engine_restarts": float(seed % 2)},
    }


def _expected(rounds: list[dict], groups: int, n: int) -> tuple[list[tuple[int, int]], int]:
    kept, dropped = [], []
    for r, batch in enumerate(rounds):
        for p in range(len(batch["uid"]) // n):
            values = batch["scores"][p * n:(p + 1) * n]
            (kept if len(set(values.tolist())) > 1 else dropped).append((r, p))
    fillers = max(0, groups - len(kept))
    return kept[:groups] + dropped[:fillers], fillers


def test_fill_takes_informative_groups_in_order_then_fillers():
    rng = random.Random(0)
    for trial in range(200):
        n, groups = rng.choice([2, 3, 4]), rng.randint(1, 6)
        prompts = groups  # each round draws a batch of prompts
        filler = GroupFiller(groups)
        rounds = []
        while not filler.full and filler.rounds < rng.randint(1, 4):
            scores = [float(rng.choice([0, 1])) for _ in range(prompts * n)]
            batch = _round(prompts, n, rng.randint(4, 9), scores, seed=trial * 10 + len(rounds))
            rounds.append(batch)
            filler.add(batch, batch["scores"], {"num_errors": 1.0, "score_mean/x": float(len(rounds))})
        batch, scores, stats, metrics = filler.batch()
        chosen, fillers = _expected(rounds, groups, n)
        assert batch["uid"] == [g for g in range(len(chosen)) for _ in range(n)]
        assert metrics["dynamic_sampling/filler_groups"] == fillers
        assert metrics["dynamic_sampling/rounds"] == len(rounds)
        assert metrics["dynamic_sampling/kept_groups"] == len(chosen) - fillers
        assert stats == {"num_errors": float(len(rounds)), "score_mean/x": 1.0}
        assert batch["rollout_metrics"]["time/generation_s"] == len(rounds)
        width = max(b["input_ids"].shape[1] for b in rounds)
        assert batch["input_ids"].shape == (len(chosen) * n, width)
        for g, (r, p) in enumerate(chosen):
            for s in range(n):
                row, src = g * n + s, p * n + s
                assert scores[row] == rounds[r]["scores"][src] == batch["scores"][row]
                assert batch["responses"][row] == rounds[r]["responses"][src]
                ids = rounds[r]["input_ids"][src]
                assert torch.equal(batch["input_ids"][row, : len(ids)], ids)
                assert not batch["input_ids"][row, len(ids):].any()
                logp = rounds[r]["rollout_logp"][src]
                assert torch.equal(batch["rollout_logp"][row, : len(logp)], logp)
        for g in range(len(chosen) - fillers):  # informative groups first
            assert len(set(scores[g * n:(g + 1) * n].tolist())) > 1
