"""A GPU torch cannot use is named before anything starts: `make install`'s check (scripts/check_cuda.py) and the
pre-flight of cluster.device=auto / cuda (rlpost.runtime.cuda_driver draws both verdicts).

The driver is simulated by an `nvidia-smi` script put first on PATH; torch is this venv's own (a CPU build here), so
the tests that rely on torch seeing no GPU skip on a machine where it sees one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlpost.config.errors import ConfigError
from rlpost.runtime.cuda_driver import (
    CU12_INSTALL,
    TOOLKIT_DRIVER,
    CudaProbe,
    required_driver,
    usable_device,
    verdict,
    version_tuple,
)
from tests.fault_table import Record
from tests.unit.test_bad_input_probes import assert_refused, rlpost

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "check_cuda.py"
DRIVER_535 = "535.104.05"
no_torch_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here: nothing to refuse")


def fake_nvidia_smi(tmp_path: Path, driver: str = DRIVER_535) -> dict[str, str]:
    """The environment of a process whose PATH starts with an `nvidia-smi` listing one H100 on `driver`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "{driver}, NVIDIA H100 80GB HBM3"\n')
    smi.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def without_nvidia_smi() -> dict[str, str]:
    """PATH with every directory that holds an nvidia-smi left out."""
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "nvidia-smi").exists()]
    return {"PATH": os.pathsep.join(dirs)}


def cuda_probe(driver: str | None, torch_cuda: str | None, available: bool = False) -> CudaProbe:
    return CudaProbe(driver=driver, gpus=["NVIDIA H100 80GB HBM3"] if driver else [], torch_version="2.14.0",
                     torch_cuda=torch_cuda, available=available)


# ---- the verdict ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("cuda", "major"), [("13.0", 580), ("12.9", 575), ("12.8", 570), ("12.6", 560),
                                             ("12.4", 550), ("13.2", 580), ("12.11", 525)])
def test_each_cuda_build_needs_nvidias_minimum_driver(cuda: str, major: int) -> None:
    need = required_driver(cuda)
    assert need is not None and version_tuple(need)[0] == major
    assert TOOLKIT_DRIVER["13.0"] == "580.65.06"


def test_driver_versions_compare_by_number() -> None:
    assert version_tuple("580.65.06") == (580, 65, 6)
    assert version_tuple("535.104.05") < version_tuple("580.65.06") < version_tuple("580.105.08")
    assert version_tuple("570.26") < version_tuple("570.124.06")


def test_a_cuda13_build_on_an_r535_driver_names_both_drivers_and_the_cuda12_builds() -> None:
    kind, line, hint = verdict(cuda_probe(DRIVER_535, "13.0"))
    assert kind == "unusable"
    assert line == (f"NVIDIA driver {DRIVER_535} is too old for torch 2.14.0's CUDA 13.0 build, which needs driver "
                    ">= 580.65.06")
    assert hint is not None and CU12_INSTALL in hint and "580.65.06" in hint


def test_a_driver_too_old_for_any_cuda12_build_is_told_to_upgrade() -> None:
    kind, line, hint = verdict(cuda_probe("470.82.01", "13.0"))
    assert kind == "unusable" and "470.82.01" in line
    assert hint == "upgrade the NVIDIA driver to >= 580.65.06"
    kind, line, hint = verdict(cuda_probe("560.35.03", "12.8"))
    assert kind == "unusable" and "needs driver >= 570.26" in line and hint == "upgrade the NVIDIA driver to >= 570.26"


def test_a_working_gpu_passes_and_an_older_driver_under_minor_version_compatibility_says_so() -> None:
    kind, line, hint = verdict(cuda_probe("580.82.07", "13.0", available=True))
    assert (kind, hint) == ("ok", None) and line.startswith("CUDA works: 1 GPU (NVIDIA H100 80GB HBM3), driver 580.82.07")
    kind, line, _ = verdict(cuda_probe(DRIVER_535, "12.8", available=True))
    assert kind == "ok" and "minor-version compatibility" in line


def test_a_new_enough_driver_that_torch_still_cannot_use_is_not_blamed() -> None:
    kind, line, hint = verdict(cuda_probe("580.82.07", "13.0"))
    assert kind == "unusable" and "new enough for CUDA 13.0" in line and "is_available() is False" in line
    assert hint is not None and "CUDA_VISIBLE_DEVICES" in hint


def test_no_gpu_a_hidden_gpu_and_a_cpu_torch_beside_a_gpu() -> None:
    kind, line, _ = verdict(cuda_probe(None, None))
    assert kind == "no-gpu" and line == "no GPU: nvidia-smi finds no NVIDIA GPU; torch 2.14.0 (CPU build)"
    hidden = CudaProbe(driver=DRIVER_535, gpus=["H100"], torch_version="2.14.0", torch_cuda="13.0", available=False,
                       hidden=True)
    assert verdict(hidden)[:2] == ("no-gpu", "no GPU: CUDA_VISIBLE_DEVICES hides every GPU; torch 2.14.0 "
                                              "(CUDA 13.0 build)")
    kind, line, hint = verdict(cuda_probe(DRIVER_535, None))
    assert kind == "unusable" and line == f"nvidia-smi lists 1 GPU (driver {DRIVER_535}) but torch 2.14.0 is a CPU build"
    assert hint is not None and "STACK=gpu-cu12" in hint


# ---- scripts/check_cuda.py: what `make install` runs ------------------------------------------------


def check_cuda(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})


@no_torch_gpu
def test_check_cuda_on_a_machine_without_nvidia_smi_says_no_gpu() -> None:
    out = check_cuda(env=without_nvidia_smi())
    assert out.returncode == 3, out.stderr
    assert out.stdout.strip() == f"check_cuda: no GPU: nvidia-smi finds no NVIDIA GPU; torch {torch.__version__} " \
                                 "(CPU build)"
    assert "Traceback" not in out.stderr


def test_check_cuda_with_an_r535_driver_and_a_cuda13_torch_fails_naming_what_to_install() -> None:
    out = check_cuda("--driver", DRIVER_535, "--torch-cuda", "13.0", "--available", "no", env={})
    assert out.returncode == 1, out.stdout + out.stderr
    first, hint = out.stderr.strip().splitlines()
    assert first.startswith(f"check_cuda: error: NVIDIA driver {DRIVER_535} is too old for torch ")
    assert first.endswith("CUDA 13.0 build, which needs driver >= 580.65.06")
    assert hint == f"  hint: install CUDA 12 builds: {CU12_INSTALL} (README, Set up), or upgrade the driver to >= " \
                   "580.65.06"
    ok = check_cuda("--driver", "580.82.07", "--torch-cuda", "13.0", "--available", "yes", env={})
    assert ok.returncode == 0 and ok.stdout.startswith("check_cuda: CUDA works: 1 GPU"), ok.stdout + ok.stderr


@no_torch_gpu
def test_check_cuda_with_a_gpu_listed_and_this_cpu_torch_fails(tmp_path: Path) -> None:
    out = check_cuda(env=fake_nvidia_smi(tmp_path))
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.splitlines()[0] == (f"check_cuda: error: nvidia-smi lists 1 GPU (driver {DRIVER_535}) but "
                                          f"torch {torch.__version__} is a CPU build")


# ---- the pre-flight: cluster.device=auto / cuda -----------------------------------------------------


@no_torch_gpu
def test_usable_device_refuses_auto_beside_a_gpu_torch_cannot_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    from rlpost.config.schema.cluster import ClusterConfig
    from rlpost.distributed.virtual_cluster import resolve_device

    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path)["PATH"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert usable_device("cpu") == "cpu"
    with pytest.raises(ConfigError) as err:
        resolve_device(ClusterConfig(device="auto"))  # the driver's own answer: no quiet fall-back to CPU
    assert err.value.key == "cluster.device" and err.value.value == "auto"
    assert DRIVER_535 in err.value.rule and "would quietly train on CPU" in err.value.rule
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the user hid the GPUs: CPU it is
    assert usable_device("auto") == "cpu"


@no_torch_gpu
@pytest.mark.faults
def test_rlpost_train_with_auto_beside_an_unusable_gpu_exits_2_naming_the_driver(tmp_path: Path,
                                                                                 fault: Record) -> None:
    env = {**fake_nvidia_smi(tmp_path), "CUDA_VISIBLE_DEVICES": "0"}
    line = assert_refused(rlpost("train", cwd=tmp_path, env=env), "cluster.device='auto'",
                          "or cluster.device=cpu to train on CPU", fault=fault)
    assert f"nvidia-smi lists 1 GPU (driver {DRIVER_535}) but torch {torch.__version__} is a CPU build" in line
    assert not (tmp_path / "outputs").exists()


@no_torch_gpu
@pytest.mark.faults
def test_rlpost_train_with_cuda_and_no_gpu_exits_2(tmp_path: Path, fault: Record) -> None:
    line = assert_refused(rlpost("train", "cluster.device=cuda", cwd=tmp_path, env=without_nvidia_smi()),
                          "cluster.device='cuda'", fault=fault)
    assert line.endswith("needs a GPU, and nvidia-smi finds no NVIDIA GPU; "
                         f"torch {torch.__version__} (CPU build)"), line


@no_torch_gpu
def test_rlpost_train_with_auto_and_the_gpus_hidden_runs_on_cpu(tmp_path: Path) -> None:
    out = rlpost("train", cwd=tmp_path, env={**fake_nvidia_smi(tmp_path), "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 99, out.stderr[-2000:]  # past the pre-flight, where Hydra would start the run
