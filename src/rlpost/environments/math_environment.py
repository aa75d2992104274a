"""Math answers checked with math-verify (parse both sides, compare symbolically)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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


def warm_up_math_verify() -> None:
    """Import math-verify and answer one dummy check, so a worker's first real call is not its slowest."""
    math_verify_reward("\\boxed{1}", "1")


class MathEnvironment(EnvironmentInterface):
    """Scores responses with math-verify in warmed, killable workers (cfg.timeout_s per call,
    cfg.batch_timeout_s per batch)."""

    cfg: MathEnvConfig

    def __init__(self, cfg: MathEnvConfig) -> None:
        self.cfg = cfg
        self.pool = VerifierPool.from_config(math_verify_reward, cfg, warmup=warm_up_math_verify)

    @classmethod
    def answer_problem(cls, answer: str) -> str | None:
        from math_verify import parse

        parsed = parse(f"${answer}$") or parse(str(answer))
        if any(not isinstance(p, str) for p in parsed):  # a sympy expression, not just the raw text back
            return None
        return "math-verify cannot parse it as math (it would only ever match the same literal text)"

    def step(self, responses: list[str], metadata: Sequence[Mapping[str, object]]) -> EnvironmentReturn:
        res = self.pool.run([(r, str(m["expected_answer"])) for r, m in zip(responses, metadata, strict=True)])
        return EnvironmentReturn(res.rewards, res.timeouts, res.errors, unfinished=res.unfinished)

    def shutdown(self) -> None:
        self.pool.shutdown()
