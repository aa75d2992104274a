"""Does a real model learn? A wall-clock-bounded GRPO run of a real model, with the same evaluation before and
after, and the validation curve in between. Prints and saves the numbers.

    make smollm2 && .venv/bin/python -m benchmarks.learning                 # SmolLM2 on arith_add1, 30 min
    .venv/bin/python -m benchmarks.learning --minutes 10 grpo.val_period=2  # extra args: Hydra overrides

The run is `rlpost train experiment=smollm2_arith_cpu` stopped by checkpointing.checkpoint_must_save_by (it
saves its last step and exits 0); "before" is `rlpost eval` of the prepared model, "after" the same eval of the
last checkpoint's HF export: same prompts (the validation split), same sampling seeds. The run ends with a
validation (every run does), and `rlpost eval` of the last checkpoint with one sample per prompt re-scores it from
the HF export alone (it uses validation's seeds), which shows the export is what was trained. Results go to
results/bench_learning.json, the latest run per configuration.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import REPO, RESULTS_DIR, host, now, run_key, save_latest

RESULTS = RESULTS_DIR / "bench_learning.json"
RLPOST = shutil.which("rlpost") or str(REPO / ".venv" / "bin" / "rlpost")


def rlpost(*args: str, cwd: Path) -> None:
    print("$ rlpost " + " ".join(args), flush=True)
    done = subprocess.run([RLPOST, *args], cwd=cwd)
    if done.returncode != 0:
        sys.exit(f"rlpost {args[0]} failed with exit status {done.returncode}")


def evaluate(model_args: list[str], overrides: list[str], prompts: int, k: int, out: Path, cwd: Path
             ) -> dict[str, object]:
    """Sampled at the run's temperature (k samples per prompt) and greedy (one), on the same prompts."""
    result: dict[str, object] = {}
    for mode, extra in (("sampled", [f"eval.num_samples={k}"]), ("greedy", ["eval.greedy=true", "eval.num_samples=1"])):
        path = out.with_name(f"{out.stem}_{mode}.json")
        rlpost("eval", *overrides, *model_args, f"eval.max_prompts={prompts}", *extra, f"eval.output={path}", cwd=cwd)
        report = json.loads(path.read_text())
        kk = k if mode == "sampled" else 1
        result["model"] = report["model"]
        result[mode] = {key: report[key] for key in ("accuracy", f"pass@{kk}", "mean_length", "num_prompts")}
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, and the Hydra overrides (every other argument) in `overrides`."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.learning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="wall-clock budget of the training run")
    parser.add_argument("--experiment", default="smollm2_arith_cpu")
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--eval-k", type=int, default=4)
    parser.add_argument("--out", default=str(RESULTS))
    args, overrides = parser.parse_known_args(argv)
    args.overrides = overrides
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    overrides = args.overrides
    base = [f"experiment={args.experiment}", *overrides]
    work = Path(tempfile.mkdtemp(prefix="bench_learning_"))
    run_dir = work / "run"
    t0 = time.perf_counter()
    before = evaluate([], base, args.eval_prompts, args.eval_k, work / "before.json", work)
    minutes = int(args.minutes)
    seconds = int(round((args.minutes - minutes) * 60))
    rlpost("train", *base, f"hydra.run.dir={run_dir}", "grpo.val_at_start=true", "grpo.max_num_steps=100000",
           f"checkpointing.checkpoint_must_save_by=00:00:{minutes:02d}:{seconds:02d}", cwd=work)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    checkpoint = f"eval.checkpoint={run_dir / 'checkpoints' / f'step_{last}'}"
    after = evaluate([checkpoint], base, args.eval_prompts, args.eval_k, work / "after.json", work)
    # The run's final validation, re-scored from the HF export alone: one sample per prompt, validation's seeds.
    final_val = next(r for r in reversed(rows) if "validation/accuracy" in r)
    replay = work / "replay.json"
    run_cfg = json.loads((run_dir / "checkpoints" / f"step_{last}" / "config.yaml").read_text())
    rlpost("eval", *base, checkpoint, "eval.num_samples=1", f"eval.max_prompts={run_cfg['grpo']['max_val_samples']}",
           f"eval.output={replay}", cwd=work)
    replayed = json.loads(replay.read_text())
    curve = [{"step": r["step"], "validation/accuracy": r["validation/accuracy"]}
             for r in rows if "validation/accuracy" in r]
    rewards = [r["train/reward"] for r in rows if "train/reward" in r]
    step_s = [r["timing/train/total_step_time"] for r in rows if "timing/train/total_step_time" in r]
    result = {
        "date": now(),
        "experiment": args.experiment,
        "overrides": overrides,
        "budget_minutes": args.minutes,
        "steps": last,
        "mean_step_s": sum(step_s) / max(len(step_s), 1),
        "validation_curve": curve,
        "train_reward_first5": sum(rewards[:5]) / max(len(rewards[:5]), 1),
        "train_reward_last5": sum(rewards[-5:]) / max(len(rewards[-5:]), 1),
        "before": before,
        "after": after,
        "final_validation": {"step": final_val["step"], "accuracy": final_val["validation/accuracy"],
                             "eval_of_export": replayed["accuracy"], "num_prompts": replayed["num_prompts"]},
        "total_s": time.perf_counter() - t0,
        "host": host(),
    }
    print(f"\n{args.experiment}: {last} steps in {args.minutes:g} min ({result['mean_step_s']:.1f} s/step)")
    for point in curve:
        print(f"  step {point['step']:>4}  validation accuracy {point['validation/accuracy']:.3f}")
    print(f"  train reward, first 5 steps {result['train_reward_first5']:.3f} -> last 5 "
          f"{result['train_reward_last5']:.3f}")
    k = args.eval_k
    for name in ("before", "after"):
        r = result[name]
        s, g = r["sampled"], r["greedy"]
        print(f"  eval {name:<6} sampled accuracy {s['accuracy']:.3f}  pass@{k} {s[f'pass@{k}']:.3f}  "
              f"greedy accuracy {g['accuracy']:.3f}  mean length {s['mean_length']:.1f}  ({r['model']})")
    fv = result["final_validation"]
    print(f"  final validation (step {fv['step']}) {fv['accuracy']:.3f}; rlpost eval of its HF export "
          f"{fv['eval_of_export']:.3f} ({fv['num_prompts']:.0f} prompts, validation's seeds)")
    save_latest(args.out, run_key(args), result)


if __name__ == "__main__":
    main()
