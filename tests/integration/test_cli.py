"""The installed `rlpost` script in a subprocess: help, version, --cfg, plan, and a bad config."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = REPO / "tests" / "snapshots" / "default_cfg_job.yaml"


def rlpost(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("rlpost") or str(REPO / ".venv" / "bin" / "rlpost")
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "RLPOST_CACHE_DIR": str(cwd / "cache"), "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def test_help_and_version(tmp_path: Path) -> None:
    out = rlpost("--help", cwd=tmp_path)
    assert out.returncode == 0 and "rlpost train" in out.stdout and "plan" in out.stdout
    out = rlpost("--version", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("rlpost ")
    out = rlpost("trian", cwd=tmp_path)
    assert out.returncode == 2 and "did you mean 'train'" in out.stderr


def test_train_help_lists_groups(tmp_path: Path) -> None:
    out = rlpost("train", "--help", cwd=tmp_path)
    assert out.returncode == 0
    for group in ("policy:", "generation:", "loss:", "algo:"):
        assert group in out.stdout


def test_cfg_job_matches_snapshot(tmp_path: Path) -> None:
    out = rlpost("train", "--cfg", "job", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == SNAPSHOT.read_text(), (
        "the default config changed; if intended, regenerate with "
        "`rlpost train --cfg job > tests/snapshots/default_cfg_job.yaml`"
    )


def test_bad_config_subprocess_exit_2_no_traceback(tmp_path: Path) -> None:
    out = rlpost("train", "policy.train_global_batch_size=96", cwd=tmp_path)
    assert out.returncode == 2
    assert "policy.train_global_batch_size=96" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "outputs").exists()


def test_plan_prints_derived_numbers(tmp_path: Path) -> None:
    out = rlpost("plan", "cluster.gpus_per_node=2", "policy.dtensor_cfg.tensor_parallel_size=2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "DP=1 TP=2 PP=1 CP=1" in text
    assert "completions per step" in text and "256 (16 x 16)" in text
    assert not (tmp_path / "outputs").exists()
