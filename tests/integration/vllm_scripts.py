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


def cpu_engine(model_dir: str, max_new_tokens: int, max_model_len: int,
               seed: int) -> tuple[Any, list[tuple[str, Any]], list[tuple[str, Any]]]:
    """Inside a check script: rlpost's vLLM-CPU engine worker on `model_dir` (the engine environment a run gives
    it), the checkpoint's weights, and those weights plus seeded noise (a refit that changes outputs)."""
    import torch
    from safetensors.torch import load_file

    from rlpost.config.schema.generation import VllmConfig
    from rlpost.models.generation import vllm_generation as vg
    from rlpost.models.generation.vllm_worker import VllmEngineWorker

    cfg = VllmConfig(max_new_tokens=max_new_tokens)
    os.environ.update(vg.engine_env(cfg.vllm_cfg, False))
    cfg.vllm_cfg.kv_cache_space_gb = 0.125
    cfg.vllm_cfg.max_model_len = max_model_len
    worker = VllmEngineWorker(model_dir, vg.engine_kwargs(cfg, 0, False))
    base = [(n, t) for f in sorted(os.listdir(model_dir)) if f.endswith(".safetensors")
            for n, t in load_file(os.path.join(model_dir, f)).items()]
    g = torch.Generator().manual_seed(seed)
    return worker, base, [(n, t + 0.3 * torch.randn(t.shape, generator=g)) for n, t in base]
