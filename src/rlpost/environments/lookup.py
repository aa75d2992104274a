"""A two-turn lookup tool a random-init tiny model can learn to use (env=lookup; data=lookup).

Each row holds a secret table (ten random digits, one per key 0-9) and asks for the value of one key
("Key 7"). The model cannot know the table: it has to ask.
- Turn 1 is the query: a single digit d asks for key d. The environment answers " value V" (V = table[d]),
  or " value ?" when the turn is not a single digit. Reward: 0.5 when d is the row's key, 0.0625 for
  another digit, else 0.
- Turn 2 is the answer: 0.5 when it is the row's value, 0.0625 for another digit, else 0. The episode ends.

A perfect episode scores 0.5 + 0.5 = 1.0 exactly (what validation's accuracy counts); the small digit
credits play the role of the synthetic tasks' format reward (a random-init policy first learns to answer
with digits). Both skills are copies (the key from the prompt, the value from the observation), and
`rlpost train experiment=tiny_lookup` learns both. The two turns weigh the same: a heavier answer turn lets its
lucky guesses (1 in 10 without the query) drown the query turn's signal, and the policy never learns to ask.
Scoring runs in the environment's killable workers like every other verifier.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rlpost.config.schema.env import LookupEnvConfig
from rlpost.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from rlpost.environments.verifier_pool import VerifierPool

QUERY_REWARD, ANSWER_REWARD, DIGIT_REWARD = 0.5, 0.5, 0.0625


def _digit(text: str) -> str | None:
    t = text.strip()
    return t if len(t) == 1 and t.isdigit() else None


def lookup_reward(response: str, wanted: str, is_query: bool) -> float:
    """One turn's reward: the wanted digit (the key on the query turn, the value on the answer turn) or not."""
    d = _digit(response)
    if d is None:
        return 0.0
    if d == wanted:
        return QUERY_REWARD if is_query else ANSWER_REWARD
    return DIGIT_REWARD


class LookupEnvironment(EnvironmentInterface):
    """The lookup tool: answers a key with its value, then scores the model's answer."""

    cfg: LookupEnvConfig

    def __init__(self, cfg: LookupEnvConfig) -> None:
        self.cfg = cfg
        self.pool = VerifierPool.from_config(lookup_reward, cfg)

    def step(self, responses: list[str], metadata: Sequence[Mapping[str, object]]) -> EnvironmentReturn:
        query = ["asked" not in m for m in metadata]
        res = self.pool.run([(r, str(m["key"]) if q else str(m["expected_answer"]), q)
                             for r, m, q in zip(responses, metadata, query, strict=True)])
        observations: list[str] = []
        next_metadata: list[dict[str, object]] = []
        for r, m, q in zip(responses, metadata, query, strict=True):
            d = _digit(r) if q else None
            observations.append(f" value {str(m['table'])[int(d)]}" if d is not None else " value ?")
            next_metadata.append({"asked": d if d is not None else ""} if q else {})
        return EnvironmentReturn(
            res.rewards, res.timeouts, res.errors, unfinished=res.unfinished,
            metrics={"lookup_right_key": float(sum(1 for r, m, q in zip(responses, metadata, query, strict=True)
                                                   if q and _digit(r) == str(m["key"])))},
            observations=observations, terminateds=[not q for q in query], next_metadata=next_metadata,
        )

    def shutdown(self) -> None:
        self.pool.shutdown()
