"""Alternating A/B runs of benchmarks.grpo: is a change faster, or is it the host?

On a shared host the same run spreads from one hour to the next by more than most changes move a step. So each arm
runs in turn, round after round (A, B, A, B, ...), and the comparison is made within each round: the paired
ratio of arm k's step to the first arm's, whose median over the rounds is printed beside the spread.

    .venv/bin/python -m benchmarks.ab --rounds 3 \\
        --arm "mb64=" --arm "mb16=policy.train_micro_batch_size=16"
    .venv/bin/python -m benchmarks.ab --rounds 2 --async-compare \\
        --arm "age1=" --arm "age2=grpo.async_grpo.max_trajectory_age_steps=2"

An arm is LABEL=OVERRIDES (Hydra overrides, space separated; empty for the default job), or LABEL@REV=OVERRIDES to
run the code of git revision REV instead of the working tree's: a change against the commit before it, on one
config, with this environment's packages (REV's GRPO benchmark and src/ from a temporary `git worktree`; a revision
from before the benchmarks package keeps it at scripts/bench_grpo.py, and it runs from there):

    .venv/bin/python -m benchmarks.ab --rounds 3 --arm "new=" --arm "old@HEAD~1="

`--common` adds overrides to every arm. With `--async-compare` an arm's overrides go to the async run only
(benchmarks.grpo's --async-override) and the figure compared is the async step; otherwise it is the mean wall-clock
step beside its bare limit (generation + training, measured in the same run). Each run's own JSON goes under --dir;
the summary goes to --out, the latest run per configuration (arms, common overrides, mode, steps, rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO, RESULTS_DIR, latest, now, run_key, save_latest

RESULTS = RESULTS_DIR / "bench_ab.json"


def parse_arm(spec: str) -> tuple[str, list[str], str | None]:
    """LABEL[@REV]=OVERRIDES -> (label, overrides, REV or None)."""
    head, sep, rest = spec.partition("=")
    label, at, rev = head.partition("@")
    if not sep or not label or not label.replace("_", "").replace("-", "").isalnum() or (at and not rev.strip()):
        raise SystemExit(f"--arm {spec!r}: expected LABEL=OVERRIDES or LABEL@REV=OVERRIDES with a label of letters, "
                         "digits, - or _")
    return label, rest.split(), rev.strip() if at else None


@contextlib.contextmanager
def code_at(rev: str, parent: Path) -> Iterator[Path]:
    """A temporary git worktree of this repository at `rev` (detached), under `parent`; removed afterwards. A rev git
    does not know stops the run, naming it."""
    found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                           capture_output=True, text=True, check=False)
    if found.returncode != 0:
        raise SystemExit(f"--arm ...@{rev}: git knows no commit {rev!r} in {REPO}")
    sha = found.stdout.strip()
    path = parent / f"worktree-{sha[:12]}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(path), sha],
                   capture_output=True, text=True, check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], capture_output=True,
                       check=False)


def bench_command(code: Path) -> list[str]:
    """The command that runs the GRPO benchmark of checkout `code`: its benchmarks/grpo.py as a module (`-P`: the
    working directory, this repository, does not shadow the checkout's package on sys.path), or, in a revision from
    before the benchmarks package, its scripts/bench_grpo.py as a script."""
    if (code / "benchmarks" / "grpo.py").is_file():
        return [sys.executable, "-P", "-m", "benchmarks.grpo"]
    if (code / "scripts" / "bench_grpo.py").is_file():
        return [sys.executable, str(code / "scripts" / "bench_grpo.py")]
    raise SystemExit(f"{code}: no GRPO benchmark (benchmarks/grpo.py or scripts/bench_grpo.py)")


def bench_env(code: Path) -> dict[str, str]:
    """This environment, with checkout `code`'s benchmarks and src/ first on the import path."""
    path = [str(code), str(code / "src"), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def figures(result: dict[str, Any]) -> dict[str, float]:
    """The numbers one GRPO benchmark result is compared by: `step_s` and `ratio` (step over its bound) always, with the
    bound named by the rest."""
    if "async_compare" in result:
        a, s = result["async_compare"]["async"], result["async_compare"]["sync"]
        return {"step_s": a["step_s"], "ratio": a["step_over_max"], "sync_step_s": s["step_s"],
                "speedup": result["async_compare"]["async_speedup"]}
    lim = result["limits"]
    bare = lim["bare_generation_s"] + lim["bare_training_s"]
    return {"step_s": result["step_s"], "ratio": result["step_over_bare"],
            "median_ratio": result["median_step_over_median_bare"], "bare_s": bare}


def summarize(runs: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """Per arm: each figure's median, min and max over the rounds, and the median of the per-round ratio of its step
    to the first arm's step in the same round (rounds where either run failed are left out of that ratio)."""
    by_round: dict[int, dict[str, dict[str, float]]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["label"]] = r["figures"]
    out: dict[str, Any] = {}
    base = labels[0]
    for label in labels:
        mine = [f[label] for f in by_round.values() if label in f]
        arm: dict[str, Any] = {"runs": len(mine)}
        for key in (mine[0] if mine else {}):
            values = [m[key] for m in mine]
            arm[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        paired = [f[label]["step_s"] / f[base]["step_s"] for f in by_round.values() if label in f and base in f]
        if paired:
            arm["step_vs_first"] = {"median": statistics.median(paired), "min": min(paired), "max": max(paired)}
        out[label] = arm
    return out


def run_one(label: str, overrides: list[str], common: list[str], args: argparse.Namespace, rnd: int,
            code: Path = REPO) -> dict[str, Any]:
    """One GRPO benchmark run of an arm, with the code of `code` (a checkout of this repository); its result (the
    newest in its own JSON file, which holds that run only)."""
    out = Path(args.dir) / f"{label}.{rnd}.json"
    out.unlink(missing_ok=True)
    cmd = [*bench_command(code), "--steps", str(args.steps), "--out", str(out)]
    if args.warmup is not None:
        cmd += ["--warmup", str(args.warmup)]
    if args.async_compare:
        cmd += ["--async-compare", *[f"--async-override={o}" for o in overrides], *common]
    else:
        cmd += [*common, *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s, check=False,
                          env=bench_env(code))
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise SystemExit(f"arm {label} (round {rnd}) failed with status {proc.returncode}: " + " | ".join(tail))
    return latest(json.loads(out.read_text()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", action="append", required=True, help="LABEL=OVERRIDES (two or more)")
    p.add_argument("--common", default="", help="overrides added to every arm (space separated)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--async-compare", action="store_true",
                   help="compare async GRPO steps (benchmarks.grpo --async-compare)")
    p.add_argument("--dir", default=str(RESULTS_DIR / "bench_ab"), help="where each run's JSON goes")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    arms = [parse_arm(a) for a in args.arm]
    labels = [label for label, _, _ in arms]
    if len(arms) < 2 or len(set(labels)) != len(labels):
        raise SystemExit("--arm: give two or more arms with distinct labels")
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        codes = {rev: stack.enter_context(code_at(rev, Path(args.dir))) for rev in {r for _, _, r in arms if r}}
        for rnd in range(1, args.rounds + 1):
            for label, overrides, rev in arms:
                fig = figures(run_one(label, overrides, args.common.split(), args, rnd, codes[rev] if rev else REPO))
                runs.append({"round": rnd, "label": label, "figures": fig})
                print(f"round {rnd} {label:>12}: step {fig['step_s']:.4f}s  ratio {fig['ratio']:.3f}", flush=True)
    summary = summarize(runs, labels)
    bound = "max(generation, training) of the async run" if args.async_compare else "bare generation + bare training"
    print(f"\nmedian [min-max] over {args.rounds} rounds; ratio = step / {bound}; "
          f"vs {labels[0]} = step / {labels[0]}'s step in the same round")
    for label in labels:
        s = summary[label]
        line = (f"{label:>12}: step {s['step_s']['median']:.4f}s [{s['step_s']['min']:.4f}-{s['step_s']['max']:.4f}]  "
                f"ratio {s['ratio']['median']:.3f} [{s['ratio']['min']:.3f}-{s['ratio']['max']:.3f}]")
        if label != labels[0]:
            v = s["step_vs_first"]
            line += f"  vs {labels[0]} {v['median']:.3f} [{v['min']:.3f}-{v['max']:.3f}]"
        print(line)
    record = {"date": now(), "arms": {label: o for label, o, _ in arms},
              "revisions": {label: rev for label, _, rev in arms if rev}, "common": args.common.split(),
              "async_compare": args.async_compare, "steps": args.steps, "rounds": args.rounds, "runs": runs,
              "summary": summary}
    save_latest(args.out, run_key(args, skip=("out", "dir", "timeout_s")), record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
