"""The benchmark suite's standard set (`make bench`): each benchmark on the shapes users run, every result beside its
limit measured in the same run, then one table of them all.

    make bench                                          # the whole set
    .venv/bin/python -m benchmarks.suite --list         # the set's commands; runs nothing
    .venv/bin/python -m benchmarks.suite --only grpo/tiny --only start/tiny
    .venv/bin/python -m benchmarks.suite --report       # the table of the latest results; runs nothing

Shapes: the default tiny job, the 17.9M-parameter shape of the same model (8 prompts x 8 samples x 8 new tokens), and
SmolLM2-135M (8 x 8 x 16) once `make smollm2` has prepared it (skipped until then). Each benchmark runs in a process
of its own (`python -m benchmarks.<name> ...`), one after another so that none shares the CPUs with another, and keeps
its result in its results file (results/bench_<name>.json, the latest run per configuration); the table reads them
back from there. A benchmark that fails is a row saying so, and the suite then exits 1.

Not in the set: benchmarks.learning (a 30-minute training run: does a real model learn?), benchmarks.ab (A/B runs
of two configurations or revisions) and benchmarks.timeline_gaps (a timeline's summary).
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.harness import REPO, RESULTS_DIR, Row, load_results, render_table, run_key

BATCH = ("grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=8", "policy.train_global_batch_size=64",
         "policy.train_micro_batch_size=8", "policy.logprob_batch_size=16")
"""8 prompts x 8 samples a step, trained in one optimizer step of micro-batches of 8."""

SHAPE_17_9M = ("model.tiny.hidden_size=512", "model.tiny.num_layers=6", "model.tiny.num_attention_heads=8",
               "model.tiny.num_key_value_heads=4", "model.tiny.intermediate_size=1408", *BATCH,
               "policy.generation.max_new_tokens=8")
"""The tiny model widened to 17.9M parameters, 8 x 8 x 8 new tokens a step."""

SMOLLM2 = ("model=smollm2_135m", *BATCH, "policy.generation.max_new_tokens=16")
"""SmolLM2-135M-Instruct (540 MB in fp32), 8 x 8 x 16 new tokens a step."""


class Bench(NamedTuple):
    """One benchmark of the set: `python -m benchmarks.<module> <argv>`."""

    name: str
    module: str
    argv: tuple[str, ...] = ()


STANDARD = (
    Bench("grpo/tiny", "grpo", ("--steps", "20")),
    Bench("grpo-async/tiny", "grpo", ("--async-compare", "--steps", "20")),
    Bench("grpo/17.9M", "grpo", ("--steps", "8", "--warmup", "1", *SHAPE_17_9M)),
    Bench("grpo/smollm2-135m", "grpo", ("--steps", "3", "--warmup", "1", *SMOLLM2)),
    Bench("refit/tiny", "refit", ("--refits", "8")),
    Bench("refit/smollm2-135m", "refit", ("model=smollm2_135m",)),
    Bench("start/tiny", "start", ("--rounds", "3")),
    Bench("generation/tiny", "generation", ()),
)
"""The standard set, in the order it runs."""


def module(bench: Bench) -> Any:
    """The benchmark's module (its `parse_args`, `table_rows` and default results file)."""
    return importlib.import_module(f"benchmarks.{bench.module}")


def _out(bench: Bench, results_dir: Path) -> list[str]:
    """`--out` for a results folder other than the default one."""
    if results_dir.resolve() == RESULTS_DIR.resolve():
        return []
    return ["--out", str(results_dir / module(bench).RESULTS.name)]


def arguments(bench: Bench, results_dir: Path) -> argparse.Namespace:
    """The benchmark's parsed command line, its results file in `results_dir`."""
    return module(bench).parse_args([*bench.argv, *_out(bench, results_dir)])


def command(bench: Bench, results_dir: Path) -> list[str]:
    """The command that runs the benchmark, its results file in `results_dir`."""
    return [sys.executable, "-m", f"benchmarks.{bench.module}", *bench.argv, *_out(bench, results_dir)]


def not_ready(bench: Bench) -> str:
    """Why the benchmark cannot run here ("" when it can): a model it names that is not prepared."""
    overrides = getattr(module(bench).parse_args(list(bench.argv)), "overrides", [])
    if not any(o.startswith("model=") for o in overrides):
        return ""  # the tiny model, built on first use
    from rlpost.config.load import load_master_config

    _, cfg = load_master_config(overrides)
    path = Path(str(cfg.policy.model_name))
    if (path / "config.json").is_file():
        return ""
    return f"{path} is not prepared" + (f" (`{cfg.model.prepare}`)" if cfg.model.prepare else "")


def result_rows(bench: Bench, results_dir: Path) -> tuple[str, list[Row]]:
    """The date and the table rows of the benchmark's latest result for its configuration."""
    args = arguments(bench, results_dir)
    result = load_results(args.out).get(run_key(args))
    if result is None:
        return "", [Row("no result", f"in {args.out}", "", None)]
    return str(result.get("date", "")), module(bench).table_rows(result)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], choices=[b.name for b in STANDARD], metavar="NAME",
                    help="run this benchmark of the set only (repeatable): " + ", ".join(b.name for b in STANDARD))
    ap.add_argument("--list", action="store_true", help="print the set's commands and run nothing")
    ap.add_argument("--report", action="store_true", help="print the table of the latest results and run nothing")
    ap.add_argument("--results", type=Path, default=RESULTS_DIR, help="the folder of the results files")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = [b for b in STANDARD if not args.only or b.name in args.only]
    if args.list:
        for b in chosen:
            print(f"{b.name:<20} {shlex.join(command(b, args.results))}")
        return 0
    rows: list[tuple[str, str, Row]] = []
    failed = 0
    for b in chosen:
        why = not_ready(b)
        if why:
            rows.append((b.name, "", Row("skipped", why, "", None)))
            continue
        if not args.report:
            cmd = command(b, args.results)
            print(f"\n[{b.name}] $ {shlex.join(cmd)}", flush=True)
            status = subprocess.run(cmd, cwd=REPO, check=False).returncode
            if status != 0:
                failed += 1
                rows.append((b.name, "", Row("failed", f"exit status {status}", "", None)))
                continue
        date, own = result_rows(b, args.results)
        rows += [(b.name, date, r) for r in own]
    print()
    print(render_table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
