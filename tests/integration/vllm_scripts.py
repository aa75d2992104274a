"""Running a vLLM check script in a fresh process (vLLM's engine is process-global state) and reading its result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_check(script: str, model_dir: Path) -> tuple[dict[str, Any], str]:
    """Run tests/integration/<script> on `model_dir`; its last `RESULT {json}` line, and its whole output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name(script)), str(model_dir)],
                          capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT ")), proc.stdout + proc.stderr
