"""How CPU tensors cross process boundaries (Ray calls, pipes) inside rlpost's batch containers.

Pickling a torch tensor goes through its storage's own reducer, a fixed cost per tensor however small, which
dominates for a training batch of a few small tensors. A numpy array pickles as a buffer (Ray even sends it out of
band, without a copy), at a small fraction of that cost. `pack` turns a CPU tensor into a
`WireTensor` (its numpy view, no copy; dtypes numpy lacks, such as bfloat16, travel as a same-width integer view)
and `unpack` turns it back into a tensor of the same dtype, shape and values, writable and owning its memory.

What `pack` leaves alone, to be pickled as usual: anything that is not a strided CPU tensor, and tensors that
require grad (their autograd flag must survive).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

_INT_VIEW = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.int8, torch.float8_e5m2: torch.int8}
"""Dtypes numpy has no type for, and the integer of the same width they travel as."""


class WireTensor(NamedTuple):
    """A CPU tensor in transit: its values as a numpy array, and its torch dtype when the array is a view."""

    array: np.ndarray
    viewed_from: str | None
    """The tensor's dtype name (e.g. "bfloat16") when `array` holds it as integers; None when they agree."""


def pack(value: object) -> object:
    """A WireTensor for a plain CPU tensor (no copy); anything else unchanged."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or value.layout != torch.strided:
        return value
    if value.requires_grad or value.is_conj() or value.is_neg():
        return value
    as_int = _INT_VIEW.get(value.dtype)
    try:
        if as_int is not None:
            return WireTensor(value.view(as_int).numpy(), str(value.dtype).removeprefix("torch."))
        return WireTensor(value.numpy(), None)
    except (TypeError, RuntimeError):  # a dtype numpy cannot hold: the tensor pickles itself
        return value


def unpack(value: object) -> object:
    """The tensor a WireTensor carried; anything else unchanged. An array that arrived read-only (a buffer Ray or
    pickle owns) is copied, so the tensor may be written."""
    if not isinstance(value, WireTensor):
        return value
    array = value.array if value.array.flags.writeable else value.array.copy()
    out = torch.from_numpy(array)
    return out.view(getattr(torch, value.viewed_from)) if value.viewed_from else out
