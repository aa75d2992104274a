"""Algorithms are units (rlpost.config.algorithms): outside an algorithm's own files, no code asks whether its block
is set. The shared machinery (config loading, plan, pre-flight, setup, loop, runner) asks the registry instead.

The scan reads every comparison with None in src/rlpost whose other side names a block: `x.ppo is not None`,
`getattr(cfg, "critic") is None`, `cfg.get("sft") is not None`. A block's own files are its algorithms' (and its
add-on's): the code module the registry names, and config/schema/<name>.py, config/algorithms/<name>.py.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from rlpost.config.algorithms import ADDONS, ALGORITHMS, all_blocks, readers

SRC = Path(__file__).resolve().parents[2] / "src" / "rlpost"


def _module_file(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(spec.origin).resolve()


def _own_files(block: str) -> set[Path]:
    """The files of the algorithms that own `block` (not those that merely read GRPO's or an add-on's block)."""
    owners = [a for a in ALGORITHMS.values() if a.blocks and block in a.blocks and
              (block != "grpo" or a.name == "grpo")]
    files = {_module_file(a.unit) for a in owners}
    for name in [a.name for a in owners] + [block]:
        files |= {p.resolve() for p in (SRC / "config" / "schema" / f"{name}.py",
                                        SRC / "config" / "algorithms" / f"{name}.py") if p.exists()}
    if block in ADDONS:
        files.add(_module_file(ADDONS[block].unit))
    if block in ("sft", "dpo", "rm"):
        files |= {(SRC / "config" / "schema" / f).resolve() for f in ("supervised.py", "supervised_master.py")}
    return files


def _named_block(node: ast.expr, blocks: set[str]) -> str | None:
    """The block `node` reads: `x.<block>`, `getattr(x, "<block>")`, `x.get("<block>")`."""
    if isinstance(node, ast.Attribute) and node.attr in blocks:
        return node.attr
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        is_lookup = (isinstance(func, ast.Name) and func.id == "getattr") or (
            isinstance(func, ast.Attribute) and func.attr == "get")
        key = node.args[1] if isinstance(func, ast.Name) and len(node.args) > 1 else node.args[0]
        if is_lookup and isinstance(key, ast.Constant) and key.value in blocks:
            return str(key.value)
    return None


def block_tests(root: Path = SRC) -> list[tuple[str, str, int]]:
    """(block, file, line) of every `is None` / `is not None` test of an algorithm's block outside its unit."""
    blocks = set(all_blocks())
    own = {b: _own_files(b) for b in blocks}
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Compare) and len(node.ops) == 1
                    and isinstance(node.ops[0], ast.Is | ast.IsNot)):
                continue
            sides = [node.left, node.comparators[0]]
            if not any(isinstance(s, ast.Constant) and s.value is None for s in sides):
                continue
            for side in sides:
                block = _named_block(side, blocks)
                if block is not None and path.resolve() not in own[block]:
                    found.append((block, str(path.relative_to(root.parent)), node.lineno))
    return found


def test_no_code_outside_an_algorithm_asks_whether_its_block_is_set() -> None:
    assert block_tests() == []


def test_the_scan_finds_a_block_test_outside_its_unit(tmp_path: Path) -> None:
    """The scan is not blind: each way of asking is found in a file that is no unit's."""
    (tmp_path / "rlpost").mkdir()
    (tmp_path / "rlpost" / "shared.py").write_text(
        "def f(cfg):\n"
        "    if cfg.ppo is not None:\n"
        "        pass\n"
        "    if getattr(cfg, 'critic') is None:\n"
        "        pass\n"
        "    return cfg.get('sft') is not None or None is cfg.distillation\n")
    found = block_tests(tmp_path / "rlpost")
    assert sorted((b, line) for b, _, line in found) == [
        ("critic", 4), ("distillation", 6), ("ppo", 2), ("sft", 6)]


def test_every_block_has_a_reader_and_every_unit_imports() -> None:
    """Each block is read by some algorithm, each algorithm's code module has its UNIT (rollout) or loop
    (supervised), and each add-on's module builds its side group."""
    for block in all_blocks():
        assert readers(block), block
    for algo in ALGORITHMS.values():
        module = importlib.import_module(algo.unit)
        assert hasattr(module, "UNIT" if algo.rollout else "supervised_loop"), algo.unit
    for addon in ADDONS.values():
        assert callable(importlib.import_module(addon.unit).side_group)
