"""Where a step's time goes between processes: a run's Ray timeline (logger.ray_timeline) summed up per actor.

    .venv/bin/python -m benchmarks.grpo --async-compare --steps 30 logger.ray_timeline=true
    .venv/bin/python -m benchmarks.timeline_gaps results/bench_grpo_timeline_async.json

Each actor's row (named by `rlpost.runtime.ray_timeline`): its calls (count, median ms), how busy it was between its
first and last steady-state call, and the idle gaps between one call and the next ("a -> b", median ms). Then the
hand-offs between rows: for each call, the latest call on another row that ended after this row's previous call had
ended and before this call started, which is what the call most plausibly waited for ("Row.a end -> Row.b start").
On a loop where every phase waits for the one before (GRPO's steps), the hand-offs and the busy fractions say which
side binds and what the step pays between the phases.

Calls made fewer than --min-calls times (set-up: __init__, the refit group) are left out, and so are the first
--warmup calls of each kept method. Printed, and written as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple


class Call(NamedTuple):
    """One actor call: its row (the actor), method, start and end in ms."""

    row: str
    method: str
    start: float
    end: float


def actor_calls(events: list[dict[str, Any]]) -> list[Call]:
    """The actor calls of a Chrome trace written by `write_timeline` (events whose category is "task::Class.method"),
    each on its row's name, in start order."""
    names = {(e.get("pid"), e.get("tid")): str(e["args"]["name"]) for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    calls = []
    for e in events:
        if e.get("ph") == "X" and str(e.get("cat", "")).startswith("task::"):
            row = names.get((e.get("pid"), e.get("tid")), str(e.get("tid")))
            start = float(e["ts"]) / 1000.0
            calls.append(Call(row, str(e["name"]), start, start + float(e["dur"]) / 1000.0))
    return sorted(calls, key=lambda c: c.start)


def steady(calls: list[Call], min_calls: int, warmup: int) -> list[Call]:
    """`calls` without set-up calls (a method called fewer than `min_calls` times on its row) and without the first
    `warmup` calls of each method."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for c in calls:
        counts[c.row, c.method] += 1
    seen: dict[tuple[str, str], int] = defaultdict(int)
    kept = []
    for c in calls:
        key = (c.row, c.method)
        if counts[key] < min_calls:
            continue
        seen[key] += 1
        if seen[key] > warmup:
            kept.append(c)
    return kept


def _median(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(values), 3), "count": len(values)}


def summarise(calls: list[Call]) -> dict[str, Any]:
    """Per row: calls, busy fraction, gaps between consecutive calls; and the hand-offs between rows."""
    rows: dict[str, list[Call]] = defaultdict(list)
    for c in calls:
        rows[c.row].append(c)
    out: dict[str, Any] = {"rows": {}, "handoffs": {}}
    handoffs: dict[str, list[float]] = defaultdict(list)
    for row, own in rows.items():
        durations: dict[str, list[float]] = defaultdict(list)
        gaps: dict[str, list[float]] = defaultdict(list)
        for c in own:
            durations[c.method].append(c.end - c.start)
        for before, after in zip(own, own[1:], strict=False):
            gaps[f"{before.method} -> {after.method}"].append(max(0.0, after.start - before.end))
            # what `after` waited for: the latest end on another row between this row's last end and its start
            waited = [o for o in calls if o.row != row and before.end <= o.end <= after.start]
            if waited:
                last = max(waited, key=lambda o: o.end)
                handoffs[f"{_short(last.row)}.{last.method} end -> {_short(row)}.{after.method} start"].append(
                    after.start - last.end)
        span = own[-1].end - own[0].start
        busy = sum(c.end - c.start for c in own)
        out["rows"][row] = {"calls": {m: _median(d) for m, d in durations.items()},
                            "busy": round(busy / span, 3) if span > 0 else None,
                            "gaps": {k: _median(v) for k, v in gaps.items()}}
    out["handoffs"] = {k: _median(v) for k, v in sorted(handoffs.items())}
    return out


def _short(row: str) -> str:
    """A row's class name(s), without the actor's name and id."""
    return row.split(" ")[0]


def render(summary: dict[str, Any]) -> str:
    lines = []
    for row, r in summary["rows"].items():
        busy = f"{r['busy']:.0%}" if r["busy"] is not None else "-"
        lines.append(f"{row}: busy {busy}")
        for m, d in r["calls"].items():
            lines.append(f"    {m:<40} {d['median_ms']:9.2f} ms  x{d['count']}")
        for k, d in r["gaps"].items():
            lines.append(f"    idle {k:<35} {d['median_ms']:9.2f} ms  x{d['count']}")
    lines.append("hand-offs (a call's start after the latest end on another row):")
    for k, d in summary["handoffs"].items():
        lines.append(f"    {k:<70} {d['median_ms']:9.2f} ms  x{d['count']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.timeline_gaps", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("timeline", type=Path)
    ap.add_argument("--min-calls", type=int, default=5, help="methods called fewer times are set-up, left out")
    ap.add_argument("--warmup", type=int, default=2, help="first calls of each method left out")
    ap.add_argument("--out", type=Path, help="also write the summary as JSON here")
    args = ap.parse_args(argv)
    summary = summarise(steady(actor_calls(json.loads(args.timeline.read_text())), args.min_calls, args.warmup))
    print(render(summary))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
