"""Where the benchmark scripts keep what they measured: a JSON list per script (results/<script>.json by default),
each run appended to it, so a file holds the history of its runs on this host."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def append_result(path: str | Path, result: dict[str, Any]) -> Path:
    """Append `result` to the JSON list at `path` (created with its folders if missing); prints where it went."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    history = json.loads(out.read_text()) if out.is_file() else []
    out.write_text(json.dumps([*history, result], indent=1))
    print(f"saved to {out}")
    return out
