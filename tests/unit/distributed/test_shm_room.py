"""A colocated refit's shared-memory buffer that /dev/shm has no room for fails with one line naming the sizes and
the fix (rlpost.distributed.shm_buckets), where filling it would die of SIGBUS."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlpost.distributed.shm_buckets import PREFIX, ShmBucketWriter, ShmTooSmall, check_shm_room, shm_shortfall

MIB = 2**20


def test_the_shortfall_line_names_what_was_found_what_is_needed_and_the_fix() -> None:
    assert shm_shortfall(64 * MIB, 64 * MIB) is None
    line = shm_shortfall(64 * MIB, 128 * MIB)
    assert line is not None and "\n" not in line
    assert "/dev/shm has 64 MiB free" in line and "needs 128 MiB" in line
    assert "--shm-size" in line and "--ipc=host" in line and "policy.refit_buffer_size_gb" in line


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, as Docker's small default /dev/shm is (root only)."""
    mount = tmp_path / "shm"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_writer_refuses_a_segment_larger_than_the_room_left(small_tmpfs: Path) -> None:
    check_shm_room(MIB, str(small_tmpfs))
    writer = ShmBucketWriter(root=str(small_tmpfs))
    before = set(Path("/dev/shm").glob(f"{PREFIX}{os.getpid()}-*"))
    try:
        with pytest.raises(ShmTooSmall, match=rf"{small_tmpfs} has 4 MiB free, .* needs 8 MiB"):
            writer.write([("w", torch.zeros(2 * MIB))])  # 8 MiB of fp32
        assert writer.segment is None
        assert set(Path("/dev/shm").glob(f"{PREFIX}{os.getpid()}-*")) == before  # nothing created
        desc = writer.write([("w", torch.ones(MIB // 4))])  # 1 MiB fits
        assert desc["records"]
    finally:
        writer.close()
