"""What the worker and engine contract tests share: a protocol's methods and a method's parameter names."""

from __future__ import annotations

import inspect


def protocol_methods(protocol: type) -> set[str]:
    """The public methods a protocol declares."""
    return {name for name, v in vars(protocol).items() if inspect.isfunction(v) and not name.startswith("_")}


def params(fn: object) -> list[str]:
    """A method's parameter names (ray.remote on a class adds a tracing keyword to its methods in place: left out)."""
    fn = inspect.unwrap(fn)  # type: ignore[arg-type]
    return [p.name for p in inspect.signature(fn).parameters.values() if p.name != "_ray_trace_ctx"]
