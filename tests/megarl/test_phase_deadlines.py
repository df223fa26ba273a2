"""A phase never hangs silently: ``megarl.controller.worker_group.gather`` over real Ray actors names the worker
that did not answer within the deadline, or that died, and the phase."""

import os
import time

import pytest
import ray

from megarl.controller.worker_group import RunError, gather


class Rank:
    def work(self, seconds: float) -> int:
        time.sleep(seconds)
        return os.getpid()


@pytest.fixture(scope="module")
def ranks():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        yield [ray.remote(num_cpus=0)(Rank).remote() for _ in range(2)]
    finally:
        ray.shutdown()


def test_a_stuck_or_dead_rank_is_named_with_the_phase(ranks):
    names = ["Megatron rank 0 of pool 'global'", "Megatron rank 1 of pool 'global'"]
    pids = gather([r.work.remote(0) for r in ranks], names, "update (actor)", 30)
    assert len(set(pids)) == 2
    start = time.monotonic()
    with pytest.raises(RunError) as stuck:
        gather([ranks[0].work.remote(0), ranks[1].work.remote(30)], names, "update (actor)", 2, lambda: "Resume with X.")
    assert time.monotonic() - start < 10
    assert str(stuck.value).startswith("update (actor): Megatron rank 1 of pool 'global' did not finish within "
                                       "trainer.phase_timeout_s=2 s (1 of 2 did)")
    assert str(stuck.value).endswith("Resume with X.")
    # A dead rank stops the phase at once, while the other still works (as it would, waiting for the
    # dead one in a collective): not after the deadline.
    ray.kill(ranks[1])
    start = time.monotonic()
    with pytest.raises(RunError, match=r"^forward \(ref_logp\): Megatron rank 1 of pool 'global' died \("):
        gather([ranks[0].work.remote(30), ranks[1].work.remote(0)], names, "forward (ref_logp)", 60)
    assert time.monotonic() - start < 10
