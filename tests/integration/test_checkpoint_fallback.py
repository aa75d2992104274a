"""A corrupted latest checkpoint does not block the re-run: `rlpost train` moves it aside, says so in
one line, resumes from the previous checkpoint, and metrics.jsonl keeps one row per step. Resume never unpickles:
pickles planted in a checkpoint are ignored, and a shard replaced by one is refused with exit status 2 (the
policy-level sweep over backends is tests/integration/test_checkpoint_no_pickle.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rlpost.runtime.checkpointing import write_manifest
from tests.fault_table import Record
from tests.pickles import plant

pytestmark = [pytest.mark.slow, pytest.mark.faults]

REPO = Path(__file__).resolve().parents[2]
RLPOST = shutil.which("rlpost") or str(REPO / ".venv" / "bin" / "rlpost")
SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=8", "policy.train_global_batch_size=32",
         "policy.train_micro_batch_size=8", "policy.logprob_batch_size=16"]


def env(cache: Path) -> dict[str, str]:
    return {**os.environ, "RLPOST_CACHE_DIR": str(cache), "RAY_AUTH_MODE": "disabled", "HYDRA_FULL_ERROR": "1"}


def train(run_dir: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([RLPOST, "train", f"hydra.run.dir={run_dir}", *overrides], env=env(cache),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_corrupt_checkpoint_falls_back_and_a_pickle_is_never_loaded(tmp_path: Path, cache: Path,
                                                                       fault: Record) -> None:
    """Step 2 truncated: the re-run moves it aside and resumes from step 1, whose directories hold planted pickles
    (listed in its manifest, so only the loaders stand in their way) that never run. Then step 3's model shard
    replaced by a pickle, the manifest rewritten to match (as an attacker with write access would): refused with
    exit status 2, not loaded and not taken for corruption."""
    run, canary = tmp_path / "run", tmp_path / "PWNED"
    common = [*SMALL, "generation=hf", "grpo.val_period=0", "checkpointing.save_period=1",
              "checkpointing.metric_name=train:reward"]
    train(run, cache, *common, "grpo.max_num_steps=2")
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_1", "step_2"]

    step1 = ckpts / "step_1"
    for d in [step1, *(p for p in step1.rglob("*") if p.is_dir())]:
        for rel in ("pickle.pkl", ".metadata", "state.pt", "pytorch_model.bin"):
            plant(d / rel, canary)
    write_manifest(step1)
    files = [p for p in (ckpts / "step_2" / "policy").rglob("*") if p.is_file()]
    victim = max(files, key=lambda p: p.stat().st_size)
    rel = victim.relative_to(ckpts / "step_2").as_posix()
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with (run / "metrics.jsonl").open("a") as f:  # what a run killed mid-step-3 could leave behind
        f.write('{"step": 3, "train/re')

    out = train(run, cache, *common, "grpo.max_num_steps=3")
    fault("a truncated checkpoint shard", out.returncode, out.stdout + out.stderr,
          data_lost=metric_steps(run) != [1, 2, 3])
    warning = [ln for ln in out.stderr.splitlines() if "is corrupt" in ln]
    assert len(warning) == 1, out.stderr[-3000:]
    assert "step_2" in warning[0] and rel in warning[0] and "resuming from step_1" in warning[0]
    assert "Traceback" not in out.stderr
    assert (ckpts / "corrupt_step_2" / rel).is_file()  # moved aside, not deleted
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_1", "step_2", "step_3"]
    assert metric_steps(run) == [1, 2, 3]
    assert not canary.exists()

    step3 = ckpts / "step_3"
    plant(next((step3 / "policy" / "weights" / "model").glob("*.safetensors")), canary)
    write_manifest(step3)
    out = subprocess.run([RLPOST, "train", f"hydra.run.dir={run}", *common, "grpo.max_num_steps=4"], env=env(cache),
                         capture_output=True, text=True, timeout=600)
    fault("a checkpoint shard replaced by a pickle", out.returncode, out.stdout + out.stderr,
          data_lost=not step3.is_dir())
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if "cannot load checkpoint" in ln]
    assert lines and str(step3) in lines[0] and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert not canary.exists() and step3.is_dir()
