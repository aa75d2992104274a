"""Every tensor collective in src/rlpost goes through rlpost.distributed.collective_device, except where the tensor
is the model's own (its parameters, logits or outputs, already on the device the group serves).

A tensor the code builds itself (a count, a loss sum, a metric vector) defaults to the CPU: all-reduced over an NCCL
group it fails at the first step on a GPU, while every CPU test passes (gloo takes CPU tensors). The helper places
such a tensor on the group's device (tests/unit/distributed/test_collective_device.py); this scan keeps the raw
`dist.<collective>(tensor)` calls to the modules listed below, each with the reason its tensors are safe.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "rlpost"

TENSOR_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                      "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter"}
"""torch.distributed calls that dispatch on their tensors' device (the *_object ones pick their device themselves)."""

MODEL_TENSORS = {
    "distributed/collective_device.py": "the helper itself",
    "ops/logprobs.py": "max / sum-exp / picked logit of the logits, on the logits' device",
    "ops/chunked_head.py": "picked logit of each chunk's logits and the hidden states' gradient, on the hidden "
                           "states' device",
    "models/megatron/export.py": "the model's parameter shards and empty_like buffers of them",
    "models/megatron/model.py": "the model's forward output, or an empty buffer on the model's device",
}
"""Modules allowed a raw tensor collective, and why their tensors already live on the group's device."""


def _raw_collectives(tree: ast.AST) -> list[tuple[str, int]]:
    """(collective, line) for each `dist.<collective>(...)` / `torch.distributed.<collective>(...)` call."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in TENSOR_COLLECTIVES:
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed"):
                found.append((node.func.attr, node.lineno))
    return found


def test_tensors_built_for_a_collective_go_through_collective_device() -> None:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in MODEL_TENSORS:
            continue
        for name, line in _raw_collectives(ast.parse(path.read_text(), str(path))):
            offenders.append(f"src/rlpost/{rel}:{line}: dist.{name}")
    assert not offenders, (
        "build the tensor on rlpost.distributed.collective_device.collective_device(group), or reduce it with "
        "its all_reduce / all_reduce_floats:\n" + "\n".join(offenders)
    )


def test_the_allowed_modules_still_call_a_raw_collective() -> None:
    """An entry whose module no longer calls one is stale: drop it, so the list stays the exceptions that exist."""
    stale = [rel for rel in MODEL_TENSORS if not _raw_collectives(ast.parse((SRC / rel).read_text()))]
    assert not stale, stale
