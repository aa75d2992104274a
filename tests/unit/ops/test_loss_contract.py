"""Every loss the workers call takes the LossFunction protocol's arguments, vocab-parallel ones included."""

from __future__ import annotations

import inspect

import pytest

from rlpost.algorithms.loss_functions import ClippedPGLossFn, NLLLoss
from rlpost.ops.loss_interface import LossFunction
from rlpost.ops.packed_loss import SequencePackingLossWrapper


@pytest.mark.parametrize("loss", [ClippedPGLossFn, NLLLoss, SequencePackingLossWrapper], ids=lambda c: c.__name__)
def test_losses_take_the_protocol_arguments(loss: type) -> None:
    want = list(inspect.signature(LossFunction.__call__).parameters)
    assert {"vocab_parallel_rank", "vocab_parallel_group"} <= set(want)
    assert list(inspect.signature(loss.__call__).parameters) == want
