"""Checkpoint manager: atomic step_N directories, keep-top-k, resume from the latest, fingerprints.

A checkpoint is written into `tmp_step_N/` and renamed to `step_N/` only when complete
(`training_info.json` is written last), so a kill during a write leaves the previous checkpoint
usable; leftover `tmp_*` directories are removed on the next start. `keep_top_k` keeps the best by
`metric_name` ('val:x' / 'train:x'; ties go to the newer) and always the latest.

Each checkpoint records the fingerprints of the model it started from and of the config; resuming
with a different one is refused unless `checkpointing.force_resume=true`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

from rlpost.config.schema.checkpoint import CheckpointingConfig

# Config keys that may change between a run and its resume.
RESUMABLE_KEYS = ("grpo.max_num_steps", "grpo.max_num_epochs", "checkpointing", "logger", "cluster.address",
                  "cluster.placement_timeout_s", "cluster.call_timeout_s", "hydra")


class CheckpointMismatch(RuntimeError):
    """The checkpoint was written by another model or config."""


def model_fingerprint(model_dir: str) -> str:
    """sha256 over config.json and the weight files' bytes of a local HF model directory."""
    h = hashlib.sha256()
    d = Path(model_dir)
    for name in sorted(os.listdir(d)):
        if name == "config.json" or name.endswith(".safetensors"):
            h.update(name.encode())
            with open(d / name, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


def _flatten(d: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(d, dict):
        out: Dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def config_diff(old: Dict[str, Any], new: Dict[str, Any]) -> List[str]:
    """Keys whose values differ, ignoring RESUMABLE_KEYS."""
    a, b = _flatten(old), _flatten(new)
    keys = sorted(set(a) | set(b))
    return [k for k in keys if a.get(k) != b.get(k) and not any(k == r or k.startswith(r + ".") for r in RESUMABLE_KEYS)]


class CheckpointManager:
    """step_N checkpoints under one directory."""

    def __init__(self, cfg: CheckpointingConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else run_dir / "checkpoints"
        if cfg.enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            for leftover in self.dir.glob("tmp_step_*"):
                shutil.rmtree(leftover, ignore_errors=True)

    def steps(self) -> List[int]:
        if not self.dir.is_dir():
            return []
        out = []
        for p in self.dir.iterdir():
            m = re.fullmatch(r"step_(\d+)", p.name)
            if m and (p / "training_info.json").is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self) -> Optional[Path]:
        if not self.cfg.enabled:
            return None
        steps = self.steps()
        return self.dir / f"step_{steps[-1]}" if steps else None

    def check_resume(self, ckpt: Path, model_fp: str, config: Dict[str, Any]) -> None:
        """Raise CheckpointMismatch (unless force_resume) when the model or config differ."""
        saved = json.loads((ckpt / "fingerprint.json").read_text()) if (ckpt / "fingerprint.json").is_file() else {}
        problems = []
        if saved.get("model") not in (None, model_fp):
            problems.append(f"model fingerprint {saved.get('model')} != {model_fp}")
        old_cfg = saved.get("config") or {}
        diff = config_diff(old_cfg, config) if old_cfg else []
        if diff:
            shown = ", ".join(f"{k}: {_flatten(old_cfg).get(k)!r} -> {_flatten(config).get(k)!r}" for k in diff[:8])
            problems.append(f"config differs in {shown}")
        if problems and not self.cfg.force_resume:
            raise CheckpointMismatch(
                f"refusing to resume from {ckpt}: " + "; ".join(problems)
                + ". Use a new run directory, or checkpointing.force_resume=true to resume anyway."
            )

    def begin(self, step: int) -> Path:
        tmp = self.dir / f"tmp_step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def finalize(self, tmp: Path, step: int, info: Dict[str, Any], model_fp: str, config: Dict[str, Any]) -> Path:
        """Write the fingerprints and training_info.json last, then rename into place and prune."""
        (tmp / "fingerprint.json").write_text(json.dumps({"model": model_fp, "config": config}, indent=1, default=str))
        (tmp / "training_info.json").write_text(json.dumps(info, indent=1))
        final = self.dir / f"step_{step}"
        if final.exists():
            old = self.dir / f"old_step_{step}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        self._prune()
        return final

    def _prune(self) -> None:
        k = self.cfg.keep_top_k
        steps = self.steps()
        if k is None or len(steps) <= k:
            return
        latest = steps[-1]
        name = self.cfg.metric_name

        def score(step: int) -> tuple[float, int]:
            info = json.loads((self.dir / f"step_{step}" / "training_info.json").read_text())
            v = info.get(name) if name else None
            if v is None:
                return (float("-inf"), step)
            return ((v if self.cfg.higher_is_better else -v), step)

        ranked = sorted(steps, key=score, reverse=True)
        keep = set(ranked[:k]) | {latest}
        for s in steps:
            if s not in keep:
                shutil.rmtree(self.dir / f"step_{s}", ignore_errors=True)
