"""The verifier of the synthetic tasks (rlpost.data.synthetic_tasks) of the default run: one-token answers.

Reward: 1.0 when the response (special tokens removed, whitespace stripped) equals the answer;
`format_reward` (default 0.1) when it is a single symbol of the task's answer alphabet (a letter,
or a digit) but the wrong one; else 0.0. The format credit matters for a random-init policy: a
specific token is 1 of ~384 at first, a letter 26 of 384, so the policy first learns to answer
with a letter, then which letter. Tokens generated after the answer would dilute the signal, so
the default run generates one token (answers are one token long).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rlpost.config.schema.env import SyntheticEnvConfig
from rlpost.data.synthetic_tasks import ALPHABETS
from rlpost.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from rlpost.environments.verifier_pool import VerifierPool


def exact_match_reward(response: str, answer: str, alphabet: str = "", format_reward: float = 0.0) -> float:
    """1.0 iff the stripped response equals the answer; format_reward for one wrong symbol of `alphabet`."""
    r = response.strip()
    if r == str(answer).strip():
        return 1.0
    return format_reward if len(r) == 1 and r in alphabet else 0.0


class SyntheticEnvironment(EnvironmentInterface):
    """Exact-match verifier of the synthetic tasks: in the calling process (`num_workers=0`, the default), or in
    killable workers with a timeout."""

    cfg: SyntheticEnvConfig

    def __init__(self, cfg: SyntheticEnvConfig) -> None:
        self.cfg = cfg
        self.pool = VerifierPool.from_config(exact_match_reward, cfg) if cfg.num_workers > 0 else None

    def step(self, responses: list[str], metadata: Sequence[Mapping[str, object]]) -> EnvironmentReturn:
        alphabet = ALPHABETS.get(self.cfg.task, "")
        args = [(r, str(m["expected_answer"]), alphabet, self.cfg.format_reward)
                for r, m in zip(responses, metadata, strict=True)]
        if self.pool is None:
            return _score_here(args)
        res = self.pool.run(args)
        return EnvironmentReturn(res.rewards, res.timeouts, res.errors, unfinished=res.unfinished)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def _score_here(args: list[tuple[str, str, str, float]]) -> EnvironmentReturn:
    """exact_match_reward of every args tuple in this process; a row it fails on gets 0 and counts as an error,
    as in a verifier worker."""
    rewards, errors = [], 0
    for a in args:
        try:
            rewards.append(float(exact_match_reward(*a)))
        except Exception:  # noqa: BLE001 - counted, as the pool counts a worker's error
            rewards.append(0.0)
            errors += 1
    return EnvironmentReturn(rewards, 0, errors)
