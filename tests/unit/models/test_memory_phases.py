"""GPU memory keys of the policy workers (issue #11 §4): what offload_before_refit / offload_after_refit /
offload_optimizer_for_logprob move, when it comes back, clear_cache_every_n_steps, and freeze_moe_router.

There is no GPU here: the device is declared 'cuda' and the moves are recorded instead of done."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from rlpost.models.megatron.model import freeze_moe_routers
from rlpost.models.policy import memory_phases
from rlpost.models.policy.dtensor_worker_base import DTensorWorkerBase
from rlpost.models.policy.memory_phases import OffloadState, move_optimizer_state


class RecordingModel(nn.Linear):
    """Records `.to(device)` instead of moving (there is no CUDA device to move to)."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.moves: list[str] = []

    def to(self, device: Any, *args: Any, **kwargs: Any) -> RecordingModel:  # type: ignore[override]
        self.moves.append(str(device))
        return self


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    return opt


def test_move_optimizer_state_moves_moments_not_step_counters() -> None:
    opt = _adam(nn.Linear(2, 2))
    move_optimizer_state(opt, "meta")
    for st in opt.state.values():
        assert st["exp_avg"].device.type == "meta" and st["exp_avg_sq"].device.type == "meta"
        assert st["step"].device.type == "cpu"


def test_everything_is_a_no_op_on_cpu() -> None:
    model = RecordingModel()
    opt = _adam(model)
    mem = OffloadState(torch.device("cpu"))
    mem.offload_optimizer(opt)
    mem.offload_model(model)
    mem.onload(model, opt, with_optimizer=True)
    assert model.moves == [] and not mem.optimizer_offloaded and not mem.model_offloaded
    assert all(p.grad is not None for p in model.parameters())  # nothing dropped


@pytest.fixture()
def moved(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    log: list[tuple[str, str]] = []
    monkeypatch.setattr(memory_phases, "move_optimizer_state", lambda opt, device: log.append(("optim", str(device))))
    monkeypatch.setattr(memory_phases, "move_buffers", lambda model, device: log.append(("buffers", str(device))))
    return log


def _worker(offload_for_logprob: bool = False, clear_every: Any = None) -> Any:
    w = DTensorWorkerBase.__new__(DTensorWorkerBase)
    w.cfg = SimpleNamespace(offload_optimizer_for_logprob=offload_for_logprob,
                            dtensor_cfg=SimpleNamespace(clear_cache_every_n_steps=clear_every))
    w.device = torch.device("cuda", 0)
    w.model = RecordingModel()
    w.optimizer = _adam(w.model)
    w._mem = OffloadState(w.device)
    w._train_micro_batches = 0
    return w


def test_refit_offloads_optimizer_then_model_and_each_comes_back_when_needed(moved: list[tuple[str, str]]) -> None:
    w = _worker()
    w.offload_before_refit()
    assert moved == [("optim", "cpu")] and w._mem.optimizer_offloaded and not w._mem.model_offloaded
    assert all(p.grad is None for p in w.model.parameters())  # gradients dropped
    w.offload_after_refit()  # the optimizer is already off; now the model
    assert moved == [("optim", "cpu"), ("buffers", "cpu")] and w.model.moves == ["cpu"]
    w.prepare_for_lp_inference()  # the model comes back; the optimizer stays on the CPU
    assert w.model.moves == ["cpu", "cuda:0"] and w._mem.optimizer_offloaded and not w._mem.model_offloaded
    w.prepare_for_training()
    assert moved[-1] == ("optim", "cuda:0") and not w._mem.optimizer_offloaded


def test_offload_optimizer_for_logprob(moved: list[tuple[str, str]]) -> None:
    w = _worker(offload_for_logprob=False)
    w.prepare_for_lp_inference()
    assert moved == [] and not w._mem.optimizer_offloaded
    w = _worker(offload_for_logprob=True)
    w.prepare_for_lp_inference()
    assert moved == [("optim", "cpu")] and w._mem.optimizer_offloaded


def test_cpu_offload_policy_keeps_parameters_where_fsdp_put_them(moved: list[tuple[str, str]]) -> None:
    w = _worker()
    w._mem = OffloadState(w.device, params_on_cpu_by_fsdp=True)
    w.offload_after_refit()
    w.prepare_for_training()
    assert w.model.moves == []  # FSDP2's CPUOffloadPolicy owns the parameters
    assert ("buffers", "cpu") in moved and ("buffers", "cuda:0") in moved


def test_clear_cache_every_n_micro_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    emptied: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    w = _worker(clear_every=3)
    for _ in range(7):
        w._maybe_clear_cache()
    assert len(emptied) == 2  # after micro-batches 3 and 6
    w = _worker(clear_every=None)
    for _ in range(7):
        w._maybe_clear_cache()
    assert len(emptied) == 2


def test_freeze_moe_router_freezes_only_routers() -> None:
    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(4, 2, bias=False)
            self.experts = nn.Linear(4, 4)

    layer = nn.ModuleDict({"mlp": Mlp(), "self_attention": nn.Linear(4, 4)})
    assert freeze_moe_routers(layer) == 1
    frozen = sorted(n for n, p in layer.named_parameters() if not p.requires_grad)
    assert frozen == ["mlp.router.weight"]
    assert freeze_moe_routers(nn.Linear(4, 4)) == 0  # a dense model has none
