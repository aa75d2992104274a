"""A malicious pickle for the tests that check resume never unpickles: loading it creates a canary file."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch


class Payload:
    """Unpickling this creates the file `canary` (any code could run instead)."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.canary), "w"))


def plant(path: Path, canary: Path) -> None:
    """Write a malicious pickle to `path`: a torch.save zip for torch-style names, a bare pickle otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix in (".pt", ".bin", ".pth", ".distcp"):
        torch.save(Payload(canary), path)
    else:
        path.write_bytes(pickle.dumps(Payload(canary)))
