"""How the runner releases a run's components: a run that ends, or stops at a step boundary, asks its workers to
release first (graceful); a failed run, one abandoned by a second signal, and one stopped during start-up kill them
at once (a worker may be stuck in the call that failed, and a graceful call would wait out its bound)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rlpost.config.load import load_master_config
from rlpost.config.schema.master import MasterConfig
from rlpost.failures import Interrupted
from rlpost.models.policy.lm_policy import Policy
from rlpost.runner import Job, _run


@dataclass
class _State:
    total_steps: int = 0


@dataclass
class _Logger:
    dir: Path
    tb_dir: Path


@dataclass
class _Comps:
    logger: _Logger
    checkpointer: object = None
    save_state: _State = field(default_factory=_State)
    closed: list[bool] = field(default_factory=list)

    def close(self, graceful: bool = True) -> None:
        self.closed.append(graceful)


class _Loop:
    def __init__(self, body: Callable[[Callable[[int, dict[str, float]], None]], None]) -> None:
        self.body = body
        self.out_of_time = False

    def run(self, on_step: Callable[[int, dict[str, float]], None]) -> None:
        self.body(on_step)

    def save_now(self, step: int, metrics: dict[str, float]) -> None:
        pass


def _main_signal(sig: int) -> None:
    signal.pthread_kill(threading.main_thread().ident or 0, sig)


def _job(comps: _Comps, body: Callable[[Callable[[int, dict[str, float]], None]], None],
         setup_body: Callable[[], None] = lambda: None) -> Job:  # type: ignore[type-arg]
    def setup(cfg: MasterConfig, run_dir: Path) -> _Comps:
        setup_body()
        return comps

    @contextmanager
    def loop(c: _Comps) -> Iterator[_Loop]:
        yield _Loop(body)

    return Job("GRPO", "grpo.max_num_steps", 3, setup, loop, lambda m: "", lambda last, c: {"final_reward": None},
               lambda s: "")


def _cfg() -> MasterConfig:
    _, cfg = load_master_config(["checkpointing=disabled", "logger.console_progress=false"])
    assert isinstance(cfg, MasterConfig)
    return cfg


def _comps(tmp_path: Path) -> _Comps:
    return _Comps(_Logger(tmp_path, tmp_path / "tb"))


def _steps(on_step: Callable[[int, dict[str, float]], None]) -> None:
    for step in (1, 2, 3):
        on_step(step, {})


def test_a_finished_run_closes_gracefully(tmp_path: Path) -> None:
    comps = _comps(tmp_path)
    _run(_job(comps, _steps), _cfg(), tmp_path)
    assert comps.closed == [True]


def test_a_failed_run_kills_its_workers(tmp_path: Path) -> None:
    comps = _comps(tmp_path)

    def fail(on_step: Callable[[int, dict[str, float]], None]) -> None:
        on_step(1, {})
        raise TimeoutError("call did not finish within 5s")

    with pytest.raises(TimeoutError):
        _run(_job(comps, fail), _cfg(), tmp_path)
    assert comps.closed == [False]


def test_a_stop_at_a_step_boundary_is_graceful_a_second_signal_is_not(tmp_path: Path) -> None:
    comps = _comps(tmp_path)

    def one_signal(on_step: Callable[[int, dict[str, float]], None]) -> None:
        _main_signal(signal.SIGTERM)
        _steps(on_step)

    with pytest.raises(Interrupted) as info:
        _run(_job(comps, one_signal), _cfg(), tmp_path)
    assert (info.value.code, info.value.when, comps.closed) == (143, "", [True])

    comps = _comps(tmp_path)

    def two_signals(on_step: Callable[[int, dict[str, float]], None]) -> None:
        _main_signal(signal.SIGINT)
        _main_signal(signal.SIGINT)
        _steps(on_step)

    with pytest.raises(Interrupted) as info:
        _run(_job(comps, two_signals), _cfg(), tmp_path)
    assert (info.value.code, comps.closed) == (130, [False])
    assert info.value.when.startswith("a second signal")


def test_a_signal_during_setup_ends_the_run_before_its_steps(tmp_path: Path) -> None:
    comps = _comps(tmp_path)
    ran: list[int] = []

    with pytest.raises(Interrupted) as info:
        _run(_job(comps, lambda on_step: ran.append(1), lambda: _main_signal(signal.SIGTERM)), _cfg(), tmp_path)
    assert (info.value.code, info.value.when, ran) == (143, "during start-up", [])
    assert comps.closed == []  # setup never returned its components: it closes what it opened itself


class _Group:
    def __init__(self) -> None:
        self.calls: list[str | None] = []

    def shutdown(self, graceful_method: Callable[[Any], object] | None = None, timeout_s: float = 30.0) -> None:
        self.calls.append(None if graceful_method is None else graceful_method.__name__)


@pytest.mark.parametrize("graceful, method", [(True, "shutdown"), (False, None)])
def test_the_policy_asks_its_workers_only_when_graceful(graceful: bool, method: str | None) -> None:
    policy = Policy.__new__(Policy)
    group = _Group()
    policy.worker_group = group  # type: ignore[assignment]
    policy.shutdown(graceful)
    assert group.calls == [method]
