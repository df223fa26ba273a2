"""The metrics file of a run: every step once, also across a resume after a run was killed
between logging a step and saving its checkpoint."""

import json

from megarl.metrics import MetricsLogger


def _steps(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_drops_the_steps_after_its_checkpoint_and_continues(tmp_path):
    logger = MetricsLogger(tmp_path, [], total_steps=5)
    for step in (1, 2, 3):
        logger.log({"step": step, "reward/mean": 0.1 * step})
    logger.close()  # killed during step 3's checkpoint: the newest checkpoint is step 2's
    resumed = MetricsLogger(tmp_path, [], total_steps=5, first_step=2)
    for step in (3, 4):
        resumed.log({"step": step, "reward/mean": 1.0})
    resumed.close()
    assert _steps(tmp_path) == [1, 2, 3, 4]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[2]["reward/mean"] == 1.0  # step 3 as the resumed run computed it
    MetricsLogger(tmp_path, [], total_steps=5, first_step=4).close()  # nothing later: the file is untouched
    assert _steps(tmp_path) == [1, 2, 3, 4]
    MetricsLogger(tmp_path, [], total_steps=5).close()  # a run from step 0 in the same directory
    assert (tmp_path / "metrics.jsonl").read_text() == ""
