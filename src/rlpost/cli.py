"""`rlpost` console script. Looks at the first word only: `train` hands the rest of argv to Hydra
untouched (after a pre-flight validation of every job it would run), `plan` prints the derived
numbers, `--help` / `--version` answer at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

from rlpost import __version__
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

examples:
  rlpost train                                   tiny model + synthetic task on this machine
  rlpost train policy=megatron algo=grpo
  rlpost train -m policy.optimizer.kwargs.lr=3e-4,1e-3,3e-3
  rlpost train --cfg job
  rlpost plan cluster.gpus_per_node=8 policy.dtensor_cfg.tensor_parallel_size=2

options:
  -h, --help          this message (`rlpost train --help` lists the config groups)
  --version           print the version
"""

# Hydra flags that take a value, and flags after which no job runs.
_VALUE_FLAGS = {
    "--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
    "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc", "--info", "-i",
}
_NO_JOB_FLAGS = {"--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc"}


def split_hydra_argv(argv: list[str]) -> tuple[list[str], list[str], bool]:
    """(flags, overrides, multirun) of a Hydra command line."""
    flags: list[str] = []
    overrides: list[str] = []
    multirun = False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-m", "--multirun"):
            multirun = True
            flags.append(a)
        elif a.startswith("-"):
            flags.append(a)
            if a in _VALUE_FLAGS and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                if a not in ("--info", "-i") or "=" not in argv[i + 1]:
                    flags.append(argv[i + 1])
                    i += 1
        else:
            overrides.append(a)
        i += 1
    return flags, overrides, multirun


def _expand_sweeps(overrides: list[str]) -> list[list[str]]:
    """Every job's override list of a multirun (Hydra's own sweep grammar)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    batches = BasicSweeper.split_arguments(parsed, None)
    return [job for batch in batches for job in batch]


def preflight(overrides: list[str], multirun: bool, flags: Sequence[str] = (),
              hydra_nodes: list[dict[str, Any]] | None = None) -> int:
    """Compose and validate every job before Hydra starts anything; print the first error, return 2 on error.
    Each job's `hydra` node (unresolved) is appended to `hydra_nodes` when given."""
    from rlpost.runtime.gc_heap import collect_and_freeze, paused_gc

    # No collections while the checks import torch and compose each job (1.0 s of them on the 2-core host); once
    # they pass, one that frees what composing the jobs dropped (10-13 MB a job), and the imports are frozen.
    with paused_gc(freeze=False):
        rc = _preflight(overrides, multirun, flags, hydra_nodes)
    if rc == 0:
        collect_and_freeze()
    return rc


def _preflight(overrides: list[str], multirun: bool, flags: Sequence[str],
               hydra_nodes: list[dict[str, Any]] | None) -> int:
    from rlpost.config.errors import ConfigError
    from rlpost.config.load import translate_exception
    from rlpost.runtime.build import check_targets, verify_targets

    try:
        check_flags(flags)
        check_hydra_overrides(overrides)
        jobs = _expand_sweeps(overrides) if multirun else [overrides]
    except ConfigError as err:
        report_config_error(err)
        return 2
    except Exception as exc:  # noqa: BLE001 - a bad override string
        report_config_error(translate_exception(exc))
        return 2
    from rlpost import failures
    from rlpost.config.load import compose_config, to_master_config
    from rlpost.data.datasets import DataError
    from rlpost.preflight import preflight_checks

    for job in jobs:
        try:
            cfg = compose_config(job)
            if (unreachable := ray_head_unreachable(cfg)) is not None:
                print(f"rlpost: error: {failures.describe(unreachable, None)}", file=sys.stderr)
                return failures.exit_status(unreachable)
            master = to_master_config(cfg, job)
            node = compose_hydra_node(job)
            check_hydra_node(node)
            if hydra_nodes is not None:
                hydra_nodes.append(node)
            check_targets(master)
            verify_targets(master)
            preflight_checks(master)
            check_output_dir(job, multirun)
        except ConfigError as err:
            report_config_error(err, job if multirun else None)
            return 2
        except DataError as err:
            print(f"rlpost: data error: {err}", file=sys.stderr)
            return 2
    return 0


def ray_head_unreachable(cfg: Any) -> Exception | None:
    """With cluster.address set, the Ray cluster to join must answer before anything else is judged: a config
    whose numbers only fit that cluster (cluster=ray's gpus_per_node) is no use without it. The error, or None."""
    from omegaconf import OmegaConf

    try:
        address = OmegaConf.select(cfg, "cluster.address", default=None)
    except Exception:  # noqa: BLE001 - a broken value is the config checks' to name
        return None
    if not isinstance(address, str) or not address:
        return None
    from rlpost.distributed.virtual_cluster import ClusterUnavailable, probe_head

    try:
        probe_head(address)
    except ClusterUnavailable as exc:
        return exc
    return None


# Hydra imports and runs what its own config names (callbacks, launcher, sweeper, logging classes,
# pkg:// search paths) before rlpost's task starts: only Hydra's defaults and rlpost's callback pass.
_FLAGS_REFUSED = {
    "--config-path": "rlpost composes conf/ (set RLPOST_CONF_DIR to use another config directory)",
    "-cp": "rlpost composes conf/ (set RLPOST_CONF_DIR to use another config directory)",
    "--config-dir": "rlpost composes conf/ (set RLPOST_CONF_DIR to use another config directory)",
    "-cd": "rlpost composes conf/ (set RLPOST_CONF_DIR to use another config directory)",
    "--config-name": "rlpost composes conf/config.yaml; pick presets with experiment=<name>",
    "-cn": "rlpost composes conf/config.yaml; pick presets with experiment=<name>",
    "--experimental-rerun": "a rerun loads a pickle, which can run any code; rerun with the saved overrides",
}
_HYDRA_TARGETS = {
    "hydra.launcher._target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher",
    "hydra.sweeper._target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
}
_RLPOST_CALLBACKS = {"sweep_summary": {"_target_": "rlpost.sweep_summary.SweepSummary"}}
_LOGGING_CLASSES = {"logging.StreamHandler", "logging.FileHandler", "logging.NullHandler", "logging.Formatter"}
_LOGGING_STREAMS = {"ext://sys.stdout", "ext://sys.stderr"}


def check_flags(flags: Sequence[str]) -> None:
    """Refuse Hydra flags that would run a config the pre-flight check never saw."""
    from rlpost.config.errors import ConfigError

    for i, f in enumerate(flags):
        name, eq, value = f.partition("=")
        if name in _FLAGS_REFUSED:
            if not eq and i + 1 < len(flags) and not flags[i + 1].startswith("-"):
                value = flags[i + 1]
            raise ConfigError(name, value or None, "is not supported by rlpost train", _FLAGS_REFUSED[name])


def check_hydra_overrides(overrides: list[str]) -> None:
    """Before composing: `hydra.searchpath` may hold only literal file:// entries (Hydra imports pkg:// ones)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from rlpost.config.errors import ConfigError
    from rlpost.config.load import translate_exception

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:  # noqa: BLE001 - a bad override string
        raise translate_exception(exc) from None
    for ov in parsed:
        key = ov.key_or_group
        if key != "hydra.searchpath" and not key.startswith(("hydra.searchpath.", "hydra.searchpath[")):
            continue
        if ov.is_sweep_override():
            raise ConfigError(key, ov.input_line, "may not be swept")
        value = ov.value()
        for entry in value if isinstance(value, list) else [value]:
            if not (isinstance(entry, str) and entry.startswith("file://") and "${" not in entry):
                raise ConfigError(key, entry, "may list only file:// directories (Hydra imports pkg:// packages)")


def compose_hydra_node(overrides: list[str]) -> dict[str, Any]:
    """The `hydra` node one job composes to, as plain unresolved data (ConfigError on failure)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from rlpost.config.load import CONFIG_NAME, conf_dir, translate_exception
    from rlpost.config.store import register_configs

    register_configs()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
            cfg = compose(config_name=CONFIG_NAME, overrides=list(overrides), return_hydra_config=True)
    except Exception as exc:  # noqa: BLE001
        raise translate_exception(exc, overrides=overrides) from None
    node = OmegaConf.to_container(cfg.hydra, resolve=False)
    assert isinstance(node, dict)
    return cast(dict[str, Any], node)


def check_hydra_node(hydra: dict[str, Any]) -> None:
    """Refuse any import path in the hydra node that is not Hydra's default or rlpost's own callback."""
    from rlpost.config.errors import ConfigError, safe_env_vars

    for name, entry in (hydra.get("callbacks") or {}).items():
        if entry != _RLPOST_CALLBACKS.get(name):
            has_target = isinstance(entry, dict) and "_target_" in entry
            key = f"hydra.callbacks.{name}" + ("._target_" if has_target else "")
            raise ConfigError(key, entry.get("_target_") if has_target else entry,
                              "Hydra callbacks run before rlpost validates anything; only rlpost's own "
                              "hydra.callbacks.sweep_summary is allowed")
    for entry in hydra.get("searchpath") or []:
        if not (isinstance(entry, str) and entry.startswith("file://")):
            raise ConfigError("hydra.searchpath", entry, "may list only file:// directories")
    safe_env_vars("hydra.job.env_set", (hydra.get("job") or {}).get("env_set") or {})
    for key, value in _hydra_leaves(hydra, "hydra"):
        leaf = key.rsplit(".", 1)[-1]
        in_logging = key.startswith(("hydra.job_logging.", "hydra.hydra_logging."))
        if leaf == "_target_" and not key.startswith("hydra.callbacks."):
            if key in _HYDRA_TARGETS and value == _HYDRA_TARGETS[key]:
                continue
            hint = "rlpost runs sweeps with Hydra's basic launcher and sweeper (hydra/launcher=basic)"
            raise ConfigError(key, value, "only Hydra's own basic launcher and sweeper may be imported", hint)
        if leaf == "()":
            raise ConfigError(key, value, "logging factories ('()') import code; use a logging class")
        if in_logging and leaf == "class" and value not in _LOGGING_CLASSES:
            raise ConfigError(key, value, f"logging classes are limited to {sorted(_LOGGING_CLASSES)}")
        if in_logging and leaf in ("listener", "queue") and isinstance(value, str) and not value.startswith("cfg://"):
            raise ConfigError(key, value, "an import path in the logging config is not allowed")
        if in_logging and isinstance(value, str) and value.startswith("ext://") and value not in _LOGGING_STREAMS:
            raise ConfigError(key, value, f"ext:// references are limited to {sorted(_LOGGING_STREAMS)}")


def _hydra_leaves(node: object, path: str) -> Iterator[tuple[str, object]]:
    """(dotted key, value) of every leaf under `node` (list items as [i]); `hydra.overrides` is skipped."""
    if path == "hydra.overrides":
        return
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _hydra_leaves(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _hydra_leaves(v, f"{path}[{i}]")
    else:
        yield path, node


def check_output_dir(overrides: list[str], multirun: bool) -> None:
    """Hydra creates the run directory before rlpost runs: refuse an empty one (the working directory), a file,
    and one that cannot be created or written."""
    from pathlib import Path

    from rlpost.config.errors import ConfigError
    from rlpost.preflight import check_writable_dir

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == key]
    if given and given[-1].strip().strip("'\"") in ("", "null"):
        raise ConfigError(key, given[-1], "is empty; Hydra would write the run into the working directory",
                          "leave it unset (outputs/<date>/<time>) or name a directory")
    # An interpolation (${now:...}) is resolved by Hydra: the part before it is what exists or is created.
    target = Path(given[-1].split("${", 1)[0] or ".") if given else Path("multirun" if multirun else "outputs")
    if target.exists() and not target.is_dir():
        raise ConfigError(key, str(target), "is a file; the run directory must be a directory")
    check_writable_dir(key, target)


def _plan(argv: list[str]) -> int:
    from rlpost.config.errors import ConfigError
    from rlpost.config.load import load_master_config, validation_off_note
    from rlpost.config.lora_params import check_lora_modules
    from rlpost.plan import print_plan
    from rlpost.preflight import check_precision
    from rlpost.runtime.build import check_targets, verify_targets

    if any(a in ("-h", "--help") for a in argv):
        print("usage: rlpost plan [hydra overrides]  (composes, validates and prints the derived numbers)")
        return 0
    try:
        check_hydra_overrides(argv)
        cfg, master = load_master_config(argv)
        check_hydra_node(compose_hydra_node(argv))
        check_targets(master)
        verify_targets(master)
        check_precision(master)  # the backend's device checks (GPU-only options on a CPU run)
        check_lora_modules(master)
    except ConfigError as err:
        report_config_error(err)
        return 2
    if note := validation_off_note(cfg, argv):
        print(f"rlpost: warning: {note}", file=sys.stderr)  # console.warn would log it too: no log file here
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
    rc = preflight(argv, False)
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
        say.error(failures.describe(exc, None))
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
    import difflib

    close = difflib.get_close_matches(cmd, ["train", "plan", "eval"], n=1)
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
        print(f"rlpost: error: {describe(exc, None)}", file=sys.stderr)
        code = exit_status(exc)
    sys.exit(code)


if __name__ == "__main__":
    entrypoint()
