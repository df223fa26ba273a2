"""User reward functions for the dispatcher tests (imported by name in worker processes)."""

import os
import time

NOT_CALLABLE = 3


def _note_pid(extra_info):
    if extra_info and extra_info.get("pid_file"):
        with open(extra_info["pid_file"], "w") as f:
            f.write(str(os.getpid()))


def length_score(*, data_source, solution_str, ground_truth, extra_info):
    """1.0 on an exact match; also reports the response length."""
    return {"score": float(solution_str == ground_truth), "length": len(solution_str)}


def sleep_long(*, data_source, solution_str, ground_truth, extra_info):
    _note_pid(extra_info)
    time.sleep(60)
    return 1.0


def busy_loop(*, data_source, solution_str, ground_truth, extra_info):
    _note_pid(extra_info)
    while True:
        pass


def raise_error(*, data_source, solution_str, ground_truth, extra_info):
    raise RuntimeError("user reward failed on purpose")


def crash(*, data_source, solution_str, ground_truth, extra_info):
    os._exit(3)


def return_nan(*, data_source, solution_str, ground_truth, extra_info):
    return float("nan")


def return_text(*, data_source, solution_str, ground_truth, extra_info):
    return "1.0"


def verl_style(data_source, solution_str, ground_truth, extra_info=None):
    """A verl-style positional signature: still callable by keyword."""
    return 0.5 if solution_str.strip() == str(ground_truth) else 0.25
