"""Exit statuses and one-line messages of known failures; the step-derived call bound; the signal guard."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import ray.exceptions

from rlpost.algorithms.loop import HealthCheckError, call_timeout_for
from rlpost.config.errors import ConfigError
from rlpost.config.schema.cluster import ClusterConfig
from rlpost.data.datasets import DataError
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


def test_call_bound_follows_the_slowest_step() -> None:
    cfg = ClusterConfig(call_timeout_s=900.0, step_timeout_factor=10.0, min_call_timeout_s=120.0)
    assert call_timeout_for(cfg, 0.5) == 120.0  # never below the floor
    assert call_timeout_for(cfg, 30.0) == 300.0  # 10 x the slowest step
    assert call_timeout_for(cfg, 500.0) == 900.0  # never above the start-up bound


def test_no_ray_head_is_one_clear_error() -> None:
    with pytest.raises(ClusterUnavailable, match=r"cluster.address=127.0.0.1:1: no Ray cluster answers"):
        init_ray(ClusterConfig(address="127.0.0.1:1"))


def test_first_signal_requests_a_stop_second_abandons(capsys: pytest.CaptureFixture[str]) -> None:
    # what was there before (Python's default_int_handler; SIG_IGN where a shell started us in the background)
    before = signal.getsignal(signal.SIGINT)
    with StopOnSignal() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        assert "stopping after the current step" in capsys.readouterr().err
        with pytest.raises(Interrupted) as info:
            os.kill(os.getpid(), signal.SIGTERM)
        assert info.value.code == 143
    assert signal.getsignal(signal.SIGINT) == before  # restored

