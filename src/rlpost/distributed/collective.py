"""StatelessGroup: a small process group between the trainer's rank 0 and the rollout engines, for refit.

The trainer's processes already own the default torch.distributed group (FSDP, Megatron), and the
engine processes are separate programs (vLLM workers), so the weight-broadcast group must not use or
alter the default group: `torch.distributed.new_group` would need every trainer rank and the engines
in one world. Instead this builds a group directly from its parts:

    TCPStore (rank 0 hosts it at host:port)  ->  PrefixStore  ->  ProcessGroupGloo (CPU) / ProcessGroupNCCL (GPU)

Nothing global is touched (no `init_process_group`, no default group), so any number of these can
live next to the trainer's own group. Every rank must construct the group concurrently (the
constructor is a rendezvous, bounded by `timeout_s`).

`broadcast_tensors` sends named tensors from `src` to all ranks in bounded chunks: the tensors are
laid end to end as one byte stream; each chunk of at most `chunk_bytes` is packed into one flat uint8
buffer, broadcast, and unpacked into the receivers' tensors (a tensor may span chunks, so the buffer
never grows past `chunk_bytes` whatever the tensor sizes). A short JSON header (names, shapes,
dtypes and the sender's chunk size, which the receivers follow) goes first, so receivers need no
prior knowledge of the layout.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypedDict

import torch
import torch.distributed as dist

DEFAULT_CHUNK_BYTES = 64 * 2**20
"""Default broadcast chunk size (bytes)."""


class _Header(TypedDict):
    """What `_send_header` broadcasts: the sender's chunk size and each tensor's (name, shape, dtype)."""

    chunk_bytes: int
    tensors: list[tuple[str, list[int], str]]


@dataclass
class BroadcastStats:
    """What the last broadcast did."""

    tensors: int = 0
    total_bytes: int = 0
    chunks: int = 0
    max_chunk_bytes: int = 0


def _dtype_from_str(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in broadcast header")
    return dt


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor."""
    return t.reshape(-1).view(torch.uint8)


class StatelessGroup:
    """A gloo/NCCL group of `world_size` ranks rendezvousing at host:port, outside torch's default group."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        prefix: str = "rlpost-refit",
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size
        self.backend = backend
        self.chunk_bytes = int(chunk_bytes)
        self.last_stats = BroadcastStats()
        timeout = timedelta(seconds=timeout_s)
        self._store: dist.Store | None = dist.TCPStore(
            host, port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
        )
        prefixed = dist.PrefixStore(prefix, self._store)
        if backend == "gloo":
            self.device = torch.device("cpu")
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = timeout
            loopback = host in ("127.0.0.1", "localhost", "::1")
            opts._devices = [
                dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
                if loopback
                else dist.ProcessGroupGloo.create_default_device()
            ]
            self._pg: Any = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
        else:  # nccl: one GPU per process, the current device
            self.device = torch.device("cuda", torch.cuda.current_device())
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, nccl_opts)
        self._buffer: torch.Tensor | None = None

    # ------------------------------------------------------------------ primitives
    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._pg.broadcast([t], opts).wait()

    def barrier(self) -> None:
        """Wait until every rank gets here (a 1-element broadcast from rank 0)."""
        self._broadcast(torch.zeros(1, device=self.device), 0)

    def _send_header(
        self, items: list[tuple[str, torch.Tensor]], src: int
    ) -> tuple[list[tuple[str, list[int], str]], int]:
        """Broadcast the layout (names, shapes, dtypes) and the sender's chunk size; every rank returns them."""
        header: _Header
        if self.rank == src:
            header = {"chunk_bytes": self.chunk_bytes, "tensors": [(n, list(t.shape), str(t.dtype)) for n, t in items]}
            raw = json.dumps(header).encode()
            length = torch.tensor([len(raw)], dtype=torch.int64, device=self.device)
        else:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(length, src)
        n = int(length.item())
        buf = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)
            if self.rank == src
            else torch.empty(n, dtype=torch.uint8, device=self.device)
        )
        self._broadcast(buf, src)
        if self.rank != src:
            header = json.loads(bytes(buf.cpu().numpy()).decode())
        meta = [(str(n_), [int(d) for d in s], str(d_)) for n_, s, d_ in header["tensors"]]
        return meta, int(header["chunk_bytes"])

    # ------------------------------------------------------------------ public
    def broadcast_tensors(
        self, tensors: Iterable[tuple[str, torch.Tensor]] | None = None, src: int = 0
    ) -> list[tuple[str, torch.Tensor]]:
        """Broadcast named tensors from `src`; every rank returns them (the sender returns its own inputs).

        On `src`, `tensors` are the (name, tensor) pairs to send (any dtype, on any device: they are
        copied through the group's device chunk by chunk); on the other ranks it is ignored.
        Receivers get fresh tensors on the group's device with the sender's names, shapes and dtypes.
        """
        if self._pg is None:
            raise RuntimeError("StatelessGroup is closed")
        items = [(n, t.detach()) for n, t in (tensors or [])] if self.rank == src else []
        meta, chunk_bytes = self._send_header(items, src)  # receivers follow the sender's chunking
        if self.rank == src:
            views = [_byte_view(t.contiguous()) for _, t in items]
            out = items
        else:
            out = [(n, torch.empty(s, dtype=_dtype_from_str(d), device=self.device)) for n, s, d in meta]
            views = [_byte_view(t) for _, t in out]
        total = sum(v.numel() for v in views)
        stats = BroadcastStats(tensors=len(meta), total_bytes=total)
        if total:
            size = min(chunk_bytes, total)
            if self._buffer is None or self._buffer.numel() < size:
                self._buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            buf = self._buffer
            ti, toff = 0, 0  # current tensor and byte offset inside it
            pos = 0
            while pos < total:
                n = min(chunk_bytes, total - pos)
                # Walk the tensors covering bytes [pos, pos + n): pack (sender) and remember the spans.
                spans: list[tuple[int, int, int, int]] = []  # (tensor, offset in tensor, offset in buf, length)
                filled = 0
                while filled < n:
                    v = views[ti]
                    take = min(v.numel() - toff, n - filled)
                    if take > 0:
                        spans.append((ti, toff, filled, take))
                        if self.rank == src:
                            buf[filled : filled + take].copy_(v[toff : toff + take])
                    filled += max(take, 0)
                    toff += max(take, 0)
                    if toff >= v.numel():
                        ti, toff = ti + 1, 0
                self._broadcast(buf[:n], src)
                if self.rank != src:
                    for i, off, boff, ln in spans:
                        views[i][off : off + ln].copy_(buf[boff : boff + ln])
                pos += n
                stats.chunks += 1
                stats.max_chunk_bytes = max(stats.max_chunk_bytes, n)
        self.last_stats = stats
        return out

    def close(self) -> None:
        """Release the group and the store (idempotent)."""
        pg, self._pg = self._pg, None
        if pg is not None:
            shutdown = getattr(pg, "shutdown", None)
            if callable(shutdown):
                try:
                    shutdown()
                except Exception:  # noqa: BLE001 - best effort on teardown
                    pass
        self._buffer = None
        self._store = None

    def __enter__(self) -> StatelessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
