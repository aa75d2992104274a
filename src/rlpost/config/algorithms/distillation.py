"""The distillation teacher's rules, plan rows and pre-flight (its block: rlpost.config.schema.distillation; its
code: rlpost.algorithms.distillation)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlpost.config.errors import require
from rlpost.config.schema.loss import ClippedPGLossConfig, DistillationLossConfig
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.side_group import side_group_rules, where

if TYPE_CHECKING:
    from rlpost.config.memory.workers import Worker


def teacher_rules(master: MasterConfig) -> None:
    """A teacher is there exactly when the loss reads it, on a backend that serves it, with synchronous steps."""
    loss = master.loss_fn
    coef = loss.distillation_kl_coef if isinstance(loss, ClippedPGLossConfig) else 0.0
    reads = isinstance(loss, DistillationLossConfig) or coef > 0
    if master.distillation is None:
        require(not reads, "loss_fn.distillation_kl_coef" if coef > 0 else "loss_fn._target_",
                coef if coef > 0 else loss._target_, "the KL to a teacher needs a teacher",
                "add distillation=teacher distillation.teacher.model_path=DIR")
        return
    require(reads, "distillation", "set", "no loss reads the teacher",
            "use algo=distillation, or loss_fn.distillation_kl_coef > 0 with GRPO's loss")
    side_group_rules(master, "distillation teacher", "the teacher scores the whole batch before it trains")


def plan_rows(master: MasterConfig, train_world: int) -> list[tuple[str, str]]:
    """Which teacher, where it runs, what the KL is taken over."""
    d, loss = master.distillation, master.loss_fn
    assert d is not None
    t = d.teacher
    over = "the whole vocabulary" if d.topk_logits_k is None else f"its top {d.topk_logits_k} tokens per position"
    kind = loss.kl_type if isinstance(loss, DistillationLossConfig) else "reverse"
    coef = loss.distillation_kl_coef if isinstance(loss, ClippedPGLossConfig) else 0.0
    use = f"{coef} x the KL added to the policy-gradient loss" if coef else "the loss"
    return [("teacher", f"{t.model_path}, scoring each sampled token, never trained; "
                        f"{where(t.colocated, t.num_workers, train_world)}; {kind} KL over {over} is {use}")]


def preflight(master: MasterConfig) -> None:
    """The teacher's model directory exists and holds a model, with as many tokens as the top-k asks for."""
    from rlpost.config.errors import ConfigError
    from rlpost.config.layout import read_hf_config

    d = master.distillation
    assert d is not None
    d.teacher.check_model_dir("distillation.teacher")
    model = d.teacher.model_dir()
    hf = read_hf_config(str(model), "distillation.teacher.model_path") if model is not None else None
    vocab = hf.get("vocab_size") if hf is not None else None
    if d.topk_logits_k is not None and isinstance(vocab, int) and d.topk_logits_k > vocab:
        raise ConfigError("distillation.topk_logits_k", d.topk_logits_k,
                          f"is more than the teacher's vocabulary ({vocab} tokens)",
                          "distillation.topk_logits_k=null takes the whole vocabulary")


def memory(master: MasterConfig, device: str, train_world: int) -> list[Worker]:
    """The teacher's workers for the memory plan: its model's weights and scoring passes, no optimizer."""
    from rlpost.config.memory.shape import read_shape
    from rlpost.config.memory.workers import policy_worker

    assert master.distillation is not None
    t = master.distillation.teacher
    model = t.model_dir()
    shape = read_shape(str(model), "distillation.teacher.model_path") if model is not None else None
    if shape is None:
        return []
    worker = policy_worker(master.policy, shape, device, t.num_workers or train_world, group="teacher",
                           trains=False, lora=False)
    worker.shares_device_with = "policy" if t.colocated else None
    return [worker]
