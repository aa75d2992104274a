"""The memory plan against measurement: real jobs on this machine, each worker's measured peak beside its estimate.

    .venv/bin/python -m benchmarks.memory                 # every configuration
    .venv/bin/python -m benchmarks.memory --only tiny 17.9M
    .venv/bin/python -m benchmarks.memory --list

Each configuration runs `rlpost train` for a few steps in a run directory of its own. The estimate is the run's
plan.json (rlpost.config.memory: the worker's peak over the phases, per rank); the measurement is the last step's
`resources/<actor>/peak_rss_gib` (the process tree's high-water mark, Linux's VmHWM) of each actor, the largest rank
of each group. A row passes within --tolerance (15%). The 4k-token rows train SFT on rows of 4,096 tokens written
by the benchmark. Results: results/bench_memory.json, the latest run per configuration set.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.harness import REPO, RESULTS_DIR, host, now, run_key, save_latest
from benchmarks.suite import BATCH, SHAPE_17_9M, SMOLLM2

RESULTS = RESULTS_DIR / "bench_memory.json"
STEPS = ("grpo.max_num_steps=2", "grpo.val_period=0", "checkpointing=disabled")
QWEN25_05B = ("model.tiny.hidden_size=896", "model.tiny.num_layers=24", "model.tiny.num_attention_heads=14",
              "model.tiny.num_key_value_heads=2", "model.tiny.intermediate_size=4864", "model.tiny.vocab_size=151936",
              *BATCH, "policy.generation.max_new_tokens=8")
"""A random-init model of Qwen2.5-0.5B's shape (494M parameters, tied)."""
LONG = ("algo=sft", "model=smollm2_135m", "data=sft_jsonl", "sft.max_num_steps=2", "sft.val_period=0",
        "sft.val_at_start=false", "checkpointing=disabled", "policy.max_total_sequence_length=4096",
        "policy.train_global_batch_size=1", "policy.train_micro_batch_size=1", "policy.logprob_batch_size=1")
"""SmolLM2 SFT on one 4,096-token row a step, two steps: the optimizer's states, made by the first step, are resident
in the second (data.train_data_path added by the benchmark)."""


MOE_17_9M = (*(o for o in SHAPE_17_9M if not o.startswith("model.tiny.intermediate_size=")),
             "model.tiny.architecture=qwen3_moe", "model.tiny.num_experts=8", "model.tiny.intermediate_size=352")
"""The 17.9M shape as a Qwen3-MoE: eight experts of a quarter of the dense width, two per token."""


class Config(NamedTuple):
    name: str
    overrides: tuple[str, ...]


CONFIGS = (
    Config("tiny", STEPS),
    Config("17.9M", (*STEPS, *SHAPE_17_9M)),
    Config("smollm2", (*STEPS, *SMOLLM2)),
    Config("smollm2-lora", (*STEPS, *SMOLLM2, "policy.dtensor_cfg.lora_cfg.enabled=true")),
    Config("smollm2-4k", LONG),
    Config("smollm2-4k-ac", (*LONG, "policy.dtensor_cfg.activation_checkpointing=true")),
    Config("qwen2.5-0.5b-shape", (*STEPS, *QWEN25_05B)),
    Config("megatron-tp2", (*STEPS, *SHAPE_17_9M, "policy=megatron", "cluster.gpus_per_node=2",
                            "policy.megatron_cfg.tensor_model_parallel_size=2")),
    Config("ppo", (*STEPS, "algo=ppo")),
    Config("qwen3-moe-17.9M", (*STEPS, *MOE_17_9M)),
)
GROUPS = (("policy", re.compile(r"^policy-\d+$")), ("engine", re.compile(r"^vllm-")),
          ("critic", re.compile(r"^critic-\d+$")), ("teacher", re.compile(r"^teacher-\d+$")),
          ("driver", re.compile(r"^driver$")))
"""Worker group of each actor label of the resource metrics."""


def long_rows(path: Path, tokens: int = 4096, rows: int = 2) -> Path:
    """`rows` SFT rows whose prompt and response fill nearly `tokens` SmolLM2 tokens (a word here is about three:
    4,029 of 4,096 with the chat template)."""
    words = " ".join(f"w{i % 97}" for i in range(int(tokens * 0.3)))
    path.write_text("".join(json.dumps({"prompt": words[: len(words) // 8], "response": words}) + "\n"
                            for _ in range(rows)))
    return path


def measured(metrics: Path) -> dict[str, float]:
    """The largest rank's peak RSS of each group, GiB, from the run's last metrics row."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    last = rows[-1]
    out: dict[str, float] = {}
    for key, value in last.items():
        m = re.fullmatch(r"resources/(.+)/peak_rss_gib", key)
        if not m:
            continue
        for group, pattern in GROUPS:
            if pattern.match(m.group(1)):
                out[group] = max(out.get(group, 0.0), float(value))
    return out


def estimated(plan: Path) -> dict[str, float]:
    """The largest rank's estimate of each group, GiB, from the run's plan.json."""
    out: dict[str, float] = {}
    for w in json.loads(plan.read_text())["memory"]["workers"]:
        out[w["group"]] = max(out.get(w["group"], 0.0), float(w["estimate_gib"]))
    return out


def run_one(cfg: Config, work: Path, timeout_s: float) -> dict[str, Any]:
    run_dir = work / cfg.name
    extra = [f"data.train_data_path={long_rows(work / 'long.jsonl')}"] if "data=sft_jsonl" in cfg.overrides else []
    argv = [sys.executable, "-m", "rlpost.cli", "train", *cfg.overrides, *extra, f"hydra.run.dir={run_dir}"]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{cfg.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    est, got = estimated(run_dir / "plan.json"), measured(run_dir / "metrics.jsonl")
    groups = []
    for group in est:
        if group in got:
            ratio = est[group] / got[group]
            groups.append({"group": group, "estimate_gib": round(est[group], 3), "measured_gib": round(got[group], 3),
                           "estimate/measured": round(ratio, 3)})
    return {"config": cfg.name, "overrides": list(cfg.overrides), "wall_s": round(time.perf_counter() - t0, 1),
            "groups": groups}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="configurations to run (default: all)")
    p.add_argument("--list", action="store_true", help="print the configurations and exit")
    p.add_argument("--tolerance", type=float, default=0.15, help="largest |estimate / measured - 1| that passes")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.list:
        for c in CONFIGS:
            print(f"{c.name:20s} {' '.join(c.overrides)}")
        return 0
    chosen = [c for c in CONFIGS if not args.only or c.name in args.only]
    rows, worst, failed = [], 0.0, []
    with tempfile.TemporaryDirectory(prefix="rlpost-bench-memory-") as tmp:
        for c in chosen:
            try:
                row = run_one(c, Path(tmp), args.timeout_s)
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # the other configurations still run
                print(f"{c.name:20s} FAILED: {e}", flush=True)
                rows.append({"config": c.name, "error": str(e)[-2000:]})
                failed.append(c.name)
                continue
            rows.append(row)
            for g in row["groups"]:
                off = abs(g["estimate/measured"] - 1)
                worst = max(worst, off)
                mark = "ok" if off <= args.tolerance else "OFF"
                print(f"{c.name:20s} {g['group']:8s} estimate {g['estimate_gib']:7.3f} GiB  measured "
                      f"{g['measured_gib']:7.3f} GiB  {g['estimate/measured']:.3f}  {mark}", flush=True)
    save_latest(args.out, run_key(args), {"at": now(), "host": host(), "rows": rows,
                                          "worst_off": round(worst, 3), "tolerance": args.tolerance,
                                          "failed": failed})
    print(f"worst |estimate/measured - 1| = {worst:.3f} (limit {args.tolerance})"
          + (f"; failed to run: {', '.join(failed)}" if failed else ""))
    return 0 if worst <= args.tolerance and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
