"""A refit in several buckets through vLLM's reload_weights loads the same weights as one load, and the engine's log
carries none of the per-layer "Failed to load weights" lines vLLM would write for the layers a bucket leaves alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_a_bucketed_reload_is_exact_and_quiet(tiny_model_dir: Path) -> None:
    script = Path(__file__).with_name("vllm_bucket_log_check.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tiny_model_dir)], capture_output=True, text=True,
                          timeout=300, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    r = json.loads(lines[-1].removeprefix("RESULT "))
    assert r["path"] == "reload"  # vLLM's reload_weights ran: the path that warns
    assert r["buckets"] == r["whole"] != r["base"]  # two buckets load what one load does, and it is not the base
    log = proc.stdout + proc.stderr
    assert "WARNING" in log or "INFO" in log  # vLLM's own log reaches this output: its absence below means something
    assert "Failed to load weights" not in log
    assert "were not loaded from checkpoint" not in log
