"""The PolicyWorker Protocol is the contract between the Policy facade and the worker families.

Both families implement every method with the Protocol's parameters, and the facade calls (by name, through
RayWorkerGroup, as `PolicyWorker.<method>`) only methods the Protocol declares: a method renamed or added on one side fails here, not in a
Ray actor at run time.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from rlpost.models.policy import lm_policy
from rlpost.models.policy.dtensor_policy_worker import DTensorPolicyWorker
from rlpost.models.policy.dtensor_policy_worker_v2 import DTensorPolicyWorkerV2
from rlpost.models.policy.interfaces import PolicyWorker
from rlpost.models.policy.megatron_policy_worker import MegatronPolicyWorker
from tests.unit.models.contracts import params, protocol_methods

CONTRACT = protocol_methods(PolicyWorker)
CALLERS = ("run_all", "run_rank0", "run_sharded", "submit_sharded", "call_async", "submit", "_logprob_call")




@pytest.mark.parametrize("worker", [DTensorPolicyWorker, DTensorPolicyWorkerV2, MegatronPolicyWorker],
                         ids=lambda c: c.__name__)
def test_every_worker_family_implements_the_contract(worker: type) -> None:
    assert len(CONTRACT) >= 20
    for name in sorted(CONTRACT):
        impl = getattr(worker, name, None)
        assert callable(impl), f"{worker.__name__} has no {name}"
        assert params(impl) == params(getattr(PolicyWorker, name)), f"{worker.__name__}.{name} signature"


def test_the_facade_calls_only_contract_methods() -> None:
    tree = ast.parse(Path(inspect.getfile(lm_policy)).read_text())
    called: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            for arg in node.args[:2] if node.func.attr in CALLERS else []:  # submit(rank, PolicyWorker.<method>)
                if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "PolicyWorker":
                    called.add(arg.attr)  # run_all(PolicyWorker.<method>, ...)
            if node.func.attr == "remote" and isinstance(node.func.value, ast.Attribute):
                called.add(node.func.value.attr)  # w.<method>.remote(...)
            target = node.func.value
            if (node.func.attr == "remote" and isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute)
                    and target.func.attr == "options" and isinstance(target.func.value, ast.Attribute)):
                called.add(target.func.value.attr)  # w.<method>.options(...).remote(...)
        if isinstance(node, ast.keyword) and node.arg == "graceful_method":  # PolicyWorker.shutdown if graceful ...
            called |= {c.attr for c in ast.walk(node.value) if isinstance(c, ast.Attribute)}
    assert {"train", "get_logprobs", "put_export_bucket", "broadcast_weights_collective", "broadcast_staged",
            "shutdown"} <= called
    unknown = sorted(called - CONTRACT)
    assert not unknown, f"called but not in PolicyWorker: {unknown}"
    assert CONTRACT <= called, f"in PolicyWorker but never called: {sorted(CONTRACT - called)}"
