"""scripts/bench_grpo.py's CPU accounting: how many CPUs a run kept busy, and the step no schedule can beat."""

from __future__ import annotations

import os
import time
from types import ModuleType

import pytest

from tests.scripts import load_script


def _bench() -> ModuleType:
    return load_script("bench_grpo")


def test_cpus_busy_is_cpu_seconds_over_wall_seconds_inside_the_window() -> None:
    b = _bench()
    # 1.5 CPUs busy from t=10 to t=14; the samples before and after the window ran at other rates
    samples = [(8.0, 0.0), (10.0, 1.0), (11.0, 2.5), (12.0, 4.0), (14.0, 7.0), (15.0, 7.1)]
    assert b.cpus_busy(samples, 10.0, 14.0) == pytest.approx(1.5)
    assert b.cpus_busy(samples, 9.0, 14.5) == pytest.approx(1.5)  # the first and last samples inside are used
    assert b.cpus_busy(samples, 14.0, 14.9) is None  # one sample: no rate
    assert b.cpus_busy([], 0.0, 1.0) is None


def test_the_cpu_floor_is_the_step_cpu_spread_over_the_hosts_cpus() -> None:
    b = _bench()
    cpus = os.cpu_count() or 1
    floor = b.cpu_floor(0.050, 1.8)
    assert floor["cpu_s_per_step"] == pytest.approx(0.09)
    assert floor["step_cpu_floor_s"] == pytest.approx(0.09 / cpus, abs=1e-4)
    assert b.cpu_floor(0.050, None) == {}


def test_the_sampler_records_the_trees_cpu_seconds() -> None:
    """A thread that spins for 0.8 s inside the sampled process: the samples' CPU seconds never fall and grow by
    at least a third of the spin (the spinning thread shares two CPUs with whatever else runs)."""
    b = _bench()
    with b.TreeUsage(sample_s=0.05) as usage:
        t0 = time.perf_counter()
        x = 0
        while time.perf_counter() - t0 < 0.8:
            x += 1
        time.sleep(0.1)
    cpu = [c for _, c in usage.cpu_samples]
    assert len(cpu) >= 5 and all(b2 >= a for a, b2 in zip(cpu, cpu[1:], strict=False))
    assert cpu[-1] - cpu[0] >= 0.25
    assert usage.peak > 0
