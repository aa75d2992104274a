"""The teacher of on-policy distillation (`distillation`: set by algo=distillation, or `distillation=teacher` for
GRPO's loss_fn.distillation_kl_coef)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rlpost.config.errors import ConfigError, require
from rlpost.config.fields import POSITIVE_OR_NONE, Block, checked
from rlpost.config.schema.side_group import check_placement

CHECKPOINT_EXPORT = Path("policy") / "weights" / "hf"
"""Where an rlpost checkpoint (step_N) holds its consolidated HF export."""


@dataclass
class TeacherConfig(Block):
    """A policy-like worker group that scores the student's tokens and never trains."""

    model_path: str = ""
    """A local HF model directory, or an rlpost checkpoint (a run's checkpoints/step_N, whose consolidated HF export
    is loaded). Its tokenizer must be the student's."""
    colocated: bool = True
    """Share the policy's workers' resources (one more actor on each of their bundles); false = bundles of its
    own, `num_workers` of them."""
    num_workers: int | None = checked(None, POSITIVE_OR_NONE)
    """Ranks of a teacher on its own resources; None = as many as the policy has."""
    logprob_batch_size: int | None = checked(None, POSITIVE_OR_NONE)
    """Samples per micro-batch of the teacher's scoring pass; None = the policy's logprob_batch_size."""

    def model_dir(self) -> Path | None:
        """The HF directory behind model_path: the directory itself, or an rlpost checkpoint's export; None when
        neither holds a config.json."""
        path = Path(self.model_path).expanduser()
        for candidate in (path, path / CHECKPOINT_EXPORT):
            if (candidate / "config.json").is_file():
                return candidate
        return None

    def check_model_dir(self, path: str) -> None:
        """ConfigError unless model_path is an HF model directory or an rlpost checkpoint (the pre-flight's)."""
        d = Path(self.model_path).expanduser()
        if not d.is_dir():
            raise ConfigError(f"{path}.model_path", self.model_path, "no such directory" if not d.exists() else
                              "is not a directory", "name a local HF model directory or a run's checkpoints/step_N")
        if self.model_dir() is None:
            raise ConfigError(f"{path}.model_path", self.model_path,
                              f"holds no config.json, itself or in {CHECKPOINT_EXPORT} (an rlpost checkpoint's HF "
                              "export): neither an HF model directory nor a checkpoint with one",
                              "checkpoints need checkpointing.save_consolidated=true")

    def check(self, path: str) -> None:
        super().check(path)
        require(bool(self.model_path), f"{path}.model_path", self.model_path,
                "must name the teacher: a local HF model directory or an rlpost checkpoint (step_N)")
        check_placement(path, self.colocated, self.num_workers)


@dataclass
class DistillationConfig(Block):
    """On-policy distillation: the student generates, the teacher scores each of its tokens (NeMo RL's names)."""

    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The teacher model and where it runs."""
    topk_logits_k: int | None = checked(64, POSITIVE_OR_NONE)
    """The teacher's top-k tokens per position that the KL is taken over (capped at the vocabulary); None = the
    whole vocabulary (the exact KL; [B, S, V] per step travels from the teacher)."""

    def check(self, path: str) -> None:
        super().check(path)
        self.teacher.check(f"{path}.teacher")
