"""Run one validated job in its run directory; always release what it started."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from rlpost.config.schema.master import MasterConfig


def run(cfg: MasterConfig, run_dir: Path) -> Optional[Any]:
    """Run GRPO for `cfg` with outputs under `run_dir`.

    Training arrives with the GRPO end-to-end work; until then a job stops after validating
    its config and printing its plan.
    """
    print(
        f"rlpost: config validated and written to {run_dir / 'resolved_config.yaml'}; "
        "training is not implemented yet, so this job stops here."
    )
    return {"run_dir": str(run_dir)}
