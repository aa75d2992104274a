"""DTensor policy workers on real Ray actors and gloo process groups (2 ranks)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from rlpost.config.load import load_master_config
from rlpost.config.schema.loss import ClippedPGLossConfig
from rlpost.config.schema.policy import PolicyConfig, PytorchOptimizerConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.distributed.virtual_cluster import RayVirtualCluster
from rlpost.distributed.worker_groups import WorkerGroupError
from rlpost.losses.clipped_pg import ClippedPGLossFn
from rlpost.models.policy.interfaces import TrainResult
from rlpost.models.policy.lm_policy import Policy
from tests.integration.exported import exported_weights

pytestmark = pytest.mark.slow

B, S = 16, 20
SGD = PytorchOptimizerConfig(name="torch.optim.SGD", kwargs={"lr": 0.5})


def policy_cfg(model_dir: Path, *overrides: str, optimizer: PytorchOptimizerConfig | None = None) -> PolicyConfig:
    _, cfg = load_master_config(
        [
            "grpo.num_prompts_per_step=2",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=4",
            "policy.logprob_batch_size=4",
            "cluster.gpus_per_node=2",
            *overrides,
        ]
    )
    p = dataclasses.replace(cfg.policy, model_name=str(model_dir))
    p.tokenizer.name = str(model_dir)
    if optimizer is not None:
        p.optimizer = optimizer
    return p


def make_batch(seed: int = 0, vocab: int = 380) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, S + 1, (B,), generator=g)
    ids = torch.randint(3, vocab, (B, S), generator=g)
    pos = torch.arange(S)[None, :]
    valid = pos < lengths[:, None]
    ids = torch.where(valid, ids, torch.zeros_like(ids))
    token_mask = (valid & (pos >= 4)).float()  # the first 4 tokens are the "prompt"
    adv = torch.randn(B, 1, generator=g).expand(B, S).clone()
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=token_mask,
        sample_mask=torch.ones(B),
        advantages=adv,
        generation_logprobs=torch.zeros(B, S),
    )


LOSS = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0))


class Built:
    def __init__(self, cfg: PolicyConfig, workers: int, **kw: Any) -> None:
        self.cluster = RayVirtualCluster(f"test-{id(self)}", workers, cpus_per_bundle=0.5)
        self.policy = Policy(self.cluster, cfg, **kw)

    def close(self) -> None:
        self.policy.shutdown()
        self.cluster.shutdown()


def train_steps(policy: Policy, n: int) -> list[float]:
    losses = []
    for step in range(n):
        data = make_batch(seed=step)
        data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
        losses.append(policy.train(data, LOSS).loss)
    return losses


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_logprobs_match_plain_transformers(ray_local: None, tiny_model_dir: Path, built: list[Built]) -> None:
    from transformers import AutoModelForCausalLM

    b = Built(policy_cfg(tiny_model_dir), 2)
    built.append(b)
    data = make_batch()
    lp = b.policy.get_logprobs(data)["logprobs"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        ref = torch.log_softmax(model(data["input_ids"]).logits.float(), -1)[:, :-1]
        ref = ref.gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    valid = (torch.arange(S)[None, 1:] < data["input_lengths"][:, None])
    assert torch.allclose(lp[:, 1:][valid], ref[valid], atol=1e-5)
    assert torch.all(lp[:, 0] == 0)


def test_dp2_equals_dp1_and_microbatch_split(ray_local: None, tiny_model_dir: Path, built: list[Built]) -> None:
    """One rank with fixed micro-batches of 4 rows, two ranks with the default dynamic batching (micro-batches cut to
    a token budget, longest rows first), and one rank with micro-batches of one row: the same losses and weights."""
    one = Built(policy_cfg(tiny_model_dir, "cluster.gpus_per_node=1", "policy.dynamic_batching.enabled=false",
                           optimizer=SGD), 1)
    built.append(one)
    l1 = train_steps(one.policy, 2)
    w1 = exported_weights(one.policy)
    one.close()
    built.remove(one)

    # FSDP2 over two ranks, the output layer read 5 tokens at a time (rlpost.ops.chunked_head.HeadLogits),
    # micro-batches of at most 48 tokens (2 to 6 rows, each micro-batch trimmed to its longest row)
    two = Built(policy_cfg(tiny_model_dir, "policy.logprob_chunk_size=5", "policy.dynamic_batching.train_mb_tokens=48",
                           "policy.dynamic_batching.sequence_length_round=1", optimizer=SGD), 2)
    assert two.policy.cfg.dynamic_batching.enabled
    built.append(two)
    l2 = train_steps(two.policy, 2)
    w2 = exported_weights(two.policy)
    two.close()
    built.remove(two)
    assert l1 == pytest.approx(l2, abs=1e-5)
    assert max_diff(w1, w2) <= 1e-5

    mb1 = Built(policy_cfg(tiny_model_dir, "cluster.gpus_per_node=1", "policy.train_micro_batch_size=1",
                           optimizer=SGD), 1)
    built.append(mb1)
    train_steps(mb1.policy, 2)
    assert max_diff(w1, exported_weights(mb1.policy)) <= 1e-5
    # the update is real: weights moved
    from safetensors.torch import load_file

    w0 = load_file(str(tiny_model_dir / "model.safetensors"))
    assert max(float((w1[k] - w0[k]).abs().max()) for k in w0) > 1e-3


def test_tp2_equals_tp1(ray_local: None, tiny_model_dir: Path, built: list[Built]) -> None:
    data = make_batch(seed=5)
    one = Built(policy_cfg(tiny_model_dir, "cluster.gpus_per_node=1", optimizer=SGD), 1)
    built.append(one)
    lp1 = one.policy.get_logprobs(data)["logprobs"]
    train_steps(one.policy, 1)
    w1 = exported_weights(one.policy)
    one.close()
    built.remove(one)

    tp = Built(policy_cfg(tiny_model_dir, "policy.dtensor_cfg.tensor_parallel_size=2", "policy.logprob_chunk_size=7",
                          optimizer=SGD), 2)  # the vocabulary-sharded output layer, 7 tokens at a time
    built.append(tp)
    lp2 = tp.policy.get_logprobs(data)["logprobs"]
    assert torch.allclose(lp1, lp2, atol=1e-5)
    train_steps(tp.policy, 1)
    assert max_diff(w1, exported_weights(tp.policy)) <= 1e-5


def test_cp2_equals_cp1(ray_local: None, tiny_model_dir: Path, built: list[Built]) -> None:
    """Context parallelism (rlpost.models.dtensor.context_parallel): two ranks split each sequence, 19 tokens so the
    second slice is padded, activation checkpointing recomputing through the key/value gathers; logprobs, the loss and
    the updated weights equal one rank's."""
    data = make_batch(seed=9)
    data = BatchedDataDict({k: v[:, :S - 1] if v.dim() == 2 else v for k, v in data.items()})
    data["input_lengths"] = data["input_lengths"].clamp(max=S - 1)

    def run(b: Built) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
        built.append(b)
        lp = b.policy.get_logprobs(data)["logprobs"]
        step = BatchedDataDict(dict(data.items()))
        step["prev_logprobs"] = lp
        loss = b.policy.train(step, LOSS).loss
        w = exported_weights(b.policy)
        b.close()
        built.remove(b)
        return lp, loss, w

    lp1, loss1, w1 = run(Built(policy_cfg(tiny_model_dir, "cluster.gpus_per_node=1", optimizer=SGD), 1))
    lp2, loss2, w2 = run(Built(policy_cfg(tiny_model_dir, "policy.dtensor_cfg.context_parallel_size=2",
                                          "policy.dtensor_cfg.activation_checkpointing=true", optimizer=SGD), 2))
    assert torch.allclose(lp1, lp2, atol=1e-5)
    assert loss1 == pytest.approx(loss2, abs=1e-5)
    assert max_diff(w1, w2) <= 1e-5


def test_packing_dynamic_batching_and_activation_checkpointing_same_logprobs(
    ray_local: None, tiny_model_dir: Path, built: list[Built]
) -> None:
    data = make_batch(seed=7)
    plain = Built(policy_cfg(tiny_model_dir, "policy.dynamic_batching.enabled=false"), 2)
    built.append(plain)
    lp = plain.policy.get_logprobs(data)["logprobs"]
    plain.close()
    built.remove(plain)
    for extra in (
        ["policy.sequence_packing.enabled=true", "policy.sequence_packing.logprob_mb_tokens=64",
         "policy.sequence_packing.sequence_length_round=1"],
        ["policy.dynamic_batching.enabled=true", "policy.dynamic_batching.logprob_mb_tokens=64",
         "policy.dynamic_batching.sequence_length_round=4"],
        ["policy.dynamic_batching.enabled=false", "policy.dtensor_cfg.activation_checkpointing=true"],
    ):
        other = Built(policy_cfg(tiny_model_dir, *extra), 2)
        built.append(other)
        lp2 = other.policy.get_logprobs(data)["logprobs"]
        valid = torch.arange(S)[None, :] < data["input_lengths"][:, None]
        assert torch.allclose(lp[valid], lp2[valid], atol=1e-5), extra
        other.close()
        built.remove(other)


def test_save_load_resume_and_hf_export(ray_local: None, tiny_model_dir: Path, built: list[Built],
                                        tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    cfg = policy_cfg(tiny_model_dir)  # AdamW: optimizer state must round-trip
    a = Built(cfg, 2)
    built.append(a)
    train_steps(a.policy, 1)
    a.policy.save_checkpoint(str(tmp_path / "weights"), str(tmp_path / "optim"))
    data = make_batch(seed=11)
    lp_saved = a.policy.get_logprobs(data)["logprobs"]
    data["prev_logprobs"] = lp_saved
    a.policy.train(data, LOSS)
    w_next = exported_weights(a.policy)
    a.close()
    built.remove(a)

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "weights" / "hf")
    with torch.no_grad():
        ref = torch.log_softmax(hf(data["input_ids"]).logits.float(), -1)[:, :-1]
        ref = ref.gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    valid = torch.arange(S)[None, 1:] < data["input_lengths"][:, None]
    assert torch.allclose(lp_saved[:, 1:][valid], ref[valid], atol=1e-5)

    b = Built(cfg, 2, weights_path=str(tmp_path / "weights"), optimizer_path=str(tmp_path / "optim"))
    built.append(b)
    assert torch.equal(b.policy.get_logprobs(data)["logprobs"], lp_saved)
    b.policy.train(data, LOSS)
    assert max_diff(w_next, exported_weights(b.policy)) == 0.0


def test_killed_worker_is_named(ray_local: None, tiny_model_dir: Path, built: list[Built]) -> None:
    import time

    b = Built(policy_cfg(tiny_model_dir), 2)
    built.append(b)
    wg = b.policy.worker_group
    big = make_batch()
    big = BatchedDataDict.from_batches([big] * 8)
    shards = big.shard_by_batch_size(2)
    futures = [w.get_logprobs.remote(shards[i]) for i, w in enumerate(wg.workers)]
    ray.kill(wg.workers[1], no_restart=True)
    t0 = time.monotonic()
    with pytest.raises(WorkerGroupError, match=r"policy rank 1 on node .* died"):
        wg.get(futures)
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("tp", [1, 2])
def test_v2_logprobs_equal_v1(ray_local: None, tiny_model_dir: Path, built: list[Built], tp: int) -> None:
    data = make_batch(seed=3)
    extra = [f"policy.dtensor_cfg.tensor_parallel_size={tp}"]
    v1 = Built(policy_cfg(tiny_model_dir, *extra, optimizer=SGD), 2)
    built.append(v1)
    lp1 = v1.policy.get_logprobs(data)["logprobs"]
    train_steps(v1.policy, 1)
    w1 = exported_weights(v1.policy)
    v1.close()
    built.remove(v1)
    v2 = Built(policy_cfg(tiny_model_dir, "policy=dtensor_v2", *extra, optimizer=SGD), 2)
    built.append(v2)
    assert torch.allclose(lp1, v2.policy.get_logprobs(data)["logprobs"], atol=1e-5)
    train_steps(v2.policy, 1)
    assert max_diff(w1, exported_weights(v2.policy)) <= 1e-5


class _Sleeper:
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def fail(self) -> None:
        raise ValueError("no such step")


def test_one_call_that_hangs_or_raises_is_named(ray_local: None) -> None:
    """ActorGroup.get of a single call (one engine, one policy rank): its answer; a call past the timeout, or one
    that raised, names the actor in one line."""
    import ray

    from rlpost.distributed.worker_groups import ActorGroup

    actor = ray.remote(_Sleeper).options(num_cpus=0).remote()
    group = ActorGroup([actor], "sleeper", timeout_s=60.0)
    assert group.get([actor.nap.remote(0.0)]) == [0.0]
    with pytest.raises(WorkerGroupError, match=r"^sleeper 0 raised ValueError: no such step"):
        group.get([actor.fail.remote()])
    group = ActorGroup([actor], "sleeper", timeout_s=60.0)
    with pytest.raises(WorkerGroupError, match=r"call did not finish within 1s on sleeper 0"):
        group.get([actor.nap.remote(30.0)], timeout_s=1.0)


def test_a_batch_trained_in_parts_equals_it_trained_whole(ray_local: None, tiny_model_dir: Path,
                                                          built: list[Built]) -> None:
    # Overlapped synchronous GRPO (rlpost.algorithms.overlap) sends a one-step batch in parts before its global
    # counts are known: two FSDP ranks, two steps, SGD (so any error in the scale shows in the weights), clipping
    # on, a masked-out sample and ragged lengths. Loss, grad norm, metrics and weights equal the whole batch's.
    # Sequence-level: its loss scale differs from the token-mean metrics' (the token-level loss is the default
    # one, which test_an_overlapped_step_equals_the_unoverlapped_one trains end to end; both are unit-tested).
    loss = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0, force_on_policy_ratio=True,
                                               token_level_loss=False))
    cfg = policy_cfg(tiny_model_dir, "policy.max_grad_norm=0.05", optimizer=SGD)

    def batch(step: int) -> BatchedDataDict:
        data = make_batch(seed=10 + step)
        data["sample_mask"][3] = 0.0
        data["generation_logprobs"] = -torch.rand(B, S, generator=torch.Generator().manual_seed(step))
        return data

    results: dict[str, list[TrainResult]] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for how in ("whole", "parts"):
        b = Built(cfg, 2)
        built.append(b)
        results[how] = []
        for step in range(2):
            data = batch(step)
            if how == "whole":
                results[how].append(b.policy.train(data, loss))
            else:
                for a in range(0, B, 8):  # two parts of 8 rows: 4 per rank, one micro-batch each
                    b.policy.train_part(data.slice(a, a + 8), loss)
                results[how].append(b.policy.finish_parts(loss))
        weights[how] = exported_weights(b.policy)
        b.close()
        built.remove(b)
    for whole, parts in zip(results["whole"], results["parts"], strict=True):
        assert parts.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-7)
        assert parts.grad_norm == pytest.approx(whole.grad_norm, rel=1e-5)
        assert whole.grad_norm > 0.05  # clipping acted, after the parts' scale
        assert parts.metrics.keys() == whole.metrics.keys()
        for k, v in whole.metrics.items():
            assert parts.metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
        assert parts.metrics["num_valid_samples"] == 15.0
    assert max_diff(weights["whole"], weights["parts"]) <= 1e-6


def test_finish_parts_without_parts_or_after_a_failed_part_raises(ray_local: None, tiny_model_dir: Path,
                                                                    built: list[Built]) -> None:
    b = Built(policy_cfg(tiny_model_dir, "cluster.gpus_per_node=1", optimizer=SGD), 1)
    built.append(b)
    loss = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0, force_on_policy_ratio=True))
    with pytest.raises(RuntimeError, match="without a train_part"):
        b.policy.finish_parts(loss)
    bad = make_batch()
    del bad["advantages"]  # the loss cannot run on this part
    before = exported_weights(b.policy)
    b.policy.train_part(make_batch(), loss)
    b.policy.train_part(bad, loss)
    with pytest.raises(WorkerGroupError, match="policy rank 0 .*raised KeyError"):
        b.policy.finish_parts(loss)
    assert max_diff(before, exported_weights(b.policy)) == 0.0  # no optimizer step on a partial batch


def test_a_rank_builds_its_model_only_once_the_start_gate_opens(ray_local: None, tiny_model_dir: Path,
                                                               built: list[Built], tmp_path: Path) -> None:
    """The colocated start-up order (rlpost.distributed.start_gate): a policy rank's process starts at once, but it
    allocates nothing until the engines on its devices sleep; here the gate is a task that ends when a file appears."""
    from rlpost.distributed.start_gate import StartGate

    @ray.remote(num_cpus=0)
    def until(path: str) -> bool:
        while not os.path.exists(path):
            time.sleep(0.05)
        return True

    opened = tmp_path / "engines-asleep"
    b = Built(policy_cfg(tiny_model_dir), 1, start_after=StartGate([until.remote(str(opened))], timeout_s=300))
    built.append(b)
    ping = b.policy.worker_group.workers[0].ping.remote()
    ready, _ = ray.wait([ping], timeout=12)  # a rank of the tiny model is up in a few seconds without a gate
    assert not ready, "the rank was built before its start gate opened"
    opened.touch()
    assert ray.get(ping, timeout=300) == 0
