"""``RolloutStream``: which weights generate each step's batch, against the staleness bound's
closed form (step j's batch from at least j - 1 - K updates, the newest published ones)."""

import random
import threading
import time

import pytest

from megarl.rollout.stream import RolloutStream


class Engines:
    """Records what the stream asks: generations as (step, version), applies as versions."""

    def __init__(self, block_at: int | None = None, fail_at: int | None = None, delay=lambda: 0.0):
        self.generated, self.applied = [], []
        self.block_at, self.fail_at, self.delay = block_at, fail_at, delay
        self.release = threading.Event()

    def generate(self, step: int, version: int):
        if step == self.block_at:
            self.release.wait(30)
        if step == self.fail_at:
            raise RuntimeError(f"engine died generating step {step}")
        time.sleep(self.delay())
        self.generated.append((step, version))
        return step, version

    def apply(self, version: int) -> dict:
        time.sleep(self.delay())
        self.applied.append(version)
        return {"sync/bytes": float(version)}


def _stream(engines: Engines, staleness: int, steps: int, first_step: int = 1) -> RolloutStream:
    return RolloutStream(engines.generate, engines.apply, max_staleness=staleness, first_step=first_step,
                         last_step=steps, version=first_step - 1)


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_a_slow_trainer_gets_batches_exactly_k_versions_old(staleness):
    """The trainer takes a batch only once the stream has generated every batch it may: step j's
    batch then comes from max(0, j - 1 - K) updates (K = 0: the synchronous loop's weights)."""
    engines = Engines()
    stream = _stream(engines, staleness, steps=6)
    try:
        for step in range(1, 7):
            deadline = time.monotonic() + 10
            while len(engines.generated) < min(6, step + staleness) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert stream.take(step, 10) == (step, max(0, step - 1 - staleness))
            stream.publish(step, step)  # the weights after this step's update
        assert [s for s, _ in engines.generated] == list(range(1, 7))
        assert engines.applied == list(range(1, 6 - staleness))  # the last batches need no newer weights
    finally:
        stream.close()


def test_the_newest_published_weights_are_applied_and_older_ones_skipped():
    engines = Engines(block_at=2)
    stream = _stream(engines, 1, steps=3)
    try:
        assert stream.take(1, 10) == (1, 0)
        stream.publish(1, 1)
        stream.publish(2, 2)  # both before the stream can apply: only the newest is
        engines.release.set()
        assert stream.take(2, 10) == (2, 0)
        assert stream.take(3, 10) == (3, 2)
        assert engines.applied == [2] and stream.take_applied() == [{"sync/bytes": 2.0}]
        assert stream.take_applied() == []
    finally:
        stream.close()


def test_the_bound_holds_whatever_the_timing():
    """Random generation, apply and training times: no batch is ever more than K updates older
    than the weights that train on it, and none is generated before its prompts' turn."""
    rng = random.Random(0)
    for staleness in (0, 1, 3):
        engines = Engines(delay=lambda: rng.random() * 0.004)
        stream = _stream(engines, staleness, steps=20, first_step=3)  # a resumed run: 2 updates done
        try:
            for step in range(3, 21):
                time.sleep(rng.random() * 0.004)
                got, version = stream.take(step, 10)
                assert got == step and step - 1 - staleness <= version <= step - 1, (staleness, step, version)
                stream.publish(step, step)
            assert [s for s, _ in engines.generated] == list(range(3, 21))
        finally:
            stream.close()


def test_a_failed_generation_reaches_the_trainer_and_a_stuck_one_times_out():
    engines = Engines(fail_at=2)
    stream = _stream(engines, 1, steps=4)
    try:
        assert stream.take(1, 10) == (1, 0)
        with pytest.raises(RuntimeError, match="engine died generating step 2"):
            stream.take(2, 10)
    finally:
        stream.close()
    stream = _stream(Engines(), 0, steps=4)
    try:
        assert stream.take(1, 10) == (1, 0)
        with pytest.raises(TimeoutError, match=r"^the batch of step 2 was not generated within 0.3 s \(the rollout "
                                               r"thread is waiting for the weights of update 1 \(the engines hold 0\)\)"):
            stream.take(2, 0.3)  # K = 0: step 2's generation waits for weights never published
    finally:
        stream.close()
    engines = Engines(block_at=2)  # a stuck engine
    stream = _stream(engines, 1, steps=4)
    try:
        assert stream.take(1, 10) == (1, 0)
        with pytest.raises(TimeoutError, match=r"^the batch of step 2 was not generated within 0.3 s \(the rollout "
                                               r"thread is generating step 2's batch with the weights of update 0\)"):
            stream.take(2, 0.3)
    finally:
        stream.close()
        engines.release.set()


def test_a_partial_rollout_takes_weights_published_during_its_generation():
    """A generation that calls ``refresh`` between its chunks (``rollout.partial_rollout_tokens``)
    continues with the weights the trainer published meanwhile; the batch's first chunk keeps the
    weights it started with, so the bound (on a sample's oldest token) still holds."""
    published, chunk_versions = threading.Event(), []
    engines = Engines()

    def generate(step, version):
        chunk_versions.append((step, version))
        if step == 2:
            assert published.wait(10)
            chunk_versions.append((step, stream.refresh()))
        return step, version

    stream = RolloutStream(generate, engines.apply, max_staleness=1, first_step=1, last_step=2, version=0)
    try:
        assert stream.take(1, 10) == (1, 0)
        stream.publish(1, 1)
        published.set()
        assert stream.take(2, 10) == (2, 0)
        assert chunk_versions == [(1, 0), (2, 0), (2, 1)] and engines.applied == [1]
        with pytest.raises(AssertionError, match="refresh"):
            stream.refresh()  # not from the trainer's thread
    finally:
        stream.close()
