"""Schemas: seed names at NeMo RL's paths, a docstring under every field, torch-free modules."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import rlpost.config.schema as schema_pkg

SCHEMA_DIR = Path(schema_pkg.__file__).parent


def test_seed_names_importable_at_mirrored_paths() -> None:
    from rlpost.algorithms.grpo import (  # noqa: F401
        GRPOConfig,
        GRPOLoggerConfig,
        GRPOSaveState,
        MasterConfig,
        _should_use_async_rollouts,
    )
    from rlpost.models.policy import (  # noqa: F401
        DTensorConfig,
        DynamicBatchingConfig,
        MegatronConfig,
        MegatronDDPConfig,
        MegatronOptimizerConfig,
        MegatronSchedulerConfig,
        PolicyConfig,
        PytorchOptimizerConfig,
        RewardModelConfig,
        SchedulerMilestones,
        SequencePackingConfig,
        SinglePytorchSchedulerConfig,
        TokenizerConfig,
    )

    for cls in (PolicyConfig, GRPOConfig, MasterConfig, MegatronConfig, GRPOLoggerConfig):
        assert dataclasses.is_dataclass(cls)


def _fields_without_docstring(path: Path) -> list[str]:
    missing = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                ok = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)
                if not ok:
                    missing.append(f"{path.name}:{node.name}.{stmt.target.id}")
    return missing


@pytest.mark.parametrize("path", sorted(SCHEMA_DIR.glob("*.py")), ids=lambda p: p.name)
def test_every_field_has_a_docstring(path: Path) -> None:
    assert _fields_without_docstring(path) == []


def test_schema_and_cli_import_no_heavy_module() -> None:
    code = (
        "import sys, rlpost.config.schema.master, rlpost.config.load, rlpost.cli, rlpost.models.policy, "
        "rlpost.plan, rlpost.runtime.build;"
        "print(sorted(m for m in ('torch', 'ray', 'vllm', 'megatron', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_save_state_roundtrip_tolerates_extra_keys() -> None:
    from rlpost.algorithms.grpo import GRPOSaveState

    s = GRPOSaveState.from_dict({"total_steps": 3, "val:accuracy": 0.5, "unknown": 1})
    assert s.total_steps == 3 and s.extra == {"val:accuracy": 0.5, "unknown": 1}
    assert GRPOSaveState.from_dict(s.to_dict()) == s
    assert GRPOSaveState.from_dict({}).current_step == 0
