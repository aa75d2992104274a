"""Sequence packing: bin-packing algorithms, packing/unpacking of token rows, and the packed attention mask.

Bin packing (`lengths`, `capacity` -> list of bins, each a list of item indices; every index appears exactly once;
an item longer than the capacity raises ValueError):
- `concatenative`: items in their original order; open a new bin when the next item does not fit the current one.
- `first_fit_decreasing` (FFD): items by decreasing length, each into the first bin with room, else a new bin.
- `first_fit_shuffle`: first fit on a seeded random order.
- `modified_first_fit_decreasing` (MFFD, Johnson & Garey 1985). Our reading of the five steps, with C the
  capacity and classes large (> C/2), medium (C/3, C/2], small (C/6, C/3], tiny (<= C/6):
  1. one bin per large item, largest first;
  2. forward over those bins: if the smallest remaining medium item fits, place the largest medium that fits;
  3. backward over the bins that got no medium item: if the two smallest remaining small items fit together,
     place the smallest small item, then the largest small item that still fits;
  4. forward over all bins: while the smallest remaining item (any class) fits, place the largest that fits;
  5. FFD for whatever is left, into new bins.

Packed layout: the sequences of one bin are concatenated into a single row [1, T]. Sequence i occupies
[cu_seqlens_padded[i], cu_seqlens_padded[i] + len_i) where len_i = cu_seqlens[i+1] - cu_seqlens[i]; each sequence is
padded to a multiple of `pad_to_multiple_of` (tensor/context parallel needs) and the row to a multiple of
`total_round`. Position ids restart at 0 for every sequence; `packed_attention_mask` is causal within a sequence
(its padding included) and blocks attention across sequences, so a model that honours both sees each sequence
exactly as if it were alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def _check(lengths: Sequence[int], capacity: int) -> None:
    if capacity <= 0:
        raise ValueError(f"bin capacity must be > 0, got {capacity}")
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"sequence {i} has length {n} > bin capacity {capacity}")


def _first_fit(order: Sequence[int], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def concatenative(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sequential packing in the original order."""
    _check(lengths, capacity)
    bins: list[list[int]] = []
    load = capacity + 1
    for i, n in enumerate(lengths):
        if load + n > capacity:
            bins.append([])
            load = 0
        bins[-1].append(i)
        load += n
    return bins


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First fit over items sorted by decreasing length (ties by index)."""
    _check(lengths, capacity)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return _first_fit(order, lengths, capacity)


def first_fit_shuffle(lengths: Sequence[int], capacity: int, seed: int = 0) -> list[list[int]]:
    """First fit over a seeded random permutation of the items."""
    _check(lengths, capacity)
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    return _first_fit(order, lengths, capacity)


def _take_largest_fitting(items: list[int], lengths: Sequence[int], room: int) -> int | None:
    """Remove and return the first item of `items` (sorted by decreasing length) with length <= room."""
    for k, i in enumerate(items):
        if lengths[i] <= room:
            return items.pop(k)
    return None


def modified_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """MFFD (Johnson & Garey 1985); see the module docstring for the steps."""
    _check(lengths, capacity)
    cap = capacity

    def by_size(pred: Callable[[int], bool]) -> list[int]:
        return sorted((i for i in range(len(lengths)) if pred(lengths[i])), key=lambda i: (-lengths[i], i))

    large = by_size(lambda n: n * 2 > cap)
    medium = by_size(lambda n: n * 3 > cap and n * 2 <= cap)
    small = by_size(lambda n: n * 6 > cap and n * 3 <= cap)
    tiny = by_size(lambda n: n * 6 <= cap)

    bins = [[i] for i in large]  # step 1
    loads = [lengths[i] for i in large]
    got_medium = [False] * len(bins)
    for b in range(len(bins)):  # step 2
        if medium and lengths[medium[-1]] <= cap - loads[b]:
            i = _take_largest_fitting(medium, lengths, cap - loads[b])
            assert i is not None
            bins[b].append(i)
            loads[b] += lengths[i]
            got_medium[b] = True
    for b in reversed(range(len(bins))):  # step 3
        if got_medium[b] or len(small) < 2:
            continue
        if lengths[small[-1]] + lengths[small[-2]] > cap - loads[b]:
            continue
        first = small.pop()
        bins[b].append(first)
        loads[b] += lengths[first]
        second = _take_largest_fitting(small, lengths, cap - loads[b])
        assert second is not None
        bins[b].append(second)
        loads[b] += lengths[second]
    rest = sorted(medium + small + tiny, key=lambda i: (-lengths[i], i))
    for b in range(len(bins)):  # step 4
        while rest and lengths[rest[-1]] <= cap - loads[b]:
            i = _take_largest_fitting(rest, lengths, cap - loads[b])
            assert i is not None
            bins[b].append(i)
            loads[b] += lengths[i]
    return bins + _first_fit(rest, lengths, capacity)  # step 5 (rest is already sorted decreasing)


PACKING_ALGORITHMS: dict[str, Callable[[Sequence[int], int], list[list[int]]]] = {
    "concatenative": concatenative,
    "first_fit_decreasing": first_fit_decreasing,
    "first_fit_shuffle": first_fit_shuffle,
    "modified_first_fit_decreasing": modified_first_fit_decreasing,
}


def get_packing_algorithm(name: str) -> Callable[[Sequence[int], int], list[list[int]]]:
    """Bin-packing function by its config name (`policy.sequence_packing.algorithm`)."""
    if name not in PACKING_ALGORITHMS:
        raise ValueError(f"unknown packing algorithm {name!r}; expected one of {sorted(PACKING_ALGORITHMS)}")
    return PACKING_ALGORITHMS[name]


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple if multiple > 1 else n


@dataclass
class PackedSequences:
    """One packed row of several sequences."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at 0 for every sequence
    cu_seqlens: torch.Tensor  # [N+1] int32, cumulative real lengths
    cu_seqlens_padded: torch.Tensor  # [N+1] int32, start offsets of the sequences in the packed row

    @property
    def total_len(self) -> int:
        return int(self.input_ids.shape[1])

    def attention_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[1, 1, T, T] additive block-diagonal causal mask for this row."""
        return packed_attention_mask(self.cu_seqlens_padded, self.total_len, dtype)


def pack_sequences(
    input_ids: torch.Tensor,
    lengths: Sequence[int] | torch.Tensor,
    pad_to_multiple_of: int = 1,
    total_round: int = 1,
    pad_value: int = 0,
) -> PackedSequences:
    """Concatenate the first lengths[i] tokens of each row of input_ids [N, S] into one row [1, T]."""
    lens = [int(n) for n in lengths]
    padded = [round_up(n, pad_to_multiple_of) for n in lens]
    cu = [0]
    cu_p = [0]
    for n, p in zip(lens, padded, strict=True):
        cu.append(cu[-1] + n)
        cu_p.append(cu_p[-1] + p)
    total = max(round_up(cu_p[-1], total_round), 1)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=input_ids.device)
    cu_seqlens_padded = torch.tensor(cu_p, dtype=torch.int32, device=input_ids.device)
    packed = pack_tensor(input_ids, cu_seqlens, cu_seqlens_padded, total, pad_value)  # [1, T]
    position_ids = torch.zeros(1, total, dtype=torch.long, device=input_ids.device)  # [1, T]
    starts = cu_p + [total]
    for i in range(len(starts) - 1):
        position_ids[0, starts[i] : starts[i + 1]] = torch.arange(starts[i + 1] - starts[i], device=input_ids.device)
    return PackedSequences(packed, position_ids, cu_seqlens, cu_seqlens_padded)


def pack_tensor(
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    total_len: int,
    pad_value: float | int = 0,
) -> torch.Tensor:
    """Pack per-token values [N, S, ...] into [1, T, ...] with the layout given by the cu_seqlens pair."""
    out = values.new_full((1, total_len, *values.shape[2:]), pad_value)
    for i in range(values.shape[0]):
        n = int(cu_seqlens[i + 1] - cu_seqlens[i])
        start = int(cu_seqlens_padded[i])
        out[0, start : start + n] = values[i, :n]
    return out


def unpack_sequences(
    packed: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    max_len: int,
    pad_value: float | int = 0,
) -> torch.Tensor:
    """Inverse of pack_tensor: [1, T, ...] -> [N, max_len, ...], positions past each length set to pad_value."""
    flat = packed[0]  # [T, ...]
    n_seq = cu_seqlens.numel() - 1
    rows = []
    for i in range(n_seq):
        n = int(cu_seqlens[i + 1] - cu_seqlens[i])
        start = int(cu_seqlens_padded[i])
        row = flat[start : start + n]
        pad = flat.new_full((max_len - n, *flat.shape[1:]), pad_value)
        rows.append(torch.cat([row, pad], dim=0))
    return torch.stack(rows, dim=0) if rows else flat.new_zeros((0, max_len, *flat.shape[1:]))


def packed_attention_mask(cu_seqlens: torch.Tensor, total_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, T, T] additive mask: 0 where query q may attend key k, finfo(dtype).min elsewhere.

    cu_seqlens are segment start offsets (pass cu_seqlens_padded for padded layouts) with cu_seqlens[-1] the end
    of the last sequence; q attends k iff k <= q and both lie in the same segment. Positions at or after
    cu_seqlens[-1] (row padding) form one extra segment, so no row is fully masked.
    Transformers (5.x) passes a 4D mask to the attention implementation unchanged (sdpa and eager).
    """
    device = cu_seqlens.device
    pos = torch.arange(total_len, device=device)  # [T]
    seg = torch.bucketize(pos, cu_seqlens[1:].to(torch.long), right=True)  # [T]
    allowed = (seg.unsqueeze(1) == seg.unsqueeze(0)) & (pos.unsqueeze(0) <= pos.unsqueeze(1))  # [T(q), T(k)]
    mask = torch.zeros(total_len, total_len, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.view(1, 1, total_len, total_len)
