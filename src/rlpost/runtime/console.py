"""The lines rlpost itself prints to a person: one `rlpost: ...` line each, on stderr.

Third-party output goes to the run's train.log; what the user must see goes through here, so it
stays readable next to the progress bar (rich redirects stderr writes above a live bar).
"""

from __future__ import annotations

import logging
import sys

_log = logging.getLogger("rlpost")


def info(msg: str) -> None:
    """A one-line notice (resume, fallback, completion)."""
    print(f"rlpost: {msg}", file=sys.stderr, flush=True)
    _log.info(msg)


def warn(msg: str) -> None:
    """A one-line warning the run continues after (slow rewards, health warnings, a bad checkpoint)."""
    print(f"rlpost: warning: {msg}", file=sys.stderr, flush=True)
    _log.warning(msg)


def error(msg: str) -> None:
    """The one line a failed run ends with."""
    print(f"rlpost: error: {msg}", file=sys.stderr, flush=True)
    _log.error(msg)
