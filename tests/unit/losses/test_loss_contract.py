"""Every loss the workers call takes the LossFunction protocol's arguments, vocab-parallel ones included."""

from __future__ import annotations

import inspect

import pytest

from rlpost.losses.clipped_pg import ClippedPGLossFn, NLLLoss
from rlpost.losses.interface import LossFunction
from rlpost.losses.packed import SequencePackingLossWrapper


@pytest.mark.parametrize("loss", [ClippedPGLossFn, NLLLoss, SequencePackingLossWrapper], ids=lambda c: c.__name__)
def test_losses_take_the_protocol_arguments(loss: type) -> None:
    want = list(inspect.signature(LossFunction.__call__).parameters)
    assert {"vocab_parallel_rank", "vocab_parallel_group"} <= set(want)
    assert list(inspect.signature(loss.__call__).parameters) == want
