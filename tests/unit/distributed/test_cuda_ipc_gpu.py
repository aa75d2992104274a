"""CUDA IPC refit buckets on a real GPU: another process opens rank 0's device buffer and reads exactly what was
written, bucket after bucket in the same buffer and in a grown one. Marked `gpu` (skipped without a GPU). It needs
only torch and rlpost's source, no Ray, so it runs on a device machine as it is:
`PYTHONPATH=src python3 -m pytest -m gpu tests/unit/distributed/test_cuda_ipc_gpu.py`."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

from rlpost.distributed.cuda_ipc_buckets import CudaIpcBucketWriter, read_cuda_ipc_bucket
from rlpost.models.fingerprint import tensor_digests

pytestmark = pytest.mark.gpu


def _engine(inbox: Any, outbox: Any) -> None:
    """The engine's side: open each descriptor, digest what it sees, copy one tensor out, drop the views."""
    while (desc := inbox.get()) is not None:
        named = read_cuda_ipc_bucket(desc)
        out = {"digests": tensor_digests(named), "devices": sorted({str(t.device) for _, t in named}),
               "first": named[0][1].detach().clone().cpu()}
        del named
        torch.cuda.current_stream().synchronize()
        outbox.put(out)


def _bucket(seed: int, scale: int = 1) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [("model.layers.0.mlp.up_proj.weight", torch.randn(64 * scale, 32, device="cuda", generator=g)),
            ("model.layers.0.input_layernorm.weight",
             torch.randn(32, device="cuda", generator=g).to(torch.bfloat16)),
            ("model.embed_tokens.weight", torch.randn(100, 32 * scale, device="cuda", generator=g).t())]


def test_another_process_reads_rank_zeros_device_buffer_exactly() -> None:
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    engine = ctx.Process(target=_engine, args=(inbox, outbox), daemon=True)
    engine.start()
    writer = CudaIpcBucketWriter(torch.device("cuda", 0))
    try:
        buffers = []
        for seed, scale in ((0, 1), (1, 1), (2, 3)):  # the same buffer rewritten, then a larger one
            named = _bucket(seed, scale)
            desc = writer.write(named)
            assert writer.buffer is not None and writer.buffer.is_cuda
            buffers.append(writer.buffer.data_ptr())
            inbox.put(desc)
            seen = outbox.get(timeout=120)
            assert seen["digests"] == tensor_digests(named)  # every tensor, bit for bit (sampled fingerprint)
            assert seen["devices"] == ["cuda:0"]
            assert torch.equal(seen["first"], named[0][1].cpu())  # a full tensor, exactly
        assert buffers[0] == buffers[1]  # rewritten in place: nothing new to open for the engine
    finally:
        inbox.put(None)
        engine.join(timeout=60)
        writer.close()
    assert engine.exitcode == 0
