"""Micro-batch planning for BatchedDataDict: dynamic batching and sequence packing (lengths only, no tensors).

Both plans work per global batch, after the global batch has been sorted by decreasing length and dealt
round-robin to the data-parallel shards (shard s gets sorted positions s, s + shards, ...), so every shard gets
a similar token load.

Dynamic batching (`plan_dynamic`): the micro-batch boundaries are chosen JOINTLY for all shards over their dealt,
length-sorted rows: a micro-batch [a, b) is grown while (b - a) * round_up(longest row of any shard in [a, b))
stays within max_tokens_per_microbatch (at least one row). Each shard then trims its own rows of [a, b) to its own
longest sequence rounded up to sequence_length_round. Joint boundaries give every shard the same number of
micro-batches.

Sequence packing (`plan_packing`): each shard bin-packs its own rows with the configured algorithm; the capacity
is max_tokens_per_microbatch and each item counts round_up(length, sequence_length_pad_multiple) tokens (the
packed row is later rounded up to sequence_length_round, which may exceed the budget by less than that round).
Rows are reordered bin by bin so every micro-batch is a contiguous row range. Shards with fewer bins than the
busiest shard get zero-weight padding micro-batches (`MicroBatchSpec.is_padding`: the first row of the global
batch with sample_mask 0), so all data-parallel ranks run the same number of forward/backward passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

from rlpost.data.packing import get_packing_algorithm, round_up


class DynamicBatchingArgs(TypedDict, total=False):
    """Arguments of dynamic batching (NeMo RL names). Only max_tokens_per_microbatch is required."""

    max_tokens_per_microbatch: int
    sequence_length_round: int  # default 1
    input_key: str  # default "input_ids"
    input_lengths_key: str  # default "input_lengths"


class SequencePackingArgs(TypedDict, total=False):
    """Arguments of sequence packing. Only max_tokens_per_microbatch is required."""

    max_tokens_per_microbatch: int
    algorithm: str  # default "modified_first_fit_decreasing"
    sequence_length_pad_multiple: int  # each sequence padded to a multiple of this (TP / CP needs); default 1
    sequence_length_round: int  # the packed row padded to a multiple of this; default 1
    input_key: str  # default "input_ids"
    input_lengths_key: str  # default "input_lengths"


@dataclass(frozen=True)
class MicroBatchSpec:
    """One micro-batch of a global batch: rows [start, end) of that global batch (shard-local)."""

    start: int
    end: int
    seq_len: int
    """Length the rows are trimmed to (dynamic: rounded max length; packing: max real length)."""
    is_padding: bool = False
    """Zero-weight filler (sample_mask 0) that only keeps the data-parallel ranks in step."""


def deal_sorted(indices: Sequence[int], lengths: Sequence[int], shards: int) -> list[list[int]]:
    """Sort `indices` by decreasing lengths[i] (ties by index) and deal them round-robin to `shards` lists."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    return [order[s::shards] for s in range(shards)]


def plan_dynamic(
    shard_lengths: Sequence[Sequence[int]], max_tokens: int, length_round: int = 1, max_len: int | None = None
) -> list[list[MicroBatchSpec]]:
    """Joint micro-batch boundaries for shards whose rows are sorted by decreasing length.

    shard_lengths[s][j] is the length of shard s's j-th row; all shards have the same row count.
    Returns one spec list per shard (same boundaries, each shard's own trimmed length).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_microbatch must be > 0, got {max_tokens}")
    n_rows = len(shard_lengths[0])
    if any(len(x) != n_rows for x in shard_lengths):
        raise ValueError("dynamic batching needs the same number of rows on every shard")

    def padded(n: int) -> int:
        p = round_up(max(n, 1), length_round)
        return min(p, max_len) if max_len is not None else p

    bounds: list[tuple[int, int]] = []
    a = 0
    while a < n_rows:
        longest = 0
        b = a
        while b < n_rows:
            cand = max(longest, max(padded(x[b]) for x in shard_lengths))
            if b > a and (b + 1 - a) * cand > max_tokens:
                break
            longest = cand
            b += 1
        bounds.append((a, b))
        a = b
    return [[MicroBatchSpec(a, b, padded(max(lens[a:b]))) for a, b in bounds] for lens in shard_lengths]


def plan_packing(lengths: Sequence[int], args: SequencePackingArgs) -> tuple[list[int], list[MicroBatchSpec]]:
    """Bin-pack one shard's rows of one global batch.

    Returns (row_order, specs): row_order[k] is the position (in `lengths`) of the k-th row after reordering
    bin by bin; specs cover the reordered rows contiguously.
    """
    algo = get_packing_algorithm(args.get("algorithm", "modified_first_fit_decreasing"))
    multiple = int(args.get("sequence_length_pad_multiple", 1))
    sizes = [round_up(max(int(n), 1), multiple) for n in lengths]
    bins = algo(sizes, int(args["max_tokens_per_microbatch"]))
    order: list[int] = []
    specs: list[MicroBatchSpec] = []
    for members in bins:
        start = len(order)
        order.extend(members)
        specs.append(MicroBatchSpec(start, len(order), max(int(lengths[i]) for i in members)))
    return order, specs


def pad_plans(plans: list[list[MicroBatchSpec]]) -> list[list[MicroBatchSpec]]:
    """Append zero-weight padding specs so every shard has as many micro-batches as the busiest one."""
    target = max(len(p) for p in plans)
    out = []
    for p in plans:
        filler_len = p[0].seq_len if p else 1
        out.append(list(p) + [MicroBatchSpec(0, 1, filler_len, is_padding=True)] * (target - len(p)))
    return out
