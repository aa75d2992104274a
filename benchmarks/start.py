"""Time to the first step as a user sees it: `rlpost train` launched as a fresh process, until the first step's
metrics row is written, beside its limit measured on the same host in the same run: a fresh process that only
imports vLLM and builds rlpost's engine for the same model. The engine's start is the longest part of a run's
start, so a run cannot start faster than a process that does nothing else.

    .venv/bin/python -m benchmarks.start                   # default job, 3 rounds
    .venv/bin/python -m benchmarks.start --rounds 5 policy=dtensor_v2

Each round runs the job, then the bare engine, alternating, so the host's drift touches both. Extra arguments are
Hydra overrides for both. benchmarks.grpo's `time_to_first_step_s` starts at `setup()` inside an already started
Python (no interpreter start, CLI, Hydra composition or pre-flight checks): it is the part this one ends with.
Results go to results/bench_start.json, the latest run per configuration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO, RESULTS_DIR, Row, host, now, run_key, save_latest

RESULTS = RESULTS_DIR / "bench_start.json"

TARGET_S = 15.0
"""The target for the default job's time to the first step."""

RATIO_LIMIT = 1.3
"""Time to the first step at most this many times a bare engine's start."""

EXIT_LIMIT_S = 3.0
"""The process ends at most this long after its last step's row."""

JOB = ["grpo.max_num_steps=1", "grpo.val_period=0", "grpo.val_at_start=false", "checkpointing=disabled",
       "logger.console_progress=false"]
"""One step, nothing after it: the run ends once its first row is written."""

BARE_ENGINE = """
import sys, time
t0 = float(sys.argv[1])
from rlpost.config.load import load_master_config
from benchmarks import limits
_, cfg = load_master_config(sys.argv[2:])
worker, _, _ = limits._engine_worker(cfg)
print("READY", time.time() - t0, flush=True)
worker.shutdown()
"""
"""A fresh Python that builds the engine and says when it is ready (seconds since its launch)."""


def _env() -> dict[str, str]:
    """This process's environment, one compute thread by default, and this repository's `benchmarks` importable."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": path}


def first_row_s(overrides: list[str], timeout_s: float = 600.0) -> tuple[float, float]:
    """(seconds from launching `rlpost train` to its first metrics row, seconds from that row, the one step's, to
    the process's exit)."""
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "rlpost.cli", "train", *JOB, *overrides, f"hydra.run.dir={run_dir}"]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        metrics = Path(run_dir) / "metrics.jsonl"
        first = None
        while first is None and proc.poll() is None and time.perf_counter() - t0 < timeout_s:
            if metrics.is_file() and metrics.stat().st_size > 0:
                first = time.perf_counter() - t0
            time.sleep(0.02)
        if first is None and metrics.is_file() and metrics.stat().st_size > 0:
            first = time.perf_counter() - t0  # the run ended between two polls
        _, err = proc.communicate(timeout=timeout_s)
        exited = time.perf_counter() - t0
        if first is None or proc.returncode != 0:
            raise RuntimeError(f"rlpost train exited {proc.returncode} without a metrics row: {err[-2000:]}")
        return first, exited - first


def bare_engine_s(overrides: list[str], timeout_s: float = 600.0) -> float:
    """Seconds from launching a fresh Python to rlpost's vLLM engine built in it (imports included)."""
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", BARE_ENGINE, repr(t0), *overrides], env=_env(), capture_output=True,
                         text=True, timeout=timeout_s)
    ready = [ln for ln in out.stdout.splitlines() if ln.startswith("READY ")]
    if out.returncode != 0 or not ready:
        raise RuntimeError(f"the bare engine did not start: {out.stderr[-2000:]}")
    return float(ready[-1].split()[1])


def summarise(first: list[float], bare: list[float], exits: list[float]) -> dict[str, Any]:
    """Medians and spreads of both sides, the per-round ratio first / bare (median) and the exit after the step."""
    ratios = [f / b for f, b in zip(first, bare, strict=True)]
    return {"first_step_s": first, "bare_engine_s": bare, "exit_s": exits,
            "first_step_median_s": round(statistics.median(first), 2),
            "bare_engine_median_s": round(statistics.median(bare), 2),
            "ratio_median": round(statistics.median(ratios), 3), "ratio_limit": RATIO_LIMIT,
            "exit_median_s": round(statistics.median(exits), 2), "exit_limit_s": EXIT_LIMIT_S,
            "target_s": TARGET_S, "meets_target": statistics.median(first) <= TARGET_S}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.start", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("overrides", nargs="*")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    first, bare, exits = [], [], []
    for r in range(args.rounds):
        step_s, exit_s = first_row_s(args.overrides)
        first.append(round(step_s, 2))
        exits.append(round(exit_s, 2))
        bare.append(round(bare_engine_s(args.overrides), 2))
        print(f"round {r + 1}: rlpost train's first step after {first[-1]:.2f}s, its exit {exits[-1]:.2f}s later; "
              f"a bare engine's start {bare[-1]:.2f}s", flush=True)
    result = {**summarise(first, bare, exits), "overrides": args.overrides, "host": host(), "date": now()}
    print(f"time to first step {result['first_step_median_s']:.2f}s (median of {args.rounds}; target <= "
          f"{TARGET_S:.0f}s) vs a bare vLLM engine's start {result['bare_engine_median_s']:.2f}s in a fresh process: "
          f"ratio {result['ratio_median']:.2f} (limit {RATIO_LIMIT}); exit {result['exit_median_s']:.2f}s after the "
          f"last step (limit {EXIT_LIMIT_S:.0f}s)")
    save_latest(args.out, run_key(args), result)
    return 0


def table_rows(result: dict[str, Any]) -> list[Row]:
    """The suite's row for one result: the median time to the first step beside a bare engine's start."""
    rows = [Row("time to first step (median)", f"{result['first_step_median_s']:.2f} s",
                f"{result['bare_engine_median_s']:.2f} s bare engine start", result["ratio_median"],
                f"<= {result.get('ratio_limit', RATIO_LIMIT)}")]
    if "exit_median_s" in result:
        limit = result["exit_limit_s"]
        rows.append(Row("exit after the last step (median)", f"{result['exit_median_s']:.2f} s", f"{limit:.0f} s limit",
                        round(result["exit_median_s"] / limit, 3), "<= 1"))
    return rows


if __name__ == "__main__":
    sys.exit(main())
