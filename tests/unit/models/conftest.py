"""Fixtures for tests of one policy worker run in-process."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost.distributed.ports import free_port


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir: Path) -> Iterator[Any]:
    """A factory of world-size-1 DTensor workers on the tied tiny model (config overrides first, keyword arguments
    go to the worker; the gloo group is torn down after the module)."""
    import torch.distributed as dist

    from rlpost.config.load import load_master_config
    from rlpost.models.policy.dtensor_policy_worker import DTensorPolicyWorker

    mp = pytest.MonkeyPatch()
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1")),
                 "RLPOST_DEVICE": "cpu"}.items():
        mp.setenv(k, v)
    threads = torch.get_num_threads()
    model_dir = tiny_model_dir

    def policy(overrides: Sequence[str], model: Path) -> Any:
        _, cfg = load_master_config(["cluster.gpus_per_node=1", *overrides])  # AdamW + the default scheduler
        cfg_p = dataclasses.replace(cfg.policy, model_name=str(model))
        cfg_p.tokenizer.name = str(model)
        return cfg_p

    def make(overrides: Sequence[str] = (), model: Path | None = None, **kw: Any) -> DTensorPolicyWorker:
        """A worker of `model` (default: the tiny model)."""
        return DTensorPolicyWorker(policy(overrides, model or model_dir), **{"init_reference_model": False, **kw})

    try:
        yield make
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)
        mp.undo()
