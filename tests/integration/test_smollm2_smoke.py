"""The real-model path stays alive: 2 GRPO steps with a validation and a checkpoint on SmolLM2-135M-Instruct
(prepared by `make smollm2`, which `make test` runs first and which is cached), through the installed CLI. That the
HF export, evaluated by `rlpost eval`, scores what the run's final validation scored is shown on the tiny model
(tests/integration/test_eval.py): the same code, without another 135M-model start."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RLPOST = shutil.which("rlpost") or str(REPO / ".venv" / "bin" / "rlpost")
CACHE = Path(os.environ.get("RLPOST_CACHE_DIR") or Path(os.environ.get("HOME", "/tmp")) / ".cache" / "rlpost")
MODEL = CACHE / "smollm2-135m-instruct"
SMALL = ["experiment=smollm2_arith_cpu", "policy.generation.max_new_tokens=8"]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([RLPOST, *args], env=env, capture_output=True, text=True, timeout=900, cwd=cwd)


@pytest.mark.skipif(not (MODEL / "rlpost_prepared.json").is_file(),
                    reason=f"{MODEL} is not prepared; `make test` prepares it (`make smollm2`)")
def test_two_grpo_steps_validate_and_export_smollm2(tmp_path: Path) -> None:
    train = run("train", f"hydra.run.dir={tmp_path / 'run'}", *SMALL, "grpo.max_num_steps=2",
                "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=8",
                "policy.train_micro_batch_size=4", "policy.logprob_batch_size=8", "grpo.val_period=2",
                "grpo.max_val_samples=4", "grpo.val_batch_size=4",
                "checkpointing.metric_name=train:reward", "checkpointing.save_period=2", cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert 0.0 <= rows[-1]["validation/accuracy"] <= 1.0 and 0 < rows[-1]["validation/avg_length"] <= 8
    for r in rows:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"])
        # the engine serves the trainer's weights: refit of a real model keeps the two sides' logprobs together
        assert 1.0 <= r["train/token_mult_prob_error"] < 1.05, r["train/token_mult_prob_error"]

    step = tmp_path / "run" / "checkpoints" / "step_2"
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(step / "policy" / "weights" / "hf")
    assert exported.config.model_type == "llama" and exported.num_parameters() > 100_000_000
