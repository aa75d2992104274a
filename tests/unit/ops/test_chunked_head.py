"""rlpost.ops.chunked_head: next-token logprobs through the output layer in chunks equal the whole logits' (values
and the gradients of the hidden states and the weight), sharded over the vocabulary on a real gloo group too, and
no tensor the size of the whole logits is ever made."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from rlpost.distributed.ports import free_port
from rlpost.ops.chunked_head import head_logprobs

N, H, V = 37, 16, 101


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    weight = (0.5 * torch.randn(V, H, generator=g, dtype=dtype)).requires_grad_()
    return hidden, weight, torch.randint(0, V, (N,), generator=g), torch.randn(N, generator=g, dtype=dtype)


def _whole(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, upstream: torch.Tensor,
           temperature: float) -> tuple[torch.Tensor, ...]:
    """The plain path: the whole logits, log-softmax, gather; and its gradients for `upstream`."""
    lp = torch.log_softmax(hidden @ weight.T / temperature, dim=-1).gather(-1, target[:, None])[:, 0]
    return (lp.detach(), *torch.autograd.grad((lp * upstream).sum(), (hidden, weight)))


def _chunked(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, upstream: torch.Tensor,
             temperature: float, chunk: int | None) -> tuple[torch.Tensor, ...]:
    lp = head_logprobs(hidden, weight, target, chunk, temperature)
    return (lp.detach(), *torch.autograd.grad((lp * upstream).sum(), (hidden, weight)))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [None, 1, 5, 64])
def test_chunks_equal_the_whole_logits(temperature: float, chunk: int | None) -> None:
    hidden, weight, target, upstream = _inputs(torch.float64)
    for got, want in zip(_chunked(hidden, weight, target, upstream, temperature, chunk),
                         _whole(hidden, weight, target, upstream, temperature), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)  # the same algebra, to fp64 rounding
    hidden, weight, target, upstream = _inputs(torch.float32)
    (lp, gh, gw), (lp0, gh0, gw0) = (_chunked(hidden, weight, target, upstream, temperature, chunk),
                                     _whole(hidden, weight, target, upstream, temperature))
    torch.testing.assert_close(lp, lp0, rtol=1e-6, atol=1e-6)  # fp32: the logprobs and the loss to 1e-6
    torch.testing.assert_close((lp * upstream).sum(), (lp0 * upstream).sum(), rtol=1e-6, atol=1e-6)
    # the weight's gradient sums over the chunks in another order: fp32 rounding of N terms
    torch.testing.assert_close(gh, gh0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, gw0, rtol=1e-5, atol=1e-5)


class _LargestTensor(TorchDispatchMode):
    """The element count of the largest tensor any op makes."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_the_whole_logits_never_exist() -> None:
    n, h, v, chunk = 512, 8, 1000, 16
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    target = torch.randint(0, v, (n,))
    with _LargestTensor() as seen:
        head_logprobs(hidden, weight, target, chunk).sum().backward()
    assert seen.largest <= max(chunk * v, v * h, n * h) < n * v, seen.largest
    with _LargestTensor() as whole:
        torch.log_softmax(hidden @ weight.T, -1).gather(-1, target[:, None]).sum().backward()
    assert whole.largest == n * v  # what the scan would have seen without chunks


def _sharded_rank(rank: int, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        hidden, weight, target, upstream = _inputs(torch.float64)
        half = (V + 1) // 2  # 51 and 50 rows: an uneven split, given by vocab_start
        start, end = (0, half) if rank == 0 else (half, V)
        local = weight.detach()[start:end].clone().requires_grad_()
        lp = head_logprobs(hidden, local, target, 4, 0.7, vocab_start=start, group=dist.group.WORLD)
        gh, gw = torch.autograd.grad((lp * upstream).sum(), (hidden, local))
        queue.put((rank, lp.detach().numpy(), gh.numpy(), gw.numpy()))  # by value: a tensor is shared by a handle
    finally:
        dist.destroy_process_group()


def test_a_vocabulary_sharded_over_two_ranks_equals_it_whole() -> None:
    hidden, weight, target, upstream = _inputs(torch.float64)
    lp, gh, gw = _whole(hidden, weight, target, upstream, 0.7)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_sharded_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = {r: [torch.from_numpy(a) for a in rest] for r, *rest in (queue.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    half = (V + 1) // 2
    for rank, (r_lp, r_gh, r_gw) in got.items():
        torch.testing.assert_close(r_lp, lp, rtol=1e-12, atol=1e-12)  # every rank: the whole vocabulary's logprobs
        torch.testing.assert_close(r_gh, gh, rtol=1e-12, atol=1e-12)  # all-reduced over the ranks' slices
        torch.testing.assert_close(r_gw, gw[:half] if rank == 0 else gw[half:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk", [None, 4])
def test_a_padded_vocabulary_predicts_only_its_real_ids(chunk: int | None) -> None:
    hidden, weight, target, upstream = _inputs(torch.float64)
    real = V - 11  # the last 11 rows are padding (Megatron pads its vocabulary): never predicted, no gradient
    target = target % real
    lp = head_logprobs(hidden, weight, target, chunk, 0.7, vocab_size=real)
    gh, gw = torch.autograd.grad((lp * upstream).sum(), (hidden, weight))
    want = _whole(hidden, weight[:real].detach().requires_grad_(), target, upstream, 0.7)
    torch.testing.assert_close(lp.detach(), want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gh, torch.autograd.grad(
        (torch.log_softmax(hidden @ weight[:real].T / 0.7, -1).gather(-1, target[:, None])[:, 0] * upstream).sum(),
        hidden)[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw[:real], want[2], rtol=1e-12, atol=1e-12)
    assert torch.all(gw[real:] == 0)


@pytest.mark.parametrize("chunk", [None, 4])
def test_k_targets_per_token_equal_the_whole_log_softmax(chunk: int | None) -> None:
    """[N, k] targets (a teacher's top-k under the student): each one's logprob and the gradients."""
    hidden, weight, _, _ = _inputs(torch.float64)
    g = torch.Generator().manual_seed(1)
    targets = torch.stack([torch.randperm(V, generator=g)[:3] for _ in range(N)])  # [N, 3], distinct per token
    upstream = torch.randn(N, 3, generator=g, dtype=torch.float64)
    whole = torch.log_softmax(hidden @ weight.T / 0.7, dim=-1).gather(-1, targets)
    want = (whole.detach(), *torch.autograd.grad((whole * upstream).sum(), (hidden, weight)))
    lp = head_logprobs(hidden, weight, targets, chunk, 0.7)
    got = (lp.detach(), *torch.autograd.grad((lp * upstream).sum(), (hidden, weight)))
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-12, atol=1e-12)
