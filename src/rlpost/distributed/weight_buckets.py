"""Weight buckets: how full HF-named tensors travel from a training worker to a colocated engine
without passing through the driver.

The trainer's rank 0 puts one bucket at a time into Ray's object store (shared memory on its node)
as raw byte arrays: one copy. The driver only forwards the object reference (wrapped in a list, so
Ray does not fetch it). Each engine maps the bucket zero-copy and loads it into its parameters: the
second and last copy. At most one bucket exists at a time, so `policy.refit_buffer_size_gb` bounds
the buffer (a single tensor larger than it travels alone).

Buckets never split a decoder layer: an engine that fuses tensors of one layer (vLLM's qkv_proj,
gate_up_proj) receives all of them in the same load call.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence

import numpy as np
import torch

BucketRecord = tuple[str, tuple[int, ...], str, np.ndarray]
"""(HF name, shape, torch dtype name, the tensor's bytes as a uint8 array)."""

_LAYER = re.compile(r"^(.*?layers\.\d+)\.")


def layer_group(name: str) -> str:
    """Tensors with the same group must travel in one bucket: the decoder layer, or the tensor itself."""
    if name == "lm_head.weight":  # with tied embeddings the engine may derive one from the other
        return "model.embed_tokens.weight"
    m = _LAYER.match(name)
    return m.group(1) if m else name


def plan_buckets(named: Sequence[tuple[str, torch.Tensor]], max_bytes: int) -> list[list[int]]:
    """Indices of `named` per bucket: whole layer groups, at most `max_bytes` unless one group is larger."""
    groups: list[tuple[list[int], int]] = []
    index: dict[str, int] = {}
    for i, (name, t) in enumerate(named):
        key = layer_group(name)
        if key not in index:
            index[key] = len(groups)
            groups.append(([], 0))
        idx, size = groups[index[key]]
        idx.append(i)
        groups[index[key]] = (idx, size + t.numel() * t.element_size())
    buckets: list[list[int]] = []
    size = 0
    for idx, nbytes in groups:
        if buckets and size + nbytes <= max_bytes:
            buckets[-1].extend(idx)
            size += nbytes
        else:
            buckets.append(list(idx))
            size = nbytes
    return buckets


def encode(named: Sequence[tuple[str, torch.Tensor]]) -> list[BucketRecord]:
    """Zero-copy uint8 views of CPU tensors (the object store makes the one copy)."""
    out: list[BucketRecord] = []
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, dtype=np.uint8)
        out.append((name, tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch."), raw))
    return out


def decode(records: Sequence[BucketRecord]) -> list[tuple[str, torch.Tensor]]:
    """Tensors viewing the records' buffers (read-only shared memory: loaders copy out of them)."""
    out: list[tuple[str, torch.Tensor]] = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, shape, dtype, raw in records:
            flat = torch.from_numpy(raw) if raw.size else torch.empty(0, dtype=torch.uint8)
            out.append((name, flat.view(getattr(torch, dtype)).reshape(shape)))
    return out
