"""Hydra callback: after a multirun, print (and save) a table of each job's swept values against its
final train reward and validation accuracy, or, for a job that failed, its exit status and one-line error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypedDict

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

FAILURE_FILE = "failure.json"
"""Written into a sweep job's directory when the job failed (rlpost.train._failed):
{"exit_status": int, "error": "rlpost: error: ..."}."""


def _last(metrics: Path, key: str) -> float | None:
    if not metrics.is_file():
        return None
    value = None
    for line in metrics.read_text().splitlines():
        d = json.loads(line)
        if key in d:
            value = d[key]
    return value


class SweepRow(TypedDict):
    """One job of a sweep: its number, the overrides it ran with, its last train/reward and validation/accuracy,
    its exit status (0: it succeeded) and, when it failed, the one line it ended with."""

    job: int
    overrides: dict[str, str]
    final_reward: float | None
    val_accuracy: float | None
    exit_status: int
    error: str | None


def _failure(job: Path) -> tuple[int, str | None]:
    """(exit status, error line) a failed job recorded in its directory (rlpost.train._failed); (0, None) if none."""
    f = job / FAILURE_FILE
    if not f.is_file():
        return 0, None
    d = json.loads(f.read_text())
    return int(d["exit_status"]), d.get("error")


def sweep_rows(sweep_dir: Path) -> list[SweepRow]:
    """One row per job directory: its overrides, final train/reward and validation/accuracy."""
    rows: list[SweepRow] = []
    for job in sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        ov_file = job / ".hydra" / "overrides.yaml"
        overrides = yaml.safe_load(ov_file.read_text()) if ov_file.is_file() else []
        exit_status, error = _failure(job)
        rows.append({
            "job": int(job.name),
            "overrides": dict(o.split("=", 1) for o in overrides if "=" in o and not o.startswith("hydra.")),
            "final_reward": _last(job / "metrics.jsonl", "train/reward"),
            "val_accuracy": _last(job / "metrics.jsonl", "validation/accuracy"),
            "exit_status": exit_status,
            "error": error,
        })
    return rows


def sweep_table(rows: list[SweepRow], title: str) -> Table:
    """The table: job, the swept overrides, final train/reward, validation/accuracy and the job's status."""
    swept = swept_keys(rows)
    table = Table(title=title)
    table.add_column("job")
    for k in swept:
        table.add_column(k)
    table.add_column("final train/reward")
    table.add_column("validation/accuracy")
    table.add_column("status")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for r in rows:
        status = "ok" if r["exit_status"] == 0 else f"failed (exit {r['exit_status']})"
        table.add_row(str(r["job"]), *[r["overrides"].get(k, "") for k in swept], fmt(r["final_reward"]),
                      fmt(r["val_accuracy"]), status)
    return table


class Best(TypedDict):
    """The best job of a sweep: by validation/accuracy, or by final train/reward when no job validated."""

    job: int
    metric: str
    value: float
    swept: dict[str, str]
    """The swept overrides of that job (the best value of each swept parameter)."""


def swept_keys(rows: list[SweepRow]) -> list[str]:
    """The overrides that differ between jobs (all of them when none differ)."""
    keys = sorted({k for r in rows for k in r["overrides"]})
    return [k for k in keys if len({r["overrides"].get(k) for r in rows}) > 1] or keys


def best_job(rows: list[SweepRow]) -> Best | None:
    """The succeeded job with the highest validation/accuracy (final train/reward when none has one); None when no
    job succeeded with either."""
    ok = [r for r in rows if r["exit_status"] == 0]
    for metric, field in (("validation/accuracy", "val_accuracy"), ("train/reward", "final_reward")):
        scored = [(r[field], r) for r in ok if r[field] is not None]  # type: ignore[literal-required]
        if scored:
            value, row = max(scored, key=lambda vr: (vr[0], -vr[1]["job"]))
            keys = swept_keys(rows)
            return {"job": row["job"], "metric": metric, "value": float(value),
                    "swept": {k: row["overrides"][k] for k in keys if k in row["overrides"]}}
    return None


def sweep_status(rows: list[SweepRow]) -> int:
    """The sweep's exit status: the first failed job's (by job number), 0 when every job succeeded."""
    return next((r["exit_status"] for r in rows if r["exit_status"] != 0), 0)


def best_line(best: Best | None) -> str:
    if best is None:
        return "best: none (no job finished with a validation accuracy or a train reward)"
    swept = " ".join(f"{k}={v}" for k, v in best["swept"].items())
    return f"best: {swept} (job {best['job']}, {best['metric']} {best['value']:.3f})"


def failure_lines(rows: list[SweepRow]) -> list[str]:
    """One line per failed job, under the table: `job N (exit S): rlpost: error: ...`."""
    return [f"job {r['job']} (exit {r['exit_status']}): {r['error'] or 'failed (no error line recorded)'}"
            for r in rows if r["exit_status"] != 0]


LAST_STATUS: list[int] = []
"""The exit status of the sweep summed up last in this process (sweep_status): jobs a launcher ran elsewhere (on
Slurm) recorded their failures in their own directories, which only the summary reads."""


class SweepSummary(Callback):
    """Prints the sweep table and its best job at the end of `rlpost train -m ...`, and writes sweep_summary.json:
    {"jobs": [one row per job], "best": the best job or null, "exit_status": the sweep's}."""

    def on_multirun_end(self, config: DictConfig, **kwargs: object) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows = sweep_rows(sweep_dir)
        best = best_job(rows)
        status = sweep_status(rows)
        LAST_STATUS[:] = [status]
        console = Console(width=120)
        console.print(sweep_table(rows, f"rlpost sweep: {sweep_dir}"))
        console.print(best_line(best), soft_wrap=True, markup=False, highlight=False)
        for line in failure_lines(rows):
            console.print(line, soft_wrap=True, markup=False, highlight=False)
        summary = {"jobs": rows, "best": best, "exit_status": status}
        (sweep_dir / "sweep_summary.json").write_text(json.dumps(summary, indent=1))
        console.print(f"report: rlpost report {sweep_dir}   (every job overlaid, this table and the swept values "
                      "against the final metrics)", soft_wrap=True, markup=False, highlight=False)
