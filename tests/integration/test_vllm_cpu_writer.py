"""rlpost's CPU weight writer leaves vLLM's engine exactly as vLLM's own reload_weights does, owns what it
loaded, and hands back to reload_weights what it can't place (a fused layer split across buckets)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.vllm_scripts import run_check

pytestmark = pytest.mark.slow


def test_cpu_writer_equals_vllm_reload(tiny_model_dir: Path) -> None:
    r, _ = run_check("vllm_writer_check.py", tiny_model_dir)
    assert r["path_reload"] == "reload" and r["path_writer"] == "writer"
    assert r["fp_writer"] == r["fp_reload"]  # both consumed the same tensors
    assert r["base_differs"]  # the seeded weights change the greedy output: the comparison can fail
    assert r["writer_equals_reload"]  # same tokens and bit-identical logprobs
    assert r["survives_overwritten_sources"]
    assert r["shm_bucket_equals_reload"] and r["survives_reused_segment"]
    assert r["split_fused_refused"] and r["unknown_refused"]
