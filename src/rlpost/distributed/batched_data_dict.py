"""BatchedDataDict: a dict of batch-major tensors and lists, with the sharding and micro-batching the workers use.

Every value has the batch on dim 0: a torch.Tensor ([B], [B, S], [B, S, ...]) or a list/tuple of length B.

Sharding (`shard_by_batch_size`, NeMo RL semantics): with batch_size, the data is cut into consecutive global
batches of batch_size rows and each global batch is split evenly over the shards, so shard s holds its part of
global batch 0, then of global batch 1, ... (`get_batch(i, batch_size // shards)` returns part i). Without
dynamic batching / packing, shard s gets rows [s * local, (s + 1) * local) of every global batch.
With dynamic batching or packing, each global batch is sorted by length and dealt round-robin to the shards,
every shard stores a micro-batch plan (see rlpost.distributed.microbatching), and the call also returns
`original_indices`: the original row index of each row of the shards concatenated in shard order. Outputs computed
shard by shard in row order go back to the caller's order with `restore_order(original_indices)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlpost.data.packing import PackedSequences, pack_sequences, unpack_sequences
from rlpost.distributed import tensor_wire
from rlpost.distributed.microbatching import (
    DynamicBatchingArgs,
    MicroBatchSpec,
    SequencePackingArgs,
    deal_sorted,
    pad_plans,
    plan_dynamic,
    plan_packing,
)

IndexLike = Sequence[int] | torch.Tensor


@dataclass
class PackedMicroBatch:
    """A packed micro-batch: the rows (trimmed, as a BatchedDataDict) and their packed single-row form."""

    data: BatchedDataDict
    """The micro-batch rows [N, seq_len]; per-sequence tensors for the loss (SequencePackingLossWrapper)."""
    packed: PackedSequences
    """input_ids / position_ids [1, T], cu_seqlens / cu_seqlens_padded [N+1] for the model."""
    seq_len: int
    """Padded row length of `data` (the longest real sequence of the bin)."""
    is_padding: bool = False

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.packed.cu_seqlens

    @property
    def position_ids(self) -> torch.Tensor:
        return self.packed.position_ids

    def unpack(self, values: torch.Tensor, pad_value: float | int = 0) -> torch.Tensor:
        """Per-token outputs of the packed row [1, T, ...] -> rows [N, seq_len, ...]."""
        return unpack_sequences(values, self.packed.cu_seqlens, self.packed.cu_seqlens_padded, self.seq_len, pad_value)


def _rebuild(cls: type[BatchedDataDict], values: dict[str, object], attrs: dict[str, object]) -> BatchedDataDict:
    """Unpickle a BatchedDataDict (see its __reduce__)."""
    out = cls({k: tensor_wire.unpack(v) for k, v in values.items()})
    out.__dict__.update(attrs)
    return out


def _to_index_list(indices: IndexLike) -> list[int]:
    return [int(i) for i in (indices.tolist() if isinstance(indices, torch.Tensor) else indices)]


class BatchedDataDict(dict[str, Any]):
    """dict[str, Tensor | list] sharing batch dim 0. Operations return new objects; values are not copied."""

    is_padding: bool = False
    """True on a zero-weight padding micro-batch (sample_mask 0) yielded only to keep DP ranks in step."""
    micro_batch_plan: list[list[MicroBatchSpec]] | None = None
    """Per global batch of this shard, its micro-batches (set by shard_by_batch_size with dynamic/packing)."""
    micro_batch_kind: str | None = None
    """'dynamic' or 'packing' when a plan is set."""
    micro_batch_args: dict[str, Any] | None = None
    """The dynamic batching / packing args the plan was made with."""

    def __reduce__(self) -> tuple[Callable[..., BatchedDataDict], tuple[object, ...]]:
        # Tensors travel as numpy arrays (rlpost.distributed.tensor_wire): much cheaper to pickle than tensors.
        return (_rebuild, (type(self), {k: tensor_wire.pack(v) for k, v in self.items()}, dict(self.__dict__)))

    # ------------------------------------------------------------------ construction and basic ops
    @classmethod
    def from_batches(
        cls, batches: Sequence[Mapping[str, Any]], pad_value_dict: Mapping[str, float] | None = None
    ) -> BatchedDataDict:
        """Concatenate batches on dim 0; tensors with ndim >= 2 are right-padded on dim 1 to the longest.

        Padding uses pad_value_dict[key] if given, else 0. Lists are concatenated.
        """
        if not batches:
            return cls()
        pad_value_dict = pad_value_dict or {}
        out = cls()
        for key in batches[0]:
            vals = [b[key] for b in batches]
            if isinstance(vals[0], torch.Tensor):
                if vals[0].ndim >= 2:
                    width = max(v.shape[1] for v in vals)
                    pad = pad_value_dict.get(key, 0)
                    vals = [_pad_dim1(v, width, pad) for v in vals]
                out[key] = torch.cat(vals, dim=0)
            else:
                out[key] = [x for v in vals for x in v]
        return out

    @property
    def size(self) -> int:
        """Batch size (0 for an empty dict); raises if values disagree."""
        sizes = {len(v) for v in self.values()}
        if len(sizes) > 1:
            raise ValueError(f"inconsistent batch sizes {sorted(sizes)} in BatchedDataDict keys {list(self)}")
        return sizes.pop() if sizes else 0

    def _new(self, values: Mapping[str, object], keep_plan: bool = False) -> BatchedDataDict:
        out = type(self)(values)
        if keep_plan:
            out.micro_batch_plan = self.micro_batch_plan
            out.micro_batch_kind = self.micro_batch_kind
            out.micro_batch_args = self.micro_batch_args
        return out

    def to(self, device: torch.device | str) -> BatchedDataDict:
        """Move every tensor to `device` (micro-batch plan kept)."""
        return self._new(
            {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()}, keep_plan=True
        )

    def select_indices(self, indices: IndexLike) -> BatchedDataDict:
        """Rows `indices` in that order (out[k] = self[indices[k]])."""
        idx = _to_index_list(indices)
        out: dict[str, object] = {}
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                out[k] = v[torch.tensor(idx, dtype=torch.long, device=v.device)]
            else:
                out[k] = [v[i] for i in idx]
        return self._new(out)

    reorder = select_indices

    def restore_order(self, original_indices: IndexLike) -> BatchedDataDict:
        """Inverse permutation: row k goes to position original_indices[k] (undoes select_indices)."""
        idx = _to_index_list(original_indices)
        inverse = [0] * len(idx)
        for k, i in enumerate(idx):
            inverse[i] = k
        return self.select_indices(inverse)

    reorder_data = restore_order  # NeMo RL's name

    def slice(self, start: int, end: int) -> BatchedDataDict:
        """Rows [start, end)."""
        return self._new({k: v[start:end] for k, v in self.items()})

    def repeat_interleave(self, n: int) -> BatchedDataDict:
        """Each row repeated n times in place (r0, r0, ..., r1, r1, ...)."""
        out: dict[str, object] = {}
        for k, v in self.items():
            out[k] = v.repeat_interleave(n, dim=0) if isinstance(v, torch.Tensor) else [x for x in v for _ in range(n)]
        return self._new(out)

    def trim_seq(self, seq_len: int, full_len: int) -> BatchedDataDict:
        """Cut every tensor whose dim 1 equals full_len down to its first seq_len positions."""
        out = {
            k: v[:, :seq_len] if isinstance(v, torch.Tensor) and v.ndim >= 2 and v.shape[1] == full_len else v
            for k, v in self.items()
        }
        return self._new(out)

    # ------------------------------------------------------------------ sharding
    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: DynamicBatchingArgs | None = None,
        sequence_packing_args: SequencePackingArgs | None = None,
    ) -> list[BatchedDataDict] | tuple[list[BatchedDataDict], list[int]]:
        """Split into `shards` data-parallel shards (see module docstring).

        Returns the shard list, or (shards, original_indices) with dynamic batching or packing.
        allow_uneven_shards (plain sharding without batch_size only): shard sizes ceil(n / shards), last smaller.
        """
        if dynamic_batching_args is not None and sequence_packing_args is not None:
            raise ValueError("dynamic batching and sequence packing are mutually exclusive")
        n = self.size
        planned = dynamic_batching_args is not None or sequence_packing_args is not None
        if allow_uneven_shards:
            if batch_size is not None or planned:
                raise ValueError("allow_uneven_shards only applies to plain sharding without batch_size")
            chunk = -(-n // shards)
            return [self.slice(min(s * chunk, n), min((s + 1) * chunk, n)) for s in range(shards)]
        batch_size = n if batch_size is None else batch_size
        if batch_size <= 0 or n % batch_size != 0 or batch_size % shards != 0:
            raise ValueError(
                f"cannot shard {n} rows into global batches of {batch_size} over {shards} shards "
                "(need n % batch_size == 0 and batch_size % shards == 0)"
            )
        local = batch_size // shards
        n_global = n // batch_size
        if not planned:
            return [
                self.select_indices([g * batch_size + s * local + j for g in range(n_global) for j in range(local)])
                for s in range(shards)
            ]
        args: dict[str, Any] = dict(dynamic_batching_args or sequence_packing_args or {})
        kind = "dynamic" if dynamic_batching_args is not None else "packing"
        lengths = _to_index_list(self[args.get("input_lengths_key", "input_lengths")])
        full_len = int(self[args.get("input_key", "input_ids")].shape[1])
        rows: list[list[int]] = [[] for _ in range(shards)]
        plans: list[list[list[MicroBatchSpec]]] = [[] for _ in range(shards)]
        for g in range(n_global):
            dealt = deal_sorted(range(g * batch_size, (g + 1) * batch_size), lengths, shards)
            if kind == "dynamic":
                specs = plan_dynamic(
                    [[lengths[i] for i in d] for d in dealt],
                    int(args["max_tokens_per_microbatch"]),
                    int(args.get("sequence_length_round", 1)),
                    max_len=full_len,
                )
                ordered = dealt
            else:
                if args.get("algorithm") == "concatenative":  # keeps the caller's order within each shard
                    dealt = [sorted(d) for d in dealt]
                packed = [plan_packing([lengths[i] for i in d], args) for d in dealt]  # type: ignore[arg-type]
                ordered = [[d[k] for k in order] for d, (order, _) in zip(dealt, packed, strict=True)]
                specs = pad_plans([sp for _, sp in packed])
            for s in range(shards):
                rows[s].extend(ordered[s])
                plans[s].append(specs[s])
        out = []
        for s in range(shards):
            shard = self.select_indices(rows[s])
            shard.micro_batch_plan, shard.micro_batch_kind, shard.micro_batch_args = plans[s], kind, args
            out.append(shard)
        return out, [i for r in rows for i in r]

    def get_batch(self, batch_idx: int, batch_size: int) -> BatchedDataDict:
        """Rows of this shard's global batch `batch_idx` (batch_size = local rows per global batch); keeps its plan."""
        out = self.slice(batch_idx * batch_size, (batch_idx + 1) * batch_size)
        if self.micro_batch_plan is not None:
            out.micro_batch_plan = [self.micro_batch_plan[batch_idx]]
            out.micro_batch_kind, out.micro_batch_args = self.micro_batch_kind, self.micro_batch_args
        return out

    # ------------------------------------------------------------------ micro-batch iterators
    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[BatchedDataDict]:
        """Consecutive micro-batches of microbatch_size rows (the last may be smaller)."""
        for start in range(0, self.size, microbatch_size):
            yield self.slice(start, start + microbatch_size)

    def _planned_specs(self, kind: str) -> Iterator[tuple[int, MicroBatchSpec]]:
        """(row offset of the global batch, spec) for every planned micro-batch of this shard."""
        if self.micro_batch_plan is None or self.micro_batch_kind != kind:
            raise ValueError(f"no {kind} micro-batch plan: shard with shard_by_batch_size(..., {kind} args) first")
        rows_per_gb = self.size // len(self.micro_batch_plan)
        for g, specs in enumerate(self.micro_batch_plan):
            for spec in specs:
                yield g * rows_per_gb, spec

    def _planned_microbatch(self, offset: int, spec: MicroBatchSpec) -> BatchedDataDict:
        assert self.micro_batch_args is not None
        full_len = int(self[self.micro_batch_args.get("input_key", "input_ids")].shape[1])
        mb = self.slice(offset + spec.start, offset + spec.end).trim_seq(spec.seq_len, full_len)
        if spec.is_padding:
            mb["sample_mask"] = torch.zeros_like(mb["sample_mask"]) if "sample_mask" in mb else torch.zeros(mb.size)
            mb.is_padding = True
        return mb

    def make_microbatch_iterator_with_dynamic_shapes(self) -> Iterator[BatchedDataDict]:
        """Dynamic-batching micro-batches: rows trimmed to the micro-batch's rounded longest sequence."""
        for offset, spec in self._planned_specs("dynamic"):
            yield self._planned_microbatch(offset, spec)

    def get_microbatch_iterator_dynamic_shapes_len(self) -> int:
        """Number of micro-batches make_microbatch_iterator_with_dynamic_shapes yields."""
        return sum(1 for _ in self._planned_specs("dynamic"))

    def make_microbatch_iterator_for_packable_sequences(self) -> Iterator[PackedMicroBatch]:
        """Packed micro-batches (one bin each) plus zero-weight padding ones (see microbatching docstring)."""
        for offset, spec in self._planned_specs("packing"):
            mb = self._planned_microbatch(offset, spec)
            args = self.micro_batch_args or {}
            packed = pack_sequences(
                mb[args.get("input_key", "input_ids")],
                _to_index_list(mb[args.get("input_lengths_key", "input_lengths")]),
                pad_to_multiple_of=int(args.get("sequence_length_pad_multiple", 1)),
                total_round=int(args.get("sequence_length_round", 1)),
            )
            yield PackedMicroBatch(data=mb, packed=packed, seq_len=spec.seq_len, is_padding=spec.is_padding)

    def get_microbatch_iterator_for_packable_sequences_len(self) -> int:
        """Number of micro-batches make_microbatch_iterator_for_packable_sequences yields."""
        return sum(1 for _ in self._planned_specs("packing"))


def _pad_dim1(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), value)
    return torch.cat([t, pad], dim=1)
