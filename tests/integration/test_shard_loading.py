"""Each DTensor policy rank builds its model on the meta device and loads only its shard, on 2 gloo processes running
the real worker class: the same weights and logprobs as loading the whole model (DP=2, TP=2 with LoRA and activation
checkpointing), and on SmolLM2-135M at DP=2 a rank's resident memory grows by its half of the weights plus one
checkpoint tensor while loading, where loading the whole model grows it by the whole model."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from rlpost.distributed.ports import free_port
from rlpost.models.policy.dtensor_policy_worker import DTensorPolicyWorker

pytestmark = pytest.mark.slow

CACHE = Path(os.environ.get("RLPOST_CACHE_DIR") or Path(os.environ.get("HOME", "/tmp")) / ".cache" / "rlpost")
SMOLLM2 = CACHE / "smollm2-135m-instruct"
SLACK = 1.15
"""Relative slack on a rank's memory bound (allocator rounding, heap fragments between tensors)."""
OVERHEAD = 32 * 2**20
"""Fixed slack on a rank's memory bound: the module and DTensor objects, rotary buffers, gloo's buffers and the Python
objects of a 30-layer model (measured: about 25 MiB over the shard at SmolLM2's size)."""
TIMEOUT_S = 300


class WholeModelWorker(DTensorPolicyWorker):
    """The worker with its model loaded whole by `from_pretrained` on every rank, then parallelised."""

    def _build_model(self) -> nn.Module:
        from rlpost.models.dtensor import lora
        from rlpost.models.dtensor.parallelize import parallelize
        from rlpost.models.policy.hf_loading import load_hf_causal_lm

        d = self.cfg.dtensor_cfg
        model = load_hf_causal_lm(self.cfg, torch.float32)
        if self.lora is not None:
            model = lora.inject(model, self.lora)
        return parallelize(model.to(self.device), self.mesh, self.cfg.precision,
                           activation_checkpointing=d.activation_checkpointing, cpu_offload=d.cpu_offload)


def _status(field: str) -> int:
    """A /proc/self/status memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class PeakMeasured:
    """Mixin: `_build_model` records by how much the rank's peak resident memory (VmHWM: anonymous and file-backed
    pages, so a mapped checkpoint counts) grew over its resident memory when the build began."""

    growth = 0

    def _build_model(self) -> nn.Module:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        start = _status("VmRSS")
        model: nn.Module = super()._build_model()  # type: ignore[misc]
        self.growth = _status("VmHWM") - start
        return model


class MeasuredWorker(PeakMeasured, DTensorPolicyWorker):
    pass


class MeasuredWholeModelWorker(PeakMeasured, WholeModelWorker):
    pass


def _policy_cfg(model_dir: Path, overrides: list[str]) -> Any:
    from rlpost.config.load import load_master_config

    _, cfg = load_master_config(["cluster.gpus_per_node=2", *overrides])
    p = dataclasses.replace(cfg.policy, model_name=str(model_dir))
    p.tokenizer.name = str(model_dir)
    return p


def _rank(rank: int, port: int, model_dir: Path, overrides: list[str], out: Path, mode: str) -> None:
    """One rank of 2: builds the worker both ways and writes what rank 0 sees (`mode` equal) or each rank's memory
    growth (`mode` memory) under `out`."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RLPOST_DEVICE="cpu")
    from rlpost.distributed.batched_data_dict import BatchedDataDict
    from rlpost.models.policy.dtensor_checkpoint import full_state_dict

    cfg = _policy_cfg(model_dir, overrides)
    if mode == "memory":
        sharded = MeasuredWorker(cfg, init_optimizer=False, init_reference_model=False)
        whole = MeasuredWholeModelWorker(cfg, init_optimizer=False, init_reference_model=False)
        (out / f"rank{rank}.json").write_text(json.dumps({"sharded": sharded.growth, "whole": whole.growth}))
        return
    ids = torch.randint(3, 380, (4, 12), generator=torch.Generator().manual_seed(0))
    data = BatchedDataDict(input_ids=ids, input_lengths=torch.full((4,), 12))
    result = {}
    for name, cls in (("sharded", DTensorPolicyWorker), ("whole", WholeModelWorker)):
        w = cls(cfg, init_optimizer=False, init_reference_model=False)
        result[name] = {"state": full_state_dict(w.model), "logprobs": w.get_logprobs(data)["logprobs"]}
    if rank == 0:
        torch.save(result, out / "rank0.pt")


def run_two_ranks(model_dir: Path, overrides: list[str], out: Path, mode: str) -> None:
    ctx = mp.spawn(_rank, args=(free_port("127.0.0.1"), model_dir, overrides, out, mode), nprocs=2, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"2 ranks ({mode}, {overrides}) did not finish in {TIMEOUT_S} s")


@pytest.mark.parametrize("overrides", [
    [],  # DP=2
    ["policy.dtensor_cfg.tensor_parallel_size=2", "policy.dtensor_cfg.lora_cfg.enabled=true",
     "policy.dtensor_cfg.activation_checkpointing=true"],
], ids=["dp2", "tp2-lora-ac"])
def test_each_rank_loading_its_shard_equals_loading_the_whole_model(tiny_model_dir: Path, tmp_path: Path,
                                                                    overrides: list[str]) -> None:
    from transformers import AutoModelForCausalLM

    run_two_ranks(tiny_model_dir, overrides, tmp_path, "equal")
    got = torch.load(tmp_path / "rank0.pt")
    sharded, whole = got["sharded"], got["whole"]
    assert sharded["state"].keys() == whole["state"].keys()
    for k, v in whole["state"].items():
        assert torch.equal(sharded["state"][k], v), k
    assert torch.equal(sharded["logprobs"], whole["logprobs"])
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    for k, v in plain.items():  # the base weights are the checkpoint's (LoRA: under base_layer)
        key = k if k in sharded["state"] else k.replace(".weight", ".base_layer.weight").replace(
            ".bias", ".base_layer.bias")
        assert torch.equal(sharded["state"][key], v), k


def checkpoint_sizes(model_dir: Path) -> tuple[int, int]:
    """(all tensors' bytes, the largest tensor's bytes) of a one-file safetensors checkpoint, from its header."""
    with (model_dir / "model.safetensors").open("rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    sizes = [end - begin for key, info in header.items() if key != "__metadata__"
             for begin, end in [info["data_offsets"]]]
    return sum(sizes), max(sizes)


@pytest.mark.skipif(not (SMOLLM2 / "rlpost_prepared.json").is_file(),
                    reason=f"{SMOLLM2} is not prepared; `make test` prepares it (`make smollm2`)")
def test_a_rank_holds_its_half_of_smollm2_plus_one_tensor_while_loading(tmp_path: Path) -> None:
    total, largest = checkpoint_sizes(SMOLLM2)  # fp32: about 538 MB, the embedding 113 MB
    bound = (total / 2 + largest) * SLACK + OVERHEAD
    assert bound < total  # a rank that held the whole model at once would exceed the bound
    run_two_ranks(SMOLLM2, [], tmp_path, "memory")
    for rank in (0, 1):
        growth = json.loads((tmp_path / f"rank{rank}.json").read_text())
        print(f"rank {rank}: sharded +{growth['sharded'] / 2**20:.0f} MiB, whole +{growth['whole'] / 2**20:.0f} "
              f"MiB, bound {bound / 2**20:.0f} MiB")
        assert growth["sharded"] <= bound, (rank, growth, bound)
        assert growth["whole"] > bound, (rank, growth, bound)  # the measurement sees a whole model loaded
