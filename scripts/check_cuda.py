"""Whether CUDA works in this Python: the check `make install` runs after installing the GPU stack.

    .venv/bin/python scripts/check_cuda.py                                     # this machine
    .venv/bin/python scripts/check_cuda.py --driver 535.104.05 --torch-cuda 13.0   # another driver or build

One line on stdout, then the exit status: 0 when torch runs a kernel on the GPU; 1 when a GPU is listed but torch
cannot use it (the line names the driver found and the one torch's build needs, the hint how to get CUDA 12
builds); 3 when nvidia-smi lists no GPU. --driver, --torch-cuda and --available replace what would be read from
nvidia-smi and torch (rlpost.runtime.cuda_driver draws the verdict).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # a checkout without `pip install -e .`

from rlpost.runtime.cuda_driver import probe, verdict  # noqa: E402

EXIT: dict[str, int] = {"ok": 0, "unusable": 1, "no-gpu": 3}
"""Exit status per verdict."""


def kernel_runs() -> str | None:
    """None when a tiny kernel runs on GPU 0, else why not (a GPU this build has no kernels for, e.g. sm_70 under
    CUDA 13)."""
    import torch

    try:
        ok = torch.ones(4, device="cuda").add_(1).sum().item() == 8.0
    except Exception as exc:  # noqa: BLE001 - any CUDA error is the answer
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None if ok else "a kernel on the GPU returned a wrong sum"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/check_cuda.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--driver", help="the NVIDIA driver version instead of nvidia-smi's ('' for none)")
    ap.add_argument("--torch-cuda", help="torch's CUDA build instead of torch.version.cuda ('' for a CPU build)")
    ap.add_argument("--available", choices=("yes", "no"), help="torch.cuda.is_available()'s answer instead of torch's")
    args = ap.parse_args(argv)
    available = None if args.available is None else args.available == "yes"
    p = probe(driver=args.driver, torch_cuda=args.torch_cuda, available=available)
    kind, line, hint = verdict(p)
    if kind == "ok" and available is None and (why := kernel_runs()) is not None:
        kind, line = "unusable", f"torch sees the GPU but cannot run a kernel on it ({why}); {line.split(': ', 1)[1]}"
        hint = "a GPU older than this CUDA build supports (CUDA 13 needs sm_75 or newer) needs older builds"
    prefix = "check_cuda: " + ("error: " if kind == "unusable" else "")
    print(prefix + line, file=sys.stdout if kind != "unusable" else sys.stderr)
    if hint:
        print(f"  hint: {hint}", file=sys.stderr)
    return EXIT[kind]


if __name__ == "__main__":
    sys.exit(main())
