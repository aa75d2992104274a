"""rlpost's TP plan of each family, on two gloo ranks, gives the unsharded model's logits and gradients (1e-5): the
per-head q/k norms' weight gradient summed over the ranks, the gathered projections of OLMo 2 and Phi-3, the experts
whole on every rank, Gemma's scaled embedding split over the vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlpost.distributed.ports import free_port

FAMILIES = ("qwen3", "mistral", "gemma2", "gemma3_text", "olmo2", "phi3", "qwen3_moe", "mixtral")


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def _worker(rank: int, world: int, port: int, dirs: dict[str, str], out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from rlpost.models.dtensor.parallelize import apply_tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ids = torch.randint(3, 380, (2, 9), generator=torch.Generator().manual_seed(7))
    worst: dict[str, float] = {}
    for family, model_dir in dirs.items():
        models = [AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) for _ in range(2)]
        apply_tp(models[1], mesh)
        results = []
        for model in models:
            logits = model(input_ids=ids).logits
            logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
            lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])
            lp.sum().backward()
            results.append((logits.detach(), _grads(model)))
        (ref_logits, ref), (tp_logits, tp) = results
        assert ref.keys() == tp.keys(), family
        worst[family] = max(float((ref_logits - tp_logits).abs().max()),
                            *(float((ref[k] - tp[k]).abs().max()) for k in ref))
    if rank == 0:
        Path(out).write_text(json.dumps(worst))
    dist.destroy_process_group()


def test_each_family_tp2_equals_the_unsharded_model(tmp_path: Path) -> None:
    from rlpost.config.schema.model import TinyModelConfig
    from rlpost.models.tiny import build_tiny_model

    # built in this process: a run's driver builds in a child of its own (ensure_tiny_model), ten interpreters here
    dirs = {f: str(build_tiny_model(TinyModelConfig(architecture=f, num_key_value_heads=2, seed=4), tmp_path / f))
            for f in FAMILIES}
    out = tmp_path / "worst.json"
    mp.spawn(_worker, args=(2, free_port("127.0.0.1"), dirs, str(out)), nprocs=2, join=True)
    worst = json.loads(out.read_text())
    assert set(worst) == set(FAMILIES)
    assert all(v <= 1e-5 for v in worst.values()), worst


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_has_a_plan(family: str) -> None:
    from rlpost.config.model_families import CAUSAL_LMS
    from rlpost.models.dtensor.parallelize import TP_PLANS

    assert CAUSAL_LMS[family] in TP_PLANS
