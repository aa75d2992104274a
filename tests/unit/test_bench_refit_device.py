"""benchmarks.refit and benchmarks.limits measure the device the config names: GPU bundles and a CUDA policy under
cluster.device=cuda, CPU bundles otherwise, and a GPU that cannot be used refused rather than measured on CPU."""

from __future__ import annotations

import pytest
import torch
from benchmarks.limits import run_device
from benchmarks.refit import CPU_BUNDLE_CPUS, RefitSetup, refit_setup

from rlpost.config.errors import ConfigError
from rlpost.config.load import load_master_config
from rlpost.config.schema.master import MasterConfig


def master(*overrides: str) -> MasterConfig:
    cfg = load_master_config(list(overrides))[1]
    assert isinstance(cfg, MasterConfig)
    return cfg


def test_cpu_and_auto_without_a_gpu_keep_the_cpu_setup() -> None:
    cpu = refit_setup(master("cluster.device=cpu"))
    assert cpu == RefitSetup("cpu", False, CPU_BUNDLE_CPUS)
    assert not cpu.cluster().use_gpus  # built, not placed: nothing starts
    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert refit_setup(master()).device == here == run_device(master())


def test_cuda_gives_gpu_bundles_and_a_cuda_policy() -> None:
    cfg = master("cluster.device=cuda")
    setup = refit_setup(cfg, "cuda")  # what a GPU machine resolves cluster.device=cuda to
    assert setup == RefitSetup("cuda", True, cfg.cluster.worker_num_cpus * 2)
    cluster = setup.cluster()
    assert cluster.use_gpus and cluster.max_colocated_worker_groups == 2
    if torch.cuda.is_available():
        assert refit_setup(cfg) == setup and run_device(cfg) == "cuda"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable GPU")
def test_cuda_on_a_machine_without_one_is_refused_not_measured_on_cpu() -> None:
    cfg = master("cluster.device=cuda")
    for setup in (refit_setup, run_device):
        with pytest.raises(ConfigError) as err:
            setup(cfg)
        assert err.value.key == "cluster.device" and err.value.value == "cuda"
