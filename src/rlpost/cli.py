"""`rlpost` console script. Looks at the first word only: `train` hands the rest of argv to Hydra
untouched (after a pre-flight validation of every job it would run), `plan` prints the derived
numbers, `--help` / `--version` answer at once.
"""

from __future__ import annotations

import sys
from typing import List, Optional, Tuple

from rlpost import __version__
from rlpost.config.errors import report_config_error

USAGE = """\
usage: rlpost <command> [hydra overrides]

commands:
  train [overrides]   run a job (GRPO by default); `-m` sweeps, `--cfg job` prints the config
  plan  [overrides]   compose + validate the config and print the derived numbers; starts nothing

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
_NO_JOB_FLAGS = {"--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc", "--experimental-rerun"}


def split_hydra_argv(argv: List[str]) -> Tuple[List[str], List[str], bool]:
    """(flags, overrides, multirun) of a Hydra command line."""
    flags: List[str] = []
    overrides: List[str] = []
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


def _expand_sweeps(overrides: List[str]) -> List[List[str]]:
    """Every job's override list of a multirun (Hydra's own sweep grammar)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    batches = BasicSweeper.split_arguments(parsed, None)
    return [job for batch in batches for job in batch]


def preflight(overrides: List[str], multirun: bool) -> int:
    """Compose and validate every job before Hydra starts anything; print the first error, return 2 on error."""
    from rlpost.build import check_targets
    from rlpost.config.errors import ConfigError
    from rlpost.config.load import load_master_config, translate_exception

    try:
        jobs = _expand_sweeps(overrides) if multirun else [overrides]
    except Exception as exc:  # noqa: BLE001 - a bad override string
        report_config_error(translate_exception(exc))
        return 2
    from rlpost.data.datasets import DataError
    from rlpost.preflight import preflight_checks

    for job in jobs:
        try:
            _, master = load_master_config(job)
            check_targets(master)
            preflight_checks(master)
            check_output_dir(job, multirun)
        except ConfigError as err:
            report_config_error(err, job if multirun else None)
            return 2
        except DataError as err:
            print(f"rlpost: data error: {err}", file=sys.stderr)
            return 2
    return 0


def check_output_dir(overrides: List[str], multirun: bool) -> None:
    """Hydra creates the run directory before rlpost runs: refuse one that is a file or unwritable."""
    import os
    from pathlib import Path

    from rlpost.config.errors import ConfigError

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == key]
    target = Path(given[-1]) if given else Path("multirun" if multirun else "outputs")
    probe = target
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe == target and target.exists() and not target.is_dir():
        raise ConfigError(key, str(target), "is a file; the run directory must be a directory")
    if probe.exists() and not probe.is_dir():
        raise ConfigError(key, str(target), f"cannot be created: {probe} is a file")
    if not os.access(probe if probe.exists() else Path.cwd(), os.W_OK | os.X_OK):
        raise ConfigError(key, str(target), f"cannot be created: {probe} is not writable")


def _plan(argv: List[str]) -> int:
    from rlpost.build import check_targets
    from rlpost.config.errors import ConfigError
    from rlpost.config.load import load_master_config
    from rlpost.plan import print_plan

    if any(a in ("-h", "--help") for a in argv):
        print("usage: rlpost plan [hydra overrides]  (composes, validates and prints the derived numbers)")
        return 0
    try:
        _, master = load_master_config(argv)
        check_targets(master)
    except ConfigError as err:
        report_config_error(err)
        return 2
    print_plan(master)
    return 0


def _train(argv: List[str]) -> int:
    flags, overrides, multirun = split_hydra_argv(argv)
    if not any(f in _NO_JOB_FLAGS for f in flags):
        rc = preflight(overrides, multirun)
        if rc:
            return rc
    from rlpost import train

    sys.argv = ["rlpost train", *argv]
    train.main()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
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
    import difflib

    close = difflib.get_close_matches(cmd, ["train", "plan"], n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    print(f"rlpost: unknown command {cmd!r}{hint}\n\n{USAGE}", file=sys.stderr)
    return 2


def entrypoint() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entrypoint()
