"""What every benchmark shares: where results go, the key a result is kept under, the process tree's memory and
CPU, and the table the suite prints.

Results: one JSON object per benchmark (results/bench_<name>.json), keyed by the run's configuration (`run_key`:
its options and Hydra overrides, as a command line), each key holding the newest run of that configuration
(`save_latest`). A file says what each configuration measures now, not how it got there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import psutil

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "results"


def host() -> dict[str, Any]:
    """The host a result was measured on."""
    return {"cpus": os.cpu_count(), "python": sys.version.split()[0]}


def now() -> str:
    """The wall-clock time a result is dated with."""
    return time.strftime("%Y-%m-%dT%H:%M:%S")


# ---- results ---------------------------------------------------------------------------------------------------


def run_key(args: argparse.Namespace, skip: tuple[str, ...] = ("out",)) -> str:
    """The configuration a run measured, as a command line: `--name=value` for each parsed option but those in
    `skip` (where results go, not what is measured), sorted, then the Hydra overrides in their order. Defaults are
    written out, so `--steps 20` and no `--steps` give the same key; an option that is off or empty is left out."""
    words: list[str] = []
    for name, value in sorted(vars(args).items()):
        if name in skip or name == "overrides" or value is None or value is False or value in ("", []):
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, list):
            words += [f"{flag}={v}" for v in value]
        else:
            words.append(f"{flag}={value}")
    return " ".join([*words, *getattr(args, "overrides", [])])


def load_results(path: str | Path) -> dict[str, dict[str, Any]]:
    """The results file at `path` ({} when there is none), oldest write first."""
    out = Path(path)
    if not out.is_file():
        return {}
    data = json.loads(out.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{out}: expected a JSON object keyed by configuration, found {type(data).__name__}")
    return data


def save_latest(path: str | Path, key: str, result: dict[str, Any]) -> Path:
    """Keep `result` as the newest run of configuration `key` in the results file at `path` (created with its
    folders), replacing the one it held; written to a temporary file first, so a run killed while saving leaves the
    previous file whole. A file holding a JSON list (a log of runs, the format before results were keyed) is moved
    aside to <name>.history.json. Prints where the result went."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_file() and not isinstance(json.loads(out.read_text()), dict):
        aside = out.with_name(f"{out.stem}.history.json")
        out.replace(aside)
        print(f"moved the log of runs {out} to {aside}")
    results = load_results(out)
    results.pop(key, None)  # re-inserted last: the file lists configurations by the time of their newest run
    results[key] = result
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(out)
    print(f"saved to {out} [{key or 'defaults'}]")
    return out


def latest(results: dict[str, dict[str, Any]] | list[dict[str, Any]]) -> dict[str, Any]:
    """The newest run in a results file's contents: the last key written, or the last entry of a log of runs (a
    JSON list)."""
    if isinstance(results, list):
        return results[-1]
    return list(results.values())[-1]


# ---- the process tree's memory and CPU -------------------------------------------------------------------------


class TreeUsage:
    """Peak total RSS of this process and its descendants, and their total CPU seconds: one sample on entering, one
    every `sample_s` in a thread, one on leaving. The process tree is listed again only every `relist_s` (and on
    entering and leaving): listing it reads every process's /proc entry, CPU taken from the run it measures."""

    def __init__(self, sample_s: float = 0.2, relist_s: float = 2.0) -> None:
        self.peak = 0
        self.cpu_samples: list[tuple[float, float]] = []
        """(time.perf_counter(), CPU seconds the tree's live processes have used so far), one per sample."""
        self.sample_s, self.relist_s = sample_s, relist_s
        self._procs: list[psutil.Process] = []
        self._listed = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def sample(self, relist: bool = False) -> tuple[int, float]:
        """Sum RSS and CPU seconds over the tree's processes (listed again first when `relist`, or on the first
        sample); update the peak and append a CPU sample. A process that ended since it was listed counts 0.
        Returns (RSS bytes, CPU seconds) of this sample."""
        if relist or not self._procs:
            me = psutil.Process()
            self._procs, self._listed = [me, *me.children(recursive=True)], time.monotonic()
        total, cpu = 0, 0.0
        for p in self._procs:
            try:
                with p.oneshot():
                    total += p.memory_info().rss
                    times = p.cpu_times()
                    cpu += times.user + times.system
            except psutil.Error:
                pass
        self.peak = max(self.peak, total)
        self.cpu_samples.append((time.perf_counter(), cpu))
        return total, cpu

    def _run(self) -> None:
        while not self._stop.wait(self.sample_s):
            self.sample(relist=time.monotonic() - self._listed >= self.relist_s)

    def cpus_busy(self, t0: float, t1: float) -> float | None:
        """`cpus_busy` of the samples taken between perf_counter times t0 and t1."""
        return cpus_busy(self.cpu_samples, t0, t1)

    def __enter__(self) -> TreeUsage:
        self.sample(relist=True)
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=2)
        self.sample(relist=True)


def cpus_busy(samples: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    """How many CPUs the process tree kept busy on average between times t0 and t1: CPU seconds over wall seconds
    between the first and the last (time, CPU seconds) sample inside the window; None with fewer than two there. A
    process that ends or starts inside the window breaks the count, so the window should be steady state."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    (ta, ca), (tb, cb) = inside[0], inside[-1]
    return (cb - ca) / (tb - ta)


def cpu_floor(step_s: float, busy: float | None) -> dict[str, float]:
    """The CPU a step uses and the shortest step any schedule of that work could take on this host's CPUs (the
    step's CPU seconds over the number of CPUs): the limit on how far overlapping phases can shorten it."""
    if busy is None:
        return {}
    cpus = os.cpu_count() or 1
    return {"cpus_busy": round(busy, 3), "cpu_s_per_step": round(step_s * busy, 4),
            "step_cpu_floor_s": round(step_s * busy / cpus, 4)}


def cpu_line(r: dict[str, Any]) -> str:
    """One line on a result's `cpu_floor` figures."""
    return (f"CPU: the process tree kept {r['cpus_busy']:.2f} of the host's {os.cpu_count()} CPUs busy over the "
            f"measured steps, {r['cpu_s_per_step']:.3f} CPU-s a step: no schedule of that work steps faster than "
            f"{r['step_cpu_floor_s']:.3f}s here")


# ---- the suite's table -----------------------------------------------------------------------------------------


class Row(NamedTuple):
    """One line of the suite's table: a measured figure beside its limit from the same run."""

    measure: str
    result: str
    limit: str
    ratio: float | None
    """result / limit (for a throughput, below 1 by how much of the limit is reached)."""
    target: str = ""


def render_table(rows: list[tuple[str, str, Row]]) -> str:
    """(benchmark, date of its result, row) triples as a fixed-width text table."""
    head = ("benchmark", "measure", "result", "limit", "result/limit", "target", "measured at")
    cells = [head] + [(name, r.measure, r.result, r.limit, "-" if r.ratio is None else f"{r.ratio:.3g}", r.target,
                       date) for name, date, r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)).rstrip() for cell in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
