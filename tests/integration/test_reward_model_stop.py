"""The reward-model environment (`env=reward_model`) under a stop request (the first SIGTERM of a run's steps):
a batch its scorer actor has not finished gets GRACE_S more, then scores 0 and counts as unfinished, instead of
holding the stop for the batch deadline; the next batch is scored by a fresh actor."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

from rlpost.environments import reward_model

pytestmark = pytest.mark.slow


class HangingScorer(reward_model._Scorer):
    """The real scorer, except that a batch whose first prompt is "hang" never ends (a stuck model server)."""

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        if prompts and prompts[0] == "hang":
            time.sleep(600)
        return super().score(prompts, responses)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A one-label sequence classifier on the tiny model's body and tokenizer (untrained: its scores are finite)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    out = tmp_path_factory.mktemp("reward_model")
    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    for f in tiny_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy2(f, out / f.name)
    return out


def test_a_stop_cuts_a_hanging_reward_model_batch_short(ray_local: None, reward_model_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.cloudpickle

    from rlpost.config.schema.env import RewardModelEnvConfig
    from rlpost.runtime import stop_request

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor's class travels by value
    monkeypatch.setattr(reward_model, "_Scorer", HangingScorer)
    monkeypatch.setattr(stop_request, "GRACE_S", 1.0)
    env = reward_model.RewardModelEnvironment(RewardModelEnvConfig(model_path=str(reward_model_dir),
                                                                   batch_timeout_s=600.0))
    timer = threading.Timer(2.0, stop_request.STOP.set)
    try:
        start = time.monotonic()
        timer.start()
        out = env.step(["a", "b"], [{"problem": "hang"}, {"problem": "hang"}])
        assert out.rewards == [0.0, 0.0] and out.unfinished == 2 and out.timeouts == 2
        assert time.monotonic() - start < 60.0  # the stop ended it, not the 600 s batch deadline
        stop_request.STOP.clear()
        out = env.step(["4"], [{"problem": "2+2"}])  # a fresh actor scores the next batch
        assert out.unfinished == 0 and out.timeouts == 0 and len(out.rewards) == 1
    finally:
        timer.cancel()
        stop_request.STOP.clear()
        env.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
