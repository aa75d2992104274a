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


_IPC_RPC = """
import os, sys
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
# a refit bucket's CUDA IPC descriptor, as AsyncLLM.collective_rpc carries it to the engine core's workers
box = {"cuda_ipc": (rebuild_cuda_tensor, (torch.Tensor, (4,), (1,), 0, torch.uint8)), "device_uuid": "GPU-0",
       "records": [("w", 0, (2,), "float32")]}
for env in (dict(os.environ), {**os.environ, **eval(sys.argv[1])}):  # vLLM reads the variable when it is used
    os.environ.clear()
    os.environ.update(env)
    try:
        back = MsgpackDecoder().decode(MsgpackEncoder().encode(("rlpost_load_bucket_ipc", (box, None))))
    except TypeError as exc:
        print("refused:", exc)
    else:
        fn, args = back[1][0]["cuda_ipc"]
        print("carried", fn is rebuild_cuda_tensor and args[-1] is torch.uint8)
"""


def test_the_async_engine_lets_a_cuda_ipc_descriptor_through_vllms_rpc() -> None:
    """vLLM's msgspec RPC (AsyncLLM's path to its engine core) refuses the CUDA IPC descriptor of a refit bucket
    unless VLLM_ALLOW_INSECURE_SERIALIZATION is set, which the async engine's environment does."""
    sync_env = engine_env(VllmSpecificArgs(async_engine=False), on_gpu=True)
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in sync_env  # its tensors never cross vLLM's RPC
    clean = {k: v for k, v in os.environ.items() if k != "VLLM_ALLOW_INSECURE_SERIALIZATION"}
    async_env = engine_env(VllmSpecificArgs(async_engine=True), on_gpu=True)
    out = subprocess.run([sys.executable, "-c", _IPC_RPC, repr(async_env)],
                         env={**clean, **sync_env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    without, with_it = out.stdout.strip().splitlines()[-2:]
    assert without.startswith("refused:") and with_it == "carried True"
