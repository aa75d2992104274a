"""Helpers of the tests that run the installed `rlpost train` in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RLPOST = shutil.which("rlpost") or str(REPO / ".venv" / "bin" / "rlpost")
TIMING = ("timing/", "performance/")


def env(cache: Path) -> dict[str, str]:
    return {**os.environ, "RLPOST_CACHE_DIR": str(cache), "RAY_AUTH_MODE": "disabled", "HYDRA_FULL_ERROR": "1"}


def train(run_dir: Path, cache: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([RLPOST, "train", f"hydra.run.dir={run_dir}", *overrides], env=env(cache),
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
