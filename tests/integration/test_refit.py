"""Refit verified against the trainer: after a training step and a refit, the engine's logprobs of
its own samples equal the trainer's (token_mult_prob_error <= 1.0001 in fp32), colocated and
non-colocated, with a TP=2 policy; a corrupted weight is caught by the fingerprint check."""

from __future__ import annotations

import dataclasses
import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost.algorithms.refit import init_refit_collective, refit_policy_generation
from rlpost.config.load import load_master_config
from rlpost.config.schema.loss import ClippedPGLossConfig
from rlpost.config.schema.policy import PytorchOptimizerConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.distributed.virtual_cluster import ClusterResourceError, RayVirtualCluster
from rlpost.losses.clipped_pg import ClippedPGLossFn
from rlpost.models.fingerprint import FingerprintMismatch
from rlpost.models.generation.vllm_generation import VllmGeneration
from rlpost.models.policy.lm_policy import Policy

pytestmark = pytest.mark.slow


def configs(model_dir: Path, *overrides: str) -> Any:
    _, cfg = load_master_config(["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=8",
                                 "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8",
                                 "policy.generation.max_new_tokens=6", "policy.generation.temperature=0.8",
                                 *overrides])
    p = dataclasses.replace(cfg.policy, model_name=str(model_dir))
    p.tokenizer.name = str(model_dir)
    if "policy=megatron" not in overrides:  # megatron's SGD comes from its layout's keys
        p.optimizer = PytorchOptimizerConfig(name="torch.optim.SGD", kwargs={"lr": 2.0})
    gen = dataclasses.replace(p.generation, model_name=str(model_dir))
    gen.stop_token_ids = []  # sample the full length: more tokens to compare
    return p, gen


def prompts(n: int = 16) -> BatchedDataDict:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 7, (n,), generator=g)
    ids = torch.randint(3, 300, (n, 6), generator=g)
    return BatchedDataDict(input_ids=ids, input_lengths=lengths, seeds=torch.arange(n))


def train_once(policy: Policy, gen_out: BatchedDataDict) -> None:
    ids = gen_out["output_ids"]
    n, s = ids.shape
    data = BatchedDataDict(input_ids=ids, input_lengths=gen_out["unpadded_sequence_lengths"],
                           token_mask=(gen_out["logprobs"] != 0).float(), sample_mask=torch.ones(n),
                           advantages=torch.randn(n, 1, generator=torch.Generator().manual_seed(1)).expand(n, s).clone(),
                           generation_logprobs=gen_out["logprobs"])
    data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
    policy.train(data, ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)))


def assert_corrupted_refit_is_caught(policy: Policy, engine: VllmGeneration, monkeypatch: pytest.MonkeyPatch,
                                     name: str = "model.layers.0.mlp.up_proj.weight") -> None:
    """A colocated refit whose engine loads a corrupted tensor fails the fingerprint check."""
    monkeypatch.setenv("RLPOST_FAULT_CORRUPT_REFIT", name)
    with pytest.raises(FingerprintMismatch):
        refit_policy_generation(policy, engine, True, "float32")


def mult_prob_error(policy: Policy, gen_out: BatchedDataDict) -> float:
    lp_train = policy.get_logprobs(BatchedDataDict(input_ids=gen_out["output_ids"],
                                                   input_lengths=gen_out["unpadded_sequence_lengths"]))["logprobs"]
    mask = gen_out["logprobs"] != 0
    return float(torch.exp((lp_train - gen_out["logprobs"]).abs())[mask].mean())


class OwnerRecorder:
    """Wraps a policy's refit export and records, bucket by bucket, the pids of the processes that wrote each of a
    per-device bucket's shared-memory segments (their names carry the owner's pid)."""

    def __init__(self, policy: Policy, monkeypatch: pytest.MonkeyPatch) -> None:
        self.owners: list[list[int]] = []
        real = policy.export_weight_buckets
        recorder = self

        class Recorded:
            def __init__(self, buckets: Any) -> None:
                self.buckets = buckets

            planned = property(lambda self: self.buckets.planned)  # the last bucket ends the refit
            fingerprint = property(lambda self: self.buckets.fingerprint)

            def __iter__(self) -> Any:
                from rlpost.distributed.shm_buckets import PREFIX

                for box in self.buckets:
                    recorder.owners.append([int(d["shm"].removeprefix(PREFIX).split("-")[0]) for d in box["per_rank"]])
                    yield box

        monkeypatch.setattr(policy, "export_weight_buckets", lambda *a, **k: Recorded(real(*a, **k)))


def worker_pids(policy: Policy) -> list[int]:
    import os

    import ray

    return ray.get([w.__ray_call__.remote(lambda _: os.getpid()) for w in policy.worker_group.workers], timeout=60)


LAYOUTS = {
    "colocated": (True, ["policy.dtensor_cfg.tensor_parallel_size=2"]),
    "split": (False, ["policy.dtensor_cfg.tensor_parallel_size=2"]),
    # LoRA served as an adapter (refit=adapter): only the adapters move, and vLLM serves them
    "colocated-lora-adapter": (True, ["policy.dtensor_cfg.tensor_parallel_size=2",
                                      "policy.dtensor_cfg.lora_cfg.enabled=true",
                                      "policy.dtensor_cfg.lora_cfg.refit=adapter"]),
    # Megatron's fused q/k/v and gate/up adapters, split into PEFT's per-layer ones
    "split-megatron-lora-adapter": (False, ["policy=megatron", "policy.megatron_cfg.tensor_model_parallel_size=2",
                                            "policy.megatron_cfg.peft.enabled=true",
                                            "policy.megatron_cfg.peft.refit=adapter",
                                            "policy.megatron_cfg.optimizer.optimizer=sgd",
                                            "policy.megatron_cfg.optimizer.sgd_momentum=0.0",
                                            "policy.optimizer.kwargs.lr=2.0", "policy.max_grad_norm=null"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_refit_keeps_engine_on_policy_with_tp2(ray_local: None, tiny_model_dir: Path, layout: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from rlpost.config.lora_params import adapter_config

    colocated, overrides = LAYOUTS[layout]
    pcfg, gcfg = configs(tiny_model_dir, "cluster.gpus_per_node=2", *overrides)
    key, lora_cfg = pcfg.lora_settings("policy")
    lora = lora_cfg.enabled
    train_cluster = RayVirtualCluster("refit-train", 2, cpus_per_bundle=0.4, max_colocated_worker_groups=2)
    gen_cluster = train_cluster if colocated else RayVirtualCluster("refit-gen", 1, cpus_per_bundle=0.2)
    policy = Policy(train_cluster, pcfg)
    adapter = adapter_config(key, lora_cfg, str(tiny_model_dir)) if lora else None
    engine = VllmGeneration(gcfg, gen_cluster, lora_adapter=adapter)
    try:
        if not colocated:
            host, port = train_cluster.get_master_address_and_port()
            init_refit_collective(policy, engine, host, port)
        info = policy.prepare_refit_info("float32")
        assert all(".lora_" in n for n in info) == lora  # an adapter refit moves the adapters alone
        engine.prepare_refit_info(info)
        out0 = engine.generate(prompts())
        train_once(policy, out0)
        stale = mult_prob_error(policy, out0)
        assert stale > 1.01  # the weights really changed: the engine is now off-policy
        recorder = OwnerRecorder(policy, monkeypatch) if colocated else None
        took = refit_policy_generation(policy, engine, colocated, "float32", refit_buffer_size_gb=2**16 / 2**30)
        assert took > 0
        if recorder is not None:  # each rank wrote every bucket into its own segment; replica r read rank r's
            assert recorder.owners and all(o == worker_pids(policy) for o in recorder.owners), recorder.owners
            monkeypatch.undo()
        out1 = engine.generate(prompts())
        err = mult_prob_error(policy, out1)
        assert err <= 1.0001, err
        if colocated:
            assert_corrupted_refit_is_caught(policy, engine, monkeypatch, "base_model.model.model.layers.0.mlp."
                                             "up_proj.lora_B.weight" if lora else "model.layers.0.mlp.up_proj.weight")
    finally:
        engine.shutdown()
        policy.shutdown()
        train_cluster.shutdown()
        if gen_cluster is not train_cluster:
            gen_cluster.shutdown()


def test_staged_refit_sends_the_staged_weights_while_the_next_update_trains(ray_local: None,
                                                                            tiny_model_dir: Path) -> None:
    """Async GRPO's refit: the weights staged after update 1 reach the engine while update 2 trains on the same
    actor, and they are update 1's, not a mix: broadcast from the policy's 'refit' concurrency group."""
    pcfg, gcfg = configs(tiny_model_dir)
    train_cluster = RayVirtualCluster("staged-train", 1, cpus_per_bundle=0.4)
    gen_cluster = RayVirtualCluster("staged-gen", 1, cpus_per_bundle=0.2)
    policy = Policy(train_cluster, pcfg)
    engine = VllmGeneration(gcfg, gen_cluster)
    try:
        host, port = train_cluster.get_master_address_and_port()
        init_refit_collective(policy, engine, host, port)
        engine.prepare_refit_info(policy.prepare_refit_info("float32"))
        out0 = engine.generate(prompts())
        train_once(policy, out0)
        staged = policy.stage_weights("float32")
        big = BatchedDataDict({k: torch.cat([v] * 8) for k, v in out0.items()})  # a longer second update
        second = threading.Thread(target=train_once, args=(policy, big))
        second.start()

        def refit() -> str:
            futures = engine.update_weights_from_collective_async()
            sent = policy.wait_broadcast(policy.broadcast_staged_async())
            return engine.wait_collective_update(futures, expected=sent)  # raises unless both sides agree

        during = refit()
        second.join(timeout=300)
        after = refit()  # update 2 is done: a copy that aliased the live weights would now send update 2's
        assert during == after == staged
        assert policy.stage_weights("float32") != staged  # update 2 changed the policy, not the staged copy
    finally:
        engine.shutdown()
        policy.shutdown()
        train_cluster.shutdown()
        gen_cluster.shutdown()


def _payload_bytes(obj: Any) -> int:
    """Bytes of tensor data inside a value the driver received."""
    import numpy as np

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(_payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_payload_bytes(v) for v in obj)
    return 0


@pytest.mark.parametrize("engine_kind", ["vllm", "hf"])
def test_refit_in_small_buckets_never_passes_through_the_driver(
    ray_local: None, tiny_model_dir: Path, engine_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """refit_buffer_size_gb below the model size: several buckets, still exact, and the driver
    receives no weight bytes (every ray.get here is counted)."""
    import ray

    from rlpost.models.generation.hf_generation import HFGeneration

    overrides = ["generation=hf"] if engine_kind == "hf" else []
    pcfg, gcfg = configs(tiny_model_dir, *overrides)
    cluster = RayVirtualCluster("refit-buckets", 1, cpus_per_bundle=0.4, max_colocated_worker_groups=2)
    policy = Policy(cluster, pcfg)
    engine = VllmGeneration(gcfg, cluster) if engine_kind == "vllm" else HFGeneration(gcfg, cluster)
    try:
        info = policy.prepare_refit_info("float32")
        engine.prepare_refit_info(info)
        out0 = engine.generate(prompts())
        train_once(policy, out0)
        model_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in info.values())
        received: list[int] = []
        real_get = ray.get

        def counting_get(*args: Any, **kwargs: Any) -> Any:
            out = real_get(*args, **kwargs)
            received.append(_payload_bytes(out))
            return out

        monkeypatch.setattr(ray, "get", counting_get)
        exported: list[Any] = []
        real_export = policy.export_weight_buckets

        def export(dtype: str, max_bytes: int) -> Any:
            exported.append(real_export(dtype, max_bytes))
            return exported[-1]

        monkeypatch.setattr(policy, "export_weight_buckets", export)
        bucket_gb = model_bytes / 5 / 2**30  # about five buckets
        refit_policy_generation(policy, engine, True, "float32", refit_buffer_size_gb=bucket_gb)
        monkeypatch.setattr(ray, "get", real_get)
        assert exported[0].count >= 3  # the buffer bound really split the model
        assert exported[0].per_device  # one node: through each rank's reusable IPC buffer, not the object store
        assert sum(received) < 0.01 * model_bytes, (sum(received), model_bytes)
        err = mult_prob_error(policy, engine.generate(prompts()))
        assert err <= 1.0001, err
    finally:
        engine.shutdown()
        policy.shutdown()
        cluster.shutdown()


def test_unsatisfiable_cluster_fails_fast_with_a_clear_message(ray_local: None) -> None:
    cl = RayVirtualCluster("too-big", workers_per_node=4, cpus_per_bundle=1.0, placement_timeout_s=3)
    with pytest.raises(ClusterResourceError, match=r"could not reserve 4 bundle\(s\) of \{'CPU': 1.0\}.*CPU: 2"):
        cl.placement_group()


def test_async_batches_stay_in_the_driver_and_the_buffer_actor_holds_their_records(ray_local: None) -> None:
    """Async GRPO's collector and trainer are both in the driver: a batch's tensors stay there, and the ReplayBuffer
    actor gets its record only (version, index, loader position), which still decides what is trained. A batch the
    buffer drops as too old is forgotten by the driver too."""
    import ray

    from rlpost.algorithms.async_grpo import Collector
    from rlpost.algorithms.replay_buffer import ReplayBuffer, Trajectories

    buffer: Any = ray.remote(ReplayBuffer).options(num_cpus=0).remote(3)
    try:
        none: Any = None
        c = Collector(none, buffer, 0, call_timeout_s=60.0, capacity=3)
        batches = [BatchedDataDict(ids=torch.full((4, 2), i)) for i in range(1, 4)]
        for index, (batch, version) in enumerate(zip(batches, (0, 0, 1), strict=True), start=1):
            c.push(Trajectories(batch, version, index, {"epoch": 0, "index": index}))
        held = ray.get(buffer.__ray_call__.remote(lambda b: [(e.index, e.batch) for e in b.entries]), timeout=60)
        assert held == [(1, None), (2, None), (3, None)]
        got = c.take(min_version=1)  # batches 1 and 2 (version 0) are too old
        assert got is not None and got.index == 3 and got.batch is batches[2]
        assert got.extra["buffer_dropped_stale"] == 2 and c._batches == {}
    finally:
        ray.kill(buffer)

