"""The multi-process harness: results, failures, timeouts, and no process left behind."""

import os
import time

import psutil
import pytest

from parallel.spawn import RankFailedError, RanksTimedOutError, run_on_ranks, threads_per_rank
from tests.parallel import rank_fns
from tests.processes import live_descendants


def test_collects_each_rank_result(monkeypatch):
    results = run_on_ranks(rank_fns.all_reduce_rank, 2, 10.0, timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["sum"] == 30.0 for r in results)  # 10 * (1 + 2), computed over gloo
    assert all(r["threads"] == threads_per_rank(2) for r in results)
    # Ranks see the caller's environment of now, not the one the (fork) server started with.
    assert [r["marker"] for r in results] == [None, None]
    monkeypatch.setenv("MEGARL_TEST_MARKER", "set after the first ranks")
    results = run_on_ranks(rank_fns.all_reduce_rank, 2, 1.0, timeout_s=120)
    assert [r["marker"] for r in results] == ["set after the first ranks"] * 2
    assert live_descendants() == []


def test_failing_rank_traceback_is_reraised_and_peers_killed():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(rank_fns.fail_on_rank_one, 2, timeout_s=120)
    assert "rank 1 of 2 failed" in str(info.value)
    assert "deliberate failure on rank one" in str(info.value)
    assert time.monotonic() - start < 60  # rank 0 was blocked in a barrier: it was killed, not awaited
    assert live_descendants() == []


def test_timeout_kills_ranks_and_their_children(tmp_path):
    pid_file = str(tmp_path / "grandchild")
    with pytest.raises(RanksTimedOutError, match="did not finish within 15 s"):
        run_on_ranks(rank_fns.start_grandchild_then_hang, 2, pid_file, timeout_s=15, init_distributed=False)
    grandchildren = [int(open(tmp_path / name).read()) for name in os.listdir(tmp_path)]
    assert len(grandchildren) == 2
    time.sleep(0.5)
    for pid in grandchildren:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert live_descendants() == []
