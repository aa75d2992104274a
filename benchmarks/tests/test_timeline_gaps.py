"""benchmarks.timeline_gaps: per-actor calls, busy fractions, idle gaps and hand-offs from a Ray timeline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import timeline_gaps as g
from benchmarks.harness import REPO

POLICY, ENGINE = "DTensorPolicyWorker policy-0 (aa)", "VllmEngineWorker replica0 (bb)"


def _call(tid: str, cls: str, method: str, start_ms: float, end_ms: float) -> dict[str, Any]:
    """An actor call's event as Ray writes it: microseconds as strings, category task::Class.method."""
    return {"cat": f"task::{cls}.{method}", "name": method, "pid": "node", "tid": tid, "ph": "X",
            "ts": str(start_ms * 1000), "dur": str((end_ms - start_ms) * 1000)}


def _timeline() -> list[dict[str, Any]]:
    """Five steps of 100 ms: training 0-40, the engine's load 43-48 (3 ms after training), generation 48-90,
    the next training 96 (6 ms after generation); plus one set-up call on each row, and Ray's own task events."""
    events: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": "node", "tid": "p", "args": {"name": POLICY}},
        {"name": "thread_name", "ph": "M", "pid": "node", "tid": "e", "args": {"name": ENGINE}},
        _call("p", "DTensorPolicyWorker", "__init__", -500, -400),
        _call("e", "VllmEngineWorker", "__init__", -500, -300),
        {"cat": "task:execute", "name": "task:execute", "pid": "node", "tid": "p", "ph": "X", "ts": "0", "dur": "1"},
    ]
    for k in range(5):
        t = 100.0 * k
        events += [_call("p", "DTensorPolicyWorker", "train", t - 4, t + 40),
                   _call("e", "VllmEngineWorker", "load", t + 43, t + 48),
                   _call("e", "VllmEngineWorker", "generate", t + 48, t + 90)]
    return events


def test_calls_busy_fraction_gaps_and_handoffs() -> None:
    calls = g.steady(g.actor_calls(_timeline()), min_calls=3, warmup=1)
    assert {c.method for c in calls} == {"train", "load", "generate"}  # set-up calls and Ray's own events left out
    assert len(calls) == 12  # the first of each method is warm-up
    s = g.summarise(calls)
    policy, engine = s["rows"][POLICY], s["rows"][ENGINE]
    assert policy["calls"]["train"] == {"median_ms": 44.0, "count": 4}
    assert policy["gaps"]["train -> train"] == {"median_ms": 56.0, "count": 3}
    assert policy["busy"] == pytest.approx(4 * 44 / (440 - 96), abs=1e-3)
    assert engine["gaps"]["load -> generate"]["median_ms"] == 0.0
    assert engine["gaps"]["generate -> load"]["median_ms"] == 53.0
    # the engine's load waited for training (3 ms), the next training for generation (6 ms); a row's first call
    # has no call before it on its row, so no hand-off
    assert s["handoffs"]["DTensorPolicyWorker.train end -> VllmEngineWorker.load start"] == {"median_ms": 3.0,
                                                                                             "count": 3}
    assert s["handoffs"]["VllmEngineWorker.generate end -> DTensorPolicyWorker.train start"] == {
        "median_ms": 6.0, "count": 3}
    assert "generate -> generate" not in engine["gaps"]


def test_the_module_prints_and_writes_the_summary(tmp_path: Path) -> None:
    """Run as `python -m benchmarks.timeline_gaps` from the repository's root, as its docstring says."""
    trace, out = tmp_path / "timeline.json", tmp_path / "gaps.json"
    trace.write_text(json.dumps(_timeline()))
    run = subprocess.run([sys.executable, "-m", "benchmarks.timeline_gaps", str(trace), "--min-calls", "3",
                          "--warmup", "1", "--out", str(out)], cwd=REPO, capture_output=True, text=True, check=True,
                         timeout=600)
    assert "VllmEngineWorker.generate end -> DTensorPolicyWorker.train start" in run.stdout
    assert json.loads(out.read_text())["rows"][POLICY]["calls"]["train"]["count"] == 4
