"""The one error type a bad config raises, and the helper the schemas use to raise it."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable, Mapping


class ConfigError(ValueError):
    """A config value breaks a rule. Carries the dotted key, the bad value and the rule."""

    def __init__(self, key: str, value: object, rule: str, hint: str | None = None) -> None:
        self.key = key
        self.value = value
        self.rule = rule
        self.hint = hint
        msg = f"{key}={value!r}: {rule}"
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, object, str, str | None]]:
        # Picklable with its fields, so it survives the trip from a Ray worker to the driver.
        return (type(self), (self.key, self.value, self.rule, self.hint))


def did_you_mean(word: str, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The hint naming the choice closest to `word` ("did you mean 'x'?"), or None when none is as close as
    `cutoff` (difflib's ratio)."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return f"did you mean {match[0]!r}?" if match else None


def require(cond: bool, key: str, value: object, rule: str, hint: str | None = None) -> None:
    """Raise ConfigError(key, value, rule) unless `cond` holds."""
    if not cond:
        raise ConfigError(key, value, rule, hint)


def format_config_error(err: ConfigError, job: list[str] | None = None) -> str:
    """The message for `err`: key, value, rule (and the hint on a second line)."""
    where = f" (job: {' '.join(job)})" if job else ""
    msg = f"rlpost: config error{where}: {err.key}={err.value!r}: {err.rule}"
    if err.hint:
        msg += f"\n  hint: {err.hint}"
    return msg


def report_config_error(err: ConfigError, job: list[str] | None = None) -> None:
    """One clear message on stderr: key, value, rule (and hint)."""
    print(format_config_error(err, job), file=sys.stderr)


LOADER_ENV_VARS = frozenset({
    "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONBREAKPOINT", "PYTHONINSPECT",
    "PYTHONEXECUTABLE", "PYTHONSAFEPATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "DYLD_INSERT_LIBRARIES",
})
"""Variables that make a process load code from a path: a config must not set them for workers."""


def safe_env_vars(key: str, env: Mapping[str, object]) -> None:
    """Refuse environment variables that would make worker processes import or preload other code."""
    for name in env:
        require(str(name).upper() not in LOADER_ENV_VARS, f"{key}.{name}", env[name],
                "this variable makes worker processes load code from a path; set it in the shell that "
                "starts rlpost instead, where you own it")
