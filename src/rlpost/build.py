"""The one place that turns `_target_` strings into objects.

Every `_target_` (and every optimizer / scheduler import path) must start with a prefix of
ALLOWED_TARGET_PREFIXES: a config must not be a way to run arbitrary code. The check on strings
(`check_targets`) is torch-free and runs before anything heavy; `resolve` and `build` import.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, Iterator, Tuple

from rlpost.config.errors import ConfigError

ALLOWED_TARGET_PREFIXES: Tuple[str, ...] = (
    "rlpost.",
    "torch.optim.",
)


def _walk_targets(obj: Any, path: str) -> Iterator[Tuple[str, str]]:
    """Yield (key, import path) for every `_target_` and optimizer/scheduler name in a config tree."""
    if is_dataclass(obj):
        for f in fields(obj):
            value = getattr(obj, f.name)
            key = f"{path}.{f.name}" if path else f.name
            if f.name == "_target_" and isinstance(value, str):
                yield key, value
            else:
                yield from _walk_targets(value, key)
        if type(obj).__name__ == "PytorchOptimizerConfig":
            yield f"{path}.name", obj.name
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk_targets(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            key = f"{path}[{i}]"
            if isinstance(v, dict) and isinstance(v.get("name"), str) and path.endswith("scheduler"):
                yield f"{key}.name", v["name"]
            yield from _walk_targets(v, key)


def check_target(key: str, target: str) -> None:
    """ConfigError unless `target` is under the allow-list."""
    if not any(target.startswith(p) for p in ALLOWED_TARGET_PREFIXES):
        raise ConfigError(key, target, f"import path outside the _target_ allow-list {list(ALLOWED_TARGET_PREFIXES)}")


def check_targets(cfg: Any) -> None:
    """Check every import path in a (dataclass) config against the allow-list, without importing."""
    for key, target in _walk_targets(cfg, ""):
        check_target(key, target)


def resolve(target: str, key: str = "_target_") -> Any:
    """Import the class or function named by an allowed `target`."""
    from hydra.utils import get_object

    check_target(key, target)
    try:
        return get_object(target)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(key, target, f"cannot be imported: {exc}") from None


def build(cfg: Any, *args: Any, key: str = "_target_", **kwargs: Any) -> Any:
    """Instantiate `cfg._target_` with the typed config itself as first argument: `Target(cfg, *args, **kwargs)`."""
    return resolve(cfg._target_, key)(cfg, *args, **kwargs)
