"""On-policy distillation's teacher: a worker group (rlpost.algorithms.side_groups) that scores the student's
tokens with its top-k logprobs and never trains (no optimizer, no reference)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rlpost.algorithms.side_groups import side_cluster, side_config
from rlpost.config.errors import ConfigError
from rlpost.config.schema.distillation import DistillationConfig
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.policy import PolicyConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.distributed.start_gate import StartGate
from rlpost.distributed.virtual_cluster import RayVirtualCluster
from rlpost.models.policy.lm_policy import Policy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

def _distillation(cfg: MasterConfig) -> DistillationConfig:
    assert cfg.distillation is not None  # only called for a run with a teacher
    return cfg.distillation


def teacher_config(cfg: MasterConfig) -> PolicyConfig:
    """The teacher's policy block: the policy's, for the teacher's model, unpacked micro-batches, no optimizer."""
    t = _distillation(cfg).teacher
    model = t.model_dir()
    assert model is not None  # the pre-flight checked it
    p = cfg.policy
    return side_config(cfg, str(model), logprob_batch_size=t.logprob_batch_size or p.logprob_batch_size,
                       sequence_packing=dataclasses.replace(p.sequence_packing, enabled=False),
                       dynamic_batching=dataclasses.replace(p.dynamic_batching, enabled=False))


def teacher_cluster(cfg: MasterConfig, policy_cluster: RayVirtualCluster) -> RayVirtualCluster | None:
    """The teacher's own bundles (None when it shares the policy's)."""
    t = _distillation(cfg).teacher
    return side_cluster("distillation_teacher_cluster", cfg, policy_cluster, t.colocated, t.num_workers)


def build_teacher(cfg: MasterConfig, cluster: RayVirtualCluster, device: str, gate: StartGate | None = None
                  ) -> Policy:
    """The teacher's workers (not waited for); each builds its model once `gate` is ready
    (rlpost.distributed.start_gate)."""
    return Policy(cluster, teacher_config(cfg), init_optimizer=False, init_reference_model=False, device=device,
                  timeout_s=cfg.cluster.call_timeout_s, name="teacher", start_after=gate)


def score(teacher: Policy, cfg: MasterConfig, train_data: BatchedDataDict) -> None:
    """Put the teacher's top-k indices and logprobs of `train_data`'s tokens into it."""
    train_data.update(teacher.get_topk_logits(train_data, _distillation(cfg).topk_logits_k))


def check_same_tokenizer(cfg: MasterConfig, student: PreTrainedTokenizerBase) -> None:
    """ConfigError (exit 2, before Ray starts) unless the teacher's tokenizer and vocabulary are the student's: the
    KL compares the two distributions token by token."""
    from transformers import AutoConfig, AutoTokenizer

    t = _distillation(cfg).teacher
    model = t.model_dir()
    assert model is not None  # the pre-flight checked it
    theirs = AutoTokenizer.from_pretrained(model, trust_remote_code=cfg.policy.trust_remote_code)
    ours_vocab, their_vocab = student.get_vocab(), theirs.get_vocab()
    student_size = AutoConfig.from_pretrained(cfg.policy.model_name).vocab_size
    teacher_size = AutoConfig.from_pretrained(model).vocab_size
    if ours_vocab == their_vocab and student_size == teacher_size:
        return
    if ours_vocab != their_vocab:
        odd = sorted(set(ours_vocab.items()) ^ set(their_vocab.items()))[:1]
        why = (f"its tokenizer ({len(their_vocab)} tokens) differs from the student's ({len(ours_vocab)} tokens, "
               f"{cfg.policy.tokenizer.name})" + (f", e.g. at {odd[0][0]!r}" if odd else ""))
    else:
        why = f"its vocabulary size {teacher_size} differs from the student's {student_size} ({cfg.policy.model_name})"
    raise ConfigError("distillation.teacher.model_path", t.model_path,
                      f"{why}; distillation compares the two token by token (cross-tokenizer distillation is not "
                      "supported)")
