"""The one error type a bad config raises, and the helper the schemas use to raise it."""

from __future__ import annotations

import sys
from typing import Any


class ConfigError(ValueError):
    """A config value breaks a rule. Carries the dotted key, the bad value and the rule."""

    def __init__(self, key: str, value: Any, rule: str, hint: str | None = None) -> None:
        self.key = key
        self.value = value
        self.rule = rule
        self.hint = hint
        msg = f"{key}={value!r}: {rule}"
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)

    def __reduce__(self) -> tuple:
        # Picklable with its fields, so it survives the trip from a Ray worker to the driver.
        return (type(self), (self.key, self.value, self.rule, self.hint))


def require(cond: bool, key: str, value: Any, rule: str, hint: str | None = None) -> None:
    """Raise ConfigError(key, value, rule) unless `cond` holds."""
    if not cond:
        raise ConfigError(key, value, rule, hint)


def one_of(key: str, value: Any, allowed: tuple[Any, ...] | list[Any]) -> None:
    """Require `value` to be one of `allowed`."""
    require(value in allowed, key, value, f"must be one of {list(allowed)}")


def positive(key: str, value: float | int | None, allow_none: bool = False) -> None:
    """Require `value` > 0 (or None when allowed)."""
    if value is None and allow_none:
        return
    require(value is not None and value > 0, key, value, "must be > 0")


def non_negative(key: str, value: float | int | None) -> None:
    """Require `value` >= 0."""
    require(value is not None and value >= 0, key, value, "must be >= 0")


def report_config_error(err: ConfigError, job: list[str] | None = None) -> None:
    """One clear message on stderr: key, value, rule (and hint)."""
    where = f" (job: {' '.join(job)})" if job else ""
    msg = f"rlpost: config error{where}: {err.key}={err.value!r}: {err.rule}"
    if err.hint:
        msg += f"\n  hint: {err.hint}"
    print(msg, file=sys.stderr)
