"""benchmarks.harness: the results files (latest run per configuration), the process tree's CPU and memory, how
many CPUs a run kept busy, the step no schedule can beat, and the suite's table."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from benchmarks import harness

SPIN = """
import sys, time
t0 = time.process_time()
while time.process_time() - t0 < 0.5:
    pass
print("spun", flush=True)
sys.stdin.read()
"""
"""A child that uses 0.5 s of CPU (its own CPU clock: the same on a loaded host), says so, and waits for stdin."""


ROUNDING = 1e-6
"""CPU seconds are whole clock ticks summed as floats: sums of the same ticks may differ in the last bits."""


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _spinning_child() -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "spun\n"
    return child


def test_a_sample_counts_the_children_listed_since() -> None:
    """A child started after the tree was listed counts only once the tree is listed again: then the sample's CPU
    seconds grow by at least everything the child used."""
    usage = harness.TreeUsage()
    _, cpu0 = usage.sample(relist=True)
    child = _spinning_child()
    try:
        spun = _cpu_s(child.pid)
        assert spun >= 0.45
        _, unlisted = usage.sample()  # the tree as listed before the child started: this process only
        rss, listed = usage.sample(relist=True)
        assert listed - cpu0 >= spun - ROUNDING
        assert unlisted - cpu0 < 0.2  # this process waited on the child's pipe, using next to no CPU
        assert rss > psutil.Process(child.pid).memory_info().rss and usage.peak >= rss
    finally:
        child.communicate("")
    assert [c for _, c in usage.cpu_samples] == [cpu0, unlisted, listed]


def test_the_tree_is_sampled_on_entering_and_on_leaving() -> None:
    """Whatever the sampling thread manages in between (here nothing: it would wait an hour), the samples on entering
    and leaving bound the block, and the one on leaving lists the tree again."""
    with harness.TreeUsage(sample_s=3600.0) as usage:
        child = _spinning_child()
        spun = _cpu_s(child.pid)
    child.communicate("")
    (t0, c0), (t1, c1) = usage.cpu_samples
    assert t1 > t0 and c1 - c0 >= spun - ROUNDING and spun >= 0.45
    assert usage.peak > 0


def test_cpus_busy_is_cpu_seconds_over_wall_seconds_inside_the_window() -> None:
    # 1.5 CPUs busy from t=10 to t=14; the samples before and after the window ran at other rates
    samples = [(8.0, 0.0), (10.0, 1.0), (11.0, 2.5), (12.0, 4.0), (14.0, 7.0), (15.0, 7.1)]
    assert harness.cpus_busy(samples, 10.0, 14.0) == pytest.approx(1.5)
    assert harness.cpus_busy(samples, 9.0, 14.5) == pytest.approx(1.5)  # the first and last samples inside are used
    assert harness.cpus_busy(samples, 14.0, 14.9) is None  # one sample: no rate
    assert harness.cpus_busy([], 0.0, 1.0) is None


def test_the_cpu_floor_is_the_step_cpu_spread_over_the_hosts_cpus() -> None:
    cpus = os.cpu_count() or 1
    floor = harness.cpu_floor(0.050, 1.8)
    assert floor["cpu_s_per_step"] == pytest.approx(0.09)
    assert floor["step_cpu_floor_s"] == pytest.approx(0.09 / cpus, abs=1e-4)
    assert harness.cpu_floor(0.050, None) == {}


def test_the_key_is_the_configuration_as_a_command_line() -> None:
    """Defaults are written out, options are sorted, overrides keep their order, where results go is no part."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--async-compare", action="store_true")
    ap.add_argument("--async-override", action="append", default=[])
    ap.add_argument("--out", default="a.json")
    ap.add_argument("overrides", nargs="*")
    key = harness.run_key(ap.parse_args(["b=1", "a=2", "--out", "x.json"]))
    assert key == "--steps=20 b=1 a=2"
    assert harness.run_key(ap.parse_args(["--steps", "20", "b=1", "a=2"])) == key
    assert harness.run_key(ap.parse_args(["a=2", "b=1"])) != key
    assert harness.run_key(ap.parse_args(["--async-override", "x=1", "--async-compare"])) == (
        "--async-compare --async-override=x=1 --steps=20")
    assert harness.run_key(ap.parse_args([]), skip=("out", "steps")) == ""


def test_a_results_file_keeps_the_latest_run_of_each_configuration(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "bench_x.json"
    harness.save_latest(out, "a", {"step_s": 1.0})
    harness.save_latest(out, "b", {"step_s": 2.0})
    harness.save_latest(out, "a", {"step_s": 3.0})
    results = harness.load_results(out)
    assert results == {"b": {"step_s": 2.0}, "a": {"step_s": 3.0}}
    assert list(results) == ["b", "a"]  # newest last
    assert harness.latest(results) == {"step_s": 3.0}
    assert [p.name for p in out.parent.iterdir()] == ["bench_x.json"]  # no temporary file left
    assert harness.load_results(tmp_path / "none.json") == {}


def test_a_log_of_runs_is_moved_aside(tmp_path: Path) -> None:
    out = tmp_path / "bench_x.json"
    out.write_text(json.dumps([{"step_s": 1.0}, {"step_s": 0.5}]))
    assert harness.latest(json.loads(out.read_text())) == {"step_s": 0.5}
    harness.save_latest(out, "k", {"step_s": 2.0})
    assert harness.load_results(out) == {"k": {"step_s": 2.0}}
    assert json.loads((tmp_path / "bench_x.history.json").read_text()) == [{"step_s": 1.0}, {"step_s": 0.5}]
    out.write_text("[]")
    with pytest.raises(ValueError, match="keyed by configuration"):
        harness.load_results(out)


def test_the_table_lines_up_its_columns() -> None:
    rows = [("grpo/tiny", "2025-01-01T00:00:00", harness.Row("step", "0.100 s", "0.080 s bare", 1.25, "<= 1.15")),
            ("start/tiny", "", harness.Row("skipped", "not prepared", "", None))]
    lines = harness.render_table(rows).splitlines()
    assert len(lines) == 4 and lines[0].startswith("benchmark")
    assert "1.25" in lines[2] and "<= 1.15" in lines[2] and lines[3].split()[-1] == "-"
    assert lines[2].index("0.100 s") == lines[0].index("result") == lines[3].index("not prepared")
