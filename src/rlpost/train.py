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

    return run(master, run_dir)


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")
def main(cfg: DictConfig) -> Optional[Any]:
    return run_job(cfg)
