"""Environment configs (`env=synthetic|math`, placed at `env`): each entry scores one kind of row."""

from __future__ import annotations

from dataclasses import dataclass

from rlpost.config.errors import require
from rlpost.config.fields import NON_NEGATIVE, POSITIVE, Block, checked, options, within


@dataclass
class EnvConfig(Block):
    """Base of every environment config."""

    _target_: str = "rlpost.environments.synthetic.SyntheticEnvironment"
    """Environment class."""
    num_workers: int = checked(1, POSITIVE)
    """Verifier worker processes."""
    timeout_s: float = checked(10.0, POSITIVE)
    """A reward computation running longer is killed: reward 0 and a counted warning."""
    batch_timeout_s: float = checked(300.0, POSITIVE)
    """Bound on scoring one batch: samples unfinished by then get reward 0 and count as timeouts."""
    slow_warning_s: float = checked(30.0, POSITIVE)
    """Scoring a batch for longer than this (or any timeout) prints one warning line for the step."""

@dataclass
class SyntheticEnvConfig(EnvConfig):
    """Exact-match verifier of the synthetic tasks."""

    num_workers: int = checked(0, NON_NEGATIVE)
    """Verifier worker processes; 0 (the default here) compares in the driver: an exact match cannot hang, and a
    worker process costs a pipe round trip a batch for nothing. With 0, nothing can be killed, so
    timeout_s and batch_timeout_s must keep their defaults."""
    task: str = "${data.synthetic.task}"
    """Task whose answers are checked."""
    format_reward: float = checked(0.1, within("[0, 1)"))
    """Reward for a well-formed but wrong answer (one symbol of the task's answer alphabet); 1.0 when correct."""

    def check(self, path: str) -> None:
        super().check(path)
        if self.num_workers == 0:
            rule = "num_workers=0 scores in the driver, where nothing can be killed: a timeout needs num_workers >= 1"
            require(self.timeout_s == EnvConfig.timeout_s, f"{path}.timeout_s", self.timeout_s, rule)
            require(self.batch_timeout_s == EnvConfig.batch_timeout_s, f"{path}.batch_timeout_s",
                    self.batch_timeout_s, rule)


@dataclass
class MathEnvConfig(EnvConfig):
    """Math answers checked with math-verify."""

    _target_: str = "rlpost.environments.math_environment.MathEnvironment"
    """Environment class."""
    verifier_type: str = checked("math", options("math"))
    """'math' (math-verify equivalence)."""
    math_verify_impl: str = checked("hf_math_verify", options("hf_math_verify"))
    """'hf_math_verify' (the math-verify package)."""
    stop_strings: list[str] | None = None
    """Strings that end a response."""


@dataclass
class CalculatorEnvConfig(EnvConfig):
    """A calculator tool for multi-turn episodes: `<call>EXPR</call>` -> `<result>VALUE</result>`, the final
    answer scored with math-verify (rlpost.environments.calculator). Each call runs in a killable worker
    bounded by timeout_s."""

    _target_: str = "rlpost.environments.calculator.CalculatorEnvironment"
    """Environment class."""


@dataclass
class LookupEnvConfig(EnvConfig):
    """A two-turn lookup tool the tiny default model learns to use: ask a key, read its value, answer it
    (rlpost.environments.lookup)."""

    _target_: str = "rlpost.environments.lookup.LookupEnvironment"
    """Environment class."""


@dataclass
class GuessGameEnvConfig(EnvConfig):
    """A guessing game: find the row's secret digit with "higher"/"lower" hints (rlpost.environments.guess_game)."""

    _target_: str = "rlpost.environments.guess_game.GuessGameEnvironment"
    """Environment class."""
    max_guesses: int = checked("${grpo.max_rollout_turns}", POSITIVE)  # type: ignore[assignment]
    """Guesses per episode (the episode's turns; by default grpo.max_rollout_turns)."""


@dataclass
class RewardModelEnvConfig(EnvConfig):
    """A trained reward model as GRPO's reward (`env=reward_model`): a Ray actor scores prompt + response with the
    HF export of an `algo=rm` run (AutoModelForSequenceClassification, one label)."""

    _target_: str = "rlpost.environments.reward_model.RewardModelEnvironment"
    """Environment class."""
    model_path: str = "???"
    """The reward model's HF directory, e.g. RUN/checkpoints/step_N/policy/weights/hf of an algo=rm run."""
    chat_template: str | None = None
    """How the prompt was rendered when the reward model was trained (policy.tokenizer.chat_template of that run):
    null = the text as is, 'default' = the tokenizer's template, or a Jinja template."""
    batch_size: int = checked(32, POSITIVE)
    """Sequences per forward of the scoring actor."""
    num_cpus: float = checked(0.25, POSITIVE)
    """Ray num_cpus of the scoring actor."""

    def check(self, path: str) -> None:
        super().check(path)
        require(self.num_workers == 1, f"{path}.num_workers", self.num_workers,
                "the reward model scores in one Ray actor (batch_size sets its batches)")
        require(self.timeout_s == EnvConfig.timeout_s, f"{path}.timeout_s", self.timeout_s,
                "the reward model scores whole batches, bounded by batch_timeout_s; there is no per-sample kill")
