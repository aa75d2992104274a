#!/usr/bin/env python
"""Benchmark N GRPO steps of a fixed workload; print and save per-phase times, tokens/s and peak
memory, each beside its limit measured in the same run (bench_limits.py): the bare engine
generating the same prompts in-process, bare torch training on the same batch, and a memcpy of the
model's bytes.

    .venv/bin/python scripts/bench_grpo.py                       # default job, 20 steps
    .venv/bin/python scripts/bench_grpo.py --steps 10 generation=hf policy=dtensor_v2
    .venv/bin/python scripts/bench_grpo.py --steps 10 model.tiny.hidden_size=512 model.tiny.num_layers=6 \
        model.tiny.num_attention_heads=8 model.tiny.num_key_value_heads=4 model.tiny.intermediate_size=1408

Extra arguments are Hydra overrides. Results go to results/bench_grpo.json (one entry per run).
Peak memory is the largest sum of RSS over the driver and all its descendant processes (Ray's
GCS/raylet, policy workers, engines, verifiers), sampled every 0.2 s.
Printed ratios: step / (bare generation + bare training) (target <= 1.15), refit GB/s beside memcpy GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from rlpost.config.load import load_master_config

REPO = Path(__file__).resolve().parents[1]


class TreeMemory:
    """Peak total RSS of this process and its descendants."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            time.sleep(0.2)

    def __enter__(self) -> TreeMemory:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2, help="steps excluded from the averages")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_grpo.json"))
    ap.add_argument("--no-limits", action="store_true", help="skip the bare-engine / bare-torch / memcpy limits")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from rlpost.algorithms.grpo import grpo_train, setup

    overrides = [f"grpo.max_num_steps={args.steps}", "grpo.val_period=0", "checkpointing=disabled",
                 "logger.console_progress=false", *args.overrides]
    _, cfg = load_master_config(overrides)
    steps: list[dict[str, float]] = []
    t0 = time.perf_counter()
    with TreeMemory() as mem, tempfile.TemporaryDirectory() as run_dir:
        comps = setup(cfg, Path(run_dir))
        t_setup = time.perf_counter() - t0
        try:
            grpo_train(comps, on_step=lambda step, m: steps.append(dict(m)))
        finally:
            comps.close()
            import ray

            ray.shutdown()
    wall = time.perf_counter() - t0
    measured = steps[args.warmup:] or steps
    limits: dict[str, float] = {}
    if not args.no_limits:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_limits import measure_limits

        limits = measure_limits(cfg)
    phases = sorted({k for m in measured for k in m if k.startswith("timing/train/")})
    result = {
        "overrides": overrides,
        "steps": len(steps),
        "setup_s": round(t_setup, 2),
        "wall_s": round(wall, 2),
        "phase_mean_s": {k.removeprefix("timing/train/"): round(statistics.mean(m.get(k, 0.0) for m in measured), 4)
                         for k in phases},
        "tokens_per_sec": round(statistics.mean(m["performance/tokens_per_sec"] for m in measured), 1),
        "generation_tokens_per_sec": round(
            statistics.mean(m["performance/generation_tokens_per_sec"] for m in measured), 1),
        "peak_memory_gib": round(mem.peak / 2**30, 3),
        "time_to_first_step_s": round(t_setup + (steps[0].get("timing/train/total_step_time", 0.0) if steps else 0.0), 2),
        "final_reward": steps[-1].get("train/reward") if steps else None,
        "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if limits:
        step_s = statistics.mean(m["timing/train/total_step_time"] for m in measured)
        refit_s = statistics.mean(m.get("timing/train/refit", 0.0) for m in measured) or float("nan")
        bare = limits["bare_generation_s"] + limits["bare_training_s"]
        result["limits"] = {k: round(v, 4) for k, v in limits.items()}
        result["step_over_bare"] = round(step_s / bare, 3)
        result["refit_gbps"] = round(limits["model_bytes"] / refit_s / 1e9, 3)
    print(json.dumps(result, indent=1))
    if limits:
        print(f"step {step_s:.3f}s vs bare generation {limits['bare_generation_s']:.3f}s + bare training "
              f"{limits['bare_training_s']:.3f}s: ratio {result['step_over_bare']:.2f} (target <= 1.15)")
        print(f"refit {result['refit_gbps']:.2f} GB/s vs memcpy {limits['memcpy_gbps']:.2f} GB/s "
              f"({limits['model_bytes'] / 1e6:.1f} MB)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    history = json.loads(out.read_text()) if out.is_file() else []
    out.write_text(json.dumps([*history, result], indent=1))
    print(f"saved to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
