"""Shared test setup: one torch thread per process, GPU tests skipped without a GPU, and the tiny model
(built once per session) that every model test loads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["tests.fault_table"]  # the `fault` fixture: probes recorded for `make faults`

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _cuda_devices() -> int:
    """CUDA devices torch can use here (0 without CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


LONGEST_FIRST = ("tests/integration/test_grpo.py", "tests/integration/test_model_family_runs.py",
                 "tests/integration/test_supervised.py", "tests/integration/test_dtensor_policy.py",
                 "tests/integration/test_slurm.py", "tests/integration/test_multinode.py",
                 "tests/integration/test_ppo.py",
                 "tests/integration/test_distillation.py")
"""The longest test files (each about 3-12 minutes), started first so that `make test`'s two pytest-xdist workers
(one file at a time each) do not end with one of them running alone."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file keeps its own order
    gpus = _cuda_devices()
    for item in items:
        if "gpu2" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs two NVIDIA GPUs ({gpus} here)"))
        elif "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (a tied Qwen2 of `model=tiny`), built once per session into a temporary cache."""
    from rlpost.config.schema.model import TinyModelConfig
    from rlpost.models.tiny import ensure_tiny_model

    return ensure_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("models") / "tiny")
