"""Cheap, deterministic fingerprints of model weights, to check that a refit delivered what was sent.

`weight_fingerprint(named_tensors)` hashes, for every tensor (in name order):

- its name and shape;
- the values at up to `samples_per_tensor` fixed positions of the flattened tensor: the first and the
  last element plus positions spread over the whole tensor by a per-tensor pseudo-random generator
  seeded from the name and the element count (so the positions are the same on every process, and
  they don't line up with rows or columns the way a plain stride would).

The sampled values are cast to float32 (exact for fp32, bf16 and fp16), -0.0 is folded into 0.0 and
every NaN into one canonical NaN, and the raw fp32 bytes are hashed (BLAKE2b). So a tensor that made
an fp32 -> fp32 or bf16 -> fp32 -> bf16 round trip gets the same fingerprint, bit for bit; a tensor
cast to a narrower dtype on the way (fp32 -> bf16) does not, which is what a refit check wants.
The cost is O(samples) per tensor: large tensors are never read in full (a non-contiguous tensor is
sampled through its strides, without a copy).

What it can NOT see (by design, it samples):
- a change at an element that is not sampled (e.g. one perturbed entry of a 4096x4096 matrix away
  from the sampled positions, or two unsampled elements swapped);
- dtype: a bf16 tensor and its exact fp32 upcast have the same fingerprint;
- tensors that are not passed in (compare name sets separately; `FingerprintBuilder.names`).
Tensors with at most `samples_per_tensor` elements (norms, biases) are covered completely.
"""

from __future__ import annotations

import functools
import hashlib
import math
import zlib
from collections.abc import Iterable, Mapping

import torch

DEFAULT_SAMPLES_PER_TENSOR = 256
"""Sampled elements per tensor."""

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class FingerprintMismatch(RuntimeError):
    """The weights an engine loaded differ from what the trainer sent (or replicas disagree)."""


@functools.lru_cache(maxsize=8192)
def sample_indices(numel: int, name: str, samples: int = DEFAULT_SAMPLES_PER_TENSOR) -> torch.Tensor:
    """Flat indices sampled from a tensor of `numel` elements named `name` (sorted, deterministic). Cached: every
    refit samples the same positions, so they are drawn once per process (the returned tensor is shared; never
    modify it)."""
    if numel <= samples:
        return torch.arange(numel, dtype=torch.int64)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}:{numel}".encode()))
    mid = torch.randint(1, numel - 1, (samples - 2,), generator=gen, dtype=torch.int64)
    ends = torch.tensor([0, numel - 1], dtype=torch.int64)
    return torch.unique(torch.cat([ends, mid]))  # sorted


def _gather_flat(t: torch.Tensor, flat_idx: torch.Tensor) -> torch.Tensor:
    """t.reshape(-1)[flat_idx], reading a non-contiguous t through its strides (no full copy)."""
    if t.dim() == 0:
        return t.reshape(1)
    if t.is_contiguous():
        return t.view(-1)[flat_idx]
    # Unravel row-major flat indices into coordinates, then turn them into storage offsets.
    offsets = torch.zeros_like(flat_idx)
    rem = flat_idx.clone()
    for size, stride in zip(reversed(t.shape), reversed(t.stride()), strict=True):
        offsets += (rem % size) * stride
        rem = rem // size
    span = int(offsets.max().item()) + 1
    return torch.as_strided(t, (span,), (1,))[offsets]


def _sampled(name: str, t: torch.Tensor, samples: int) -> torch.Tensor:
    """The sampled values of `t` as fp32 on the CPU (empty for an empty tensor)."""
    if not t.numel():
        return torch.empty(0, dtype=torch.float32)
    return _gather_flat(t, sample_indices(t.numel(), name, samples).to(t.device)).to(device="cpu", dtype=torch.float32)


def _canonical_bytes(vals: torch.Tensor) -> bytes:
    """fp32 values as bytes with -0.0 folded into 0.0 and every NaN into one NaN."""
    vals = torch.where(vals == 0, torch.zeros_like(vals), vals)
    vals = torch.where(torch.isnan(vals), torch.full_like(vals, math.nan), vals)
    return vals.contiguous().numpy().tobytes()


def _digest(name: str, shape: torch.Size, values: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(name.encode())
    h.update(b"|" + ",".join(str(d) for d in shape).encode() + b"|")
    h.update(values)
    return h.digest()


def tensor_digest(name: str, tensor: torch.Tensor, samples: int = DEFAULT_SAMPLES_PER_TENSOR) -> bytes:
    """Digest of one tensor: name, shape and its sampled values as canonical fp32 bytes."""
    return tensor_digests([(name, tensor)], samples)[name]


def tensor_digests(named: Iterable[tuple[str, torch.Tensor]], samples: int = DEFAULT_SAMPLES_PER_TENSOR
                   ) -> dict[str, bytes]:
    """`tensor_digest` of many tensors at once, equal to it bit for bit: the samples of all of them are canonicalised
    in one pass instead of a handful of small ops per tensor, whose fixed cost dominates for small tensors."""
    named = [(n, t.detach()) for n, t in named]
    parts = [_sampled(n, t, samples) for n, t in named]
    flat = _canonical_bytes(torch.cat(parts)) if parts else b""
    out, at = {}, 0
    for (name, t), part in zip(named, parts, strict=True):
        end = at + 4 * part.numel()
        out[name] = _digest(name, t.shape, flat[at:end])
        at = end
    return out


class FingerprintBuilder:
    """Accumulates tensors in any order (e.g. while they stream into a model); `hexdigest()` sorts by name."""

    def __init__(self, samples_per_tensor: int = DEFAULT_SAMPLES_PER_TENSOR) -> None:
        self.samples_per_tensor = samples_per_tensor
        self._digests: dict[str, bytes] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Add one tensor; a repeated name replaces the earlier one."""
        self._digests[name] = tensor_digest(name, tensor, self.samples_per_tensor)

    def add_all(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Add many tensors (as `add` each, in order), in one pass."""
        self._digests.update(tensor_digests(named, self.samples_per_tensor))

    @property
    def names(self) -> list[str]:
        """Names added so far, sorted."""
        return sorted(self._digests)

    def hexdigest(self) -> str:
        """Fingerprint of everything added: a 32-character hex string."""
        return fingerprint_of_digests({n: d.hex() for n, d in self._digests.items()})

    def digests(self) -> dict[str, str]:
        """Per-tensor digests (hex): parts loaded in several calls combine with fingerprint_of_digests."""
        return {n: d.hex() for n, d in self._digests.items()}


def fingerprint_of_digests(digests: Mapping[str, str]) -> str:
    """The fingerprint of tensors whose per-tensor digests were gathered, possibly in several parts."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(digests):
        h.update(bytes.fromhex(digests[name]))
    return h.hexdigest()


def weight_fingerprint(named_tensors: NamedTensors, samples_per_tensor: int = DEFAULT_SAMPLES_PER_TENSOR) -> str:
    """Fingerprint of named tensors (a mapping or (name, tensor) pairs), independent of their order."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    b = FingerprintBuilder(samples_per_tensor)
    b.add_all(items)
    return b.hexdigest()


def check_fingerprints(fps: list[str], expected: str | None, who: str = "replica") -> str:
    """The common fingerprint of every engine process; FingerprintMismatch naming each one that differs.

    `expected` is the sender's fingerprint when known; otherwise the first process's is the reference.
    """
    ref = expected if expected is not None else fps[0]
    bad = [r for r, fp in enumerate(fps) if fp != ref]
    if bad:
        against = "the sender's" if expected is not None else f"{who} 0's"
        raise FingerprintMismatch(
            "refit check failed: "
            + ", ".join(f"{who} {r} loaded weights with fingerprint {fps[r]}" for r in bad)
            + f", {against} is {ref}"
        )
    return ref
