"""`rlpost eval` through the installed CLI: a model directory and a trained (LoRA) checkpoint's adapter,
accuracy / pass@k / length in a JSON report, a clean console, and bad input refused with exit 2."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RLPOST = shutil.which("rlpost") or str(REPO / ".venv" / "bin" / "rlpost")


def run(cache: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RLPOST_CACHE_DIR": str(cache), "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([RLPOST, *args], env=env, capture_output=True, text=True, timeout=600, cwd=cwd)


def test_eval_a_model_dir_and_a_trained_checkpoint(tmp_path: Path, cache: Path) -> None:
    out = run(cache, "eval", "generation=hf", "eval.num_samples=4", "eval.max_prompts=8",
              f"eval.output={tmp_path / 'base.json'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    base = json.loads((tmp_path / "base.json").read_text())
    assert base["num_prompts"] == 8 and base["num_samples"] == 32 and base["k"] == 4
    assert 0.0 <= base["accuracy"] <= base["pass@4"] <= 1.0 and base["mean_length"] == 1.0
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert all(re.match(r"^(rlpost eval: |  accuracy |  report: )", line) for line in lines), lines
    assert (tmp_path / "base.log").is_file()  # the engine's output went there

    # val_period=5 > max_num_steps: the only validation is the one every run ends with, in two batches of 8
    val = ["grpo.max_val_samples=16", "grpo.val_batch_size=8"]
    # trained with LoRA: the checkpoint holds a PEFT adapter, which eval merges into the base (quietly: its progress
    # bars go to the log)
    train = run(cache, "train", f"hydra.run.dir={tmp_path / 'run'}", "generation=hf", "grpo.max_num_steps=3",
                "grpo.val_period=5", *val, "checkpointing.metric_name=train:reward", "checkpointing.save_period=1",
                "policy.dtensor_cfg.lora_cfg.enabled=true", cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    validated = [r for r in rows if "validation/reward" in r]
    assert [r["step"] for r in validated] == [3]
    step = tmp_path / "run" / "checkpoints" / "step_3"
    out = run(cache, "eval", "generation=hf", *val, "eval.max_prompts=16", f"eval.checkpoint={step}",
              f"eval.output={tmp_path / 'trained.json'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert all(re.match(r"^(rlpost eval: |  accuracy |  report: )", line) for line in lines), lines
    trained = json.loads((tmp_path / "trained.json").read_text())
    assert (step / "policy" / "weights" / "adapter" / "adapter_model.safetensors").is_file()
    assert trained["model"] == str(tmp_path / "merged_model") and trained["k"] == 1
    assert trained["step"] == 3 and trained["accuracy"] == trained["pass@1"]
    # the adapter alone, sampled with validation's seeds, scores what the run's final validation scored
    assert trained["accuracy"] == validated[0]["validation/accuracy"]
    assert trained["mean_reward"] == pytest.approx(validated[0]["validation/reward"], abs=1e-9)


def test_eval_refuses_a_checkpoint_without_an_export(tmp_path: Path, cache: Path) -> None:
    out = run(cache, "eval", f"eval.checkpoint={tmp_path / 'nothing'}", cwd=tmp_path)
    assert out.returncode == 2 and "eval.checkpoint" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "outputs").exists()
