"""rlpost.checks: every command runs one table of checks in one order, each the scopes it can judge, so a fault
gets the same line from `rlpost plan`, `train`, `eval` and `launch`, and no command keeps a sequence of its own."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

import rlpost
from rlpost.checks import CHECKS, JOB, LAUNCH, PLAN, TRAIN
from rlpost.cli import main
from rlpost.launch.command import check as launch_check

SRC = Path(rlpost.__file__).parent
LORA_TYPO = ["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.target_modules=[q_prj]"]
"""A config-scope fault: LoRA names no layer of the model (judged from its config.json)."""
PRECISION = ["cluster.device=cpu", "policy.precision=bfloat16"]
"""A config-scope fault judged after LoRA's: bf16 training on CPU."""
KWARG_TYPO = ["+policy.optimizer.kwargs.lrr=0.1"]
"""A files-scope fault: the optimizer class has no such argument (judged by importing it)."""


def _commands(run_dir: Path) -> dict[str, Callable[[list[str]], int]]:
    return {
        "plan": lambda o: main(["plan", *o]),
        "train": lambda o: main(["train", *o]),
        "eval": lambda o: main(["eval", *o]),
        "launch": lambda o: launch_check(o, run_dir),
    }


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_fault_gets_the_same_line_from_every_command_that_judges_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    commands = _commands(tmp_path / "run")
    both = {name: (run(PRECISION + LORA_TYPO + KWARG_TYPO), _error_line(capsys)) for name, run in commands.items()}
    assert {rc for rc, _ in both.values()} == {2}
    assert len({line for _, line in both.values()}) == 1, both  # the first fault in CHECKS' order, everywhere
    assert "target_modules=['q_prj']: names no linear layer" in both["plan"][1]

    files = {name: run(KWARG_TYPO) for name, run in commands.items()}
    assert files["plan"] == 0  # plan judges the config alone
    capsys.readouterr()
    lines = {name: (run(KWARG_TYPO), _error_line(capsys)) for name, run in commands.items() if name != "plan"}
    assert len(set(lines.values())) == 1 and "policy.optimizer.kwargs.lrr" in lines["train"][1], lines


def test_the_scopes_of_each_command() -> None:
    assert PLAN.scopes == {"config"} and JOB.scopes == {"config", "outputs"}
    assert LAUNCH.scopes == TRAIN.scopes - {"host"} and not LAUNCH.here  # a launched job's host is its node
    assert {c.scope for c in CHECKS} == TRAIN.scopes


def _checks_functions() -> set[str]:
    """The check functions rlpost.checks runs (what it imports from the modules that define them)."""
    tree = ast.parse((SRC / "checks.py").read_text())
    return {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            for alias in node.names if (alias.asname or alias.name).startswith(("check_", "verify_", "addon_"))}


def test_no_command_runs_a_check_outside_the_table() -> None:
    names = _checks_functions()
    assert {"check_model_dir", "check_optimizer", "check_targets", "check_output_dirs", "check_data"} <= names
    calls = []
    for path in SRC.rglob("*.py"):
        if path.name == "checks.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
                calls.append(f"{path.relative_to(SRC)}:{node.lineno} {node.func.id}")
    # the one helper a check shares with another: the chat template's value, read by both data checks
    assert calls == [f"preflight_data.py:{_line('preflight_data.py', 'check_chat_template_value(master)')} "
                     "check_chat_template_value"], calls


def _line(file: str, text: str) -> int:
    return next(i for i, ln in enumerate((SRC / file).read_text().splitlines(), 1) if text in ln and "def " not in ln)
