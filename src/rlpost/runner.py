"""Run one validated job in its run directory, whatever its algorithm: setup -> the algorithm's step loop
(rlpost.algorithms.loop) -> summary, always releasing Ray, process groups and worker processes (also between the
jobs of a multirun).

The first Ctrl-C (or SIGTERM) lets the current step finish (and, with `checkpointing.save_on_interrupt`, saves
it), then stops; a second one abandons the step at once. One during start-up ends the run at once.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rlpost.algorithms.loop import StepLoop
from rlpost.config.algorithms import algorithm
from rlpost.config.schema.checkpoint import CheckpointingConfig
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.supervised_master import SupervisedMasterConfig
from rlpost.failures import SIGNAL_CODES, Interrupted
from rlpost.runtime import console as say
from rlpost.runtime.checkpointing import CheckpointError, CheckpointManager, read_json
from rlpost.runtime.stop_request import STOP
from rlpost.runtime.timer import Span, recording_spans

if TYPE_CHECKING:
    from rlpost.algorithms.grpo_setup import GRPOComponents
    from rlpost.algorithms.supervised import SupervisedComponents
    from rlpost.runtime.metrics_logger import MetricsLogger


class StopOnSignal:
    """SIGINT/SIGTERM while the run starts (Ray, workers, engines): end at once (Interrupted "during start-up"); once
    the steps run (`started()`): stop at the next step boundary; a second signal: abandon the step now."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.running = False
        self.abort: Interrupted | None = None
        """The stop raised from the handler (start-up, a second signal): a wait inside Ray turns it into a plain
        KeyboardInterrupt, so `interrupted()` gives it back."""
        self._old: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    def __enter__(self) -> StopOnSignal:
        STOP.clear()
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNAL_CODES:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        STOP.clear()
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def started(self) -> None:
        """The steps begin: a signal from now on stops at the next step boundary."""
        self.running = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if not self.running:
            self.signum = signum
            self.abort = Interrupted(sig.name, SIGNAL_CODES[sig], "during start-up")
            raise self.abort
        if self.signum is not None:
            self.abort = Interrupted(sig.name, SIGNAL_CODES[sig], "a second signal: the step in flight was abandoned")
            raise self.abort
        self.signum = signum
        STOP.set()
        say.info(f"{sig.name}: stopping after the current step (press Ctrl-C again to abandon it now)")

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def stop_after(self, step: int, last_step: int, ck: CheckpointingConfig, save: Callable[[], None]) -> None:
        """At a step boundary, when a stop was requested: make sure the step is saved if it should be (it was on
        schedule, or checkpointing.save_on_interrupt: `save` now), then raise Interrupted."""
        if not self.requested:
            return
        saved = ck.enabled and (step % ck.save_period == 0 or step >= last_step)
        if ck.enabled and ck.save_on_interrupt and not saved:
            save()
            saved = True
        if saved:
            say.info(f"stopped after step {step}; checkpoint saved")
        raise self.interrupted()

    def interrupted(self) -> Interrupted:
        """The stop to end the run with: the one the handler raised, else the requested stop at a step boundary."""
        if self.abort is not None:
            return self.abort
        assert self.signum is not None
        sig = signal.Signals(self.signum)
        return Interrupted(sig.name, SIGNAL_CODES[sig], "" if self.running else "during start-up")


def _quiet_close(comps: Components | None, spans: deque[Span] | None = None, graceful: bool = True) -> None:
    """Release everything with SIGINT and SIGTERM ignored, so a late signal cannot leave processes behind (Ray's
    task timeline written first when logger.ray_timeline recorded the driver's phases as `spans`: the actors' events
    go with them). A failed or abandoned run passes `graceful=False`: its workers are killed without being asked
    first (one may be stuck in the call that failed)."""
    import ray

    main = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in SIGNAL_CODES} if main else {}
    try:
        if comps is not None and spans is not None and ray.is_initialized():
            _timeline(comps.logger.dir, spans)
        if comps is not None:
            comps.close(graceful)
        if ray.is_initialized():
            ray.shutdown()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextmanager
def _phase_spans(cfg: MasterConfig | SupervisedMasterConfig) -> Iterator[deque[Span] | None]:
    """logger.ray_timeline: the driver's timed phases of the run, recorded for the timeline; else None."""
    if not cfg.logger.ray_timeline:
        yield None
        return
    with recording_spans() as spans:
        yield spans


def _timeline(log_dir: Path, spans: deque[Span]) -> None:
    """logger.ray_timeline: write it (rlpost.runtime.ray_timeline); a failure is a warning, never the run's end."""
    from rlpost.runtime.ray_timeline import FILE_NAME, write_timeline

    try:
        path = write_timeline(log_dir / FILE_NAME, spans)
    except Exception as exc:  # noqa: BLE001 - a diagnostic file must not turn a finished run into a failed one
        say.warn(f"logger.ray_timeline: Ray's task timeline was not written ({type(exc).__name__}: {exc})")
        return
    say.info(f"Ray's task timeline: {path} (open it in ui.perfetto.dev or chrome://tracing)")


def _completed_steps(cfg: MasterConfig | SupervisedMasterConfig, run_dir: Path) -> int | None:
    """Steps of the newest verified checkpoint when it already reaches the algorithm's max_num_steps (else None).

    Checked before anything starts, so re-running a finished job costs nothing. (A run that ended by
    max_num_epochs is noticed after setup, by the loop doing no step.)
    """
    if not cfg.checkpointing.enabled:
        return None
    goal = cfg.loop.max_num_steps if isinstance(cfg, SupervisedMasterConfig) else cfg.grpo.max_num_steps
    manager = CheckpointManager(cfg.checkpointing, run_dir)
    newest = manager.latest()
    if newest is None:
        return None
    try:  # cheap first: steps only grow, so if the newest is short of the goal, none is complete
        if int(read_json(newest / "training_info.json").get("total_steps", 0)) < goal:
            return None  # setup verifies (hashes) the checkpoint it resumes from, once
    except CheckpointError:
        pass  # unreadable: the verification below decides, as setup's would
    last = manager.latest_verified()
    if last is None:
        return None
    steps = int(read_json(last / "training_info.json").get("total_steps", 0))
    return steps if steps >= goal else None


class _SaveState(Protocol):
    @property
    def total_steps(self) -> int: ...


class Components(Protocol):
    """What the runner uses of a run's components (GRPOComponents, SupervisedComponents)."""

    @property
    def logger(self) -> MetricsLogger: ...

    @property
    def checkpointer(self) -> CheckpointManager: ...

    @property
    def save_state(self) -> _SaveState: ...

    def close(self, graceful: bool = True) -> None: ...


_Cfg = TypeVar("_Cfg", MasterConfig, SupervisedMasterConfig)
_C = TypeVar("_C", bound=Components)


@dataclass(frozen=True)
class Job(Generic[_Cfg, _C]):
    """What the runner needs to know of an algorithm: its name, how to set it up and loop it, how a step shows on
    the progress bar and how the run is summed up."""

    label: str
    """Progress-bar label (GRPO, SFT, DPO, RM)."""
    budget_key: str
    """The key that bounds the run's steps, named when a finished run is re-run."""
    max_num_steps: int
    setup: Callable[[_Cfg, Path], _C]
    """(cfg, run_dir) -> the run's components (Ray started, workers built)."""
    loop: Callable[[_C], AbstractContextManager[StepLoop]]
    """components -> the step loop, with whatever must run around it (async GRPO's collector)."""
    progress: Callable[[dict[str, float]], str]
    """A step's metrics -> the progress bar's text."""
    summary: Callable[[dict[str, float], _C], dict[str, object]]
    """(last step's metrics, the components with the final save state) -> the summary's algorithm-specific
    entries."""
    result_line: Callable[[dict[str, object]], str]
    """The summary -> the console's result text."""


def _grpo_job(cfg: MasterConfig) -> Job[MasterConfig, GRPOComponents]:
    from rlpost.algorithms.grpo import setup
    from rlpost.algorithms.grpo_unit import GRPOUnit

    def loop(comps: GRPOComponents) -> AbstractContextManager[StepLoop]:
        assert isinstance(comps.unit, GRPOUnit), f"{cfg.algo}'s UNIT is no GRPOUnit"
        return comps.unit.loop(comps)

    def progress(m: dict[str, float]) -> str:
        info = f"reward {m.get('train/reward', float('nan')):.3f}  step {m.get('timing/train/total_step_time', 0):.2f}s"
        if "validation/accuracy" in m:
            info += f"  val acc {m['validation/accuracy']:.3f}"
        return info

    def result_line(summary: dict[str, object]) -> str:
        reward = summary["final_reward"]
        return f"final train/reward {reward:.3f}" if reward is not None else "no step left to run (run complete)"

    return Job(algorithm(cfg.algo).label, "grpo.max_num_steps", cfg.grpo.max_num_steps, setup,
               loop, progress,
               lambda last, comps: {"final_reward": last.get("train/reward"),
                                    "val_accuracy": last.get("validation/accuracy", comps.save_state.val_reward)},
               result_line)


def _supervised_job(cfg: SupervisedMasterConfig) -> Job[SupervisedMasterConfig, SupervisedComponents]:
    from rlpost.algorithms.supervised import setup, supervised_loop

    key = "accuracy" if cfg.pairs else "token_accuracy"

    def progress(m: dict[str, float]) -> str:
        info = f"loss {m.get('train/loss', float('nan')):.4f}  {key} {m.get(f'train/{key}', float('nan')):.3f}"
        if f"validation/{key}" in m:
            info += f"  val loss {m['validation/loss']:.4f}  val {key} {m[f'validation/{key}']:.3f}"
        return info

    def result_line(summary: dict[str, object]) -> str:
        val = f", validation loss {summary['val_loss']:.4f}, {key} {summary[f'val_{key}']:.3f}" \
            if summary["val_loss"] is not None else ""
        return f"final train/loss {summary['final_loss']:.4f}{val}" if summary["final_loss"] is not None \
            else "no step left to run (run complete)"

    return Job(cfg.algo.upper(), f"{cfg.algo}.max_num_steps", cfg.loop.max_num_steps, setup, supervised_loop,
               progress, lambda last, comps: {"final_loss": last.get("train/loss"),
                                              f"val_{key}": last.get(f"validation/{key}"),
                                              "val_loss": last.get("validation/loss")},
               result_line)


StepObserver = Callable[[int, dict[str, float]], None]
"""Called after each step with its number and metrics (what metrics.jsonl gets), on the driver's thread."""


def run(cfg: MasterConfig | SupervisedMasterConfig, run_dir: Path,
        on_step: StepObserver | None = None) -> dict[str, object]:
    """Train with the configured algorithm: setup -> its step loop -> summary, releasing everything at the end;
    returns the summary (final metrics, where the outputs are, the seconds setup took). `on_step` sees every
    step's metrics as they are logged (benchmarks.grpo times the steps with it)."""
    if isinstance(cfg, SupervisedMasterConfig):
        return _run(_supervised_job(cfg), cfg, run_dir, on_step)
    return _run(_grpo_job(cfg), cfg, run_dir, on_step)


def _run(job: Job[_Cfg, _C], cfg: _Cfg, run_dir: Path, observer: StepObserver | None = None) -> dict[str, object]:
    console = Console(stderr=True)
    t0 = time.perf_counter()
    last: dict[str, float] = {}
    comps: _C | None = None
    done = _completed_steps(cfg, run_dir)
    if done is not None:
        say.info(f"run already complete: {done} steps, {job.budget_key}={job.max_num_steps} (checkpoints in "
                 f"{CheckpointManager(cfg.checkpointing, run_dir).dir}); nothing to do. Raise {job.budget_key} "
                 "to train further.")
        return {"run_dir": str(run_dir), "steps": done, "complete": True}
    graceful = False
    out_of_time = False
    with StopOnSignal() as stop, _phase_spans(cfg) as spans:
        try:
            comps = job.setup(cfg, run_dir)
            setup_s = time.perf_counter() - t0
            start = comps.save_state.total_steps
            if start:
                say.info(f"resuming from step {start} ({comps.checkpointer.latest()})")
            with Progress(
                TextColumn(f"[bold]{job.label}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(), console=console, disable=not cfg.logger.console_progress,
            ) as progress, job.loop(comps) as loop:
                task = progress.add_task("train", total=job.max_num_steps, completed=start, info="")

                def on_step(step: int, m: dict[str, float]) -> None:
                    if observer is not None:
                        observer(step, m)
                    last.update(m)
                    progress.update(task, completed=step, info=job.progress(m))
                    stop.stop_after(step, job.max_num_steps, cfg.checkpointing, lambda: loop.save_now(step, m))

                stop.started()
                loop.run(on_step)
                out_of_time = loop.out_of_time
            graceful = True
        except Interrupted as exc:
            graceful = not exc.when  # stopped at a step boundary: the workers are idle
            raise
        except BaseException as exc:
            graceful = False
            if stop.requested:  # the handler's stop, as a wait inside Ray re-raised it (or what a worker made of it)
                raise stop.interrupted() from exc
            raise
        finally:
            _quiet_close(comps, spans, graceful)
    summary: dict[str, object] = {
        "run_dir": str(run_dir),
        "steps": comps.save_state.total_steps,
        "complete": not out_of_time,
        **job.summary(last, comps),
        "setup_s": setup_s,
        "wall_s": time.perf_counter() - t0,
        "metrics": str(comps.logger.dir / "metrics.jsonl"),
        "tensorboard": str(comps.logger.tb_dir),
    }
    steps = "steps" if isinstance(cfg, MasterConfig) else f"{job.label} steps"
    console.print(
        f"[bold green]done[/]: {summary['steps']} {steps} in {summary['wall_s']:.0f}s, {job.result_line(summary)}\n"
        f"  metrics:     {summary['metrics']}\n  tensorboard: {summary['tensorboard']}\n"
        f"  checkpoints: {comps.checkpointer.dir if cfg.checkpointing.enabled else '(disabled)'}",
        soft_wrap=True,  # a long path stays on its line
    )
    return summary
