"""GenerationInterface: what the GRPO loop needs from a rollout engine, and the generate() data contract.

Input `data` (a BatchedDataDict or any dict of tensors):
- `input_ids` [B, P] int64: prompts, RIGHT-padded with the tokenizer's pad id;
- `input_lengths` [B] int64: true prompt lengths;
- optional `seeds` [B] int64: per-row sampling seeds (vLLM: per request; HF: the first seed of each shard);
- optional `stop_strings`: a list of B lists of strings (or None) that end that row, on top of the
  config's `stop_strings` (a multi-turn environment's next stop strings).

Output BatchedDataDict, one row per input row, in input order:
- `output_ids` [B, P + N] int64: row i = its prompt (input_lengths[i] tokens), then its generated
  tokens, then pad id; N = the longest generation in the batch (so the prompt part of every row
  starts at column 0 and P is the input's padded width);
- `logprobs` [B, P + N] float32: at the column of each generated token, the logprob the engine gave
  that token when it sampled it; 0 at prompt and padding columns. The distribution is the one
  sampled from: logits / temperature, then top-k / top-p (renormalised over the kept tokens), i.e.
  vLLM's `processed_logprobs`; greedy = plain log_softmax of the logits;
- `generation_lengths` [B] int64: generated tokens (a stop token that ended the sample is included);
- `unpadded_sequence_lengths` [B] int64: input_lengths + generation_lengths;
- `truncated` [B] bool: True when the sample hit max_new_tokens (or the context limit) without a stop.

Stop rules: `stop_token_ids` (None = the tokenizer's EOS; [] = none) and `stop_strings` end a
sample; the token that completes the stop (id or string) is the last generated token.

Refit: `update_weights`, `update_weights_from_buckets` and `wait_collective_update` return the engine-side weight fingerprint
(rlpost.models.fingerprint) of what the engine actually loaded; a disagreement raises
FingerprintMismatch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from rlpost.distributed.batched_data_dict import BatchedDataDict

if TYPE_CHECKING:
    import ray

StateDictInfo = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""Parameter name -> (shape, dtype), as the trainer will send them."""

OUTPUT_KEYS = ("output_ids", "logprobs", "generation_lengths", "unpadded_sequence_lengths", "truncated")
"""Keys every generate() result has."""


def slice_rows(data: Mapping[str, Any], a: int, b: int) -> dict[str, Any]:
    """Rows [a, b) of a generate() input (every value is per row)."""
    return {k: v[a:b] for k, v in data.items()}


class GenerationInterface(ABC):
    """A rollout engine: generate from token prompts, take new weights from the trainer."""

    @abstractmethod
    def generate(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict:
        """Generate for every row of `data` (see the module docstring for the contract); a BatchedDataDict."""

    def generate_chunks(self, data: Mapping[str, Any], bounds: list[tuple[int, int]],
                        greedy: bool = False) -> Iterator[BatchedDataDict]:
        """generate() for rows [a, b) of `data`, for each (a, b) of `bounds` in order, each chunk's result as soon as
        it is there (synchronous GRPO trains on a chunk while the next one generates: rlpost.algorithms.overlap).
        This default makes one generate() call per chunk; an engine that can run its chunks back to back (vLLM:
        one streaming call per replica) overrides it."""
        for a, b in bounds:
            yield self.generate(slice_rows(data, a, b), greedy)

    async def generate_async(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict:
        """generate() awaited from a coroutine, so many small requests (one per multi-turn sample) run at once.
        The default runs generate() in a thread; an engine with an async core (vLLM's AsyncLLM) overrides it."""
        import asyncio

        return await asyncio.to_thread(self.generate, data, greedy)

    def wait_started(self) -> None:
        """Return once every engine worker has started (raising, named, when one failed to). An engine whose
        constructor does not wait lets the policy's workers start beside it; this default has nothing to wait for."""
        return None

    @abstractmethod
    def pause_for_refit(self, recompute_kv_cache: bool = False) -> None:
        """Freeze in-flight requests so new weights can be loaded under them (grpo.async_grpo.in_flight_weight_updates);
        they go on after `resume_after_refit`. An engine that cannot raises."""

    @abstractmethod
    def resume_after_refit(self) -> None:
        """Let the requests frozen by `pause_for_refit` go on."""

    @abstractmethod
    def check_alive(self) -> None:
        """Raise, naming it, when an engine worker is dead (a refit broadcast fails when a receiver died, and
        the receiver is the one to name)."""

    def sleep_once_started(self) -> list[ray.ObjectRef[object]]:
        """Put a colocated engine to sleep as soon as it has started, without waiting: the handles that are ready
        once it sleeps, for the worker groups that share its devices to wait on before they allocate
        (rlpost.distributed.start_gate). An engine on workers of its own stays awake: no handles."""
        self.finish_generation()
        return []

    @property
    def asleep(self) -> bool:
        """Some part of the engine sleeps (rlpost.models.generation.sleep_state): it must be woken before it
        generates. An engine that never sleeps keeps this default."""
        return False

    @abstractmethod
    def prepare_for_generation(self, tags: list[str] | None = None, **kwargs: object) -> bool:
        """Make the engine ready to generate (wake weights / KV cache on GPU, or only `tags` of them); True when
        done."""

    @abstractmethod
    def finish_generation(self, **kwargs: object) -> bool:
        """Release generation memory for training (sleep on GPU when colocated); True when done."""

    @abstractmethod
    def prepare_refit_info(self, state_dict_info: StateDictInfo) -> None:
        """Tell the engine which parameters (name -> (shape, dtype)) later refits will carry."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Load new weights (HF names, full tensors); returns the engine-side fingerprint."""

    @abstractmethod
    def update_weights_from_buckets(self, buckets: Iterable[object]) -> str:
        """Load refit buckets (boxes from the trainer's rank 0: IPC descriptors or [object ref], never read by the
        driver);
        returns the fingerprint of everything loaded, checked across the engine's workers."""

    @abstractmethod
    def init_collective_async(self, master_addr: str, master_port: int, rank_offset: int, world_size: int
                              ) -> list[ray.ObjectRef[object]]:
        """Start joining the refit group (rlpost.distributed.collective) whose rank 0 is the trainer: engine worker k
        takes rank rank_offset + k. The trainer's rank 0 joins concurrently; `wait_collective_init` waits for the
        group to form."""

    @abstractmethod
    def wait_collective_init(self, futures: list[ray.ObjectRef[object]]) -> None:
        """Wait for `init_collective_async`."""

    @property
    @abstractmethod
    def engine_world_size(self) -> int:
        """Processes of the engine that join the refit group."""

    @abstractmethod
    def update_weights_from_collective_async(self) -> list[ray.ObjectRef[str]]:
        """Start receiving a broadcast; finish with `wait_collective_update`."""

    @abstractmethod
    def wait_collective_update(self, futures: list[ray.ObjectRef[str]], expected: str | None = None) -> str:
        """Wait for a collective refit; the engine's workers must agree (and match `expected` when given);
        returns the fingerprint."""

    @abstractmethod
    def set_call_timeout(self, timeout_s: float) -> None:
        """Bound every later remote call by `timeout_s` (the loop tightens it once step times are known)."""

    @abstractmethod
    def shutdown(self, graceful: bool = True) -> None:
        """Stop the engine and release its workers (idempotent): `graceful` stops each engine first (bounded); a
        failed or abandoned run passes False and the workers are killed at once."""
