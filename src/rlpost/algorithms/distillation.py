"""On-policy distillation (`algo=distillation`, and the teacher add-on any rollout algorithm may take): the teacher
is a worker group (a `SideGroup`, rlpost.algorithms.units) that scores the student's tokens with its top-k logprobs
and never trains (no optimizer, no reference)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from rlpost.algorithms.grpo_unit import GRPOUnit
from rlpost.algorithms.side_groups import side_cluster, side_config
from rlpost.config.errors import ConfigError
from rlpost.config.schema.distillation import DistillationConfig
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.policy import PolicyConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlpost.distributed.batched_data_dict import BatchedDataDict
    from rlpost.distributed.start_gate import StartGate
    from rlpost.distributed.virtual_cluster import RayVirtualCluster
    from rlpost.models.policy.lm_policy import Policy
    from rlpost.runtime.timer import Timer


class TeacherGroup:
    """The teacher's workers: the policy's backend for the teacher's model, no optimizer."""

    name = "teacher"
    checkpoint_dir: str | None = None

    def __init__(self, cfg: MasterConfig, distillation: DistillationConfig) -> None:
        self.cfg, self.distillation = cfg, distillation
        self.colocated = distillation.teacher.colocated

    def config(self) -> PolicyConfig:
        """The teacher's policy block: the policy's, for the teacher's model, unpacked micro-batches, no optimizer."""
        t, p = self.distillation.teacher, self.cfg.policy
        model = t.model_dir()
        assert model is not None  # the pre-flight checked it
        return side_config(self.cfg, str(model), logprob_batch_size=t.logprob_batch_size or p.logprob_batch_size,
                           sequence_packing=dataclasses.replace(p.sequence_packing, enabled=False),
                           dynamic_batching=dataclasses.replace(p.dynamic_batching, enabled=False))

    def before_start(self, tokenizer: PreTrainedTokenizerBase) -> None:
        check_same_tokenizer(self.cfg, self.distillation, tokenizer)

    def cluster(self, policy_cluster: RayVirtualCluster) -> RayVirtualCluster | None:
        t = self.distillation.teacher
        return side_cluster("distillation_teacher_cluster", self.cfg, policy_cluster, t.colocated, t.num_workers)

    def build(self, cluster: RayVirtualCluster, checkpoint: Path | None, device: str,
              gate: StartGate | None) -> Policy:
        """The teacher's workers (it never trains: nothing of it is in a checkpoint)."""
        from rlpost.models.policy.lm_policy import Policy

        return Policy(cluster, self.config(), init_optimizer=False, init_reference_model=False, device=device,
                      timeout_s=self.cfg.cluster.call_timeout_s, name="teacher", start_after=gate)

    def score(self, group: Policy, train_data: BatchedDataDict, timer: Timer) -> None:
        """Put the teacher's top-k indices and logprobs of `train_data`'s tokens into it."""
        with timer.time("teacher_logprobs"):
            train_data.update(group.get_topk_logits(train_data, self.distillation.topk_logits_k))


def side_group(cfg: MasterConfig) -> TeacherGroup:
    """The add-on's worker group (rlpost.config.algorithms.ADDONS)."""
    assert cfg.distillation is not None
    return TeacherGroup(cfg, cfg.distillation)


UNIT = GRPOUnit()
"""`algo=distillation`: GRPO's step and loop; the teacher comes with the block it sets (the add-on), the KL with
loss=distillation."""


def check_same_tokenizer(cfg: MasterConfig, distillation: DistillationConfig, student: PreTrainedTokenizerBase) -> None:
    """ConfigError (exit 2, before Ray starts) unless the teacher's tokenizer and vocabulary are the student's: the
    KL compares the two distributions token by token."""
    from transformers import AutoConfig, AutoTokenizer

    t = distillation.teacher
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
