"""What `rlpost report` reads of a run directory, and how runs are named side by side.

A run directory holds metrics.jsonl (one row per step, rlpost.runtime.metrics_logger); the rest is optional:
resolved_config.yaml, .hydra/overrides.yaml (the command line's overrides), run_status.json (finished / stopped /
failed, rlpost.runtime.run_status), failure.json (a failed sweep job's line, rlpost.sweep_summary) and train.log,
whose `[rlpost][WARNING|ERROR]` lines are the run's warnings. A sweep directory holds numbered job directories
(0, 1, ...) and sweep_summary.json.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

METRICS = "metrics.jsonl"
_LOG_LINE = re.compile(r"^\[[^\]]*\]\[rlpost[^\]]*\]\[(WARNING|ERROR)\] - (.*)$")
"""Hydra's file format, `[time][logger][LEVEL] - message`, for rlpost's own loggers."""


class ReportInputError(ValueError):
    """A path given to `rlpost report` that is not a run or sweep directory: `path` and the rule it breaks."""

    def __init__(self, path: Path, rule: str) -> None:
        super().__init__(f"{path}: {rule}")
        self.path, self.rule = path, rule


@dataclass
class Run:
    """One run directory, read."""

    path: Path
    rows: list[dict[str, float]]
    """metrics.jsonl's rows in step order (a resumed run's re-run steps appear once: the last row wins)."""
    overrides: list[str] = field(default_factory=list)
    """The overrides it was started with (hydra.* left out)."""
    config_text: str = ""
    """resolved_config.yaml as written."""
    status: dict[str, Any] = field(default_factory=dict)
    """run_status.json: state, exit_status, steps, error."""
    messages: list[str] = field(default_factory=list)
    """Its failures and warnings: the status's error, a sweep job's failure line, rlpost's warning lines, the
    reward timeouts and health warnings its rows counted."""
    name: str = ""
    """Its name in legends (`legend_names`)."""

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, over the rows that have it."""
        pts = [(int(r["step"]), float(r[key])) for r in self.rows if key in r]
        return [s for s, _ in pts], [v for _, v in pts]

    def keys(self) -> set[str]:
        return {k for r in self.rows for k in r if k != "step"}

    def last(self, key: str) -> float | None:
        _, values = self.series(key)
        return values[-1] if values else None


def _rows(path: Path) -> list[dict[str, float]]:
    by_step: dict[int, dict[str, float]] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError, RecursionError):
            continue  # a partial last line of a killed run, or a line that is no metrics row
        numbers = {k: float(v) for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        by_step.setdefault(step, {}).update(numbers)  # a text value charts nothing
    return [by_step[s] for s in sorted(by_step)]


def _read_yaml_list(path: Path) -> list[str]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return []
    return [str(o) for o in data if not str(o).startswith("hydra.")] if isinstance(data, list) else []


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def log_messages(train_log: Path) -> list[str]:
    """rlpost's own warning and error lines in train.log, each once, in order."""
    if not train_log.is_file():
        return []
    seen: dict[str, None] = {}
    for line in train_log.read_text(errors="replace").splitlines():
        m = _LOG_LINE.match(line)
        if m:
            seen.setdefault(f"{m.group(1).lower()}: {m.group(2)}", None)
    return list(seen)


def advisory_steps(rows: list[dict[str, float]]) -> dict[str, list[int]]:
    """The steps each run-health advisory fired at (advisories/<rule> in metrics.jsonl), by rule."""
    out: dict[str, list[int]] = {}
    for r in rows:
        for key, value in r.items():
            if key.startswith("advisories/") and value > 0:
                out.setdefault(key.split("/", 1)[1], []).append(int(r["step"]))
    return out


def _counted(rows: list[dict[str, float]]) -> list[str]:
    """Lines for what the rows count: reward timeouts and errors, health-gate warnings, advisories."""
    out = [f"warning: advisory {rule} at {len(steps)} step(s) (from step {steps[0]}; advisories/{rule})"
           for rule, steps in advisory_steps(rows).items()]
    for key, what in (("train/reward_timeouts", "reward calls timed out"), ("train/reward_errors", "reward calls failed"),
                      ("train/health_warnings", "steps passed the health gate's warn threshold")):
        steps = [int(r["step"]) for r in rows if r.get(key, 0.0) > 0]
        if steps:
            total = sum(r.get(key, 0.0) for r in rows)
            count = f"{total:.0f} " if key != "train/health_warnings" else ""
            out.append(f"warning: {count}{what} (steps {', '.join(map(str, steps[:10]))}"
                       f"{', ...' if len(steps) > 10 else ''}; {key})")
    return out


def is_run_dir(path: Path) -> bool:
    return (path / METRICS).is_file()


def is_sweep_dir(path: Path) -> bool:
    return (path / "sweep_summary.json").is_file() or any(
        p.is_dir() and p.name.isdigit() and is_run_dir(p) for p in path.iterdir())


def load_run(path: Path) -> Run:
    """Read a run directory; ReportInputError when it has no metrics.jsonl."""
    if not is_run_dir(path):
        raise ReportInputError(path, f"not a run directory (no {METRICS}) nor a sweep directory (numbered job "
                                     "directories, sweep_summary.json)")
    rows = _rows(path / METRICS)
    status = _read_json(path / "run_status.json")
    messages = []
    if status.get("error"):
        messages.append(f"{status.get('state', 'failed')} (exit {status.get('exit_status')}): {status['error']}")
    failure = _read_json(path / "failure.json")
    if failure.get("error") and failure["error"] != status.get("error"):
        messages.append(f"failed (exit {failure.get('exit_status')}): {failure['error']}")
    messages += log_messages(path / "train.log") + _counted(rows)
    config = path / "resolved_config.yaml"
    return Run(path=path, rows=rows, overrides=_read_yaml_list(path / ".hydra" / "overrides.yaml"),
               config_text=config.read_text() if config.is_file() else "", status=status, messages=messages)


def sweep_jobs(path: Path) -> list[Path]:
    """A sweep directory's job directories, by job number."""
    return sorted((p for p in path.iterdir() if p.is_dir() and p.name.isdigit() and is_run_dir(p)),
                  key=lambda p: int(p.name))


def expand(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """(run directories, sweep directories) named by `paths`; ReportInputError for a path that is neither."""
    runs: list[Path] = []
    sweeps: list[Path] = []
    for p in paths:
        if not p.exists():
            raise ReportInputError(p, "no such directory")
        if not p.is_dir():
            raise ReportInputError(p, "not a directory (give a run directory or a sweep directory)")
        if is_run_dir(p):
            runs.append(p)
        elif is_sweep_dir(p):
            sweeps.append(p)
            runs.extend(sweep_jobs(p))
        else:
            raise ReportInputError(p, f"not a run directory (no {METRICS}) nor a sweep directory (numbered job "
                                      "directories, sweep_summary.json)")
    return runs, sweeps


def differing_overrides(runs: list[Run]) -> list[str]:
    """The override keys whose value differs between the runs (a key one run lacks counts as differing)."""
    maps = [dict(o.split("=", 1) for o in r.overrides if "=" in o) for r in runs]
    keys = sorted({k for m in maps for k in m})
    return [k for k in keys if len({m.get(k) for m in maps}) > 1]


def legend_names(runs: list[Run]) -> list[str]:
    """Each run's legend name: its differing overrides (`lr=1e-3 seed=2`, each key by its last part unless two
    differing keys share it); a run with none, or runs that would share a name, by their directory instead."""
    keys = differing_overrides(runs)
    short = {k: k.rsplit(".", 1)[-1] for k in keys}
    if len(set(short.values())) < len(keys):
        short = {k: k for k in keys}
    names = []
    for r in runs:
        m = dict(o.split("=", 1) for o in r.overrides if "=" in o)
        names.append(" ".join(f"{short[k]}={m[k]}" for k in keys if k in m))
    if len(runs) == 1 or not all(names) or len(set(names)) < len(names):
        dirs = [_dir_name(r.path) for r in runs]
        names = [f"{d} ({n})" if n else d for d, n in zip(dirs, names, strict=True)] if len(set(dirs)) == len(dirs) \
            else [str(r.path) for r in runs]
    return names


def _dir_name(path: Path) -> str:
    return f"{path.parent.name}/{path.name}" if path.name.isdigit() else path.name


def load_runs(paths: list[Path]) -> tuple[list[Run], list[Path]]:
    """Every run named by `paths` (a sweep: its jobs), named for the legends; and the sweep directories among them."""
    dirs, sweeps = expand(paths)
    runs = [load_run(p) for p in dict.fromkeys(dirs)]
    for run, name in zip(runs, legend_names(runs), strict=True):
        run.name = name
    return runs, sweeps
