"""The @hydra.main task: compose -> typed MasterConfig -> build -> run -> close (always).

A bad config exits with status 2 and one message, never a traceback. Under `-m` the basic
launcher runs jobs one after another in this process; each job releases what it started, and a job
that fails is recorded (its one line and exit status, in <job dir>/failure.json and SWEEP_FAILURES)
instead of ending the sweep: the next job runs. Ctrl-C / SIGTERM still stop the whole sweep.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from rlpost.config.load import conf_dir
from rlpost.config.store import register_configs

if TYPE_CHECKING:
    from rlpost.preflight import AnyMaster
    from rlpost.runtime.run_lock import RunLock

register_configs()

PREFLIGHT_DONE = "RLPOST_PREFLIGHT_DONE"
"""Set by the `rlpost` CLI around Hydra's run once its pre-flight checked every job of the command."""

SWEEP_FAILURES: list[tuple[int, int]] = []
"""(job number, exit status) of each sweep job that failed in this process, in the order they ran."""


def sweep_exit_status() -> int:
    """The sweep's exit status: the first failed job's documented status, 0 when every job succeeded. Jobs run in
    this process are counted here; jobs a launcher ran elsewhere (Slurm) by the sweep summary, from their
    directories."""
    from rlpost.sweep_summary import LAST_STATUS

    if SWEEP_FAILURES:
        return SWEEP_FAILURES[0][1]
    return LAST_STATUS[0] if LAST_STATUS else 0


def _run_dir() -> Path:
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return Path.cwd()


def _log_file() -> Path | None:
    """Hydra's file handler target (<run dir>/train.log), if logging is configured."""
    import logging

    for handler in logging.getLogger().handlers:
        name = getattr(handler, "baseFilename", None)
        if name:
            return Path(name)
    return None


def _in_sweep() -> int | None:
    """This job's number when Hydra runs it as part of a multirun, else None."""
    from hydra.types import RunMode

    try:
        hc = HydraConfig.get()
    except ValueError:
        return None
    return int(hc.job.num) if hc.mode == RunMode.MULTIRUN else None


def _failed(code: int, line: str, run_dir: Path, holds_dir: bool = True) -> dict[str, object]:
    """End a failed job with `code`: a single run exits; a sweep job is recorded and the sweep goes on.

    `line` is what was printed on the console (its first line lands in the sweep summary). Interrupts
    always exit, so Ctrl-C / SIGTERM stop the whole sweep. The run's status file is written only by a job that
    holds its directory (`holds_dir`): a job refused before it took the lock leaves the holder's alone.
    """
    import json

    from rlpost import failures
    from rlpost.runtime.run_status import steps_done, write_status
    from rlpost.sweep_summary import FAILURE_FILE

    interrupted = code in failures.STOPPED
    if holds_dir:
        write_status(run_dir, "stopped" if interrupted else "failed", code, steps_done(run_dir),
                     error=line.splitlines()[0])
    job = _in_sweep()
    if job is None or interrupted:
        sys.exit(code)
    SWEEP_FAILURES.append((job, code))
    record = {"exit_status": code, "error": line.splitlines()[0]}
    try:
        (run_dir / FAILURE_FILE).write_text(json.dumps(record))
    except OSError:
        pass  # an unwritable job dir: its row then lacks the line, the sweep's exit status still counts it
    return {"run_dir": str(run_dir), **record}


def run_job(cfg: DictConfig) -> dict[str, object]:
    """Validate, lock and create the run directory, write the resolved config into it, then run the job.

    Every known failure ends with one line and its documented exit status (rlpost.failures);
    the traceback goes to train.log. In a sweep a failed job returns its record instead (see _failed).
    """
    from rlpost import failures

    run_dir = _run_dir()
    fresh = _in_sweep() is None and _made_for_this_job(run_dir)
    try:
        return _checked_run(cfg, run_dir)
    except SystemExit as exc:
        if fresh and exc.code == failures.EXIT_INPUT:  # refused: the directory Hydra made for it is not a run
            _remove_unheld(run_dir)
        raise


def _remove_unheld(run_dir: Path) -> None:
    """Remove `run_dir` unless another run holds its lock (a run started in the same second shares the default
    `outputs/<date>/<time>` directory: it is that run's)."""
    from rlpost.config.errors import ConfigError
    from rlpost.runtime.run_lock import acquire

    try:
        with acquire(run_dir, "hydra.run.dir"):
            shutil.rmtree(run_dir, ignore_errors=True)
    except ConfigError:
        pass


def _made_for_this_job(run_dir: Path) -> bool:
    """The run directory holds nothing but its lock and what Hydra wrote for this job (.hydra/, the log it opened): it
    was made for this job, and a job refused with exit 2 leaves no directory behind (a directory with an earlier
    run's files stays)."""
    from rlpost.runtime.run_lock import LOCK_FILE

    try:
        return {p.name for p in run_dir.iterdir()} <= {".hydra", "train.log", LOCK_FILE}
    except OSError:
        return False


def _checked_run(cfg: DictConfig, run_dir: Path) -> dict[str, object]:
    """The job's checks, its locks, then the run (run_job)."""
    from rlpost import failures
    from rlpost.checks import JOB, TRAIN, run_checks
    from rlpost.config.errors import ConfigError, format_config_error
    from rlpost.config.load import to_master_config

    try:
        master = to_master_config(cfg)
        run_checks(master, run_dir, JOB if os.environ.get(PREFLIGHT_DONE) else TRAIN)  # JOB: the command was checked
        locks = _lock_dirs(master, run_dir)
    except ConfigError as err:
        msg = format_config_error(err)
        print(msg, file=sys.stderr)
        return _failed(failures.EXIT_INPUT, msg, run_dir, holds_dir=False)
    except Exception as exc:  # noqa: BLE001 - e.g. DataError: bad input found before anything starts
        return _job_error(exc, run_dir, holds_dir=False)
    try:
        return _run_locked(cfg, master, run_dir)
    finally:  # after the runner released Ray and the workers, whatever ended the run
        for lock in reversed(locks):
            lock.release()


def _lock_dirs(master: AnyMaster, run_dir: Path) -> list[RunLock]:
    """Lock the run directory, and the checkpoint directory when it lies elsewhere (rlpost.runtime.run_lock), then
    check the run directory is writable; ConfigError (exit 2) when another run holds one of them."""
    from hydra.types import RunMode

    from rlpost.runtime.checkpointing import CheckpointManager
    from rlpost.runtime.run_lock import acquire

    try:
        multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:
        multirun = False
    locks = [acquire(run_dir, "hydra.sweep.dir" if multirun else "hydra.run.dir")]
    try:
        ck = master.checkpointing
        ck_dir = CheckpointManager.directory(ck, run_dir)
        if ck.enabled and not Path(os.path.realpath(ck_dir)).is_relative_to(os.path.realpath(run_dir)):
            locks.append(acquire(ck_dir, "checkpointing.checkpoint_dir"))
        _make_run_dir(run_dir)
    except BaseException:
        for lock in reversed(locks):
            lock.release()
        raise
    return locks


def _run_locked(cfg: DictConfig, master: AnyMaster, run_dir: Path) -> dict[str, object]:
    from rlpost import failures
    from rlpost.config.load import task_overrides, validation_off_note
    from rlpost.plan import plan_json, print_plan
    from rlpost.runtime import console as say
    from rlpost.runtime.run_log import capture_driver_output

    capture_driver_output(_log_file() or run_dir / "train.log")
    if note := validation_off_note(cfg, task_overrides()):
        say.warn(note)
    (run_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(master), resolve=True))
    (run_dir / "plan.json").write_text(json.dumps(plan_json(master), indent=1) + "\n")
    print_plan(master)
    from rlpost.runner import run
    from rlpost.runtime.run_status import steps_done, write_status

    try:
        summary = run(master, run_dir)
    except (Exception, KeyboardInterrupt, failures.Interrupted) as exc:
        return _job_error(exc, run_dir)
    steps = summary.get("steps")
    write_status(run_dir, "finished" if summary.get("complete", True) else "stopped", 0,
                 steps if isinstance(steps, int) else steps_done(run_dir))
    if "metrics" in summary:  # steps ran: the run's page (rlpost.report), under the runner's summary lines
        print(f"  report:      rlpost report {run_dir}   (writes {run_dir / 'report.html'})", file=sys.stderr,
              flush=True)
    return summary


def _job_error(exc: BaseException, run_dir: Path, holds_dir: bool = True) -> dict[str, object]:
    """Traceback to train.log, the one `rlpost: error: ...` line to the console, then _failed."""
    from rlpost import failures
    from rlpost.runtime import console as say

    failures.log_traceback(exc)
    line = failures.describe(exc, _log_file())
    say.error(line)
    return _failed(failures.exit_status(exc), f"rlpost: error: {line}", run_dir, holds_dir)


def _make_run_dir(run_dir: Path) -> None:
    """Create the run directory, or raise ConfigError naming hydra.run.dir and why not."""
    from rlpost.config.errors import ConfigError

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".rlpost_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError("hydra.run.dir", str(run_dir), f"cannot write the run directory ({exc.strerror})") from None


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")
def main(cfg: DictConfig) -> dict[str, object]:
    return run_job(cfg)
