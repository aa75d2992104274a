"""`rlpost` console script. Looks at the first word only: `train` hands the rest of argv to Hydra
untouched (after a pre-flight validation of every job it would run), `plan` prints the derived
numbers, `--help` / `--version` answer at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

from rlpost import __version__
from rlpost.command_checks import (
    _NO_JOB_FLAGS,
    preflight,
    split_hydra_argv,
)
from rlpost.command_checks import _expand_sweeps as _expand_sweeps
from rlpost.config.errors import report_config_error
from rlpost.failures import SIGNAL_CODES, Interrupted, describe, exit_status

if TYPE_CHECKING:
    from rlpost.runtime.run_lock import RunLock

USAGE = """\
usage: rlpost <command> [hydra overrides]

commands:
  train [overrides]   run a job (GRPO by default); `-m` sweeps, `--cfg job` prints the config
  plan  [overrides]   compose + validate the config and print the derived numbers; starts nothing
  eval  [overrides]   score a model dir or a checkpoint (eval.checkpoint=...) on a data set: accuracy, pass@k
  report DIR [DIR ...]
                      one HTML page (opens offline) of a run, several runs overlaid, or a sweep directory
  launch <slurm|ray|kuberay> [options] -- train [overrides]
                      run on a cluster: a Slurm job, a Ray job, or a KubeRay manifest (`rlpost launch --help`)

examples:
  rlpost train                                   tiny model + synthetic task on this machine
  rlpost train policy=megatron algo=grpo
  rlpost train -m policy.optimizer.kwargs.lr=3e-4,1e-3,3e-3
  rlpost train --cfg job
  rlpost report outputs/2026-01-01/12-00-00
  rlpost plan cluster.gpus_per_node=8 policy.dtensor_cfg.tensor_parallel_size=2
  rlpost launch slurm --nodes=2 --gpus-per-node=8 -- train cluster.gpus_per_node=8 policy.train_micro_batch_size=16

options:
  -h, --help          this message (`rlpost train --help` lists the config groups)
  --version           print the version
"""

def _plan(argv: list[str]) -> int:
    from rlpost.checks import PLAN
    from rlpost.config.load import validation_off_note
    from rlpost.plan import print_plan

    if any(a in ("-h", "--help") for a in argv):
        print("usage: rlpost plan [--json] [hydra overrides]  (composes, validates and prints the derived numbers "
              "and the memory plan; --json: one JSON object)")
        return 0
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    jobs: list[tuple[Any, Any]] = []
    rc = preflight(argv, False, command=PLAN, jobs_out=jobs)
    if rc:
        return rc
    cfg, master = jobs[0]
    if note := validation_off_note(cfg, argv):
        print(f"rlpost: warning: {note}", file=sys.stderr)  # console.warn would log it too: no log file here
    if as_json:
        import json

        from rlpost.plan import plan_json

        print(json.dumps(plan_json(master), indent=1))
    else:
        print_plan(master)
    return 0


def _eval(argv: list[str]) -> int:
    """`rlpost eval [overrides]`: the same config as train, validated the same way, then rlpost.evaluate."""
    from rlpost import failures
    from rlpost.config.errors import ConfigError
    from rlpost.runtime import console as say

    if any(a in ("-h", "--help") for a in argv):
        print("usage: rlpost eval [hydra overrides]  (e.g. model.path=DIR | eval.checkpoint=RUN/checkpoints/step_N,"
              " data=..., eval.num_samples=8, eval.greedy=true)")
        return 0
    from rlpost.checks import EVAL

    rc = preflight(argv, False, command=EVAL)
    if rc:
        return rc
    from rlpost.config.load import load_master_config
    from rlpost.config.schema.master import MasterConfig
    from rlpost.evaluate import evaluate

    _, master = load_master_config(argv)
    if not isinstance(master, MasterConfig):
        report_config_error(ConfigError("algo", master.algo, "rlpost eval generates and scores answers with GRPO's "
                                        "engine and environments", "run it with algo=grpo (the default)"))
        return 2
    try:
        report = evaluate(master)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - one line and the documented status
        if isinstance(exc, ConfigError):
            report_config_error(exc)
            return 2
        say.error(failures.describe(exc, None, resumes=False))  # an evaluation starts over when run again
        return failures.exit_status(exc)
    k = report["k"]
    print(f"rlpost eval: {report['model']} on {report['data']} ({report['split']}, "
          f"{int(report['num_prompts'])} prompts x {k})")
    print(f"  accuracy {report['accuracy']:.3f}  pass@{k} {report[f'pass@{k}']:.3f}  "
          f"mean length {report['mean_length']:.1f}  ({report['wall_s']:.0f}s)")
    print(f"  report: {report['output']}")
    return 0


def _train(argv: list[str]) -> int:
    flags, overrides, multirun = split_hydra_argv(argv)
    nodes: list[dict[str, Any]] = []
    runs_jobs = not any(f in _NO_JOB_FLAGS or f.split("=", 1)[0] in ("--cfg", "-c") for f in flags)
    if not any(f in _NO_JOB_FLAGS for f in flags):
        rc = preflight(overrides, multirun, flags, nodes)
        if rc:
            return rc
    import os

    from rlpost import train
    from rlpost.config.errors import ConfigError

    try:
        lock = lock_output_dir(nodes[0], multirun) if runs_jobs and nodes else None
    except ConfigError as err:
        report_config_error(err)
        return 2
    sys.argv = ["rlpost train", *argv]
    os.environ[train.PREFLIGHT_DONE] = "1"  # every job was checked above; run_job need not read the data again
    train.SWEEP_FAILURES.clear()
    from rlpost.sweep_summary import LAST_STATUS

    LAST_STATUS.clear()
    try:
        train.main()
    finally:
        os.environ.pop(train.PREFLIGHT_DONE, None)
        if lock is not None:
            lock.release()
    # A sweep runs every job even when one fails; it then ends with the first failed job's status.
    return train.sweep_exit_status()


def lock_output_dir(hydra: dict[str, Any], multirun: bool) -> RunLock | None:
    """Lock the run directory (the sweep directory under -m) before Hydra writes into it, when the config names it
    literally (rlpost.runtime.run_lock); each job locks its own directory again when it starts. A directory made
    of interpolations (the default `outputs/${now:...}`) is only known once Hydra resolves it: the job locks it.
    ConfigError when another run holds it."""
    from pathlib import Path

    from rlpost.runtime.run_lock import acquire

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    value = (hydra.get("sweep" if multirun else "run") or {}).get("dir")
    if not isinstance(value, str) or "${" in value:
        return None
    return acquire(Path(value), key)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("--version", "-V", "version"):
        print(f"rlpost {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        return _train(rest)
    if cmd == "plan":
        return _plan(rest)
    if cmd == "eval":
        return _eval(rest)
    if cmd == "launch":
        from rlpost.launch.command import launch

        return launch(rest)
    if cmd == "report":
        from rlpost.report.command import report

        return report(rest)
    import difflib

    close = difflib.get_close_matches(cmd, ["train", "plan", "eval", "launch", "report"], n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    print(f"rlpost: unknown command {cmd!r}{hint}\n\n{USAGE}", file=sys.stderr)
    return 2


def _interrupt(signum: int, frame: FrameType | None) -> None:
    sig = signal.Signals(signum)
    raise Interrupted(sig.name, SIGNAL_CODES[sig], "during start-up")


def entrypoint() -> None:
    """The `rlpost` command. Before a run's steps begin (checks, Hydra, start-up), SIGINT and SIGTERM end it at
    once: one line and the exit status (130, 143), no traceback; a run's steps have their own handlers
    (rlpost.runner)."""
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNAL_CODES:
            if signal.getsignal(sig) != signal.SIG_IGN:  # a shell's `cmd &` ignores SIGINT: keep it so
                signal.signal(sig, _interrupt)
    try:
        code = main()
    except (KeyboardInterrupt, Interrupted) as exc:
        print(f"rlpost: error: {describe(exc, None, resumes=sys.argv[1:2] == ['train'])}", file=sys.stderr)
        code = exit_status(exc)
    sys.exit(code)


if __name__ == "__main__":
    entrypoint()
