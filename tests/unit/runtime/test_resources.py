"""rlpost.runtime.resources: the driver's and actors' CPU % and RSS from psutil, tokens/s from a step's phases, and
the metric names of Ray actors."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

psutil = pytest.importorskip("psutil")  # a device machine without it skips the GPU check below, not fails

from rlpost.runtime.resources import ResourceMonitor, _ProcessTree, actor_label, tokens_per_s  # noqa: E402


def test_actor_labels_drop_the_groups_unique_suffix() -> None:
    assert actor_label("policy-0-7f3a2b1c4d50", "DTensorPolicyWorker") == "policy-0"
    assert actor_label("vllm-replica0-7f3a2b1c4d50", "VllmEngineWorker") == "vllm-replica0"
    assert actor_label("", "ReplayBuffer") == "replaybuffer"
    assert actor_label("a b:c", "X") == "a_b_c"


def test_tokens_per_s_use_the_generation_and_training_phases() -> None:
    times = {"generation": 0.5, "policy_training": 0.25, "total_step_time": 1.0}
    assert tokens_per_s(100.0, 200.0, times) == {"resources/generation_tokens_per_s": 200.0,
                                                 "resources/training_tokens_per_s": 800.0}
    # SFT/DPO: nothing generated, no training phase: the whole step
    assert tokens_per_s(None, 50.0, {"total_step_time": 0.5}) == {"resources/training_tokens_per_s": 100.0}


def test_a_busy_process_tree_reads_about_one_core_and_its_memory() -> None:
    # a parent that starts a spinning child: the tree sums them
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'while True: pass']); "
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        tree = _ProcessTree(psutil.Process(proc.pid))
        deadline = time.monotonic() + 10
        while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        tree.sample()
        time.sleep(1.0)
        got = tree.sample()
        assert got is not None
        assert 40.0 < got["cpu_percent"] < 210.0, got  # one spinning core (shared with whatever else runs)
        assert 0.005 < got["rss_gib"] < 1.0, got
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()
    assert tree.sample() is None  # gone


def test_without_ray_the_monitor_samples_the_driver() -> None:
    monitor = ResourceMonitor()
    first = monitor.sample()
    assert first["resources/driver/rss_gib"] == pytest.approx(psutil.Process().memory_info().rss / 2**30, rel=0.2)
    assert first["resources/driver/cpu_percent"] >= 0.0
    assert not [k for k in first if k.startswith("resources/") and not k.startswith(("resources/driver/",
                                                                                     "resources/gpu"))]


@pytest.mark.gpu
def test_nvml_reads_each_gpus_memory_and_load() -> None:
    """NVML's device numbers (NeMo RL's monitor_gpus): 512 MiB allocated on the device shows in its used memory."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("pynvml")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.cuda.init()
    monitor = ResourceMonitor()
    before = monitor.sample()
    held = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    after = monitor.sample()
    assert after["resources/gpu0/memory_used_gib"] - before["resources/gpu0/memory_used_gib"] > 0.4, (before, after)
    assert 0.0 <= after["resources/gpu0/utilization_pct"] <= 100.0
    del held


def test_the_peak_resident_set_outlives_the_memory_that_made_it() -> None:
    """peak_rss_gib is the process's high-water mark: 300 MiB touched and freed still count after."""
    code = ("import sys, time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); del b; "
            "print('freed', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "freed"
        got = _ProcessTree(psutil.Process(proc.pid)).sample()
        assert got is not None
        assert got["rss_gib"] < 0.2, got  # the pages went back
        assert got["peak_rss_gib"] > 0.29, got
    finally:
        proc.kill()
        proc.wait()
