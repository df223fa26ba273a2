"""A DAPO run (`megarl train` with the dapo preset's dynamic sampling and soft overlong penalty) on
CPU, real Ray, Megatron and SGLang, checked step by step against closed forms on the batches it
trained on (``trainer.save_rollouts_every=1``):

- every trained group's task scores (the arithmetic reward of its responses, recomputed here)
  differ, but for the fillers the metrics count, which come last and score alike; the metrics add
  up (kept + fillers = batch size, fillers only once the rounds ran out) and groups were dropped;
- every sample's score is its task score plus DAPO's penalty of its length
  (0 up to max_new_tokens - buffer, then -(L - start) / buffer);
- every advantage is GRPO's of those scores within its group.
"""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tests.megarl.test_trainer import _metrics, _overrides, _run

MAX_NEW, BUFFER, BATCH, N, ROUNDS = 4, 3, 4, 4, 3


@pytest.fixture(scope="module")
def dapo_run(arith_prompts, tmp_path_factory):
    from model_specs.tokenizer import load_tokenizer, save_char_tokenizer

    prompts = arith_prompts(400)
    out = tmp_path_factory.mktemp("dapo")
    # a response ends after its first digit: lengths 1..MAX_NEW, so the penalty takes every value
    save_char_tokenizer(out / "tokenizer")
    digits = load_tokenizer(str(out / "tokenizer")).convert_tokens_to_ids(list("0123456789"))
    settings = {"rollout.stop_token_ids": f"[{','.join(map(str, digits))}]",
                "trainer.total_steps": 3, "trainer.save_every": 0, "trainer.save_rollouts_every": 1,
                "data.batch_size": BATCH, "rollout.n": N, "rollout.max_new_tokens": MAX_NEW,
                "actor.micro_batch_size": 8, "ref.micro_batch_size": 8,
                "algorithm.dynamic_sampling.enabled": "true", "algorithm.dynamic_sampling.max_rounds": ROUNDS,
                "algorithm.overlong_penalty.enabled": "true", "algorithm.overlong_penalty.buffer_len": BUFFER,
                "actor.clip_ratio_high": 0.28}
    code, output = _run(_overrides(prompts, out, **settings), timeout_s=600)
    assert code == 0, output[-3000:]
    answers = {row["prompt"]: row["reward_model"]["ground_truth"] for row in pq.read_table(prompts).to_pylist()}
    return out, answers


def _task_score(response: str, ground_truth) -> float:
    from megarl.rewards.arithmetic import compute_score

    return compute_score(response, ground_truth, partial_credit_scale=5)


def _penalty(length: int) -> float:
    start = MAX_NEW - BUFFER
    return 0.0 if length <= start else -(length - start) / BUFFER


def test_dapo_trains_informative_groups_with_the_overlong_penalty(dapo_run):
    out, answers = dapo_run
    from model_specs.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(out / "initial_model"))
    steps = _metrics(out)
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        kept, fillers = m["dynamic_sampling/kept_groups"], m["dynamic_sampling/filler_groups"]
        assert kept + fillers == BATCH and 1 <= m["dynamic_sampling/rounds"] <= ROUNDS, m
        assert fillers == 0 or m["dynamic_sampling/rounds"] == ROUNDS, m
    assert sum(m["dynamic_sampling/dropped_groups"] for m in steps) > 0, steps
    lengths = set()
    for m in steps:
        lines = [json.loads(line) for line in
                 (Path(out) / "rollouts" / f"step_{m['step']:06d}.jsonl").read_text().splitlines()]
        assert [line["uid"] for line in lines] == [g for g in range(BATCH) for _ in range(N)]
        task, shaped = [], []
        for line in lines:
            prompt = tokenizer.decode(line["prompt_ids"], skip_special_tokens=True)
            task.append(_task_score(line["response"], answers[prompt]))
            length = len(line["response_ids"])
            assert line["score"] == pytest.approx(task[-1] + _penalty(length), abs=1e-6), line
            shaped.append(line["score"])
        for g in range(BATCH):
            group = task[g * N:(g + 1) * N]
            informative = len(set(group)) > 1
            assert informative == (g < BATCH - m["dynamic_sampling/filler_groups"]), (m["step"], g, group)
            scores = torch.tensor(shaped[g * N:(g + 1) * N], dtype=torch.float64)
            expected = (scores - scores.mean()) / (scores.std() + 1e-6)
            got = [line["advantage"] for line in lines[g * N:(g + 1) * N]]
            assert got == pytest.approx(expected.tolist(), abs=1e-4), (m["step"], g)
        assert m["reward/overlong_fraction"] == pytest.approx(sum(_penalty(len(x["response_ids"])) < 0
                                                                  for x in lines) / len(lines))
        lengths.update(len(x["response_ids"]) for x in lines)
    assert lengths == set(range(1, MAX_NEW + 1)), lengths  # every branch of the penalty was taken
