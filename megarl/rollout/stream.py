"""Generation running ahead of training by a bounded number of weight versions.

``rollout.mode=streaming`` (and ``one_step_off``, its ``max_staleness=1``): a thread of the driver
generates the batch of every training step in order, as early as the staleness bound allows, while
the trainer trains on earlier ones. The trainer publishes the weights after each update; the thread
applies the newest published weights to the engines before each generation (engines take new
weights only between generations), and starts the batch of step ``j`` only once the engines hold at
least ``j - 1 - max_staleness`` updates. So every batch is at most ``max_staleness`` versions older
than the weights that train on it; with 0 the thread waits for each update's weights, which is the
synchronous loop with the same batches, seeds and weights. With partial rollouts the generation
calls ``refresh`` between chunks of a batch, so weights published meanwhile reach its later tokens.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


class RolloutStream:
    """The batches of steps ``first_step..last_step`` (1-based), generated in a thread of their own.

    ``generate(step, version)`` returns step ``step``'s batch sampled by the engines' weights after
    ``version`` updates; ``apply_weights(payload)`` writes published weights into the engines and
    returns its metrics. ``version`` is the number of updates the engines hold at the start."""

    def __init__(self, generate: Callable[[int, int], Any], apply_weights: Callable[[Any], dict], *,
                 max_staleness: int, first_step: int, last_step: int, version: int):
        self._generate, self._apply = generate, apply_weights
        self.max_staleness, self.last_step = max_staleness, last_step
        self.version = version  # the updates the engines hold (written by the thread only)
        self._published: tuple[int, Any] | None = None  # the newest weights not applied yet
        self._ready: dict[int, Any] = {}
        self._applied: list[dict] = []  # metrics of the applies since the last take_applied()
        self._error: BaseException | None = None
        self._doing = "starting"  # what the thread is doing, for a timeout's message
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(first_step,), name="megarl-rollout", daemon=True)
        self._thread.start()

    def publish(self, version: int, payload: Any) -> None:
        """The weights after ``version`` updates (replacing any published ones not applied yet)."""
        with self._cond:
            self._published = (version, payload)
            self._cond.notify_all()

    def take(self, step: int, timeout_s: float) -> Any:
        """Step ``step``'s batch once generated; the thread's error if it failed; TimeoutError after
        ``timeout_s``, naming what the generation waits for."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while step not in self._ready and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the batch of step {step} was not generated within {timeout_s:g} s (the "
                                       f"rollout thread is {self._doing})")
                self._cond.wait(left)
            if step in self._ready:
                return self._ready.pop(step)
            raise self._error

    def refresh(self) -> int:
        """From within ``generate`` (between the chunks of a partial rollout): apply the newest
        published weights, if any; returns the updates the engines hold."""
        assert threading.current_thread() is self._thread, "refresh() belongs to the stream's own generation"
        with self._cond:
            published, self._published = self._published, None
        if published is not None:
            self._apply_published(*published)
        return self.version

    def take_applied(self) -> list[dict]:
        """The metrics of every weight apply since the last call, oldest first."""
        with self._cond:
            applied, self._applied = self._applied, []
        return applied

    def close(self) -> None:
        """Stop after the generation or apply in progress (not waited for)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self, step: int) -> None:
        try:
            while step <= self.last_step:
                needed = step - 1 - self.max_staleness  # the oldest weights step's batch may come from
                with self._cond:
                    self._doing = f"waiting for the weights of update {needed} (the engines hold {self.version})"
                    while not self._closed and self._published is None and self.version < needed:
                        self._cond.wait()
                    if self._closed:
                        return
                    published, self._published = self._published, None
                if published is not None:
                    self._apply_published(*published)
                if self.version < needed:
                    continue
                self._doing = f"generating step {step}'s batch with the weights of update {self.version}"
                batch = self._generate(step, self.version)
                with self._cond:
                    self._ready[step] = batch
                    self._cond.notify_all()
                step += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's take()
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _apply_published(self, version: int, payload: Any) -> None:
        doing, self._doing = self._doing, f"applying the weights of update {version}"
        metrics = self._apply(payload)
        self.version = version
        with self._cond:
            self._applied.append(metrics)
        self._doing = doing
