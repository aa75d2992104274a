"""Fixtures for tests that run real Ray actors and process groups."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The RLPOST_CACHE_DIR of every `rlpost` subprocess of the session: each tiny model is built there once (builds
    are atomic renames, so runs can share it)."""
    return tmp_path_factory.mktemp("rlpost-cache")


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A local Ray cluster for the module (2 CPUs, small object store), shut down afterwards."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=256 * 2**20,
        logging_level="WARNING",
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}},
    )
    yield
    ray.shutdown()


class Closable(Protocol):
    def close(self) -> None: ...


@pytest.fixture
def built() -> Iterator[list[Closable]]:
    """What a test builds (policies and their clusters) is appended here and closed after it, however it ends."""
    made: list[Closable] = []
    yield made
    for b in made:
        b.close()
