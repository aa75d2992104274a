"""Field rules: a schema field declares its range where it is defined.

    max_num_steps: int = checked(100, POSITIVE)
    top_p: float = checked(1.0, within("(0, 1]"))
    device: str = checked("auto", options("auto", "cpu", "cuda"))

`Block.check(path)` runs the declared rule of every field of a block, naming `path.field` in the ConfigError; a
block's own `check` adds the rules that span fields after `super().check(path)`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from rlpost.config.errors import ConfigError

T = TypeVar("T")

RULE = "rlpost_rule"
"""Dataclass field metadata key holding a field's `Rule`."""


@dataclass(frozen=True)
class Rule:
    """A test of one value, and the rule a failing value breaks ("must be > 0")."""

    test: Callable[[Any], bool]
    text: str
    allow_none: bool = False
    """None passes (an unset optional value)."""

    def __call__(self, key: str, value: object) -> None:
        if value is None and self.allow_none:
            return
        if value is None or not self.test(value):
            raise ConfigError(key, value, self.text)


POSITIVE = Rule(lambda v: v > 0, "must be > 0")
POSITIVE_OR_NONE = Rule(lambda v: v > 0, "must be > 0", allow_none=True)
NON_NEGATIVE = Rule(lambda v: v >= 0, "must be >= 0")
SEED = Rule(lambda v: 0 <= v < 2**32, "must be a seed in [0, 2**32 - 1] (what numpy, torch and vLLM all take)")


def options(*allowed: object, allow_none: bool = False) -> Rule:
    """The value is one of `allowed` (or None when `allow_none`)."""
    return Rule(lambda v: v in allowed, f"must be one of {list(allowed)}", allow_none)


def within(interval: str) -> Rule:
    """The value lies in `interval`, written as in mathematics: "[0, 1)", "(0, 1]"."""
    lo_s, hi_s = interval[1:-1].split(",")
    lo, hi = float(lo_s), float(hi_s)
    above = operator.ge if interval[0] == "[" else operator.gt
    below = operator.le if interval[-1] == "]" else operator.lt
    return Rule(lambda v: above(v, lo) and below(v, hi), f"must be in {interval}")


def checked(default: T, rule: Rule) -> T:
    """A dataclass field with an immutable `default` whose values must pass `rule`."""
    value: Any = field(default=default, metadata={RULE: rule})
    return value  # a dataclasses.Field, typed as the value it defaults to (as dataclasses.field is)


def check_fields(block: Any, path: str) -> None:
    """Run the declared rule of every field of the dataclass `block`, found at `path`."""
    for f in fields(block):
        rule = f.metadata.get(RULE)
        if rule is not None:
            rule(f"{path}.{f.name}", getattr(block, f.name))


class Block:
    """A config block whose `check(path)` runs its fields' declared rules; subclasses extend it."""

    def check(self, path: str) -> None:
        check_fields(self, path)
