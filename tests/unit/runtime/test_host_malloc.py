"""rlpost.runtime.host_malloc: with the mmap threshold fixed, freed large tensors leave the process; without it, a
heap that smaller live allocations pin keeps them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlpost.config.layout import LONG_SEQUENCE_TOKENS, maps_large_buffers

_PROBE = """
import sys, psutil, torch
from rlpost.runtime import host_malloc
if sys.argv[1] == "mapped":
    assert host_malloc.map_large_buffers()
torch.empty(2 << 20, dtype=torch.uint8).fill_(1)  # a first 2 MiB buffer, freed: glibc's threshold rises past it
rss = psutil.Process().memory_info().rss
big, pins = [], []
for _ in range(64):  # 64 x 2 MiB, each followed by a small live allocation that pins the heap above it
    big.append(torch.empty(2 << 20, dtype=torch.uint8).fill_(1))
    pins.append(torch.empty(4096, dtype=torch.uint8).fill_(1))
del big
print((psutil.Process().memory_info().rss - rss) / 2**20)
"""


def _left_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_large_buffers_leave_the_process_only_when_mapped() -> None:
    assert _left_mib("mapped") < 16  # the 128 MiB went back to the OS
    assert _left_mib("heap") > 64  # pinned in the heap


def test_only_long_sequences_map_their_buffers() -> None:
    assert maps_large_buffers(8192) and maps_large_buffers(LONG_SEQUENCE_TOKENS)
    assert not maps_large_buffers(512)
