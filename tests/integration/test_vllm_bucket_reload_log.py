"""A refit in several buckets through vLLM's reload_weights loads the same weights as one load, and the engine's log
carries none of the per-layer "Failed to load weights" lines vLLM would write for the layers a bucket leaves alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.vllm_scripts import run_check

pytestmark = pytest.mark.slow


def test_a_bucketed_reload_is_exact_and_quiet(tiny_model_dir: Path) -> None:
    r, log = run_check("vllm_bucket_log_check.py", tiny_model_dir)
    assert r["buckets"] == r["whole"] != r["base"]  # two buckets load what one load does, and it is not the base
    assert "WARNING" in log or "INFO" in log  # vLLM's own log reaches this output: its absence below means something
    assert "Failed to load weights" not in log
    assert "were not loaded from checkpoint" not in log
