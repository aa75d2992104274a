"""The engine actors' environment: with enforce_eager nothing is compiled, vLLM's sampler helper included."""

from __future__ import annotations

import os
import subprocess
import sys

from rlpost.config.schema.generation import VllmSpecificArgs
from rlpost.models.generation.vllm_generation import VLLM_ENGINE_ENV, engine_env

_CHECK = """
import torch
from vllm.v1.sample.ops.logprobs import batched_count_greater_than
x = torch.tensor([[0.5, 2.0, -1.0], [3.0, 1.0, 2.0]])
ranks = batched_count_greater_than(x, x[:, :1])
assert ranks.tolist() == [2, 1], ranks
from torch._dynamo.utils import counters
print("graphs", sum(counters["stats"].values()))
"""


def test_an_eager_engine_compiles_nothing() -> None:
    eager = engine_env(VllmSpecificArgs(enforce_eager=True), on_gpu=False)
    assert eager == {**VLLM_ENGINE_ENV, "TORCHDYNAMO_DISABLE": "1"}
    assert "TORCHDYNAMO_DISABLE" not in engine_env(VllmSpecificArgs(enforce_eager=False), on_gpu=False)  # compiled
    assert "TORCHDYNAMO_DISABLE" not in engine_env(VllmSpecificArgs(enforce_eager=True), on_gpu=True)  # GB-sized mask
    # the helper vLLM's sampler compiles runs eagerly under that environment, with the same values
    out = subprocess.run([sys.executable, "-c", _CHECK], env={**os.environ, **eager, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("graphs 0"), out.stdout
