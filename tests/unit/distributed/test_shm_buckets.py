"""Refit buckets through one reusable shared-memory segment: exact round trip, reuse, growth, and who unlinks it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from rlpost.distributed.shm_buckets import PREFIX, ShmBucketWriter, read_bucket, sweep_orphans


def _named(scale: int = 1) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(scale)
    return [("a.weight", torch.randn(3 * scale, 5, generator=g)),
            ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
            ("c.steps", torch.arange(4, dtype=torch.int64)),
            ("d.empty", torch.zeros(0, 3)),
            ("e.strided", torch.randn(6, 4, generator=g).t())]  # non-contiguous: written contiguous


def _same(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for (_, x), (_, y) in zip(a, b, strict=True))


def test_round_trip_reuse_and_growth() -> None:
    w = ShmBucketWriter()
    try:
        first = w.write(_named())
        assert _same(read_bucket(first), _named())
        again = w.write(_named(1))
        assert again["shm"] == first["shm"]  # the same segment, reused
        bigger = w.write(_named(50))
        assert bigger["shm"] != first["shm"] and _same(read_bucket(bigger), _named(50))  # grown: a new segment
        assert not Path("/dev/shm", first["shm"]).exists()  # the outgrown one is unlinked
    finally:
        w.close()
    assert not Path("/dev/shm", bigger["shm"]).exists()


def test_an_engine_that_exits_leaves_the_owners_segment_alone() -> None:
    """A reader process (with its own resource tracker, like an engine actor) unregisters its attachment, so its
    exit does not unlink the owner's segment."""
    w = ShmBucketWriter()
    try:
        desc = w.write(_named())
        reader = ("import json, sys; from rlpost.distributed.shm_buckets import read_bucket; "
                  "print(float(read_bucket(json.loads(sys.argv[1]))[0][1].sum()))")
        out = subprocess.run([sys.executable, "-c", reader, json.dumps(desc)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert float(out.stdout) == float(_named()[0][1].sum())
        assert "leaked" not in out.stderr
        assert Path("/dev/shm", desc["shm"]).exists()
        assert _same(read_bucket(w.write(_named())), _named())
    finally:
        w.close()


def test_segments_of_dead_owners_are_swept(tmp_path: Path) -> None:
    """A segment whose owner pid is gone is unlinked by the next writer; a live owner's is kept."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"{PREFIX}{int(dead.stdout)}-abc"
    mine = tmp_path / f"{PREFIX}{os.getpid()}-def"
    orphan.write_bytes(b"x")
    mine.write_bytes(b"x")
    assert sweep_orphans(str(tmp_path)) == [orphan.name]
    assert not orphan.exists() and mine.exists()


def test_a_reader_in_the_owners_process_leaves_the_tracker_consistent() -> None:
    """A reader in the owner's own process (an engine beside the policy in one process, a test) reads the segment
    its process wrote: its attachment must not unregister the owner's one registration, or the owner's unlink makes
    the resource tracker raise KeyError."""
    script = ("from rlpost.distributed.shm_buckets import ShmBucketWriter, read_bucket; import torch; "
              "w = ShmBucketWriter(); d = w.write([('a', torch.ones(3))]); "
              "assert float(read_bucket(d)[0][1].sum()) == 3.0; w.close(); print('ok')")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert "KeyError" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
