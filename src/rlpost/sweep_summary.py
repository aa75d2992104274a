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
    keys = sorted({k for r in rows for k in r["overrides"]})
    swept = [k for k in keys if len({r["overrides"].get(k) for r in rows}) > 1] or keys
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


def failure_lines(rows: list[SweepRow]) -> list[str]:
    """One line per failed job, under the table: `job N (exit S): rlpost: error: ...`."""
    return [f"job {r['job']} (exit {r['exit_status']}): {r['error'] or 'failed (no error line recorded)'}"
            for r in rows if r["exit_status"] != 0]


class SweepSummary(Callback):
    """Prints the sweep table at the end of `rlpost train -m ...` and writes sweep_summary.json."""

    def on_multirun_end(self, config: DictConfig, **kwargs: object) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows = sweep_rows(sweep_dir)
        console = Console(width=120)
        console.print(sweep_table(rows, f"rlpost sweep: {sweep_dir}"))
        for line in failure_lines(rows):
            console.print(line, soft_wrap=True, markup=False, highlight=False)
        (sweep_dir / "sweep_summary.json").write_text(json.dumps(rows, indent=1))
