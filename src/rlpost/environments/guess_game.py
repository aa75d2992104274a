"""A guessing game for multi-turn episodes (env=guess_game; data=guess_game): find the secret digit.

Each row holds a secret digit. Every model turn is one guess (a single digit); the environment answers
" higher", " lower" (the secret is above / below the guess) or ends the episode when the guess is right.
The episode also ends after grpo.max_rollout_turns guesses. Reward, given on the episode's last turn:
1.0 when the secret was found, else 0.0625 x the share of turns that were a digit at all (the format
credit that gets a random-init policy to guess digits first). Random digits find the secret within 4
guesses about a third of the time; a policy that reads the answers (never repeating a guess, moving the
way the hint says) finds it more often, and binary search always does within 4.

The game runs in the driver (a few comparisons); the verifier pool still scores each turn, so the
environment's num_workers and timeouts have their usual effect.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rlpost.config.schema.env import GuessGameEnvConfig
from rlpost.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from rlpost.environments.verifier_pool import VerifierPool

FOUND_REWARD, DIGIT_CREDIT = 1.0, 0.0625


def _digit(text: str) -> int | None:
    t = text.strip()
    return int(t) if len(t) == 1 and t.isdigit() else None


def guess_reward(found: bool, digit_turns: int, turns: int, over: bool) -> float:
    """The turn's reward: nothing until the episode is over, then 1.0 if found, else the format credit."""
    if not over:
        return 0.0
    return FOUND_REWARD if found else DIGIT_CREDIT * digit_turns / max(turns, 1)


def _count(m: Mapping[str, object], key: str) -> int:
    """A counter this environment keeps in the episode's metadata (0 before its first turn)."""
    value = m.get(key, 0)
    assert isinstance(value, int)
    return value


class GuessGameEnvironment(EnvironmentInterface):
    """Answers each guess with a hint until the secret is found or the guesses run out."""

    cfg: GuessGameEnvConfig

    def __init__(self, cfg: GuessGameEnvConfig) -> None:
        self.cfg = cfg
        self.pool = VerifierPool.from_config(guess_reward, cfg)

    def step(self, responses: list[str], metadata: Sequence[Mapping[str, object]]) -> EnvironmentReturn:
        observations: list[str] = []
        over: list[bool] = []
        nxt: list[dict[str, object]] = []
        args: list[tuple[bool, int, int, bool]] = []
        found = 0
        for r, m in zip(responses, metadata, strict=True):
            secret, g = int(str(m["expected_answer"])), _digit(r)
            turns = _count(m, "guesses") + 1
            digit_turns = _count(m, "digit_guesses") + (g is not None)
            hit = g == secret
            done = hit or turns >= self.cfg.max_guesses
            found += hit
            observations.append("" if done else " higher" if g is not None and secret > g else
                                " lower" if g is not None else " a digit")
            over.append(done)
            nxt.append({"guesses": turns, "digit_guesses": digit_turns})
            args.append((hit, digit_turns, turns, done))
        res = self.pool.run(args)
        return EnvironmentReturn(res.rewards, res.timeouts, res.errors, unfinished=res.unfinished,
                                 metrics={"guess_game_found": float(found)}, observations=observations,
                                 terminateds=over, next_metadata=nxt)

    def shutdown(self) -> None:
        self.pool.shutdown()
