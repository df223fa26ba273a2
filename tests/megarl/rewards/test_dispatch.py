import logging
import os
import time

import pytest
import torch

from megarl.rewards import RewardModel, RewardRunner, compute_rewards

from . import helpers

H = helpers.__name__


def test_builtins_by_data_source_run_inline():
    sources = ["openai/gsm8k", "openai/gsm8k", "lighteval/MATH", "math", "synthetic_arith", "synthetic_arith", "exact_match"]
    responses = ["#### 1,000", "#### 7", "\\boxed{\\frac12}", "\\boxed{3}", "7", "8", " yes "]
    truths = ["1000", "8", "0.5", "4", "7", "7", "yes"]
    infos = [None, None, None, None, None, {"partial_credit_scale": 2}, None]
    scores, stats = compute_rewards(sources, responses, truths, infos)
    assert scores.dtype == torch.float32
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.5, 1.0]
    assert stats["num_samples"] == 7 and stats["num_errors"] == 0 and stats["num_timeouts"] == 0
    assert stats["score_mean"] == pytest.approx(4.5 / 7)
    assert stats["score_mean/openai/gsm8k"] == 0.5
    assert stats["score_mean/synthetic_arith"] == 0.75


def test_unknown_data_source_fails_before_running():
    with pytest.raises(ValueError) as e:
        compute_rewards(["openai/gsm8k", "my/new_data"], ["#### 1", "x"], ["1", "x"])
    assert "'my/new_data'" in str(e.value) and "reward_fns=" in str(e.value)
    scores, _ = compute_rewards(["my/new_data"], ["x"], ["x"], default="exact_match")
    assert scores.tolist() == [1.0]


def test_overrides_and_callables():
    scores, stats = compute_rewards(
        ["openai/gsm8k", "a"],
        ["#### 5", "abc"],
        ["5", "abc"],
        reward_fns={"openai/gsm8k": "exact_match", "a": helpers.length_score},
        backend="inline",
    )
    assert scores.tolist() == [0.0, 1.0]  # exact match of "#### 5" vs "5" fails
    assert stats["extra/length"] == 3.0
    verl, _ = compute_rewards(["v"], [" 4 "], [4], reward_fns={"v": helpers.verl_style}, backend="inline")
    assert verl.tolist() == [0.5]


def test_length_mismatch():
    with pytest.raises(ValueError, match="lengths differ"):
        compute_rewards(["math"], ["a", "b"], ["a", "b"])


def test_bad_specs_fail_when_the_runner_is_built():
    with pytest.raises(ValueError, match="megarl_missing_mod:f"):
        RewardRunner(reward_fns={"x": "megarl_missing_mod:f"})
    with pytest.raises(ValueError, match="cannot be sent to a worker process.*backend='thread'"):
        RewardRunner(reward_fns={"x": lambda **kw: 1.0}, backend="process")
    with pytest.raises(ValueError, match="backend"):
        RewardRunner(backend="fork")
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunner(timeout_s=0)
    RewardRunner(reward_fns={"x": lambda **kw: 1.0}, backend="thread").close()


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_process_backend_turns_timeouts_errors_and_crashes_into_zero(tmp_path, caplog):
    sleep_pid, loop_pid = tmp_path / "sleep.pid", tmp_path / "loop.pid"
    fns = {
        "ok": f"{H}:length_score",
        "sleep": f"{H}:sleep_long",
        "loop": f"{H}:busy_loop",
        "raise": f"{H}:raise_error",
        "crash": f"{H}:crash",
        "nan": f"{H}:return_nan",
        "text": f"{H}:return_text",
    }
    sources = ["ok", "sleep", "raise", "loop", "crash", "nan", "text", "ok"]
    infos = [{}, {"pid_file": str(sleep_pid)}, {}, {"pid_file": str(loop_pid)}, {}, {}, {}, {}]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.dispatch"):
        with RewardRunner(reward_fns=fns, timeout_s=0.5, backend="process", num_workers=4) as runner:
            scores, stats = runner(sources, ["ab"] * 7 + ["x"], ["ab"] * 7 + ["y"], infos)
            elapsed = time.monotonic() - start
            assert scores.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
            assert stats["num_timeouts"] == 2  # sleep, busy loop
            assert stats["num_errors"] == 4  # raise, crash, nan, text
            assert stats["extra/length"] == 1.5
            # the hung calls' worker processes were killed, not left running
            assert _pid_gone(int(sleep_pid.read_text())) and _pid_gone(int(loop_pid.read_text()))
            # the runner still works after killing workers
            again, again_stats = runner(["ok", "ok"], ["a", "b"], ["a", "a"])
            assert again.tolist() == [1.0, 0.0] and again_stats["num_timeouts"] == again_stats["num_errors"] == 0
    assert elapsed < 15, elapsed  # not the 60 s the sleeping function wanted
    assert any("6 of 8 calls failed" in r.getMessage() and "2 timed out" in r.getMessage() for r in caplog.records)


def test_injected_worker_crash_scores_its_call_zero_and_the_next_worker_goes_on(caplog):
    """``MEGARL_FAULTS=kill_reward_worker@k``'s mechanism: the worker about to run the next batch's
    first process call is SIGKILLed; that sample scores 0 (an error), the rest score normally on a
    new worker, and the batch after is clean. A batch with no process call refuses it."""
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.dispatch"):
        with RewardRunner(reward_fns={"ok": f"{H}:length_score"}, backend="process", num_workers=1) as runner:
            runner.crash_a_worker_in_the_next_batch()
            scores, stats = runner(["ok"] * 3, ["ab", "ab", "x"], ["ab", "ab", "y"])
            assert scores.tolist() == [0.0, 1.0, 0.0] and stats["num_errors"] == 1, (scores, stats)
            again, again_stats = runner(["ok"] * 2, ["ab", "x"], ["ab", "y"])
            assert again.tolist() == [1.0, 0.0] and again_stats["num_errors"] == 0
    assert any("reward worker process died before the call" in r.getMessage() for r in caplog.records)
    with RewardRunner(backend="inline") as runner:
        runner.crash_a_worker_in_the_next_batch()
        with pytest.raises(ValueError, match="kill_reward_worker: no reward of this batch runs in a worker process"):
            runner(["gsm8k"], ["#### 1"], ["1"])


def test_thread_backend_abandons_hung_calls(caplog):
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.dispatch"):
        with RewardRunner(
            reward_fns={"ok": helpers.length_score, "sleep": helpers.sleep_long, "raise": helpers.raise_error},
            timeout_s=0.5,
            backend="thread",
        ) as runner:
            scores, stats = runner(["sleep", "ok", "raise"], ["a", "a", "a"], ["a", "a", "a"])
            assert runner.num_abandoned_threads == 1
    assert time.monotonic() - start < 5
    assert scores.tolist() == [0.0, 1.0, 0.0]
    assert stats["num_timeouts"] == 1 and stats["num_errors"] == 1
    assert any("2 of 3 calls failed" in r.getMessage() for r in caplog.records)


def test_inline_backend_catches_exceptions_and_bad_values():
    scores, stats = compute_rewards(
        ["raise", "nan", "text", "ok"],
        ["a"] * 4,
        ["a"] * 4,
        reward_fns={
            "raise": helpers.raise_error,
            "nan": helpers.return_nan,
            "text": helpers.return_text,
            "ok": helpers.length_score,
        },
        backend="inline",
    )
    assert scores.tolist() == [0.0, 0.0, 0.0, 1.0]
    assert stats["num_errors"] == 3 and stats["num_timeouts"] == 0


def test_reward_model_protocol():
    class Scalar:
        def score(self, input_ids, attention_mask):
            return attention_mask.sum(-1).float()

    class NotAModel:
        def forward(self, x):
            return x

    assert isinstance(Scalar(), RewardModel)
    assert not isinstance(NotAModel(), RewardModel)
