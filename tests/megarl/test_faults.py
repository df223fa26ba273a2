"""The fault-injection switch: inert unless set, each planned fault fires once, a bad entry is
refused naming it."""

import pytest

from megarl.faults import FaultPlan, planned_faults


def test_faults_fire_once_and_bad_entries_are_named(monkeypatch):
    monkeypatch.delenv("MEGARL_FAULTS", raising=False)
    assert planned_faults() == set()
    plan = FaultPlan("kill_engine@2, kill_engine@5")
    assert [plan.fire("kill_engine", step) for step in (1, 2, 2, 5)] == [False, True, False, True]
    for bad in ("kill_engine", "kill_engine@x", "explode@2"):
        with pytest.raises(ValueError, match=f"MEGARL_FAULTS: '{bad}' is not <kind>@<step>"):
            planned_faults(bad)
