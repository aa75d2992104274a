"""The @hydra.main task: compose -> typed MasterConfig -> build -> run -> close (always).

A bad config exits with status 2 and one message, never a traceback. Under `-m` the basic
launcher runs jobs one after another in this process; each job releases what it started.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from rlpost.config.load import conf_dir
from rlpost.config.store import register_configs

register_configs()


def _run_dir() -> Path:
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return Path.cwd()


def run_job(cfg: DictConfig) -> Optional[Any]:
    """Validate, write the resolved config into the run directory, then run the job."""
    from rlpost.build import check_targets
    from rlpost.cli import report_config_error
    from rlpost.config.errors import ConfigError
    from rlpost.config.load import to_master_config
    from rlpost.plan import print_plan

    try:
        master = to_master_config(cfg)
        check_targets(master)
    except ConfigError as err:
        report_config_error(err)
        sys.exit(2)
    run_dir = _run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(master), resolve=True))
    print_plan(master)
    from rlpost.runner import run

    try:
        return run(master, run_dir)
    except Exception as exc:  # noqa: BLE001 - known failures end with one clear line, not a traceback
        code = _known_failure(exc)
        if code is None:
            raise
        print(f"rlpost: error: {exc}", file=sys.stderr)
        sys.exit(code)


def _known_failure(exc: BaseException) -> Optional[int]:
    """Exit status for failures a user can act on: 2 for bad input (data, checkpoint), 1 for run-time checks."""
    from rlpost.algorithms.dynamic_sampling import DynamicSamplingExhausted
    from rlpost.algorithms.grpo import HealthCheckError
    from rlpost.checkpointing import CheckpointMismatch
    from rlpost.config.errors import ConfigError
    from rlpost.data.datasets import DataError
    from rlpost.distributed.virtual_cluster import ClusterResourceError
    from rlpost.models.fingerprint import FingerprintMismatch

    if isinstance(exc, (ConfigError, DataError, CheckpointMismatch, FileNotFoundError)):
        return 2
    if isinstance(exc, (HealthCheckError, DynamicSamplingExhausted, ClusterResourceError, FingerprintMismatch)):
        return 1
    return None


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")
def main(cfg: DictConfig) -> Optional[Any]:
    return run_job(cfg)
