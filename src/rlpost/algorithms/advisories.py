"""Run-health advisories: the signs of a run that silently goes nowhere, checked on each step's metrics row.

Each rule reads metrics the step already has and fires when its condition has held for `window` steps in a row (or,
comparing with the run's own history, once `window` steps of it exist). A rule that fires adds
`advisories/<rule> = 1` to the row (metrics.jsonl counts it; `rlpost report` draws a band over those steps) and, the
first time only, prints one `rlpost: warning:` line. Thresholds: `logger.advisories` (AdvisoriesConfig).

| rule | fires when |
|---|---|
| zero_variance | the share of prompt groups whose samples all got one reward (train/zero_variance_groups) is above the limit |
| truncated | the share of responses cut at max_new_tokens (train/truncated_fraction) is above the limit |
| prob_error_drift | train/token_mult_prob_error has risen by the limit over its median of the first steps |
| flat_reward | train/reward has moved by less than the tolerance over flat_reward_steps steps |
| throughput | generation or training tokens/s stayed below a share of the run's median for `window` steps |
| stall | a step took stall_factor x the run's median step (validation and checkpoint saves left out) |
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from rlpost.config.schema.advisories import AdvisoriesConfig
from rlpost.runtime import console as say

RATES = ("resources/generation_tokens_per_s", "resources/training_tokens_per_s")
STEP_TIME = "timing/train/total_step_time"


SCHEDULED = ("timing/train/checkpointing", "timing/validation/total_validation_time")
"""What a step does on its schedule, not every step: left out of the step time a stall is judged by."""


def step_seconds(metrics: dict[str, float]) -> float | None:
    """The step's own time: total_step_time less a scheduled validation or checkpoint save."""
    if STEP_TIME not in metrics:
        return None
    return metrics[STEP_TIME] - sum(metrics.get(k, 0.0) for k in SCHEDULED)


class RunHealth:
    """The advisories of one run (one instance, fed every step's metrics in order)."""

    def __init__(self, cfg: AdvisoriesConfig, multi_token: bool = True) -> None:
        """`multi_token`: the run generates more than one token per response (else every response is 'cut')."""
        self.cfg, self.multi_token = cfg, multi_token
        self.history: dict[str, list[float]] = {}
        self.streak: dict[str, int] = {}
        self.warned: set[str] = set()

    def observe(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Check the step's row; add advisories/<rule> for each rule that fires, warn once per rule; the rules that
        fired."""
        if not self.cfg.enabled:
            return []
        fired, holds = [], set()
        for name, check in self._rules():
            why = check(metrics)
            self.streak[name] = self.streak.get(name, 0) + 1 if why else 0
            if why:
                holds.add(name)
            if why and self.streak[name] >= self._needs(name):
                fired.append(name)
                metrics[f"advisories/{name}"] = 1.0
                if name not in self.warned:
                    self.warned.add(name)
                    say.warn(f"step {step}: {why} (logger.advisories; counted as advisories/{name})")
        self._remember(metrics, holds)
        return fired

    def _remember(self, metrics: dict[str, float], holds: set[str]) -> None:
        """The run's history; a slow step or stretch does not become the run's median."""
        kept: dict[str, float] = {k: float(metrics[k]) for k in ("train/token_mult_prob_error", "train/reward")
                                  if k in metrics}
        if "throughput" not in holds:
            kept.update({k: float(metrics[k]) for k in RATES if k in metrics})
        if "stall" not in holds and (seconds := step_seconds(metrics)) is not None:
            kept[STEP_TIME] = seconds
        for key, value in kept.items():
            self.history.setdefault(key, []).append(value)

    def _needs(self, name: str) -> int:
        """Steps in a row a rule's condition must hold: `window` for a share or a rate (one noisy step is no
        collapse), one for a stall or a drift past the run's own first steps."""
        return self.cfg.window if name in ("zero_variance", "truncated", "throughput") else 1

    def _rules(self) -> list[tuple[str, Callable[[dict[str, float]], str | None]]]:
        c = self.cfg
        rules: list[tuple[str, Callable[[dict[str, float]], str | None]]] = []
        if c.zero_variance_share is not None:
            rules.append(("zero_variance", self._zero_variance))
        if c.truncated_share is not None and self.multi_token:
            rules.append(("truncated", self._truncated))
        if c.prob_error_rise is not None:
            rules.append(("prob_error_drift", self._drift))
        if c.flat_reward_steps is not None:
            rules.append(("flat_reward", self._flat))
        if c.throughput_drop is not None:
            rules.append(("throughput", self._throughput))
        if c.stall_factor is not None:
            rules.append(("stall", self._stall))
        return rules

    def _zero_variance(self, m: dict[str, float]) -> str | None:
        share, limit = m.get("train/zero_variance_groups"), self.cfg.zero_variance_share
        if share is None or limit is None or share <= limit:
            return None
        return (f"{share:.0%} of the prompt groups got one reward for all their samples for {self.cfg.window} steps: "
                "no learning signal (an easier task, more samples per prompt, or dynamic sampling)")

    def _truncated(self, m: dict[str, float]) -> str | None:
        share, limit = m.get("train/truncated_fraction"), self.cfg.truncated_share
        if share is None or limit is None or share <= limit:
            return None
        return (f"{share:.0%} of the responses were cut at policy.generation.max_new_tokens for {self.cfg.window} "
                "steps (raise it, or check the stop tokens)")

    def _drift(self, m: dict[str, float]) -> str | None:
        now, past, rise = m.get("train/token_mult_prob_error"), self.history.get("train/token_mult_prob_error", []), \
            self.cfg.prob_error_rise
        if now is None or rise is None or len(past) < self.cfg.window:
            return None
        base = statistics.median(past[: self.cfg.window])
        if now - base <= rise:
            return None
        return (f"train/token_mult_prob_error rose to {now:.4f} from {base:.4f} over the first steps: the engine's "
                "and the trainer's logprobs are drifting apart (refit, precision)")

    def _flat(self, m: dict[str, float]) -> str | None:
        steps, now = self.cfg.flat_reward_steps, m.get("train/reward")
        past = self.history.get("train/reward", [])
        if steps is None or now is None or len(past) + 1 < steps:
            return None
        recent = [*past[-(steps - 1):], now] if steps > 1 else [now]
        if max(recent) - min(recent) >= self.cfg.flat_reward_tolerance:
            return None
        return (f"train/reward has stayed within {self.cfg.flat_reward_tolerance} of {now:.3f} for {steps} steps: "
                "solved, or not learning (the learning rate, the task's difficulty, the reward)")

    def _throughput(self, m: dict[str, float]) -> str | None:
        drop = self.cfg.throughput_drop
        for key in RATES:
            now, past = m.get(key), self.history.get(key, [])
            if now is None or drop is None or len(past) < self.cfg.window:
                continue
            median = statistics.median(past)
            if median > 0 and now < drop * median:
                what = key.split("/")[1].split("_")[0]
                return (f"{what} ran at {now:,.0f} tokens/s, below {drop:.0%} of the run's median {median:,.0f} "
                        "(another process on the machine, swapping, a slow node)")
        return None

    def _stall(self, m: dict[str, float]) -> str | None:
        now, past, factor = step_seconds(m), self.history.get(STEP_TIME, []), self.cfg.stall_factor
        if now is None or factor is None or len(past) < self.cfg.window:
            return None
        median = statistics.median(past)
        if median <= 0 or now < factor * median:
            return None
        return (f"the step took {now:.1f} s, {now / median:.1f} x the run's median {median:.1f} s: a worker or the "
                "engine waited on the other (timing/train/* shows which phase)")
