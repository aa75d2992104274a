"""The checks of a job beyond its schema, in the one order every command runs them.

Composing a job validates it against the schemas first (`MasterConfig.__post_init__`: each block's rules beside its
fields, then the algorithm's rules across blocks). The checks here judge it against the world, and each belongs to
one scope:

| scope | what it reads | commands that judge it |
|---|---|---|
| config | the config, and the model's config.json where there is one | plan, train, eval, launch |
| files | the model directory, the code the config names, the data files | train, eval, launch |
| host | this machine's devices and CPUs, the Ray cluster it joins | train, eval (a launched job: on its node) |
| outputs | the directories the run writes | train, eval, launch |

A command runs the scopes it can judge, always in CHECKS' order, so a config with several faults gets the same first
line from each command that judges them. A check that depends on the device reads `Command.here`: where the job
runs elsewhere (`rlpost launch`), `cluster.device=auto` is not resolved on this machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlpost.config.algorithms import preflight as addon_preflight
from rlpost.config.lora_params import check_lora_modules
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.supervised_master import SupervisedMasterConfig
from rlpost.memory_plan import check_memory
from rlpost.preflight import (
    check_cuda_device,
    check_eval_output,
    check_gpu_only_keys,
    check_hf_config_overrides,
    check_local_cpus,
    check_model_dir,
    check_model_limits,
    check_optimizer,
    check_output_dirs,
    check_precision,
    check_vocab_shards,
)
from rlpost.preflight_data import (
    check_chat_template,
    check_chat_template_value,
    check_data,
    check_prompt_files,
    check_supervised_data,
)
from rlpost.preflight_engine import check_engine_kwargs
from rlpost.runtime.build import check_target_kinds, check_targets, verify_targets

AnyMaster = MasterConfig | SupervisedMasterConfig
"""The master config of any algorithm."""

Scope = Literal["config", "files", "host", "outputs"]


@dataclass(frozen=True)
class Command:
    """What a command can judge of its jobs."""

    name: str
    scopes: frozenset[Scope]
    here: bool
    """The job runs on this machine: `cluster.device=auto` is this machine's device."""


PLAN = Command("plan", frozenset({"config"}), here=True)
TRAIN = Command("train", frozenset({"config", "files", "host", "outputs"}), here=True)
EVAL = Command("eval", TRAIN.scopes, here=True)
LAUNCH = Command("launch", frozenset({"config", "files", "outputs"}), here=False)
JOB = Command("train job", frozenset({"config", "outputs"}), here=True)
"""A job of a `rlpost train` command line that TRAIN checked: what is new in the job is its run directory."""


@dataclass(frozen=True)
class Check:
    scope: Scope
    run: Callable[[AnyMaster, Command, Path | None], None]
    """(the job's config, the command, the run directory where it is known)."""


def _targets(master: AnyMaster, command: Command, run_dir: Path | None) -> None:
    """Every import path under the allow-list (strings first: nothing foreign is imported), then proven."""
    check_targets(master)
    verify_targets(master)


def _data(master: AnyMaster, command: Command, run_dir: Path | None) -> None:
    """The algorithm's add-ons' files, then the prompt or row files, read once (bad rows named by file:line)."""
    if isinstance(master, SupervisedMasterConfig):
        check_chat_template_value(master)
        check_supervised_data(master)
        return
    addon_preflight(master)
    check_prompt_files(master)
    check_chat_template(master)
    check_data(master)


def _eval_output(master: AnyMaster, command: Command, run_dir: Path | None) -> None:
    """`rlpost eval`'s report file, before any scoring."""
    if command.name == EVAL.name and isinstance(master, MasterConfig) and master.eval.output:
        check_eval_output(master.eval.output)


def _master_only(check: Callable[[AnyMaster], None]) -> Callable[[AnyMaster, Command, Path | None], None]:
    return lambda master, command, run_dir: check(master)


CHECKS: tuple[Check, ...] = (
    Check("config", _targets),
    Check("files", _master_only(check_model_dir)),
    Check("files", _master_only(check_hf_config_overrides)),
    Check("files", _master_only(check_vocab_shards)),
    Check("config", _master_only(check_lora_modules)),
    Check("config", _master_only(check_model_limits)),
    Check("files", _master_only(check_optimizer)),
    Check("files", _master_only(check_target_kinds)),  # after the optimizer's allow-list, which imports nothing
    Check("files", _master_only(check_engine_kwargs)),
    Check("host", _master_only(check_cuda_device)),
    Check("config", lambda master, command, run_dir: check_precision(master, command.here)),
    Check("host", _master_only(check_gpu_only_keys)),
    Check("host", _master_only(check_local_cpus)),
    Check("host", _master_only(check_memory)),
    Check("outputs", lambda master, command, run_dir: check_output_dirs(master, run_dir)),
    Check("outputs", _eval_output),
    Check("files", _data),
)
"""Every check, in the order each command runs the ones of its scopes."""


def run_checks(master: AnyMaster, run_dir: Path | None = None, command: Command = TRAIN) -> None:
    """Raise the first ConfigError (or DataError) of `master` among `command`'s scopes. Loads no model, starts no
    Ray. `run_dir`: the run's directory, where it is known (the output directories' defaults lie under it)."""
    for check in CHECKS:
        if check.scope in command.scopes:
            check.run(master, command, run_dir)
