"""checkpointing.checkpoint_must_save_by through a real `rlpost train`: with a budget already spent after
the first step, the run saves that step, says so in one line and exits 0; re-running resumes. The same
runs print validation samples (logger.num_val_samples_to_print) and train with policy.hf_config_overrides,
which the HF engine must apply too (train/token_mult_prob_error stays at 1)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RLPOST = shutil.which("rlpost") or str(REPO / ".venv" / "bin" / "rlpost")


def test_run_saves_and_stops_before_the_deadline_then_resumes(tmp_path: Path, cache: Path) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "RLPOST_CACHE_DIR": str(cache), "RAY_AUTH_MODE": "disabled"}
    cmd = [RLPOST, "train", f"hydra.run.dir={run}", "generation=hf", "grpo.max_num_steps=50", "grpo.val_period=1",
           "grpo.max_val_samples=8", "checkpointing.save_period=1000", "checkpointing.checkpoint_must_save_by=00:00:00:01",
           "logger.num_val_samples_to_print=2", "+policy.hf_config_overrides.rms_norm_eps=0.5"]
    for step in (1, 2):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        lines = [ln for ln in out.stderr.splitlines() if ln.startswith("rlpost: ")]
        stop = [ln for ln in lines if "checkpoint_must_save_by" in ln]
        assert len(stop) == 1 and f"saved step {step} and stopped" in stop[0] and "re-run" in stop[0], lines
        samples = [ln for ln in lines if ln.startswith("rlpost: validation sample ") and f"at step {step}:" in ln]
        assert len(samples) == 2 and all(" -> " in ln and "(reward " in ln and len(ln) <= 210 for ln in samples)
        if step == 2:
            assert any("resuming from step 1" in ln for ln in lines)
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{s}" for s in range(1, step + 1)]
        assert (run / "checkpoints" / f"step_{step}" / "policy" / "weights" / "hf" / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3 for r in rows), rows
    hf = json.loads((run / "checkpoints" / "step_2" / "policy" / "weights" / "hf" / "config.json").read_text())
    assert hf["rms_norm_eps"] == 0.5


def test_supervised_runs_honour_the_deadline_too(tmp_path: Path, cache: Path) -> None:
    """algo=sft (the loop DPO and RM share) reads checkpointing.checkpoint_must_save_by like GRPO: save the step,
    stop with exit 0, and the re-run resumes from it."""
    algo = "sft"
    run = tmp_path / "run"
    env = {**os.environ, "RLPOST_CACHE_DIR": str(cache), "RAY_AUTH_MODE": "disabled"}
    cmd = [RLPOST, "train", f"hydra.run.dir={run}", f"algo={algo}", f"{algo}.val_at_start=false",
           "checkpointing.save_period=1000", "checkpointing.checkpoint_must_save_by=00:00:00:01"]
    for step in (1, 2):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        stop = [ln for ln in out.stderr.splitlines() if "checkpoint_must_save_by" in ln]
        assert len(stop) == 1 and f"saved step {step} and stopped" in stop[0], out.stderr[-2000:]
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{s}" for s in range(1, step + 1)]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("validation/loss" in r for r in rows)
