"""StatelessGroup: a gloo group of 3 spawned processes broadcasts named tensors exactly, in bounded chunks."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

from rlpost.distributed.ports import free_port

WORLD = 3
CHUNK = 1000  # bytes; far below the total, and not a multiple of any tensor size


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(100, 37, generator=g)),  # 14.8 kB: spans many chunks
        ("b.bf16", torch.randn(333, generator=g).to(torch.bfloat16)),
        ("c.empty", torch.zeros(0, 4)),
        ("d.int", torch.randint(0, 1000, (7, 3), generator=g)),
        ("e.scalar", torch.tensor(3.5)),
        ("f.noncontig", torch.randn(20, 30, generator=g).t()),
    ]


def _run(rank: int, port: int, q: Any) -> None:
    torch.set_num_threads(1)
    from rlpost.distributed.collective import StatelessGroup

    try:
        assert not torch.distributed.is_initialized()
        chunk = CHUNK if rank == 0 else 10**9  # receivers follow the sender's chunking
        with StatelessGroup("127.0.0.1", port, rank, WORLD, backend="gloo", timeout_s=60, chunk_bytes=chunk) as g:
            out = g.broadcast_tensors(_tensors() if rank == 0 else None, src=0)
            stats = dict(vars(g.last_stats))
            again = g.broadcast_tensors([("x", torch.full((3,), float(rank)))] if rank == 0 else None)
            ok = len(out) == len(_tensors()) and all(
                n1 == n2 and t1.dtype == t2.dtype and t1.shape == t2.shape and torch.equal(t1, t2)
                for (n1, t1), (n2, t2) in zip(out, _tensors(), strict=True)
            )
            ok = ok and torch.equal(again[0][1], torch.zeros(3))
            q.put((rank, ok, stats, torch.distributed.is_initialized(), None))
    except Exception as exc:  # noqa: BLE001 - report to the parent
        q.put((rank, False, {}, False, repr(exc)))


@pytest.mark.slow
def test_broadcast_three_processes_exact_and_chunked() -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_run, args=(r, port, q), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = sorted(q.get(timeout=90) for _ in range(WORLD))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    total = sum(t.numel() * t.element_size() for _, t in _tensors())
    for rank, ok, _stats, default_group, err in results:
        assert err is None, f"rank {rank}: {err}"
        assert ok, f"rank {rank} got different tensors"
        assert not default_group, "the default torch.distributed group must stay untouched"
    assert total > 10 * CHUNK
    for _, _, stats, _, _ in results:  # every rank moved the bytes in the sender's bounded chunks
        assert stats["total_bytes"] == total
        assert stats["max_chunk_bytes"] == CHUNK
        assert stats["chunks"] == -(-total // CHUNK)


def test_chunk_walk_single_process() -> None:
    """World of one: the chunked pack/unpack path runs and the sender's stats show bounded chunks."""
    from rlpost.distributed.collective import StatelessGroup

    with StatelessGroup("127.0.0.1", free_port("127.0.0.1"), 0, 1, chunk_bytes=CHUNK, timeout_s=30) as g:
        out = g.broadcast_tensors(_tensors())
        total = sum(t.numel() * t.element_size() for _, t in _tensors())
        assert g.last_stats.total_bytes == total
        assert g.last_stats.max_chunk_bytes == CHUNK < total
        assert g.last_stats.chunks == -(-total // CHUNK)
        assert [n for n, _ in out] == [n for n, _ in _tensors()]
    with pytest.raises(ValueError):
        StatelessGroup("127.0.0.1", 1, 3, 2)
