"""rlpost's CPU weight writer leaves vLLM's engine exactly as vLLM's own reload_weights does, owns what it
loaded, and hands back to reload_weights what it can't place (a fused layer split across buckets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_cpu_writer_equals_vllm_reload(tiny_model_dir: Path) -> None:
    script = Path(__file__).with_name("vllm_writer_check.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tiny_model_dir)], capture_output=True, text=True,
                          timeout=300, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    r = json.loads(lines[-1].removeprefix("RESULT "))
    assert r["path_reload"] == "reload" and r["path_writer"] == "writer"
    assert r["fp_writer"] == r["fp_reload"]  # both consumed the same tensors
    assert r["base_differs"]  # the seeded weights change the greedy output: the comparison can fail
    assert r["writer_equals_reload"]  # same tokens and bit-identical logprobs
    assert r["survives_overwritten_sources"]
    assert r["shm_bucket_equals_reload"] and r["survives_reused_segment"]
    assert r["split_fused_refused"] and r["unknown_refused"]
