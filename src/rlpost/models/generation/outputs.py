"""Prompt unpacking, replica sharding and output assembly shared by the rollout engines.

Engines return their samples packed (`GeneratedBatch`: every sample's new token ids and logprobs back to
back, with the lengths and truncation flags); `assemble_outputs` scatters those into the batch tensors of the
generate() contract (see rlpost.models.generation.interfaces). `GeneratedSample` is one sample, for engines
that build them one at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

import torch

from rlpost.distributed.batched_data_dict import BatchedDataDict


class EngineInfo(TypedDict):
    """What an engine worker's `info()` answers: its tokenizer's ids and where it runs."""

    eos_token_id: int | None
    pad_token_id: int
    pid: int
    replica: NotRequired[int]
    device: NotRequired[str]


@dataclass
class GeneratedSample:
    """One sample as an engine returns it."""

    token_ids: list[int] = field(default_factory=list)
    """Generated tokens (the stop token that ended the sample included)."""
    logprobs: list[float] = field(default_factory=list)
    """Logprob of each generated token under the sampling distribution."""
    truncated: bool = False
    """Hit max_new_tokens / the context limit without a stop."""


@dataclass
class GeneratedBatch:
    """The samples of one engine call, packed: what goes back through Ray. A few flat lists pickle much faster than
    one `GeneratedSample` object per sample, and `assemble_outputs` scatters them in one indexed copy instead of
    building a Python row per sample."""

    token_ids: list[int] = field(default_factory=list)
    """Every sample's generated tokens, sample after sample."""
    logprobs: list[float] = field(default_factory=list)
    """Their logprobs, in the same order."""
    lengths: list[int] = field(default_factory=list)
    """Tokens of each sample."""
    truncated: list[bool] = field(default_factory=list)
    """Per sample: hit max_new_tokens / the context limit without a stop."""

    def __len__(self) -> int:
        return len(self.lengths)

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float], truncated: bool) -> None:
        """Append one sample."""
        if len(logprobs) != len(token_ids):
            raise ValueError(f"sample {len(self.lengths)}: {len(token_ids)} tokens but {len(logprobs)} logprobs")
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.lengths.append(len(token_ids))
        self.truncated.append(bool(truncated))

    @classmethod
    def of(cls, samples: Iterable[GeneratedSample | GeneratedBatch]) -> GeneratedBatch:
        """Samples and packed batches, in order, as one packed batch."""
        out = cls()
        for s in samples:
            if isinstance(s, GeneratedBatch):
                out.token_ids += s.token_ids
                out.logprobs += s.logprobs
                out.lengths += s.lengths
                out.truncated += s.truncated
            else:
                out.add(s.token_ids, s.logprobs, s.truncated)
        return out

    def samples(self) -> list[GeneratedSample]:
        """One GeneratedSample per sample."""
        out, a = [], 0
        for n, t in zip(self.lengths, self.truncated, strict=True):
            out.append(GeneratedSample(self.token_ids[a : a + n], self.logprobs[a : a + n], t))
            a += n
        return out


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
    input_ids: torch.Tensor, input_lengths: torch.Tensor,
    samples: GeneratedBatch | Sequence[GeneratedSample | GeneratedBatch], pad_id: int
) -> BatchedDataDict:
    """Build the generate() result (a BatchedDataDict) from the rows' samples, in row order: each row is its
    prompt, then its generated tokens, then padding to the longest."""
    packed = samples if isinstance(samples, GeneratedBatch) else GeneratedBatch.of(samples)
    input_ids = torch.as_tensor(input_ids)
    input_lengths = torch.as_tensor(input_lengths).to(torch.int64)
    b, p = input_ids.shape
    if len(packed) != b:
        raise ValueError(f"{len(packed)} samples for a batch of {b}")
    if len(packed.logprobs) != len(packed.token_ids) or sum(packed.lengths) != len(packed.token_ids):
        raise ValueError(f"{len(packed.token_ids)} tokens, {len(packed.logprobs)} logprobs and lengths summing to "
                         f"{sum(packed.lengths)} do not agree")
    gen_lens = torch.tensor(packed.lengths, dtype=torch.int64).reshape(b)
    width = p + (int(gen_lens.max()) if b else 0)
    pos = torch.arange(width)
    ends = input_lengths + gen_lens
    in_prompt = pos < input_lengths[:, None]
    in_answer = ~in_prompt & (pos < ends[:, None])
    output_ids = torch.full((b, width), pad_id, dtype=torch.int64)
    output_ids[in_prompt] = input_ids.to(torch.int64)[in_prompt[:, :p]]
    # a boolean mask enumerates row by row, which is the packed order
    output_ids[in_answer] = torch.tensor(packed.token_ids, dtype=torch.int64)
    logprobs = torch.zeros((b, width), dtype=torch.float32)
    logprobs[in_answer] = torch.tensor(packed.logprobs, dtype=torch.float32)
    return BatchedDataDict(
        output_ids=output_ids,
        logprobs=logprobs,
        generation_lengths=gen_lens,
        unpadded_sequence_lengths=ends,
        truncated=torch.tensor(packed.truncated, dtype=torch.bool).reshape(b),
    )
