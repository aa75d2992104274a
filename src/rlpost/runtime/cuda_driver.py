"""Whether this machine's GPUs can be used: the NVIDIA driver nvidia-smi reports against torch's CUDA build.

One verdict for three callers: `make install` on the GPU stack (scripts/check_cuda.py), the pre-flight of a run
with cluster.device=auto or cuda (rlpost.preflight), and `resolve_device` on the driver. A wheel built for a
newer CUDA than the driver supports installs cleanly and then reports `torch.cuda.is_available() == False`; the
verdict names the driver found, the one the build needs, and the way to CUDA 12 builds.

Driver minimums are NVIDIA's (CUDA Toolkit release notes, Linux x86_64): `TOOLKIT_DRIVER` per CUDA minor release,
`FAMILY_DRIVER` the oldest driver any release of a major version runs on (minor-version compatibility).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal

from rlpost.config.errors import ConfigError

TOOLKIT_DRIVER: dict[str, str] = {
    "13.0": "580.65.06",
    "12.9": "575.51.03",
    "12.8": "570.26",
    "12.6": "560.28.03",
    "12.5": "555.42.02",
    "12.4": "550.54.14",
    "12.3": "545.23.06",
    "12.2": "535.54.03",
    "12.1": "530.30.02",
    "12.0": "525.60.13",
}
"""The driver each CUDA minor release ships with: what a build of that release is sure to run on."""
FAMILY_DRIVER: dict[int, str] = {13: "580.65.06", 12: "525.60.13"}
"""The oldest driver a CUDA major version runs on at all (minor-version compatibility)."""
CU12_INSTALL = "make install STACK=gpu-cu12"
"""The CUDA 12 builds of the GPU stack (requirements/gpu-cu12.txt; README, Set up)."""
NVIDIA_SMI_TIMEOUT_S = 15.0
"""nvidia-smi hangs on some broken drivers: past this the machine counts as having no usable GPU."""

Verdict = Literal["ok", "no-gpu", "unusable"]
"""'ok': torch runs on the GPU; 'no-gpu': nvidia-smi lists none; 'unusable': a GPU is listed but torch cannot use
it."""


@dataclass(frozen=True)
class CudaProbe:
    """What the verdict is drawn from: the driver's side and torch's side."""

    driver: str | None
    """nvidia-smi's driver_version; None when nvidia-smi is missing, fails or lists no GPU."""
    gpus: list[str]
    """The names of the GPUs nvidia-smi lists."""
    torch_version: str
    """torch.__version__."""
    torch_cuda: str | None
    """torch.version.cuda: the CUDA release torch was built for; None for a CPU build."""
    available: bool
    """torch.cuda.is_available()."""
    hidden: bool = False
    """CUDA_VISIBLE_DEVICES is set to hide every GPU from this process."""


def version_tuple(version: str) -> tuple[int, ...]:
    """'535.104.05' -> (535, 104, 5); non-numeric parts end the tuple."""
    out: list[int] = []
    for part in version.strip().split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits or digits != part:
            if digits:
                out.append(int(digits))
            break
        out.append(int(digits))
    return tuple(out)


def required_driver(torch_cuda: str) -> str | None:
    """The driver a build for CUDA `torch_cuda` ('12.8', '13.0') needs: its release's, else its major version's."""
    major_minor = ".".join(torch_cuda.split(".")[:2])
    if major_minor in TOOLKIT_DRIVER:
        return TOOLKIT_DRIVER[major_minor]
    major = version_tuple(torch_cuda)[:1]
    return FAMILY_DRIVER.get(major[0]) if major else None


def nvidia_smi() -> tuple[str | None, list[str]]:
    """(driver version, GPU names) as nvidia-smi lists them; (None, []) without a working nvidia-smi or a GPU."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, []
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version,name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None, []
    rows = [line.split(",", 1) for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    rows = [r for r in rows if version_tuple(r[0])]
    if not rows:
        return None, []
    return rows[0][0].strip(), [r[1].strip() if len(r) > 1 else "GPU" for r in rows]


def gpus_hidden() -> bool:
    """CUDA_VISIBLE_DEVICES set to show no GPU ('' or '-1'): the user chose the CPU."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return value is not None and value.strip() in ("", "-1")


def probe(driver: str | None = None, torch_cuda: str | None = None, available: bool | None = None) -> CudaProbe:
    """This machine's CudaProbe; an argument given replaces what would be read (scripts/check_cuda.py's --driver,
    --torch-cuda, --available). torch is imported; CUDA is initialised only by `torch.cuda.is_available()`."""
    import torch

    gpus: list[str] = []
    if driver is None:
        driver, gpus = nvidia_smi()
    elif driver:
        gpus = ["GPU"]
    return CudaProbe(
        driver=driver or None,
        gpus=gpus,
        torch_version=str(torch.__version__),
        torch_cuda=(torch_cuda or None) if torch_cuda is not None else torch.version.cuda,
        available=torch.cuda.is_available() if available is None else available,
        hidden=gpus_hidden(),
    )


def _build(p: CudaProbe) -> str:
    return f"torch {p.torch_version} ({f'CUDA {p.torch_cuda}' if p.torch_cuda else 'CPU'} build)"


def verdict(p: CudaProbe) -> tuple[Verdict, str, str | None]:
    """(verdict, one line saying it, a hint or None)."""
    gpus = f"{len(p.gpus)} GPU{'s' if len(p.gpus) != 1 else ''}"
    if p.driver is None or p.hidden:
        why = "CUDA_VISIBLE_DEVICES hides every GPU" if p.driver else "nvidia-smi finds no NVIDIA GPU"
        return "no-gpu", f"no GPU: {why}; {_build(p)}", None
    if p.available:
        need = required_driver(p.torch_cuda) if p.torch_cuda else None
        compat = ""
        if need and version_tuple(p.driver) < version_tuple(need):
            compat = f"; older than CUDA {p.torch_cuda}'s {need}, it runs by CUDA minor-version compatibility"
        name = p.gpus[0] if p.gpus else "GPU"
        return "ok", f"CUDA works: {gpus} ({name}), driver {p.driver}, {_build(p)}{compat}", None
    if not p.torch_cuda:
        return ("unusable", f"nvidia-smi lists {gpus} (driver {p.driver}) but torch {p.torch_version} is a CPU build",
                "install the GPU stack: make install STACK=gpu (driver R580+) or STACK=gpu-cu12 (older drivers)")
    need = required_driver(p.torch_cuda)
    if need and version_tuple(p.driver) < version_tuple(need):
        line = (f"NVIDIA driver {p.driver} is too old for torch {p.torch_version}'s CUDA {p.torch_cuda} build, "
                f"which needs driver >= {need}")
        cu12_runs = version_tuple(p.driver) >= version_tuple(FAMILY_DRIVER[12])
        if version_tuple(p.torch_cuda)[0] >= 13 and cu12_runs:
            hint = f"install CUDA 12 builds: {CU12_INSTALL} (README, Set up), or upgrade the driver to >= {need}"
        else:
            hint = f"upgrade the NVIDIA driver to >= {need}"
        return "unusable", line, hint
    return ("unusable", f"nvidia-smi lists {gpus} (driver {p.driver}, new enough for CUDA {p.torch_cuda}) but "
            f"{_build(p)} cannot use them: torch.cuda.is_available() is False",
            "check the container's GPU access (docker --gpus) and CUDA_VISIBLE_DEVICES")


def usable_device(device: str, key: str = "cluster.device") -> str:
    """'cuda' or 'cpu' for `device` ('auto', 'cuda' or 'cpu'), or ConfigError naming `key` when the GPU it would
    use cannot be used: cuda without one, or auto beside a GPU torch cannot use (a run that would quietly train on
    CPU). nvidia-smi runs only when torch sees no GPU."""
    if device == "cpu":
        return "cpu"
    try:
        import torch
    except ImportError:
        if device == "auto":
            return "cpu"
        raise ConfigError(key, device, "torch is not installed") from None
    if torch.cuda.is_available():
        return "cuda"
    kind, line, hint = verdict(probe(available=False))
    if kind == "no-gpu":
        if device == "auto":
            return "cpu"
        raise ConfigError(key, device, f"needs a GPU, and {line.removeprefix('no GPU: ')}",
                          "use cluster.device=auto or cluster.device=cpu on this machine")
    if device == "auto":
        line += "; cluster.device=auto would quietly train on CPU"
    raise ConfigError(key, device, line, f"{hint}; or cluster.device=cpu to train on CPU")
