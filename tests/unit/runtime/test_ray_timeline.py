"""logger.ray_timeline's file: Ray's task events with each worker row named after the actor class that ran there."""

from __future__ import annotations

from rlpost.runtime.ray_timeline import named_rows


def _event(cat: str, tid: str, name: str = "x") -> dict[str, object]:
    return {"cat": cat, "name": name, "pid": "10.0.0.1", "tid": tid, "ts": 1.0, "dur": 2.0, "ph": "X"}


def test_each_worker_row_is_named_after_its_actor_classes() -> None:
    events = [
        _event("submit_task", "driver:01000000ffff"),
        _event("task:execute", "worker:aaaaaaaaaaaa"),
        _event("task::vllm-replica0-7f30:VllmEngineWorker.__init__", "worker:aaaaaaaaaaaa", "__init__"),
        _event("task::VllmEngineWorker.generate", "worker:aaaaaaaaaaaa", "generate"),
        _event("task::VllmEngineWorker.load_bucket", "worker:aaaaaaaaaaaa", "load_bucket"),
        _event("task::DTensorPolicyWorker.train", "worker:bbbbbbbbbbbb", "train"),
        _event("task::ReplayBuffer.push", "worker:cccccccccccc", "push"),
        _event("task::VerifierPool.score", "worker:cccccccccccc", "score"),
    ]
    out = named_rows(events)
    meta = {(e["pid"], e["tid"]): e["args"]["name"] for e in out if e["ph"] == "M"}  # type: ignore[index]
    assert meta == {
        ("10.0.0.1", "driver:01000000ffff"): "driver (01000000)",
        ("10.0.0.1", "worker:aaaaaaaaaaaa"): "VllmEngineWorker vllm-replica0-7f30 (aaaaaaaa)",
        ("10.0.0.1", "worker:bbbbbbbbbbbb"): "DTensorPolicyWorker (bbbbbbbb)",
        ("10.0.0.1", "worker:cccccccccccc"): "ReplayBuffer + VerifierPool (cccccccc)",
    }
    assert all(e["name"] == "thread_name" for e in out if e["ph"] == "M")
    assert out[len(meta):] == events  # every event kept, in order, after the names


def test_no_actor_call_no_names() -> None:
    events = [_event("task:execute", "worker:aaaaaaaaaaaa")]
    assert named_rows(events) == events


def test_timer_phases_are_recorded_only_while_asked_and_become_driver_rows() -> None:
    import threading
    import time

    from rlpost.runtime.ray_timeline import DRIVER_PID, driver_events
    from rlpost.runtime.timer import Timer, recording_spans

    timer = Timer()
    with timer.time("before"):
        pass
    with recording_spans() as spans:
        t0 = time.time()
        with timer.time("total_step_time"), timer.time("generation"):
            time.sleep(0.01)
        def collect() -> None:
            with Timer().time("collector_phase"):
                pass

        worker = threading.Thread(target=collect, name="collector")
        with Timer().time("in_thread"):
            worker.start()
            worker.join()
    with timer.time("after"):
        pass
    assert [(t, n) for t, n, _, _ in spans] == [("MainThread", "generation"), ("MainThread", "total_step_time"),
                                               ("collector", "collector_phase"), ("MainThread", "in_thread")]
    gen = list(spans)[0]
    assert t0 <= gen[2] <= t0 + 0.005 and 0.01 <= gen[3] < 0.5  # wall-clock start, seconds
    assert set(timer.times) == {"before", "generation", "total_step_time", "after"}  # the metrics are unchanged

    events = driver_events(list(spans))
    phases = [e for e in events if e["ph"] == "X"]
    assert [(e["tid"], e["name"]) for e in phases] == [(t, n) for t, n, _, _ in spans]
    assert all(e["pid"] == DRIVER_PID for e in phases)
    assert phases[0]["ts"] == gen[2] * 1e6 and phases[0]["dur"] == gen[3] * 1e6  # microseconds, as Ray's events
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {DRIVER_PID, "MainThread", "collector"}
    assert driver_events([]) == []
    with recording_spans(limit=2) as last:  # a long run keeps its most recent phases
        for name in ("a", "b", "c"):
            with timer.time(name):
                pass
    assert [n for _, n, _, _ in last] == ["b", "c"]
