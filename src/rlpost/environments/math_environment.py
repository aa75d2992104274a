"""Math answers checked with math-verify (parse both sides, compare symbolically)."""

from __future__ import annotations

from typing import Any, Dict, List

from rlpost.config.schema.env import MathEnvConfig
from rlpost.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from rlpost.environments.verifier_pool import VerifierPool


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 iff math-verify finds the response's final answer equivalent to the ground truth."""
    from math_verify import parse, verify

    gold = parse(f"${answer}$") or parse(str(answer))
    pred = parse(response)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred) else 0.0


class MathEnvironment(EnvironmentInterface):
    """Scores responses with math-verify in killable workers, each call bounded by cfg.timeout_s."""

    def __init__(self, cfg: MathEnvConfig) -> None:
        self.cfg = cfg
        self.pool = VerifierPool(math_verify_reward, cfg.num_workers, cfg.timeout_s)

    def step(self, responses: List[str], metadata: List[Dict[str, Any]]) -> EnvironmentReturn:
        rewards, timeouts, errors = self.pool.map(
            [(r, m["expected_answer"]) for r, m in zip(responses, metadata, strict=True)]
        )
        return EnvironmentReturn(rewards, timeouts, errors)

    def shutdown(self) -> None:
        self.pool.shutdown()
