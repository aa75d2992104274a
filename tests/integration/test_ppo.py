"""PPO end to end through the installed `rlpost train algo=ppo`: the default task learned with a critic beside the
policy, the critic checkpointed and resumed with it, and its warm-up on workers of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.cli_runs import AC, metrics, train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def learned(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`rlpost train algo=ppo` as shipped: 80 steps of the default task."""
    run = tmp_path_factory.mktemp("ppo") / "run"
    train(run, cache, "algo=ppo", timeout=900)
    return run


def test_ppo_learns_the_default_task(learned: Path) -> None:
    lines = metrics(learned)
    assert [m["step"] for m in lines] == list(range(1, 81))
    rewards = [m["train/reward"] for m in lines]
    assert sum(rewards[:5]) / 5 < 0.1
    assert sum(rewards[-5:]) / 5 >= 0.9, rewards
    last = lines[-1]
    assert last["validation/accuracy"] >= 0.9
    # the critic learned to predict the reward: its values follow the returns, and explain part of their variance
    assert abs(last["train/values/mean"] - last["train/returns/mean"]) < 0.15
    assert max(m.get("train/explained_variance", 0.0) for m in lines[-30:]) > 0.2  # absent: the returns were equal
    assert all(m["train/policy_trained"] == 1.0 and m["train/token_mult_prob_error"] <= 1.001 for m in lines)
    for key in ("train/value_loss", "train/value_clip_fraction", "train/advantages/mean", "train/critic_grad_norm",
                "timing/train/critic_values", "timing/train/critic_training"):
        assert key in last, key
    # whitened over the batch: the advantages' mean over valid tokens is 0 (per sample it need not be)
    assert abs(last["train/advantages/mean"]) < 0.5


def test_the_critic_is_checkpointed_and_resumed_with_the_policy(learned: Path, cache: Path) -> None:
    step_80 = learned / "checkpoints" / "step_80"
    assert any((step_80 / "critic" / "weights").iterdir()) and any((step_80 / "critic" / "optimizer").iterdir())
    out = train(learned, cache, "algo=ppo", "grpo.max_num_steps=82", "grpo.max_num_epochs=3")
    assert "resuming from step 80" in out.stdout + out.stderr
    after = [m for m in metrics(learned) if m["step"] > 80]
    assert [m["step"] for m in after] == [81, 82]
    # a fresh critic would start near 0 while the returns are near 1: the restored one is already close
    assert after[0]["train/values/mean"] > 0.6 and after[0]["train/value_loss"] < 0.2, after[0]


def test_critic_warmup_on_workers_of_its_own(cache: Path, tmp_path: Path) -> None:
    run = tmp_path / "warmup"
    train(run, cache, "algo=ppo", "ppo.critic_warmup_steps=2", "grpo.max_num_steps=3", "critic.colocated=false",
          "checkpointing=disabled", "grpo.val_period=0", "ppo.whiten_advantages=false", "ppo.gamma=0.9",
          "ppo.lam=0.5", "ppo.value_clip=null", AC)
    lines = metrics(run)
    assert [m["train/policy_trained"] for m in lines] == [0.0, 0.0, 1.0]
    assert [m["train/grad_norm"] == 0.0 for m in lines] == [True, True, False]
    assert all(m["train/critic_grad_norm"] > 0 for m in lines)
    assert all(m["train/value_clip_fraction"] == 0.0 for m in lines)


def test_a_megatron_critic_is_trained_checkpointed_and_resumed(cache: Path, tmp_path: Path) -> None:
    run = tmp_path / "megatron"
    short = ["algo=ppo", "policy=megatron", "grpo.val_period=0", "checkpointing.metric_name=null",
             "checkpointing.save_period=3", "policy.megatron_cfg.activation_checkpointing=true"]
    train(run, cache, *short, "grpo.max_num_steps=3")
    assert any((run / "checkpoints" / "step_3" / "critic" / "weights").iterdir())
    out = train(run, cache, *short, "grpo.max_num_steps=4")
    assert "resuming from step 3" in out.stdout + out.stderr
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert all(m["train/critic_grad_norm"] > 0 and m["train/value_loss"] >= 0 for m in lines)
