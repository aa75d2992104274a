"""Policy checkpoints are pickle-free: tensors in safetensors, the rest in JSON, and loading never unpickles.

In-process, one rank (a world-size-1 gloo group) of the real DTensor worker on the tiny model: a save -> load round
trip with every unpickling entry point patched to fail is bit-exact; a malicious pickle planted under any name, or
written over any file of the checkpoint, is ignored or refused with a CheckpointError and its payload never runs.
The 2-rank Ray versions for both backends are in tests/integration/test_checkpoint_no_pickle.py.
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost.models.policy import dtensor_checkpoint as dc
from rlpost.runtime.checkpointing import CheckpointError
from tests.pickles import plant


# ---- the JSON codec ------------------------------------------------------------------------------------------------
def test_state_codec_round_trips_tuples_keys_floats_and_tensor_refs() -> None:
    state = {
        "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.arange(4.0)}, 7: {"momentum_buffer": None}},
        "param_groups": [{"lr": 0.1 + 0.2, "betas": (0.9, 0.999), "eps": 1e-8, "params": ["w"], "fused": None,
                          "big": 2**70, "inf": math.inf}],
        "__tuple__": "a key that looks like a marker",
    }
    tensors: dict[str, torch.Tensor] = {}
    enc = dc.encode_state(state, tensors)
    assert sorted(tensors) == ["state/w/exp_avg", "state/w/step"]
    back = dc.decode_state(json.loads(json.dumps(enc)), tensors)
    assert back["param_groups"][0]["betas"] == (0.9, 0.999) and isinstance(back["param_groups"][0]["betas"], tuple)
    assert back["param_groups"][0]["lr"] == 0.1 + 0.2 and back["param_groups"][0]["big"] == 2**70
    assert back["param_groups"][0]["inf"] == math.inf
    assert back["state"][7] == {"momentum_buffer": None} and back["__tuple__"] == state["__tuple__"]
    assert back["state"]["w"]["exp_avg"] is tensors["state/w/exp_avg"]
    assert sorted(dc.tensor_refs(enc)) == sorted(tensors)


def test_state_codec_refuses_values_json_cannot_hold() -> None:
    with pytest.raises(TypeError, match=r"state at scheduler/fn: a value of type function"):
        dc.encode_state({"fn": lambda: 0}, {}, ("scheduler",))
    with pytest.raises(TypeError, match=r"a key of type tuple"):
        dc.encode_state({(1, 2): 0}, {})


# ---- the DTensor worker, one rank (the `one_rank` fixture is in conftest.py) -----------------------------------


def _step(worker: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in worker.model.parameters():  # one fp32 rank trains unwrapped (parallelize.fsdp_needed): plain tensors
        grad = torch.randn(p.shape, generator=g)
        p.grad = (torch.distributed.tensor.distribute_tensor(grad, p.device_mesh, p.placements)
                  if hasattr(p, "device_mesh") else grad)
    worker.optimizer.step()
    worker.scheduler.step()
    worker.optimizer.zero_grad(set_to_none=True)


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _snapshot(worker: Any) -> dict[str, Any]:
    opt = worker.optimizer.state_dict()
    return {
        "params": {n: _local(p).detach().clone() for n, p in worker.model.named_parameters()},
        "optim": {(i, k): _local(v).clone() if isinstance(v, torch.Tensor) else v
                  for i, st in opt["state"].items() for k, v in st.items()},
        "groups": opt["param_groups"],
        "sched": worker.scheduler.state_dict(),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["params"].keys() == b["params"].keys() and a["optim"].keys() == b["optim"].keys()
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    assert all(torch.equal(a["optim"][k], b["optim"][k]) for k in a["optim"])
    assert a["groups"] == b["groups"] and a["sched"] == b["sched"]


def _no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("checkpoint loading unpickled something")

    for mod, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load"),
                      (torch.serialization, "load")]:
        monkeypatch.setattr(mod, name, refuse)


@pytest.fixture(scope="module")
def saved(one_rank: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """A checkpoint after two AdamW steps, the state it holds, and the state one more step later."""
    root = tmp_path_factory.mktemp("ckpt")
    w = one_rank()
    _step(w, 0)
    _step(w, 1)
    dc.save(w, str(root / "weights"), str(root / "optimizer"), w.cfg.model_name)
    at_save = _snapshot(w)
    _step(w, 2)
    return root, at_save, _snapshot(w)


def test_layout_is_safetensors_and_json_only(saved: tuple[Path, dict[str, Any], dict[str, Any]]) -> None:
    root, _, _ = saved
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    ours = [f for f in files if not f.startswith("weights/hf/")]
    assert ours == [
        "optimizer/optim/shard-00001-model-00001-of-00001.safetensors",
        "optimizer/optimizer.json",
        "optimizer/scheduler.json",
        "weights/checkpoint.json",
        "weights/model/shard-00001-model-00001-of-00001.safetensors",
    ]
    assert "weights/hf/model.safetensors" in files and "weights/hf/config.json" in files


def test_round_trip_is_bit_exact_without_any_unpickling(
    one_rank: Any, saved: tuple[Path, dict[str, Any], dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, at_save, after_next = saved
    w = one_rank()
    with monkeypatch.context() as m:
        _no_unpickling(m)
        dc.load(w, str(root / "weights"), str(root / "optimizer"))
    _assert_same(at_save, _snapshot(w))
    _step(w, 2)
    _assert_same(after_next, _snapshot(w))


# Names a loader might open: DCP's pickled metadata, torch files, pickles, and stray shards.
PLANTED = [
    "weights/.metadata", "weights/model/.metadata", "weights/model/__0_0.distcp", "weights/model.pt",
    "weights/pytorch_model.bin", "weights/state.pkl", "weights/hf/pytorch_model.bin", "weights/hf/training_args.bin",
    "optimizer/.metadata", "optimizer/optim/.metadata", "optimizer/optim/__0_0.distcp", "optimizer/scheduler.pt",
    "optimizer/optim.pt", "optimizer/optimizer.bin", "optimizer/rng_state.pth", "optimizer/state.pkl",
    "training_info.pkl", ".metadata",
]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_planted_pickles_are_ignored_and_never_run(
    one_rank: Any, saved: tuple[Path, dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    root, at_save, _ = saved
    ckpt = _copy(root, tmp_path / "ckpt")
    canary = tmp_path / "PWNED"
    for rel in PLANTED:
        plant(ckpt / rel, canary)
    w = one_rank()
    dc.load(w, str(ckpt / "weights"), str(ckpt / "optimizer"))
    assert not canary.exists()
    _assert_same(at_save, _snapshot(w))
    pickle.loads((ckpt / "weights/state.pkl").read_bytes()).close()  # the payload is real: unpickling runs it
    assert canary.exists()


def _saved_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_every_saved_file_replaced_by_a_pickle_is_refused_or_ignored(
    one_rank: Any, saved: tuple[Path, dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    root, _, _ = saved
    canary = tmp_path / "PWNED"
    w = one_rank()
    outcome: dict[str, str] = {}
    for rel in _saved_files(root):
        ckpt = tmp_path / "ckpt"
        shutil.rmtree(ckpt, ignore_errors=True)
        _copy(root, ckpt)
        plant(ckpt / rel, canary)
        try:
            dc.load(w, str(ckpt / "weights"), str(ckpt / "optimizer"))
            outcome[rel] = "ignored"
        except CheckpointError as exc:
            assert str(ckpt) in str(exc) and "\n" not in str(exc), exc
            outcome[rel] = "refused"
        assert not canary.exists(), rel
    assert len(outcome) >= 10
    # the HF export is never read on resume; every other file is, and a pickle there is refused
    assert {k for k, v in outcome.items() if v == "ignored"} == {k for k in outcome if k.startswith("weights/hf/")}


def test_shard_set_must_cover_every_tensor(
    one_rank: Any, saved: tuple[Path, dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    root, _, _ = saved
    ckpt = _copy(root, tmp_path / "ckpt")
    shard = next((ckpt / "weights/model").glob("*.safetensors"))
    shutil.copy2(shard, shard.with_name("shard-00002-model-00001-of-00001.safetensors"))  # a duplicate shard
    with pytest.raises(CheckpointError, match=r"cover .* and overlap"):
        dc.load(one_rank(), str(ckpt / "weights"), None)
    for extra in (ckpt / "weights/model").glob("*.safetensors"):
        extra.unlink()
    with pytest.raises(CheckpointError, match=r"no tensor"):
        dc.load(one_rank(), str(ckpt / "weights"), None)


def test_old_dcp_checkpoint_is_refused_without_reading_it(one_rank: Any, tmp_path: Path) -> None:
    canary = tmp_path / "PWNED"
    plant(tmp_path / "weights/dcp/.metadata", canary)
    plant(tmp_path / "weights/dcp/__0_0.distcp", canary)
    with pytest.raises(CheckpointError, match=r"old DCP format .* no\s+longer loads"):
        dc.load(one_rank(), str(tmp_path / "weights"), str(tmp_path / "optimizer"))
    assert not canary.exists()


def test_one_plain_rank_exports_what_dcp_would(one_rank: Any) -> None:
    """full_state_dict's shortcut for one unwrapped CPU rank returns DCP's full state dict: the same names, the same
    tensors (the model's own storage, no copies), tied weights included; and a refit export built on it works."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    w = one_rank()
    _step(w, 0)
    fast = dc.full_state_dict(w.model)
    ref = get_model_state_dict(w.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert list(fast) == list(ref)
    for k in ref:
        assert torch.equal(fast[k], ref[k]) and fast[k].data_ptr() == ref[k].data_ptr(), k
        assert not fast[k].requires_grad
    info = w.prepare_weights_for_export("float32")
    assert set(info) == set(ref) - {"lm_head.weight"}  # a tied head is not sent apart: the engine derives it
