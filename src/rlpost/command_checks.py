"""The pre-flight of an `rlpost` command line: every job it would run is composed and validated, and Hydra's own
config is held to what rlpost allows, before anything starts (bad input exits 2 with one line). Used by `rlpost
train`, `plan`, `eval` and `launch`."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

from rlpost.config.errors import report_config_error

if TYPE_CHECKING:
    from rlpost.checks import AnyMaster, Command

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
              hydra_nodes: list[dict[str, Any]] | None = None, command: Command | None = None,
              jobs_out: list[tuple[Any, AnyMaster]] | None = None) -> int:
    """Compose and validate every job before Hydra starts anything, running `command`'s checks (rlpost.checks);
    print the first error, return 2 on error. Each job's `hydra` node (unresolved) is appended to `hydra_nodes` and
    its (composed config, master config) to `jobs_out` when given. `command`: rlpost.checks.TRAIN unless given. A
    launched job (`rlpost.checks.LAUNCH`) runs on a Ray cluster that does not exist yet, on nodes whose devices this
    host may not have: its Ray head and device checks are left to the job's own pre-flight there."""
    from rlpost.checks import TRAIN
    from rlpost.runtime.gc_heap import collect_and_freeze, paused_gc

    # No collections while the checks import torch and compose each job (1.0 s of them on the 2-core host); once
    # they pass, one that frees what composing the jobs dropped (10-13 MB a job), and the imports are frozen.
    with paused_gc(freeze=False):
        rc = _preflight(overrides, multirun, flags, hydra_nodes, command or TRAIN, jobs_out)
    if rc == 0:
        collect_and_freeze()
    return rc


def _preflight(overrides: list[str], multirun: bool, flags: Sequence[str],
               hydra_nodes: list[dict[str, Any]] | None, command: Command,
               jobs_out: list[tuple[Any, AnyMaster]] | None) -> int:
    from rlpost.config.errors import ConfigError
    from rlpost.config.load import translate_exception

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
    from rlpost.checks import run_checks
    from rlpost.config.load import compose_config, to_master_config
    from rlpost.data.datasets import DataError

    for job in jobs:
        try:
            cfg = compose_config(job, with_hydra=True)
            node = _hydra_node(cfg)
            if "host" in command.scopes and (unreachable := ray_head_unreachable(cfg)) is not None:
                print(f"rlpost: error: {failures.describe(unreachable, None)}", file=sys.stderr)
                return failures.exit_status(unreachable)
            master = to_master_config(cfg, job)
            check_hydra_node(node)
            if hydra_nodes is not None:
                hydra_nodes.append(node)
            run_checks(master, command=command)
            if "outputs" in command.scopes:
                check_output_dir(job, multirun)
            if jobs_out is not None:
                jobs_out.append((cfg, master))
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
    "hydra.launcher._target_": (
        "hydra._internal.core_plugins.basic_launcher.BasicLauncher",
        # hydra/launcher=submitit_slurm | submitit_local (the hydra-submitit-launcher package): each job a Slurm job
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
    ),
    "hydra.sweeper._target_": ("hydra._internal.core_plugins.basic_sweeper.BasicSweeper",),
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


def _hydra_node(cfg: Any) -> dict[str, Any]:
    """Take the `hydra` node out of a job composed with it (`compose_config(with_hydra=True)`): that node as plain
    unresolved data; `cfg` is left the job's own config. One composition serves both."""
    from omegaconf import OmegaConf, open_dict

    node = OmegaConf.to_container(cfg.hydra, resolve=False)
    assert isinstance(node, dict)
    with open_dict(cfg):
        del cfg["hydra"]
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
            if value in _HYDRA_TARGETS.get(key, ()):
                continue
            hint = "sweeps run with Hydra's basic launcher (hydra/launcher=basic) or on Slurm " \
                   "(hydra/launcher=submitit_slurm)"
            raise ConfigError(key, value, "only Hydra's basic launcher and sweeper and the submitit launchers may be "
                              "imported", hint)
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
    from rlpost.preflight import check_not_a_shared_dir, check_writable_dir

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == key]
    if given and given[-1].strip().strip("'\"") in ("", "null"):
        raise ConfigError(key, given[-1], "is empty; Hydra would write the run into the working directory",
                          "leave it unset (outputs/<date>/<time>) or name a directory")
    # An interpolation (${now:...}) is resolved by Hydra: the part before it is what exists or is created.
    target = Path(given[-1].split("${", 1)[0] or ".") if given else Path("multirun" if multirun else "outputs")
    if given and "${" not in given[-1]:
        check_not_a_shared_dir(key, given[-1])
    if target.exists() and not target.is_dir():
        raise ConfigError(key, str(target), "is a file; the run directory must be a directory")
    check_writable_dir(key, target)
