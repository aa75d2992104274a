"""The reference pass leaves the policy's weights exactly as they were, tied embeddings included
(one storage under two names used to be restored twice, the second time with the reference value)."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One world-size-1 DTensor worker on the tied tiny model, with a reference model."""
    import torch.distributed as dist

    from rlpost.config.load import load_master_config
    from rlpost.config.schema.model import TinyModelConfig
    from rlpost.models.policy.dtensor_policy_worker import DTensorPolicyWorker
    from rlpost.models.tiny import ensure_tiny_model

    mp = pytest.MonkeyPatch()
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                 "RLPOST_DEVICE": "cpu"}.items():
        mp.setenv(k, v)
    threads = torch.get_num_threads()
    model_dir: Path = ensure_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("models") / "tiny")
    _, cfg = load_master_config(["cluster.gpus_per_node=1"])
    cfg_p = dataclasses.replace(cfg.policy, model_name=str(model_dir))
    cfg_p.tokenizer.name = str(model_dir)
    try:
        yield DTensorPolicyWorker(cfg_p, init_reference_model=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)
        mp.undo()


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def test_reference_logprobs_leave_the_trained_weights_untouched(worker: Any) -> None:
    from rlpost.distributed.batched_data_dict import BatchedDataDict

    assert worker.model.config.tie_word_embeddings
    with torch.no_grad():  # "training" moved every weight away from the reference
        for p in worker.model.parameters():
            _local(p).add_(0.01)
    before = {n: _local(p).detach().clone() for n, p in worker.model.named_parameters()}
    ids = torch.randint(3, 300, (4, 8), generator=torch.Generator().manual_seed(0))
    data = BatchedDataDict(input_ids=ids, input_lengths=torch.full((4,), 8))
    lp_now = worker.get_logprobs(data)["logprobs"]
    ref = worker.get_reference_policy_logprobs(data)["reference_logprobs"]
    assert not torch.allclose(ref, lp_now)  # the reference really is another model
    for n, p in worker.model.named_parameters():
        torch.testing.assert_close(_local(p), before[n], rtol=0, atol=0, msg=n)
    torch.testing.assert_close(worker.get_logprobs(data)["logprobs"], lp_now, rtol=0, atol=0)
