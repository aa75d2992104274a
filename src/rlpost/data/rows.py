"""The row types the data layer hands on: a prompt row (GRPO, eval) and the supervised rows (SFT, preference)."""

from __future__ import annotations

from typing import Required, TypedDict, final


class PromptRow(TypedDict, total=False):
    """One prompt: what a data file or synthetic task gives, its environment, and once `PromptProcessor` has
    tokenized it its prompt ids. The environment reads the row as its metadata."""

    problem: Required[str]
    """The prompt text (data.input_key)."""
    expected_answer: Required[str]
    """The ground truth the environment scores against (data.output_key)."""
    env_name: str
    """The `env` entry that scores this row (data.env_name)."""
    source: str
    """Where the row came from ('file:line'), when read with_source."""
    key: str
    """lookup task: the key the model must ask for."""
    table: str
    """lookup task: the row's secret table (one digit per key)."""
    prompt_ids: list[int]
    """Tokenized prompt, at most data.max_input_seq_length ids."""
    loss_multiplier: float
    """0.0 for a truncated prompt (masked out of the loss), else 1.0."""
    too_long: bool
    """The prompt was truncated to data.max_input_seq_length."""


Message = dict[str, str]
"""{'role': 'system' | 'user' | 'assistant', 'content': text}."""


@final
class SFTRow(TypedDict):
    """A checked SFT conversation: [system] user assistant (user assistant)*, ending with the assistant."""

    messages: list[Message]
    source: str


@final
class PreferenceRow(TypedDict):
    """A checked preference pair: the prompt conversation (ending with the user) and two different replies."""

    prompt: list[Message]
    chosen: str
    rejected: str
    source: str
