"""A run's timeline: ``megarl.metrics.Timeline`` writes Chrome trace events that ``json`` reads
(with or without the closing bracket, across a resumed run), and ``tools/plot_timeline.py`` draws
them as a PNG."""

import json

from megarl.metrics import Timeline, read_timeline
from tools import plot_timeline


def test_timeline_is_a_chrome_trace_that_resumes_and_plots(tmp_path):
    path = tmp_path / "timeline.json"
    timeline = Timeline(path)
    timeline.span("generate", "rollout", 100.0, 101.5, 1)
    timeline.span("update", "controller", 100.5, 101.0, 1)
    Timeline(path).span("sync", "controller", 101.5, 101.75, 1)  # a resumed run appends
    trace = json.loads(path.read_text().rstrip().rstrip(",") + "]")  # what a trace viewer reads
    assert [e["name"] for e in trace if e["ph"] == "M"] == ["thread_name", "thread_name"]
    events = read_timeline(path)
    assert [(e["name"], e["lane"], e["ts"], e["dur"]) for e in events] == [
        ("generate", "rollout", 100_000_000, 1_500_000), ("update", "controller", 100_500_000, 500_000),
        ("sync", "controller", 101_500_000, 250_000)]
    png = tmp_path / "t.png"
    assert plot_timeline.main([str(path), "--output", str(png), "--steps", "1"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert plot_timeline.main([str(path), "--steps", "7-9"]) == 2  # no phases there: says so
    # A step's window shows whatever ran meanwhile: here the generation of step 2, ahead of training.
    timeline.span("generate", "rollout", 101.6, 102.0, 2)
    timeline.span("update", "controller", 102.5, 103.0, 2)
    window = plot_timeline.events_of_steps(read_timeline(path), range(1, 2))
    assert [(e["name"], e["args"]["step"]) for e in window] == [
        ("generate", 1), ("update", 1), ("sync", 1), ("generate", 2)]
