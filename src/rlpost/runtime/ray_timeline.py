"""logger.ray_timeline: Ray's task timeline of a run, as a Chrome trace file.

Ray records when every actor call started and ended (deserialising its arguments, running, storing its result) and
`ray.timeline()` returns those events in the Chrome tracing format. A worker's row is named only by its worker id
there, so `write_timeline` adds a name to each row: the actor class whose calls ran on it (the engine replicas, the
policy workers, a reward model's scorer, async GRPO's replay buffer), then writes the file for Perfetto
(ui.perfetto.dev) or chrome://tracing. It shows where a step's time goes across processes: a generate call beside
the training call, the engine's load, the gaps between them. Beside them, on rows of their own ("rlpost driver", one
per driver thread), the driver's timed phases (`timing/*`: generation, policy_training, refit, ...) recorded by
`rlpost.runtime.timer`'s `recording_spans`, on the same clock.

Workers report their events to Ray's control store about once a second, so the dump waits that long first (only
when the timeline was asked for). It must run before the actors are killed; `rlpost.runner` calls it as the run
ends, after a failure too.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

from rlpost.runtime.timer import Span

FLUSH_S = 1.2
"""How long to wait for the workers' last reports (Ray's task_events_report_interval_ms is 1000 by default)."""
FILE_NAME = "ray_timeline.json"
DRIVER_PID = "rlpost driver"
"""The process the driver's phase rows are grouped under."""


def named_rows(events: list[dict[str, object]]) -> list[dict[str, object]]:
    """`events` preceded by a thread_name metadata event per row: a worker that ran actor calls ("task::Class.method",
    or "task::<actor name>:Class.__init__" for the constructor) is named "Class <actor name> (worker id prefix)", a row
    that ran several classes' calls lists them; the driver's row (its task submissions) is named "driver"."""
    # row -> (classes, actor names), first seen first
    rows: dict[tuple[object, object], tuple[list[str], list[str]]] = {}
    for e in events:
        cat, tid = str(e.get("cat", "")), e.get("tid")
        if tid is None:
            continue
        classes, actors = rows.setdefault((e.get("pid"), tid), ([], []))
        if str(tid).startswith("driver:"):
            cls, actor = "driver", ""
        elif cat.startswith("task::"):
            actor, _, call = cat.removeprefix("task::").rpartition(":")
            cls = call.split(".")[0]
        else:
            continue
        for seen, new in ((classes, cls), (actors, actor)):
            if new and new not in seen:
                seen.append(new)
    meta = [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
             "args": {"name": " ".join([" + ".join(classes), *actors, f"({str(tid).split(':', 1)[-1][:8]})"])}}
            for (pid, tid), (classes, actors) in rows.items() if classes]
    return meta + events


def driver_events(spans: list[Span]) -> list[dict[str, object]]:
    """The driver's timed phases as complete events (microseconds since the epoch, as Ray's), one row per thread."""
    events: list[dict[str, object]] = [{"name": "process_name", "ph": "M", "pid": DRIVER_PID, "tid": "",
                                     "args": {"name": DRIVER_PID}}] if spans else []
    for thread in dict.fromkeys(t for t, _, _, _ in spans):
        events.append({"name": "thread_name", "ph": "M", "pid": DRIVER_PID, "tid": thread, "args": {"name": thread}})
    events += [{"name": name, "cat": "rlpost", "ph": "X", "pid": DRIVER_PID, "tid": thread, "ts": start * 1e6,
                "dur": seconds * 1e6, "args": {}} for thread, name, start, seconds in spans]
    return events


def write_timeline(path: Path, spans: Iterable[Span] = ()) -> Path:
    """Write the Ray session's task timeline, rows named (`named_rows`), and the driver's phases (`driver_events`)
    to `path` (a run's: its log dir's FILE_NAME); `path`."""
    import ray

    time.sleep(FLUSH_S)
    state_log = logging.getLogger("ray._private.state")  # a notice that a later Ray reads this from its dashboard
    level = state_log.level
    state_log.setLevel(logging.ERROR)
    try:
        events = ray.timeline() or []
    finally:
        state_log.setLevel(level)
    path.write_text(json.dumps(named_rows(list(events)) + driver_events(list(spans))))
    return path
