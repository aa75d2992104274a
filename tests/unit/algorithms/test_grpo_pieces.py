"""GRPO loop pieces that need no workers: health gate, dynamic sampling, train-data layout, seeds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlpost.algorithms.advantages import calculate_baseline_and_std_per_prompt
from rlpost.algorithms.collect import sample_seeds
from rlpost.algorithms.dynamic_sampling import DynamicSampler, DynamicSamplingExhausted
from rlpost.algorithms.loop import DriftLimits, HealthCheckError, health_gate
from rlpost.algorithms.rollouts import RolloutBatch
from rlpost.algorithms.train_data import build_train_data
from rlpost.config.schema.grpo import GRPOConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.models.policy.interfaces import TrainResult


def test_health_gate_warns_then_aborts(capsys: pytest.CaptureFixture[str]) -> None:
    drift = DriftLimits(warn=1.05, abort=1.5)
    m = {"train/token_mult_prob_error": 1.01}
    health_gate(m, 1, 0.1, drift)
    assert "train/health_warnings" not in m
    assert capsys.readouterr().err == ""
    m = {"train/token_mult_prob_error": 1.2}
    health_gate(m, 2, 0.1, drift)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlpost: warning: step 2:") and "warn threshold" in err[0]
    assert m["train/health_warnings"] == 1.0
    with pytest.raises(HealthCheckError, match="abort threshold 1.5"):
        health_gate({"train/token_mult_prob_error": 1.6}, 3, 0.1, drift)
    health_gate({"train/token_mult_prob_error": 1.6}, 4, 0.1, drift, same_weights=False)  # an older batch: policy drift
    health_gate({"train/token_mult_prob_error": 1.6}, 5, 0.1, None)  # no engine: no drift limits


@pytest.mark.parametrize(
    "metrics, match",
    [
        ({"train/loss": float("nan"), "train/grad_norm": 1.0}, "train/loss=nan is not finite"),
        ({"train/loss": 0.1, "train/grad_norm": float("inf")}, "train/grad_norm=inf is not finite"),
        ({"train/loss": 0.1, "train/grad_norm": 1.0, "train/params_finite": 0.0}, "weights are no longer finite"),
    ],
)
def test_health_gate_stops_on_non_finite_training(metrics: dict, match: str) -> None:
    drift = DriftLimits(**{"warn": GRPOConfig().token_mult_prob_error_warn_threshold,
                           "abort": GRPOConfig().token_mult_prob_error_abort_threshold})
    with pytest.raises(HealthCheckError, match=match) as info:
        health_gate(dict(metrics), 4, 1e30, drift)
    assert "lr=1e+30" in str(info.value) and "before saving this step" in str(info.value)
    with pytest.raises(HealthCheckError, match=match):
        health_gate(dict(metrics), 4, 1e30, None)  # SFT / DPO / RM: the same check without drift limits
    health_gate({"train/loss": 0.1, "train/grad_norm": 1.0, "train/params_finite": 1.0}, 5, 1e30, drift)
    with pytest.raises(HealthCheckError, match="no checkpoint was saved yet"):  # what is saved, as the loop says
        health_gate(dict(metrics), 1, 1e30, drift, kept="no checkpoint was saved yet")


def batch(rewards: list[float], group: int) -> RolloutBatch:
    n = len(rewards)
    gen = BatchedDataDict(
        output_ids=torch.arange(n * 5).reshape(n, 5),
        logprobs=torch.full((n, 5), -1.0),
        generation_lengths=torch.full((n,), 2),
        unpadded_sequence_lengths=torch.full((n,), 5),
        truncated=torch.zeros(n, dtype=torch.bool),
    )
    return RolloutBatch(
        rows=[{"i": i} for i in range(n)], group_ids=torch.arange(n) // group, gen=gen,
        input_lengths=torch.full((n,), 3), responses=["x"] * n, rewards=torch.tensor(rewards, dtype=torch.float32),
    )


def _std(b: RolloutBatch) -> torch.Tensor:
    _, std = calculate_baseline_and_std_per_prompt(b.group_ids, b.rewards, torch.ones_like(b.rewards), False)
    return std


def test_dynamic_sampling_keeps_varied_groups_across_batches() -> None:
    s = DynamicSampler(target=4, max_gen_batches=3)
    b1 = batch([1, 1, 0, 1, 0, 0], group=2)  # groups: (1,1) same, (0,1) varied, (0,0) same
    assert s.add(b1, _std(b1)) is None and s.discarded == 4
    b2 = batch([0, 1, 1, 1], group=2)
    full = s.add(b2, _std(b2))
    assert full is not None and full.size == 4
    assert full.rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert len(set(full.group_ids.tolist())) == 2  # group ids stay distinct across batches
    s2 = DynamicSampler(target=4, max_gen_batches=2)
    b3 = batch([1, 1], group=2)
    s2.add(b3, _std(b3))
    b4 = batch([0, 0], group=2)
    with pytest.raises(DynamicSamplingExhausted, match="after 2 generation batches"):
        s2.add(b4, _std(b4))


def test_dynamic_sampling_decides_on_the_std_the_advantages_use() -> None:
    """Scaled or shaped rewards decide: raw rewards that differ but shape to equal values are dropped,
    and a group whose shaped rewards differ is kept even if the raw ones are equal."""
    b = batch([1, 0, 1, 1], group=2)
    shaped_std = torch.tensor([0.0, 0.0, 0.3, 0.3])  # e.g. the overlong penalty split group 2, flattened group 1
    s = DynamicSampler(target=2, max_gen_batches=1)
    full = s.add(b, shaped_std)
    assert full is not None and full.rewards.tolist() == [1.0, 1.0] and s.discarded == 2


def test_train_data_masks_only_response_tokens() -> None:
    b = batch([1.0, 0.0], group=2)
    td = build_train_data(b, torch.tensor([0.5, -0.5]), torch.tensor([1.0, 0.0]), pad_id=0, multiple=4)
    assert td["input_ids"].shape == (2, 8)
    assert td["token_mask"][0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0]
    assert td["advantages"][0].tolist() == [0, 0, 0, 0.5, 0.5, 0, 0, 0]
    assert td["generation_logprobs"][1].tolist() == [0, 0, 0, -1, -1, 0, 0, 0]
    assert td["sample_mask"].tolist() == [1.0, 0.0]


def test_sample_seeds_depend_only_on_step() -> None:
    assert sample_seeds(42, 3, 4) == sample_seeds(42, 3, 4)
    assert sample_seeds(42, 3, 4) != sample_seeds(42, 4, 4)
    assert len(set(sample_seeds(42, 3, 64))) == 64


class _SavingPolicy:
    """Writes a weights file where a real Policy would write its checkpoint."""

    def save_checkpoint(self, weights: str, optimizer: str, hf_export: bool = True) -> None:
        from pathlib import Path

        Path(weights).mkdir(parents=True)
        (Path(weights) / "w.bin").write_bytes(b"w")


def test_keep_top_k_ranks_only_metrics_measured_at_that_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from rlpost.algorithms.grpo import save_checkpoint
    from rlpost.config.schema.checkpoint import CheckpointingConfig
    from rlpost.config.schema.grpo import GRPOSaveState
    from rlpost.runtime.checkpointing import CheckpointManager

    ck = CheckpointingConfig(metric_name="val:accuracy", keep_top_k=1)
    c = SimpleNamespace(
        cfg=SimpleNamespace(checkpointing=ck), save_state=GRPOSaveState(), sides=[], policy=_SavingPolicy(),
        checkpointer=CheckpointManager(ck, tmp_path), dataloader=SimpleNamespace(state_dict=lambda: {}),
        config_dict={}, model_fp="fp",
    )
    save_checkpoint(c, 10, {"validation/accuracy": 0.5})  # type: ignore[arg-type]
    save_checkpoint(c, 20, {"validation/accuracy": 0.9})  # type: ignore[arg-type]
    save_checkpoint(c, 30, {})  # type: ignore[arg-type]  # no validation at step 30
    info30 = json.loads((tmp_path / "checkpoints" / "step_30" / "training_info.json").read_text())
    assert "val:accuracy" not in info30  # step 20's 0.9 is not inherited
    save_checkpoint(c, 40, {})  # type: ignore[arg-type]
    # top-1 by a measured metric is step 20; the latest (40) is always kept; 30 (unmeasured) goes.
    assert c.checkpointer.steps() == [20, 40]


def test_valid_tokens_leave_out_masked_samples() -> None:
    """total_valid_tokens and train/valid_response_tokens count only samples the loss trains on."""
    from rlpost.algorithms.grpo import _step_metrics, valid_response_tokens

    b = batch([1.0, 0.0, 1.0], group=3)
    td = {"token_mask": torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 0]], dtype=torch.float32),
          "sample_mask": torch.tensor([1.0, 0.0, 1.0]), "input_lengths": torch.tensor([4, 4, 4])}
    assert valid_response_tokens(td).tolist() == [2.0, 0.0, 1.0]
    results = TrainResult(loss=0.0, grad_norm=0.0, lr=0.0, params_finite=True, all_mb_metrics={}, metrics={})
    m = _step_metrics(b, td, torch.zeros(3), results, None)  # type: ignore[arg-type]
    assert m["train/valid_response_tokens"] == 3.0  # the masked sample's 3 tokens are not counted
