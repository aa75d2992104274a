"""rlpost.runtime.resources on a real local Ray: the probe actor of another node (here pinned to this one) samples
the actors it is given, answers within the step's wait, and is not itself listed as one of the job's actors."""

from __future__ import annotations

import os
import time

import pytest
import ray

from rlpost.runtime.resources import NodeSampler, ResourceMonitor, _job_actors, _this_node


@ray.remote(num_cpus=0)
class Spinner:
    def pid(self) -> int:
        return os.getpid()

    def spin(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass


def test_a_node_probe_samples_the_actors_it_is_given(ray_local: None) -> None:
    spinner = Spinner.options(name="spinner-0-0123456789ab").remote()
    pid = ray.get(spinner.pid.remote(), timeout=60)
    here = _this_node()
    assert _job_actors()[here]["spinner-0"] == pid

    monitor = ResourceMonitor()
    deadline = time.monotonic() + 90
    first = monitor._remote({here: {"spinner-0": pid}})  # what it does for every node but the driver's
    while not first and time.monotonic() < deadline:  # a probe still starting is late: left out of that row
        first = monitor._remote({here: {"spinner-0": pid}})
    assert first["resources/spinner-0/rss_gib"] > 0.01, first
    ray.get(spinner.spin.remote(1.5), timeout=60)
    second = monitor._remote({here: {"spinner-0": pid}})
    assert second["resources/spinner-0/cpu_percent"] > 30.0, second  # the probe kept the first sample's CPU time
    assert len(monitor._probes) == 1

    listed = _job_actors()
    assert NodeSampler.__name__.lower() not in listed[here] and set(listed[here]) == {"spinner-0"}
    whole = monitor.sample()  # the driver's node: sampled here, not by the probe
    assert whole["resources/spinner-0/rss_gib"] == pytest.approx(second["resources/spinner-0/rss_gib"], rel=0.5)

    ray.kill(next(iter(monitor._probes.values())))
    assert monitor._remote({here: {"spinner-0": pid}}) == {}  # a dead probe: no numbers, and it is dropped
    assert monitor._probes == {}
    ray.kill(spinner)
