"""The fault suite's table. `make faults` runs every test marked `faults` (bad input, signals, kills, a locked run
directory, sweeps with a failing job, corrupt checkpoints); each test records what a user saw through the `fault`
fixture, and `python -m tests.fault_table RECORDS` prints one table: probes, clean exits, tracebacks, data lost.

A probe is clean when it exits with a documented status (rlpost.failures: 0, 2, 3, 130, 143) and, on a failure, its
console ends with one `rlpost: ...` line and holds no traceback. The test asserts more (the line's words, the
checkpoints, the metrics); the table counts what a person running the command would see.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

RECORDS_ENV = "RLPOST_FAULT_RECORDS"
"""Where the `fault` fixture appends its records (JSON lines); unset: nothing is recorded."""

DOCUMENTED = (0, 2, 3, 130, 143)
"""The exit statuses README's table documents."""


@dataclass(frozen=True)
class Probe:
    """One fault or bad input, as a user would have seen it."""

    test: str
    probe: str
    exit_status: int
    clean: bool
    """A documented status and, on a failure, one `rlpost:` line last on the console."""
    traceback: bool
    """A Python traceback (or a crash dump) on the console."""
    data_lost: bool
    """Metrics rows or checkpoints lost or duplicated (the test's own finding)."""


def probe(test: str, name: str, exit_status: int, console: str, data_lost: bool = False) -> Probe:
    """Judge one probe from its exit status and what it printed (stdout and stderr together)."""
    lines = [line for line in console.strip().splitlines() if line.strip()]
    traceback = "Traceback (most recent call last)" in console or "*** SIGTERM received" in console
    if lines and lines[-1].startswith("  hint: "):  # rlpost's error line may end with its hint line
        lines = lines[:-1]
    last_is_ours = bool(lines) and lines[-1].startswith("rlpost")
    clean = exit_status in DOCUMENTED and not traceback and (exit_status == 0 or last_is_ours)
    return Probe(test, name, exit_status, clean, traceback, data_lost)


Record = Callable[..., Probe]


@pytest.fixture
def fault(request: pytest.FixtureRequest) -> Record:
    """`fault(name, exit_status, console, data_lost=False)` records one probe of the calling test (appended to
    $RLPOST_FAULT_RECORDS when set) and returns it."""

    def record(name: str, exit_status: int, console: str, data_lost: bool = False) -> Probe:
        found = probe(request.node.nodeid, name, exit_status, console, data_lost)
        path = os.environ.get(RECORDS_ENV)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(asdict(found)) + "\n")
        return found

    return record


def load(path: Path) -> list[Probe]:
    if not path.is_file():
        return []
    return [Probe(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def table(probes: list[Probe]) -> str:
    """The summary table, then each probe that was not clean."""
    clean = sum(p.clean for p in probes)
    tracebacks = sum(p.traceback for p in probes)
    lost = sum(p.data_lost for p in probes)
    rows = [
        "| probes | clean exits | tracebacks | data lost |",
        "|---:|---:|---:|---:|",
        f"| {len(probes)} | {clean} | {tracebacks} | {lost} |",
    ]
    bad = [p for p in probes if not p.clean or p.traceback or p.data_lost]
    if bad:
        rows.append("")
        rows += [f"not clean: {p.test} [{p.probe}] exit {p.exit_status}"
                 f"{' traceback' if p.traceback else ''}{' data lost' if p.data_lost else ''}" for p in bad]
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    """`python -m tests.fault_table RECORDS`: print the table; status 1 when a probe was not clean or none ran."""
    probes = load(Path(argv[0]))
    print(table(probes))
    return 0 if probes and all(p.clean and not p.traceback and not p.data_lost for p in probes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
