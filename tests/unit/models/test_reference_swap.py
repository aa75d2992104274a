"""The reference pass leaves the policy's weights exactly as they were, tied embeddings included
(one storage under two names used to be restored twice, the second time with the reference value)."""

from __future__ import annotations

from typing import Any

import pytest
import torch


@pytest.fixture(scope="module")
def worker(one_rank: Any) -> Any:
    return one_rank(init_reference_model=True)


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
