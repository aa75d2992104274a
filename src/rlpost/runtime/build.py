"""The one place that turns `_target_` strings into objects.

Every `_target_` and every other import path in a config (optimizer and scheduler names,
`custom_parallel_plan`, `_target_` keys in plain dicts, dotted strings in `vllm_kwargs`) must name a
class or function *defined* in an allowed package (ALLOWED_PACKAGES), reached without going through a
module attribute: `rlpost.runtime.checkpointing.os.system` or a foreign function imported into an rlpost
module is refused. Three levels:

- `check_target(s)`: strings only (prefix of ALLOWED_TARGET_PREFIXES, dotted Python names, no
  dunders); imports nothing.
- `verify_target(s)`: proves the path from the source files (AST, imports nothing) and falls back to
  importing the named rlpost / torch.optim module; run by `rlpost plan` and the CLI pre-flight.
- `resolve` / `build`: import and check the object itself; the last gate before anything is called.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import inspect
import keyword
import re
from collections.abc import Iterator, Sequence
from dataclasses import Field, fields, is_dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from rlpost.config.errors import ConfigError
from rlpost.config.schema.policy import DTensorConfig, PolicyConfig, PytorchOptimizerConfig

ALLOWED_TARGET_PREFIXES: tuple[str, ...] = (
    "rlpost.",
    "torch.optim.",
)
ALLOWED_PACKAGES: tuple[str, ...] = tuple(p.rstrip(".") for p in ALLOWED_TARGET_PREFIXES)
"""An object is allowed when its `__module__` is one of these or inside one."""

IMPORT_PATH = "import_path"
"""Dataclass field metadata key marking a field that names code. Values:
"value" (the field is an import path), "entry_names" (a list of mappings whose 'name' is one) and
"dotted_strings" (every dotted-name string anywhere inside the value is checked as one)."""

# Import-path fields of schemas that carry no IMPORT_PATH metadata (yet); metadata wins over this.
_DECLARED: dict[type, dict[str, str]] = {
    PytorchOptimizerConfig: {"name": "value"},
    DTensorConfig: {"custom_parallel_plan": "value"},
    PolicyConfig: {"scheduler": "entry_names"},
}

_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?::[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)?")


class Targeted(Protocol):
    """A config that names the class it builds."""

    _target_: str


def looks_like_import_path(value: str) -> bool:
    """True for 'pkg.mod.Name' / 'pkg.mod:Name' strings (what a library would import)."""
    return ("." in value or ":" in value) and _DOTTED.fullmatch(value) is not None


def _marker(obj: object, f: Field[object]) -> str | None:
    if IMPORT_PATH in f.metadata:
        return str(f.metadata[IMPORT_PATH])
    for cls in type(obj).__mro__:
        if f.name in _DECLARED.get(cls, {}):
            return _DECLARED[cls][f.name]
    return None


def _walk_targets(obj: object, path: str, dotted: bool = False) -> Iterator[tuple[str, object]]:
    """Yield (key, import path) for every `_target_` and every declared import path in a config tree."""
    if is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            value = getattr(obj, f.name)
            key = f"{path}.{f.name}" if path else f.name
            marker = _marker(obj, f)
            if f.name == "_target_" or (marker == "value" and value is not None):
                yield key, value
                continue
            if marker == "entry_names" and isinstance(value, list):
                for i, e in enumerate(value):
                    if isinstance(e, dict) and "name" in e:
                        yield f"{key}[{i}].name", e["name"]
            yield from _walk_targets(value, key, dotted or marker == "dotted_strings")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            key = f"{path}.{k}"
            if k == "_target_":
                yield key, v
            else:
                yield from _walk_targets(v, key, dotted)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk_targets(v, f"{path}[{i}]", dotted)
    elif dotted and isinstance(obj, str) and looks_like_import_path(obj):
        yield path, obj


def allowed_module(name: str) -> bool:
    """True when module `name` is one of ALLOWED_PACKAGES or inside one."""
    return any(name == p or name.startswith(p + ".") for p in ALLOWED_PACKAGES)


def check_target(key: str, target: object) -> None:
    """ConfigError unless `target` is a dotted Python name under the allow-list (strings only, no import)."""
    if not isinstance(target, str):
        raise ConfigError(key, target, "must be an import path (a string)")
    if not any(target.startswith(p) for p in ALLOWED_TARGET_PREFIXES):
        raise ConfigError(key, target, f"import path outside the _target_ allow-list {list(ALLOWED_TARGET_PREFIXES)}")
    parts = target.split(".")
    if any(not p.isidentifier() or keyword.iskeyword(p) for p in parts):
        raise ConfigError(key, target, "is not a dotted Python name (pkg.module.Name)")
    if any(p.startswith("__") and p.endswith("__") for p in parts):
        raise ConfigError(key, target, "may not name a dunder attribute")


def check_targets(cfg: object) -> None:
    """Check every import path in a (dataclass) config against the allow-list, without importing."""
    for key, target in _walk_targets(cfg, ""):
        check_target(key, target)


def verify_target(key: str, target: object) -> None:
    """`check_target`, then prove `target` names a class/function defined in an allowed package.

    Proven from the source files when possible (imports nothing); otherwise the named rlpost /
    torch.optim module is imported and `resolve`'s object checks decide.
    """
    check_target(key, target)  # a str from here on
    if not _proven_in_source(str(target)):
        _locate(str(target), key)


def verify_targets(cfg: object) -> None:
    """`check_target` on every import path of `cfg` first (nothing foreign is ever imported), then `verify_target`."""
    found = list(_walk_targets(cfg, ""))
    for key, target in found:
        check_target(key, target)
    for key, target in found:
        verify_target(key, target)


TARGET_KINDS: dict[str, tuple[str, str]] = {
    "policy._target_": ("rlpost.models.policy.interfaces.PolicyWorker", "policy worker"),
    "policy.generation._target_": ("rlpost.models.generation.interfaces.GenerationInterface", "rollout engine"),
    "loss_fn._target_": ("rlpost.losses.interface.LossFunction", "loss"),
    "env.*._target_": ("rlpost.environments.interfaces.EnvironmentInterface", "reward environment"),
}
"""What the class a `_target_` key names must be: (the interface it subclasses or implements, a short name)."""

SHIPPED_KINDS: dict[str, str] = {
    **dict.fromkeys([
        "rlpost.models.policy.dtensor_policy_worker.DTensorPolicyWorker",
        "rlpost.models.policy.dtensor_policy_worker_v2.DTensorPolicyWorkerV2",
        "rlpost.models.policy.megatron_policy_worker.MegatronPolicyWorker",
    ], "policy._target_"),
    **dict.fromkeys([
        "rlpost.models.generation.vllm_generation.VllmGeneration",
        "rlpost.models.generation.hf_generation.HFGeneration",
    ], "policy.generation._target_"),
    **dict.fromkeys([
        "rlpost.losses.clipped_pg.ClippedPGLossFn", "rlpost.losses.clipped_pg.NLLLoss",
        "rlpost.losses.cispo.CISPOLossFn", "rlpost.losses.distillation.DistillationLossFn",
        "rlpost.losses.preference.DPOLossFn", "rlpost.losses.preference.PreferenceLoss",
    ], "loss_fn._target_"),
    **dict.fromkeys([
        "rlpost.environments.synthetic.SyntheticEnvironment",
        "rlpost.environments.math_environment.MathEnvironment",
        "rlpost.environments.calculator.CalculatorEnvironment",
        "rlpost.environments.lookup.LookupEnvironment",
        "rlpost.environments.guess_game.GuessGameEnvironment",
        "rlpost.environments.reward_model.RewardModelEnvironment",
    ], "env.*._target_"),
}
"""The kind of every class conf/ ships (tests/unit/config/test_targets.py proves each by importing it): the
pre-flight takes a shipped class of the key's kind as proven, and imports only the others. A worker module
imports FSDP2, DTensor and torch.compile's machinery (1.5 s on the 2-core host): the driver would pay it before
Ray starts, only to learn what the tests already showed."""


def _kind_key(key: str) -> str | None:
    """The TARGET_KINDS key of a config key (`env.<name>._target_` is `env.*._target_`), or None."""
    if key in TARGET_KINDS:
        return key
    parts = key.split(".")
    if len(parts) == 3 and parts[0] == "env" and parts[2] == "_target_":
        return "env.*._target_"
    return None


def _missing_members(cls: type, protocol: type) -> list[str]:
    """The methods of `protocol` (a typing.Protocol) that `cls` and its bases (not `object`) do not define."""
    wanted = [n for n, v in vars(protocol).items() if callable(v) and (not n.startswith("_") or n == "__call__")]
    have = {n for c in cls.__mro__ if c is not object for n in vars(c)}
    return [n for n in wanted if n not in have]


def check_target_kind(key: str, target: str, trust_shipped: bool = True) -> None:
    """The class `target` names is what `key` builds (TARGET_KINDS): a subclass of the key's interface, or a class
    with every method of its protocol. Imports the target's module (as the run would), unless it is a shipped
    class of that kind (SHIPPED_KINDS) and `trust_shipped`."""
    kind_key = _kind_key(key)
    if kind_key is None or (trust_shipped and SHIPPED_KINDS.get(target) == kind_key):
        return
    iface_path, what = TARGET_KINDS[kind_key]
    module, _, name = iface_path.rpartition(".")
    iface = getattr(importlib.import_module(module), name)
    obj = resolve(target, key)
    how = "implementing" if _is_protocol(iface) else "a subclass of"
    expected = f"{key} names a {what} class ({how} {iface_path})"
    if not inspect.isclass(obj):
        raise ConfigError(key, target, f"is a {type(obj).__name__}, not a class; {expected}")
    if _is_protocol(iface):
        missing = _missing_members(obj, iface)
        if missing:
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            raise ConfigError(key, target, f"is not a {what} class: it has no {shown}; {expected}")
    elif not issubclass(obj, iface):
        raise ConfigError(key, target, f"is not a {what} class; {expected}")
    if inspect.isabstract(obj):
        abstract = sorted(getattr(obj, "__abstractmethods__", ()))
        raise ConfigError(key, target, f"is abstract (it leaves {', '.join(abstract)} "
                          f"undefined); {expected}")


def _is_protocol(cls: type) -> bool:
    return bool(getattr(cls, "_is_protocol", False))


def check_target_kinds(cfg: Any) -> None:
    """`check_target_kind` on every `_target_` of `cfg` that TARGET_KINDS knows (after `verify_targets`)."""
    for key, target in _walk_targets(cfg, ""):
        if isinstance(target, str):
            check_target_kind(key, target)


def resolve(target: str, key: str = "_target_") -> Any:
    """Import the class or function named by an allowed `target` (ConfigError if it is not one)."""
    return _locate(target, key)


def build(cfg: Targeted, *args: object, key: str = "_target_", **kwargs: object) -> Any:
    """Instantiate `cfg._target_` with the typed config itself as first argument: `Target(cfg, *args, **kwargs)`."""
    return resolve(cfg._target_, key)(cfg, *args, **kwargs)


# ---- import and check the object ----------------------------------------------------------------


def _root_len(target: str) -> int:
    """How many leading parts of an allowed `target` are the allowed package itself."""
    return next(len(p.split(".")) for p in ALLOWED_PACKAGES if target.startswith(p + "."))


def _import_prefix(parts: list[str], key: str, target: str) -> tuple[ModuleType, int]:
    """Import the longest module prefix of `parts` (within the allowed package); (module, its length)."""
    n = _root_len(target)
    name = ".".join(parts[:n])
    try:
        module = importlib.import_module(name)
        while n < len(parts):
            name = ".".join(parts[: n + 1])
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError as exc:
                if exc.name != name:
                    raise
                break
            n += 1
    except Exception as exc:  # noqa: BLE001 - an allowed module that fails to import
        raise ConfigError(key, target, f"cannot be imported: {type(exc).__name__}: {exc}") from None
    if getattr(module, "__name__", None) != ".".join(parts[:n]):
        raise ConfigError(key, target, f"module {'.'.join(parts[:n])} is an alias of {module.__name__}")
    return module, n


def _locate(target: str, key: str) -> Any:
    """Import `target` and check every object on its path: no module crossed, each defined where it is named."""
    check_target(key, target)
    parts = target.split(".")
    obj, n = _import_prefix(parts, key, target)
    attrs = parts[n:]
    if not attrs:
        raise ConfigError(key, target, "names a module; expected a class or function")
    for j, name in enumerate(attrs):
        here = ".".join(parts[: n + j + 1])
        try:
            obj = getattr(obj, name)
        except AttributeError:
            close = difflib.get_close_matches(name, [a for a in dir(obj) if not a.startswith("_")], n=1, cutoff=0.6)
            hint = f"did you mean '{'.'.join(parts[: n + j] + close)}'?" if close else None
            where = ".".join(parts[: n + j])
            raise ConfigError(key, target, f"cannot be imported: {where} has no attribute {name!r}", hint) from None
        if inspect.ismodule(obj):
            raise ConfigError(key, target, f"{here} is a module reached through an attribute (module {obj.__name__})")
        last = j == len(attrs) - 1
        if not last or callable(obj):
            mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
            if not (isinstance(mod, str) and allowed_module(mod)):
                raise ConfigError(
                    key, target, f"{here} is {mod}.{qual}, defined outside the allowed packages {list(ALLOWED_PACKAGES)}"
                )
            if qual != ".".join(attrs[: j + 1]):
                raise ConfigError(key, target, f"{here} is {mod}.{qual}, re-exported under another name")
            if not last and not inspect.isclass(obj):
                raise ConfigError(key, target, f"{here} is not a class; an import path goes through classes only")
        else:
            tmod = type(obj).__module__
            if tmod != "builtins" and not allowed_module(tmod):
                raise ConfigError(key, target, f"{here} is a {tmod}.{type(obj).__qualname__} object, not rlpost data")
    return obj


# ---- prove from source (no import) ---------------------------------------------------------------


def _module_file(name: str) -> Path | None:
    """Source file of module `name` (package __init__.py or module .py), found without importing."""
    parts = name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations or not spec.origin:
        return None
    dirs: Sequence[str] = list(spec.submodule_search_locations)
    file: Path | None = Path(spec.origin)
    for p in parts[1:]:
        file = None
        for d in dirs:
            if (Path(d) / p / "__init__.py").is_file():
                file, dirs = Path(d) / p / "__init__.py", [str(Path(d) / p)]
                break
            if (Path(d) / f"{p}.py").is_file():
                file, dirs = Path(d) / f"{p}.py", []
                break
        if file is None:
            return None
    return file


@lru_cache(maxsize=256)
def _parse(file: Path) -> ast.Module | None:
    try:
        return ast.parse(file.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None


def _stores(stmt: ast.stmt, name: str) -> bool:
    """True when `stmt` itself (not its nested statements) binds or deletes `name`."""
    if isinstance(stmt, (ast.Global, ast.Nonlocal)):
        return name in stmt.names
    todo = [c for c in ast.iter_child_nodes(stmt) if not isinstance(c, ast.stmt)]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load):
            return True
        if isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name == name:
            return True
        if isinstance(node, ast.MatchMapping) and node.rest == name:
            return True
        todo += [c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.stmt)]
    return False


def _bindings(body: list[ast.stmt], name: str) -> list[ast.stmt]:
    """Statements of a module/class body (through if/try/with/for/match, not into defs) that bind `name`."""
    found: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if stmt.name == name:
                found.append(stmt)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in stmt.names):
                found.append(stmt)
        else:
            if _stores(stmt, name):
                found.append(stmt)
            nested = [b for f in ("body", "orelse", "finalbody") for b in getattr(stmt, f, None) or []]
            nested += [b for h in getattr(stmt, "handlers", None) or [] for b in h.body]
            nested += [b for c in getattr(stmt, "cases", None) or [] for b in c.body]
            found += _bindings(nested, name)
    return found


def _from_module(node: ast.ImportFrom, module: str, file: Path) -> str:
    """Absolute name of the module a `from ... import` statement reads."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if file.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _defined(body: list[ast.stmt], module: str, file: Path, attrs: list[str], depth: int) -> bool:
    """True when every binding of attrs[0] in `body` is a class/def (walked into for the rest) or an
    allowed `from X import` that is itself proven."""
    if depth > 16:
        return False
    found = _bindings(body, attrs[0])
    if not found:
        return False
    for stmt in found:
        if isinstance(stmt, ast.ClassDef):
            if len(attrs) > 1 and not _defined(stmt.body, module, file, attrs[1:], depth + 1):
                return False
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if len(attrs) > 1:
                return False
        elif isinstance(stmt, ast.ImportFrom):
            alias = next(a for a in stmt.names if (a.asname or a.name) == attrs[0])
            src = _from_module(stmt, module, file)
            if not allowed_module(src) or _module_file(f"{src}.{alias.name}") is not None:
                return False  # foreign, or a submodule (a module object)
            if not _proven_at(src, [alias.name, *attrs[1:]], depth + 1):
                return False
        else:
            return False
    return True


def _proven_at(module: str, attrs: list[str], depth: int) -> bool:
    file = _module_file(module)
    tree = _parse(file) if file is not None else None
    return tree is not None and _defined(tree.body, module, file, attrs, depth)  # type: ignore[arg-type]


def _proven_in_source(target: str) -> bool:
    """True when the source files show `target` is a class/function defined in an allowed package."""
    try:
        check_target("", target)
    except ConfigError:
        return False
    parts = target.split(".")
    n = _root_len(target)
    while n < len(parts) and _module_file(".".join(parts[: n + 1])) is not None:
        n += 1
    module = ".".join(parts[:n])
    if n == len(parts) or not allowed_module(module):
        return False
    return _proven_at(module, parts[n:], 0)
