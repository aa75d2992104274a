"""Import layering (DESIGN §3b): packages import only to their left, interfaces are leaves.

Order, left to right:

    config → runtime → data → distributed → ops → losses → environments → models → algorithms → app → report → launch → cli

`runtime/` holds the run-time services every layer may use (console lines, the run log, `_target_`
resolution, timers, checkpoint files, metrics); `ops/` the tensor ops shared by workers and losses; `losses/` every loss and the interface the workers call it through;
"app" is every module directly under `rlpost/` (train, runner, preflight, plan, ...) but `cli`, the console script
that dispatches to all of them, `report/` (`rlpost report`, which reads what the app wrote) and `launch/` (`rlpost
launch`) included. Every
import counts: the lazy ones inside functions and those under `if TYPE_CHECKING:` too (an annotation
that names a class is a dependency on it).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "rlpost"
ORDER = ["config", "runtime", "data", "distributed", "ops", "losses", "environments", "models", "algorithms", "app", "report",
         "launch", "cli"]


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    path = SRC.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _layer(module: str) -> str:
    parts = module.split(".")
    if module == "rlpost.cli":
        return "cli"
    if len(parts) == 1 or (len(parts) == 2 and (SRC / f"{parts[1]}.py").exists()):
        return "app"
    return parts[1]


def _imports(tree: ast.AST, package: str) -> Iterator[tuple[str, int]]:
    """(imported rlpost module, line) for every import statement in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "rlpost")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "rlpost":
                for alias in node.names:  # `from rlpost.runtime import console` imports a module
                    sub = f"{target}.{alias.name}"
                    yield (sub if _is_module(sub) else target), node.lineno


def _edges() -> list[tuple[str, str, int]]:
    edges = []
    for path in sorted(SRC.rglob("*.py")):
        module = _module(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for target, line in _imports(ast.parse(path.read_text()), package):
            edges.append((module, target, line))
    return edges


EDGES = _edges()


def test_the_scan_sees_the_imports_it_must_judge() -> None:
    # Guards the scanner itself: known imports of each kind are found.
    found = {(a, b) for a, b, _ in EDGES}
    assert ("rlpost.cli", "rlpost.train") in found  # lazy, inside a function
    assert ("rlpost.algorithms.grpo", "rlpost.runtime.console") in found  # `from rlpost.runtime import console`
    assert len(EDGES) > 200


def test_every_package_imports_only_to_its_left() -> None:
    upward = []
    for module, target, line in EDGES:
        src, dst = _layer(module), _layer(target)
        assert src in ORDER and dst in ORDER, f"{module} or {target} is in no layer of {ORDER}"
        if ORDER.index(dst) > ORDER.index(src):
            upward.append(f"{module}:{line} imports {target} ({src} -> {dst})")
    assert not upward, "imports that run against the layer order:\n" + "\n".join(upward)


def test_config_imports_nothing_heavy() -> None:
    heavy = ("torch", "vllm", "megatron", "ray", "transformers")
    bad = []
    for path in (SRC / "config").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] in heavy]
    assert not bad


@pytest.mark.parametrize("interfaces", sorted(p for p in SRC.rglob("interfaces.py")), ids=lambda p: _module(p))
def test_interfaces_modules_are_leaves(interfaces: Path) -> None:
    # A leaf names only data types: config schemas, the batch container, other interfaces.
    module = _module(interfaces)
    allowed = ("rlpost.config", "rlpost.distributed.batched_data_dict", "rlpost.losses.interface")
    deps = [t for m, t, _ in EDGES
            if m == module and not t.startswith(allowed) and not t.endswith(".interfaces")]
    assert not deps, f"{module} imports {deps}"


def test_workers_and_engines_never_meet_and_never_import_algorithms() -> None:
    bad = []
    for module, target, line in EDGES:
        if module.startswith("rlpost.models.") and target.startswith("rlpost.algorithms"):
            bad.append(f"{module}:{line} -> {target}")
        if module.startswith("rlpost.models.generation") and target.startswith(("rlpost.models.policy",
                                                                                 "rlpost.models.dtensor",
                                                                                 "rlpost.models.megatron")):
            bad.append(f"{module}:{line} -> {target}")
        if module.startswith(("rlpost.models.policy", "rlpost.models.dtensor", "rlpost.models.megatron")) \
                and target.startswith("rlpost.models.generation"):
            bad.append(f"{module}:{line} -> {target}")
    assert not bad, "\n".join(bad)


def test_no_import_circle_between_two_files() -> None:
    # A module's own package __init__ does not count (Python runs it first anyway).
    pairs = {(a, b) for a, b, _ in EDGES if a != b}
    circles = sorted({tuple(sorted((a, b))) for a, b in pairs if (b, a) in pairs})
    assert not circles, f"two-file import circles: {circles}"
