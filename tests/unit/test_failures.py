"""Exit statuses and one-line messages of known failures; the step-derived call bound; the signal guard."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import pytest
import ray.exceptions

from rlpost.algorithms.loop import HealthCheckError, call_timeout_for
from rlpost.config.errors import ConfigError
from rlpost.config.schema.cluster import ClusterConfig
from rlpost.data.datasets import DataError
from rlpost.distributed.ray_signals import keep_driver_handlers
from rlpost.distributed.virtual_cluster import ClusterUnavailable, init_ray
from rlpost.distributed.worker_groups import WorkerGroupError
from rlpost.failures import Interrupted, describe, exit_status
from rlpost.models.tiny import TinyTargetError
from rlpost.runner import StopOnSignal
from rlpost.runtime.checkpointing import CheckpointError, CheckpointMismatch


@pytest.mark.parametrize(
    "exc, code",
    [
        (ConfigError("a.b", 1, "must be > 1"), 2),
        (DataError("data.jsonl:3: empty 'problem'"), 2),
        (CheckpointError("checkpoint step_3: cannot read training_info.json"), 2),
        (CheckpointMismatch("refusing to resume"), 2),
        (TinyTargetError("x: not a tiny build"), 2),
        (WorkerGroupError("policy rank 1 on node n died: killed"), 3),
        (HealthCheckError("step 2: train/loss=nan is not finite"), 3),
        (ClusterUnavailable("cluster.address=auto: no Ray cluster answers there"), 3),
        (ray.exceptions.GetTimeoutError("late"), 3),
        (KeyboardInterrupt(), 130),
        (Interrupted("SIGTERM", 143), 143),
        (Interrupted("SIGINT", 130, "during start-up"), 130),
        (ZeroDivisionError("division by zero"), 1),
    ],
)
def test_exit_status(exc: BaseException, code: int) -> None:
    assert exit_status(exc) == code


def test_messages_are_one_line() -> None:
    remote = WorkerGroupError("policy rank 0 on node n raised RuntimeError: boom\nTraceback (most recent call last):\n ...")
    assert describe(remote, Path("/r/train.log")) == "policy rank 0 on node n raised RuntimeError: boom"
    bug = describe(ZeroDivisionError("division by zero"), Path("/r/train.log"))
    assert bug == "unexpected ZeroDivisionError: division by zero (traceback in /r/train.log)"
    assert "resume" in describe(KeyboardInterrupt(), None)
    assert describe(KeyboardInterrupt(), None, resumes=False) == "interrupted by SIGINT"  # rlpost eval, plan


def test_call_bound_follows_the_slowest_step() -> None:
    cfg = ClusterConfig(call_timeout_s=900.0, step_timeout_factor=10.0, min_call_timeout_s=120.0)
    assert call_timeout_for(cfg, 0.5) == 120.0  # never below the floor
    assert call_timeout_for(cfg, 30.0) == 300.0  # 10 x the slowest step
    assert call_timeout_for(cfg, 500.0) == 900.0  # never above the start-up bound


def test_no_ray_head_is_one_clear_error() -> None:
    with pytest.raises(ClusterUnavailable, match=r"cluster.address=127.0.0.1:1: no Ray cluster answers"):
        init_ray(ClusterConfig(address="127.0.0.1:1"))


def _signal_main(sig: int) -> None:
    """Send `sig` to the main thread: handled there before the next line runs, whatever other threads exist."""
    signal.pthread_kill(threading.main_thread().ident or 0, sig)


def test_first_signal_requests_a_stop_second_abandons(capsys: pytest.CaptureFixture[str]) -> None:
    # what was there before (Python's default_int_handler; SIG_IGN where a shell started us in the background)
    before = signal.getsignal(signal.SIGINT)
    with StopOnSignal() as stop:
        stop.started()
        assert not stop.requested
        _signal_main(signal.SIGINT)
        assert stop.requested
        assert "stopping after the current step" in capsys.readouterr().err
        with pytest.raises(Interrupted) as info:
            _signal_main(signal.SIGTERM)
        assert info.value.code == 143 and info.value.when == "a second signal: the step in flight was abandoned"
    assert signal.getsignal(signal.SIGINT) == before  # restored
    assert describe(info.value, None) == ("interrupted by SIGTERM (a second signal: the step in flight was "
                                          "abandoned); re-run the same command to resume from the last checkpoint")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_start_up_ends_the_run_at_once(sig: signal.Signals, code: int) -> None:
    with StopOnSignal() as stop, pytest.raises(Interrupted) as info:
        _signal_main(sig)
    assert (info.value.signame, info.value.code, info.value.when) == (sig.name, code, "during start-up")
    assert stop.interrupted().when == "during start-up"


def test_interrupted_passes_through_except_exception() -> None:
    """A retry or a best-effort close (`except Exception`) on the way out does not swallow the stop."""
    with pytest.raises(Interrupted):
        try:
            raise Interrupted("SIGTERM", 143, "during start-up")
        except Exception:  # noqa: BLE001 - what the test is about
            pytest.fail("Interrupted was caught as an Exception")


def test_driver_handlers_survive_what_ray_installs_meanwhile_and_get_the_noted_signal() -> None:
    from ray._private import utils as ray_utils

    got: list[int] = []

    def mine(signum: int, frame: object) -> None:
        got.append(signum)

    old = signal.signal(signal.SIGTERM, mine)
    try:
        with keep_driver_handlers():
            ray_utils.set_sigterm_handler(lambda signum, frame: sys.exit(signum))  # what ray.init does first
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # and anything else installed meanwhile
            _signal_main(signal.SIGTERM)
            assert got == []  # noted, not handled: Ray is not half-started when the driver's handler runs
        assert got == [signal.SIGTERM]  # handled on leaving, by the driver's handler
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        _signal_main(signal.SIGTERM)
        assert got == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


def test_the_fault_table_takes_an_error_line_with_its_hint_as_clean() -> None:
    from tests.fault_table import probe

    assert probe("t", "p", 2, "rlpost: config error: k='v': rule\n  hint: did you mean 'key'?\n").clean
    assert probe("t", "p", 2, "rlpost: config error: k='v': rule\n").clean
    assert not probe("t", "p", 2, "  hint: a hint alone\n").clean
    assert not probe("t", "p", 1, "rlpost: error: unexpected\n").clean
    assert not probe("t", "p", 2, "Traceback (most recent call last):\nrlpost: error\n").clean
