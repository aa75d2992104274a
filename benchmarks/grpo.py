"""Benchmark N GRPO steps of a fixed workload; print and save per-phase times, tokens/s and peak memory, each beside
its limit measured in the same run (benchmarks.limits): the bare engine generating the same prompts in-process, bare
torch training on the same batch, the engine's bare in-place load, and a memcpy of the model's bytes.

    .venv/bin/python -m benchmarks.grpo                       # default job, 20 steps
    .venv/bin/python -m benchmarks.grpo --steps 10 generation=hf policy=dtensor_v2
    .venv/bin/python -m benchmarks.grpo --steps 10 model.tiny.hidden_size=512 model.tiny.num_layers=6 \\
        model.tiny.num_attention_heads=8 model.tiny.num_key_value_heads=4 model.tiny.intermediate_size=1408

Extra arguments are Hydra overrides. Results go to results/bench_grpo.json, the latest run per configuration
(benchmarks.harness). With `logger.ray_timeline=true` each run also writes its timeline (every actor call and the
driver's phases on one clock, rlpost.runtime.ray_timeline) to results/bench_grpo_timeline[_sync|_async].json.
Peak memory is the largest sum of RSS over the driver and all its descendant processes (Ray's GCS/raylet, policy
workers, engines, verifiers), sampled every 0.2 s. The same sampler sums the tree's CPU seconds: over the measured
steps, how many of the host's CPUs the run kept busy, and so the shortest step any schedule of that work could take
on them (`step_cpu_floor_s`: CPU seconds a step / CPUs), the limit of overlapping phases.
Printed ratios: step / (bare generation + bare training) (target <= 1.15), refit GB/s beside memcpy GB/s.

    .venv/bin/python -m benchmarks.grpo --async-compare --steps 20 [overrides]   # sync vs async GRPO
    .venv/bin/python -m benchmarks.grpo --async-compare --async-override grpo.async_grpo.max_trajectory_age_steps=2

`--async-compare` runs sync and async GRPO on the same split layout (engine on one worker slot, trainer on the
other) and prints each step beside generation + training and max(generation, training). `--async-override` (repeat
it) adds an override to the async run only, for the async-only keys that the sync run refuses.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from benchmarks.harness import (
    RESULTS_DIR,
    Row,
    TreeUsage,
    cpu_floor,
    cpu_line,
    host,
    now,
    run_key,
    save_latest,
)

RESULTS = RESULTS_DIR / "bench_grpo.json"

SPLIT = ["cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
         "policy.generation.colocated.resources.gpus_per_node=1", "loss_fn.use_importance_sampling_correction=true"]
"""The engine on one worker slot, the trainer on the other (what async GRPO needs), IS correction on."""

STEP_TARGET = 1.15
"""Target of step / (bare generation + bare training)."""

ASYNC_TARGET = 1.1
"""Target of the async step / max(generation, training)."""


def run_steps(overrides: list[str]) -> tuple[Any, list[dict[str, float]], float, float, TreeUsage]:
    """(config, per-step metrics, setup seconds, wall seconds, the process tree's memory and CPU) of one training
    run, run as `rlpost train` runs it (rlpost.runner) in a temporary run directory."""
    from rlpost.config.load import load_master_config
    from rlpost.config.schema.master import MasterConfig
    from rlpost.runner import run
    from rlpost.runtime.ray_timeline import FILE_NAME
    from rlpost.runtime.run_log import ENV_VAR, capture_driver_output

    _, cfg = load_master_config(overrides)
    if not isinstance(cfg, MasterConfig):
        raise SystemExit("benchmarks.grpo measures GRPO runs (algo=grpo)")
    steps: list[dict[str, float]] = []
    t0 = time.perf_counter()
    with TreeUsage() as usage, tempfile.TemporaryDirectory() as run_dir:
        capture_driver_output(Path(run_dir) / "train.log")  # as `rlpost train` does: workers write to the run's log
        try:
            summary = run(cfg, Path(run_dir), on_step=lambda step, m: steps.append(stamped(m)))
        finally:
            os.environ.pop(ENV_VAR, None)
        timeline = Path(str(summary["metrics"])).parent / FILE_NAME
        if timeline.is_file():  # logger.ray_timeline: kept beside the results
            mode = ("_async" if cfg.grpo.async_grpo.enabled else "_sync") if SPLIT[0] in overrides else ""
            kept = RESULTS_DIR / f"bench_grpo_timeline{mode}.json"
            kept.parent.mkdir(exist_ok=True)
            shutil.copyfile(timeline, kept)
            print(f"timeline: {kept}", flush=True)
    return cfg, steps, cast(float, summary["setup_s"]), time.perf_counter() - t0, usage


WALL = "bench/logged_at"
"""The key `stamped` adds to a step's metrics row."""


def stamped(m: dict[str, float]) -> dict[str, float]:
    """A step's metrics row with the wall-clock time it was logged at (WALL)."""
    return {**m, WALL: time.perf_counter()}


def wall_steps(steps: list[dict[str, float]], warmup: int) -> list[float]:
    """Wall-clock seconds between consecutive steps' rows after the warm-up: everything a step costs, including
    what runs outside its `total_step_time` (logging, the step's bookkeeping between two timers)."""
    times = [m[WALL] for m in steps[max(warmup - 1, 0):]]
    gaps = [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
    return gaps or [steps[-1].get("timing/train/total_step_time", 0.0)]


def measured_window(steps: list[dict[str, float]], warmup: int) -> tuple[float, float]:
    """The perf_counter times from the end of the warm-up to the last step's row: the steps `wall_steps` measures."""
    if not steps:
        return (0.0, 0.0)
    return steps[max(warmup - 1, 0)][WALL], steps[-1][WALL]


def mean(measured: list[dict[str, float]], key: str) -> float:
    """The mean of `key` over the measured steps' rows (0 where a row lacks it)."""
    return statistics.mean(m.get(key, 0.0) for m in measured)


def base_overrides(args: argparse.Namespace) -> list[str]:
    """The asked steps, no validation, no checkpoints, no progress bar; then the user's overrides."""
    return [f"grpo.max_num_steps={args.steps}", "grpo.val_period=0", "checkpointing=disabled",
            "logger.console_progress=false", *args.overrides]


def runs(args: argparse.Namespace) -> dict[str, list[str]]:
    """The training runs `args` asks for, each as the Hydra overrides it composes: "run", or with --async-compare
    "sync" and "async" on the split layout."""
    base = base_overrides(args)
    if not args.async_compare:
        return {"run": base}
    return {"sync": [*base, *SPLIT], "async": [*base, *SPLIT, "grpo.async_grpo.enabled=true", *args.async_override]}


def compare_async(args: argparse.Namespace) -> dict[str, Any]:
    """Sync and async GRPO on the same split layout and workload, one after the other: each step beside
    generation + training (sync's bound) and max(generation, training) (async's)."""
    out: dict[str, Any] = {}
    for mode, overrides in runs(args).items():
        _, steps, _, _, usage = run_steps(overrides)
        measured = steps[args.warmup:] or steps
        gen = mean(measured, "async/generation_s") if mode == "async" else mean(measured, "timing/train/generation")
        train = (mean(measured, "timing/train/policy_training")
                 + mean(measured, "timing/train/policy_and_reference_logprobs"))
        step = mean(measured, "timing/train/total_step_time")
        out[mode] = {"step_s": round(step, 4), "generation_s": round(gen, 4), "training_s": round(train, 4),
                     "refit_s": round(mean(measured, "timing/train/refit"), 4),
                     "step_over_sum": round(step / (gen + train), 3), "step_over_max": round(step / max(gen, train), 3),
                     "final_reward": steps[-1].get("train/reward") if steps else None,
                     **cpu_floor(step, usage.cpus_busy(*measured_window(steps, args.warmup)))}
        if mode == "async":
            out[mode]["trainer_wait_s"] = round(mean(measured, "async/trainer_wait_s"), 4)
            # the engine's refit before each batch: on the generation side of the overlap
            out[mode]["engine_refit_s"] = round(mean(measured, "async/engine_refit_s"), 4)
            out[mode]["dropped_stale"] = steps[-1].get("async/dropped_stale") if steps else None
    out["async_speedup"] = round(out["sync"]["step_s"] / out["async"]["step_s"], 3)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.grpo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2, help="steps excluded from the averages")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--no-limits", action="store_true", help="skip the bare-engine / bare-torch / memcpy limits")
    ap.add_argument("--async-compare", action="store_true",
                    help="sync vs async GRPO, engine and trainer on separate slots (instead of the default run)")
    ap.add_argument("--async-override", action="append", default=[], metavar="KEY=VALUE",
                    help="with --async-compare: an override for the async run only (repeatable)")
    ap.add_argument("overrides", nargs="*")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = base_overrides(args)
    if args.async_compare:
        result: dict[str, Any] = {"overrides": overrides, "async_overrides": args.async_override,
                                  "async_compare": compare_async(args), "host": host(), "date": now()}
        print(json.dumps(result, indent=1))
        for mode in ("sync", "async"):
            r = result["async_compare"][mode]
            print(f"{mode:>5}: step {r['step_s']:.3f}s  generation {r['generation_s']:.3f}s  training "
                  f"{r['training_s']:.3f}s  step/(gen+train) {r['step_over_sum']:.2f}  "
                  f"step/max(gen,train) {r['step_over_max']:.2f}")
        a = result["async_compare"]["async"]
        print(f"async: the engine's refit before each batch {a['engine_refit_s']:.3f}s (async/engine_refit_s): "
              f"(generation + it) / max(gen, train) = "
              f"{(a['generation_s'] + a['engine_refit_s']) / max(a['generation_s'], a['training_s']):.2f}")
        print(f"async speed-up {result['async_compare']['async_speedup']:.2f}x "
              f"(target: async step/max <= {ASYNC_TARGET})")
        if "cpus_busy" in a:
            print(f"async {cpu_line(a)}, against the target {ASYNC_TARGET} x max(gen, train) = "
                  f"{ASYNC_TARGET * max(a['generation_s'], a['training_s']):.3f}s")
        save_latest(args.out, run_key(args), result)
        return 0
    cfg, steps, t_setup, wall, usage = run_steps(overrides)
    measured = steps[args.warmup:] or steps
    limits: dict[str, float] = {}
    if not args.no_limits:
        from benchmarks.limits import measure_limits

        limits = measure_limits(cfg)
    phases = sorted({k for m in measured for k in m if k.startswith("timing/train/")})
    result = {
        "overrides": overrides,
        "steps": len(steps),
        "setup_s": round(t_setup, 2),
        "wall_s": round(wall, 2),
        "phase_mean_s": {k.removeprefix("timing/train/"): round(mean(measured, k), 4) for k in phases},
        "tokens_per_sec": round(mean(measured, "performance/tokens_per_sec"), 1),
        "train_tokens_per_step": round(mean(measured, "train/total_num_tokens"), 1),
        "generation_tokens_per_sec": round(mean(measured, "performance/generation_tokens_per_sec"), 1),
        "peak_memory_gib": round(usage.peak / 2**30, 3),
        "time_to_first_step_s": round(t_setup + (steps[0].get("timing/train/total_step_time", 0.0) if steps else 0.0),
                                      2),
        "final_reward": steps[-1].get("train/reward") if steps else None,
        "host": host(),
        "date": now(),
    }
    if limits:
        walls = wall_steps(steps, args.warmup)
        step_s, step_median = statistics.mean(walls), statistics.median(walls)
        result["step_total_step_time_s"] = round(mean(measured, "timing/train/total_step_time"), 4)
        refit_s = mean(measured, "timing/train/refit") or float("nan")
        bare = limits["bare_generation_s"] + limits["bare_training_s"]
        bare_median = limits["bare_generation_median_s"] + limits["bare_training_median_s"]
        result["limits"] = {k: round(v, 4) for k, v in limits.items()}
        result["step_s"] = round(step_s, 4)
        result["step_median_s"] = round(step_median, 4)
        result["step_over_bare"] = round(step_s / bare, 3)
        # the same statistic on both sides: the median step against the median bare runs
        result["median_step_over_median_bare"] = round(step_median / bare_median, 3)
        # A refit must at least run the engine's in-place load: the floor of any design with a separate engine.
        result["step_over_bare_with_load"] = round(step_s / (bare + limits["bare_load_s"]), 3)
        # a single-process trainer's step: the two bare phases in turn, each after the other
        result["median_step_over_median_bare_alternating"] = round(step_median / limits["bare_alternating_median_s"], 3)
        result["refit_gbps"] = round(limits["model_bytes"] / refit_s / 1e9, 3)
        result.update(cpu_floor(step_s, usage.cpus_busy(*measured_window(steps, args.warmup))))
    print(json.dumps(result, indent=1))
    if limits:
        print(f"step {step_s:.3f}s (mean wall clock between steps; timing/train/total_step_time "
              f"{result['step_total_step_time_s']:.3f}s) vs bare generation {limits['bare_generation_s']:.3f}s + "
              f"bare training {limits['bare_training_s']:.3f}s (best of {limits['bare_repeats']:.0f} each): ratio "
              f"{result['step_over_bare']:.2f} (target <= {STEP_TARGET})")
        print(f"median step {step_median:.3f}s vs median bare generation {limits['bare_generation_median_s']:.3f}s + "
              f"median bare training {limits['bare_training_median_s']:.3f}s: ratio "
              f"{result['median_step_over_median_bare']:.2f}")
        print(f"median step vs the median of bare generation then bare training in turn in one process "
              f"{limits['bare_alternating_median_s']:.3f}s (a single-process trainer's step): ratio "
              f"{result['median_step_over_median_bare_alternating']:.2f}")
        print(f"tokens trained per step: {result['train_tokens_per_step']:.0f} (bare training: "
              f"{limits['bare_training_tokens']:.0f})")
        print(f"step vs bare generation + bare training + the engine's bare in-place load "
              f"{limits['bare_load_s']:.3f}s: ratio {result['step_over_bare_with_load']:.2f}")
        print(f"refit {refit_s:.3f}s = {result['refit_gbps']:.2f} GB/s vs memcpy {limits['memcpy_gbps']:.2f} GB/s "
              f"({limits['model_bytes'] / 1e6:.1f} MB); the engine's in-place load alone takes "
              f"{limits['bare_load_s']:.3f}s")
        if "cpus_busy" in result:
            print(cpu_line(result))
    save_latest(args.out, run_key(args), result)
    return 0


def table_rows(result: dict[str, Any]) -> list[Row]:
    """The suite's rows for one result: each step beside its bound, the refit beside memcpy."""
    if "async_compare" in result:
        s, a = result["async_compare"]["sync"], result["async_compare"]["async"]
        rows = [Row("sync step", f"{s['step_s']:.3f} s", f"{s['generation_s'] + s['training_s']:.3f} s gen + train",
                    s["step_over_sum"]),
                Row("async step", f"{a['step_s']:.3f} s", f"{max(a['generation_s'], a['training_s']):.3f} s "
                    "max(gen, train)", a["step_over_max"], f"<= {ASYNC_TARGET}")]
        if a.get("step_cpu_floor_s"):
            rows.append(Row("async step vs CPU", f"{a['step_s']:.3f} s", f"{a['step_cpu_floor_s']:.3f} s CPU floor",
                            a["step_s"] / a["step_cpu_floor_s"]))
        return rows
    if "limits" not in result:
        return [Row("step", f"{result['phase_mean_s'].get('total_step_time', float('nan')):.3f} s",
                    "not measured (--no-limits)", None)]
    lim = result["limits"]
    bare = lim["bare_generation_s"] + lim["bare_training_s"]
    rows = [Row("step (mean)", f"{result['step_s']:.3f} s", f"{bare:.3f} s bare gen + train",
                result["step_over_bare"], f"<= {STEP_TARGET}"),
            Row("step (median)", f"{result['step_median_s']:.3f} s",
                f"{lim['bare_generation_median_s'] + lim['bare_training_median_s']:.3f} s median bare gen + train",
                result["median_step_over_median_bare"]),
            Row("step (median)", f"{result['step_median_s']:.3f} s",
                f"{lim['bare_alternating_median_s']:.3f} s bare gen then train, one process",
                result["median_step_over_median_bare_alternating"])]
    if result.get("step_cpu_floor_s"):
        rows.append(Row("step (mean)", f"{result['step_s']:.3f} s", f"{result['step_cpu_floor_s']:.3f} s CPU floor",
                        result["step_s"] / result["step_cpu_floor_s"]))
    rows.append(Row("refit", f"{result['refit_gbps']:.2f} GB/s", f"{lim['memcpy_gbps']:.2f} GB/s memcpy",
                    result["refit_gbps"] / lim["memcpy_gbps"]))
    return rows


if __name__ == "__main__":
    sys.exit(main())
