"""Resume never unpickles: a policy checkpoint (2 Ray ranks; DTensor TP2, Megatron PP2) with a
malicious pickle planted under every name a loader might open is restored bit-exactly and the payload never runs; a
pickle written over a file the resume does read is refused with a one-line CheckpointError. The same through
`rlpost train` (planted pickles ignored on resume, a shard replaced by a pickle refused with exit status 2) is in
tests/integration/test_checkpoint_fallback.py.

The per-file sweep over every saved file, and the round trip with pickle patched out, are in
tests/unit/models/test_pickle_free_checkpoint.py (one rank, in-process).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost.algorithms.grpo_setup import _checkpoint_load_failure
from rlpost.config.load import load_master_config
from rlpost.config.schema.loss import ClippedPGLossConfig
from rlpost.config.schema.policy import PolicyConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.distributed.virtual_cluster import RayVirtualCluster
from rlpost.distributed.worker_groups import WorkerGroupError
from rlpost.losses.clipped_pg import ClippedPGLossFn
from rlpost.models.policy.lm_policy import Policy
from tests.integration.exported import exported_weights
from tests.pickles import plant

pytestmark = pytest.mark.slow

B, S = 16, 20
LOSS = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0))
COMMON = ["grpo.num_prompts_per_step=2", "policy.train_global_batch_size=16", "policy.train_micro_batch_size=4",
          "policy.logprob_batch_size=4", "cluster.gpus_per_node=2"]
BACKENDS = {
    "dtensor_tp2": ["policy.dtensor_cfg.tensor_parallel_size=2"],
    "megatron_pp2": ["policy=megatron", "policy.megatron_cfg.pipeline_model_parallel_size=2"],
}
# Names a loader might open: DCP's pickled metadata, torch files, pickles.
PLANTED = [".metadata", "model/.metadata", "model/__0_0.distcp", "__0_0.distcp", "model.pt", "pytorch_model.bin",
           "state.pkl", "optim/.metadata", "optim/__1_0.distcp", "scheduler.pt", "optimizer.pt", "rng_state.pth"]


def policy_cfg(model_dir: Path, *overrides: str) -> PolicyConfig:
    _, cfg = load_master_config([*COMMON, *overrides])
    p = dataclasses.replace(cfg.policy, model_name=str(model_dir))
    p.tokenizer.name = str(model_dir)
    return p


def make_batch(seed: int) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, S + 1, (B,), generator=g)
    pos = torch.arange(S)[None, :]
    valid = pos < lengths[:, None]
    ids = torch.where(valid, torch.randint(3, 380, (B, S), generator=g), 0)
    return BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=(valid & (pos >= 4)).float(),
                           sample_mask=torch.ones(B), advantages=torch.randn(B, 1, generator=g).expand(B, S).clone(),
                           generation_logprobs=torch.zeros(B, S))


class Built:
    def __init__(self, cfg: PolicyConfig, **kw: Any) -> None:
        self.cluster = RayVirtualCluster(f"nopickle-{id(self)}", 2, cpus_per_bundle=0.5)
        self.policy = Policy(self.cluster, cfg, timeout_s=300.0, **kw)

    def close(self) -> None:
        self.policy.shutdown()
        self.cluster.shutdown()


def _build(made: list[Built], cfg: PolicyConfig, **kw: Any) -> Built:
    b = Built(cfg, **kw)
    made.append(b)
    return b


def _close(made: list[Built], b: Built) -> None:
    made.remove(b)
    b.close()


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_planted_pickles_never_run_and_replaced_files_are_refused(
    backend: str, ray_local: None, tiny_model_dir: Path, built: list[Built], tmp_path: Path
) -> None:
    cfg = policy_cfg(tiny_model_dir, *BACKENDS[backend])  # Adam: optimizer state and a scheduler to restore
    ckpt, canary = tmp_path / "ckpt", tmp_path / "PWNED"
    a = _build(built, cfg)
    first, later = make_batch(0), make_batch(11)
    first["prev_logprobs"] = a.policy.get_logprobs(first)["logprobs"]
    a.policy.train(first, LOSS)
    a.policy.save_checkpoint(str(ckpt / "weights"), str(ckpt / "optimizer"))
    lp_saved = a.policy.get_logprobs(later)["logprobs"]
    w_saved = exported_weights(a.policy)
    later["prev_logprobs"] = lp_saved
    a.policy.train(later, LOSS)  # the step after the checkpoint: equal only where the optimizer state came back
    w_next = exported_weights(a.policy)
    _close(built, a)

    ours = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*")
                  if p.is_file() and "/hf/" not in p.as_posix())
    assert all(f.endswith((".json", ".safetensors")) for f in ours), ours
    shards = [f for f in ours if f.endswith(".safetensors")]
    assert len([f for f in shards if f.startswith("weights/model/")]) == 2, ours  # one per rank

    for sub in ("weights", "optimizer", "weights/hf"):
        for rel in PLANTED:
            plant(ckpt / sub / rel, canary)
    b = _build(built, cfg, weights_path=str(ckpt / "weights"), optimizer_path=str(ckpt / "optimizer"))
    assert torch.equal(b.policy.get_logprobs(later)["logprobs"], lp_saved)
    b.policy.train(later, LOSS)
    w = exported_weights(b.policy)
    assert w.keys() == w_next.keys() and all(torch.equal(w[k], w_next[k]) for k in w)
    _close(built, b)
    assert not canary.exists()
    if backend == "dtensor_tp2":  # the shards carry their offsets: a TP2 checkpoint restores into DP2 x TP1
        c = _build(built, policy_cfg(tiny_model_dir), weights_path=str(ckpt / "weights"),
                   optimizer_path=str(ckpt / "optimizer"))
        w = exported_weights(c.policy)
        assert w.keys() == w_saved.keys() and all(torch.equal(w[k], w_saved[k]) for k in w)
        _close(built, c)

    # A replaced file, one restore: the optimizer's JSON (DTensor), the second rank's model shard (Megatron). Every
    # other saved file, replaced in turn, is refused by the one-rank sweep of
    # tests/unit/models/test_pickle_free_checkpoint.py; here the refusal crosses the Ray workers to the driver.
    replaced = {
        "dtensor_tp2": ["optimizer/optimizer.json"],
        "megatron_pp2": [sorted(f for f in shards if f.startswith("weights/model/"))[-1]],
    }[backend]
    for rel in replaced:
        original = (ckpt / rel).read_bytes()
        plant(ckpt / rel, canary)
        b = _build(built, cfg, weights_path=str(ckpt / "weights"), optimizer_path=str(ckpt / "optimizer"))
        with pytest.raises(WorkerGroupError) as info:
            b.policy.get_logprobs(later)
        why = _checkpoint_load_failure(info.value)  # what `rlpost train` reports (exit status 2)
        assert why is not None and re.search(r"CheckpointError: cannot load checkpoint( file)? /", why), why
        _close(built, b)
        assert not canary.exists(), rel
        (ckpt / rel).write_bytes(original)
