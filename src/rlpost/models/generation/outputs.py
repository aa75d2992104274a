"""Prompt unpacking, replica sharding and output assembly shared by the rollout engines.

Engines work per sample (`GeneratedSample`: the new token ids, their logprobs, whether the sample
was truncated); `assemble_outputs` turns those back into the batch tensors of the generate()
contract (see rlpost.models.generation.interfaces).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

try:  # written concurrently; fall back to a plain dict until it exists
    from rlpost.distributed.batched_data_dict import BatchedDataDict as _OutDict
except ImportError:  # pragma: no cover
    _OutDict = dict  # type: ignore[assignment,misc]


@dataclass
class GeneratedSample:
    """One sample as an engine returns it."""

    token_ids: list[int] = field(default_factory=list)
    """Generated tokens (the stop token that ended the sample included)."""
    logprobs: list[float] = field(default_factory=list)
    """Logprob of each generated token under the sampling distribution."""
    truncated: bool = False
    """Hit max_new_tokens / the context limit without a stop."""


def unpack_prompts(data: Mapping[str, Any]) -> list[list[int]]:
    """The unpadded prompts of a right-padded batch (`input_ids` [B, P], `input_lengths` [B])."""
    ids = data["input_ids"]
    lens = data["input_lengths"]
    ids = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(ids)
    lens = lens if isinstance(lens, torch.Tensor) else torch.as_tensor(lens)
    if ids.dim() != 2 or lens.dim() != 1 or lens.shape[0] != ids.shape[0]:
        raise ValueError(f"input_ids must be [B, P] and input_lengths [B]; got {tuple(ids.shape)}, {tuple(lens.shape)}")
    if lens.numel() and (int(lens.min()) < 1 or int(lens.max()) > ids.shape[1]):
        raise ValueError(f"input_lengths must be in [1, {ids.shape[1]}], got {lens.tolist()}")
    return [row[:n] for row, n in zip(ids.tolist(), lens.tolist(), strict=True)]


def row_stop_strings(data: Mapping[str, Any]) -> list[list[str]] | None:
    """The optional per-row `stop_strings` of a generate() input (a multi-turn environment's next stops), as
    lists of strings (None rows -> []), or None when the input has none."""
    stops = data.get("stop_strings") if hasattr(data, "get") else None
    if stops is None:
        return None
    return [list(s) if s else [] for s in stops]


def contiguous_splits(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` contiguous chunks covering range(n), sizes differing by at most one."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        end = start + base + (1 if p < extra else 0)
        out.append((start, end))
        start = end
    return out


def assemble_outputs(
    input_ids: torch.Tensor, input_lengths: torch.Tensor, samples: Sequence[GeneratedSample], pad_id: int
) -> Any:
    """Build the generate() result (a BatchedDataDict) from per-row samples, in row order."""
    input_ids = torch.as_tensor(input_ids)
    input_lengths = torch.as_tensor(input_lengths)
    b, p = input_ids.shape
    if len(samples) != b:
        raise ValueError(f"{len(samples)} samples for a batch of {b}")
    n_max = max((len(s.token_ids) for s in samples), default=0)
    width = p + n_max
    # Rows are built as Python lists and become tensors in one call each: per-row tensor slicing cost more than
    # generating a tiny model's batch.
    prompts, lens_in = input_ids.tolist(), input_lengths.tolist()
    ids_rows, lp_rows, gen_lens, truncated = [], [], [], []
    for i, s in enumerate(samples):
        n_in, n = int(lens_in[i]), len(s.token_ids)
        if len(s.logprobs) != n:
            raise ValueError(f"row {i}: {n} tokens but {len(s.logprobs)} logprobs")
        tail = width - n_in - n
        ids_rows.append(prompts[i][:n_in] + list(s.token_ids) + [pad_id] * tail)
        lp_rows.append([0.0] * n_in + list(s.logprobs) + [0.0] * tail)
        gen_lens.append(n)
        truncated.append(bool(s.truncated))
    output_ids = torch.tensor(ids_rows, dtype=torch.int64).reshape(b, width)
    logprobs = torch.tensor(lp_rows, dtype=torch.float32).reshape(b, width)
    gen_lens_t = torch.tensor(gen_lens, dtype=torch.int64)
    return _OutDict(
        output_ids=output_ids,
        logprobs=logprobs,
        generation_lengths=gen_lens_t,
        unpadded_sequence_lengths=input_lengths.to(torch.int64) + gen_lens_t,
        truncated=torch.tensor(truncated, dtype=torch.bool),
    )
