"""Next-token logprobs: unsharded vs a plain log_softmax, chunking, and the vocab-parallel version on 2 gloo ranks."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlpost.config.schema.loss import ClippedPGLossConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.distributed.ports import free_port
from rlpost.losses.clipped_pg import ClippedPGLossFn
from rlpost.ops.logprobs import logprobs_from_logits, vocab_parallel_logprobs

B, S, V = 3, 7, 10
CHUNKS = (None, 1, 3)


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(B, S, V, generator=g)
    ids = torch.randint(0, V, (B, S), generator=g)
    upstream = torch.randn(B, S, generator=g)
    return logits, ids, upstream


def reference_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Position t = log_softmax(logits[t-1])[ids[t]], position 0 = 0, by plain indexing."""
    out = torch.zeros(ids.shape, dtype=torch.float32)
    lsm = torch.log_softmax(logits.float(), dim=-1)
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            out[b, t] = lsm[b, t - 1, ids[b, t]]
    return out


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_logprobs_and_grad_match_log_softmax(chunk_size: int | None) -> None:
    logits, ids, upstream = inputs()
    a = logits.clone().requires_grad_(True)
    lp = logprobs_from_logits(a, ids, chunk_size=chunk_size)
    assert lp.shape == (B, S) and lp.dtype == torch.float32
    assert torch.all(lp[:, 0] == 0)
    torch.testing.assert_close(lp, reference_logprobs(logits, ids), atol=1e-6, rtol=0)
    (lp * upstream).sum().backward()
    b = logits.clone().requires_grad_(True)
    (reference_logprobs(b, ids) * upstream).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=0)
    assert torch.all(a.grad[:, -1] == 0)  # the last position predicts nothing


def test_bf16_logits_computed_in_fp32() -> None:
    logits, ids, _ = inputs(1)
    lp = logprobs_from_logits(logits.bfloat16(), ids)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, reference_logprobs(logits.bfloat16().float(), ids), atol=1e-5, rtol=0)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        logits, ids, upstream = inputs()
        per = V // world
        lo, hi = rank * per, (rank + 1) * per
        results: dict[str, np.ndarray] = {}
        for chunk in CHUNKS:
            local = logits[:, :, lo:hi].clone().requires_grad_(True)
            lp = vocab_parallel_logprobs(local, ids, lo, hi, dist.group.WORLD, chunk_size=chunk)
            (lp * upstream).sum().backward()
            results[f"lp_{chunk}"] = lp.detach().numpy()
            results[f"grad_{chunk}"] = local.grad.numpy()
        # the loss takes TP-sharded logits through vocab_parallel_group / vocab_parallel_rank
        data = _loss_data(ids)
        local = logits[:, :, lo:hi].clone().requires_grad_(True)
        loss, _ = ClippedPGLossFn(ClippedPGLossConfig())(
            local,
            data,
            torch.tensor(3.0),
            torch.tensor(12.0),
            vocab_parallel_rank=rank,
            vocab_parallel_group=dist.group.WORLD,
        )
        loss.backward()
        results["loss"] = np.array(float(loss))
        results["loss_grad"] = local.grad.numpy()
        np.savez(Path(out_dir) / f"rank{rank}.npz", **results)
    finally:
        dist.destroy_process_group()


def _loss_data(ids: torch.Tensor) -> BatchedDataDict:
    g = torch.Generator().manual_seed(7)
    return BatchedDataDict(
        input_ids=ids,
        token_mask=torch.ones(B, S),
        sample_mask=torch.ones(B),
        advantages=torch.randn(B, S, generator=g),
        prev_logprobs=-torch.rand(B, S, generator=g) * 3,
        generation_logprobs=-torch.rand(B, S, generator=g) * 3,
        reference_policy_logprobs=-torch.rand(B, S, generator=g) * 3,
    )


@pytest.mark.slow
def test_vocab_parallel_matches_unsharded_on_two_gloo_ranks(tmp_path: Path) -> None:
    world = 2
    mp.spawn(_worker, args=(world, free_port("127.0.0.1"), str(tmp_path)), nprocs=world, join=True)
    res = [np.load(tmp_path / f"rank{r}.npz") for r in range(world)]
    logits, ids, upstream = inputs()
    full = logits.clone().requires_grad_(True)
    lp = logprobs_from_logits(full, ids)
    (lp * upstream).sum().backward()
    per = V // world
    for chunk in CHUNKS:
        for r in range(world):
            np.testing.assert_allclose(res[r][f"lp_{chunk}"], lp.detach().numpy(), atol=1e-5, rtol=0)
            want = full.grad[:, :, r * per : (r + 1) * per].numpy()
            np.testing.assert_allclose(res[r][f"grad_{chunk}"], want, atol=1e-6, rtol=0)
    full2 = logits.clone().requires_grad_(True)
    loss, _ = ClippedPGLossFn(ClippedPGLossConfig())(full2, _loss_data(ids), torch.tensor(3.0), torch.tensor(12.0))
    loss.backward()
    for r in range(world):
        assert float(res[r]["loss"]) == pytest.approx(float(loss), abs=1e-6)
        want = full2.grad[:, :, r * per : (r + 1) * per].numpy()
        np.testing.assert_allclose(res[r]["loss_grad"], want, atol=1e-6, rtol=0)
    assert np.abs(res[0]["loss_grad"]).max() > 1e-3
