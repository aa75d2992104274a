"""EngineGroup: the driver's side of an engine made of Ray actors, the same for every engine.

An engine's actors (vLLM's replica leaders, the HF engine's workers) each hold a model that sleeps and wakes and
takes new weights. What the driver does with them is one piece of code: it mirrors their sleep state
(rlpost.models.generation.sleep_state) so an awake engine costs no call, and it is the one weight receiver of every
refit transport (full tensors through the object store, buckets where the policy wrote them, a broadcast over the
refit group), checking that every actor loaded what the policy sent. A subclass starts the actors and generates.

Each actor answers the calls of `EngineActor`, which the driver makes through it (typed, never by a string).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, cast

import ray
import torch

from rlpost.distributed.bucket_layout import PerDeviceBuckets, is_per_device, slots_of
from rlpost.distributed.worker_groups import ALIVE_TIMEOUT_S, ActorGroup
from rlpost.models.fingerprint import check_fingerprints, fingerprint_of_digests, weight_fingerprint
from rlpost.models.generation.interfaces import GenerationInterface, StateDictInfo
from rlpost.models.generation.sleep_state import SleepState
from rlpost.models.generation.vllm_extension import FAULT_ENV

if TYPE_CHECKING:
    from rlpost.config.schema.generation import GenerationConfig
    from rlpost.distributed.bucket_layout import RefitBucket
    from rlpost.models.generation.outputs import EngineInfo

FAULT_REPLICA_ENV = "RLPOST_FAULT_CORRUPT_REFIT_REPLICA"
"""Test-only: which actor corrupts the parameter named by FAULT_ENV (default 0)."""

RefitInfo = dict[str, tuple[tuple[int, ...], str]]
"""name -> (shape, dtype string), as every later refit must carry them."""


class EngineActor(Protocol):
    """What the driver calls on each engine actor (rlpost.models.generation.vllm_worker.VllmEngineWorker, one per
    vLLM replica; hf_generation.HFGenerationWorker)."""

    def info(self) -> EngineInfo:
        """Tokenizer ids and where the actor runs (also the cheap liveness call)."""

    def state(self) -> str:
        """Its sleep state in words."""

    def sleep(self, level: int = 1) -> bool:
        """Release the device for training (rlpost.models.generation.sleep_state)."""

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake the `tags` parts (None: all)."""

    def prepare_refit_info(self, info: RefitInfo | None) -> None:
        """The names, shapes and dtypes every later refit carries."""

    def update_weights(self, named: list[tuple[str, torch.Tensor]], corrupt: str | None = None) -> str:
        """Load full tensors; the fingerprint of what was loaded."""

    def load_bucket(self, box: RefitBucket, corrupt: str | None = None, last: bool = False) -> dict[str, str]:
        """Load one refit bucket; per-tensor digests. `last`: `end_refit` runs in the same call."""

    def end_refit(self) -> bool:
        """After a refit's last bucket."""

    def init_collective(self, host: str, port: int, rank_offset: int, world_size: int, timeout_s: float) -> object:
        """Join the trainer's refit group from rank `rank_offset`."""

    def update_weights_from_collective(self, corrupt: str | None = None) -> str:
        """Receive the trainer's broadcast and load it; the fingerprint."""

    def shutdown(self) -> bool:
        """Release what the actor holds before it is killed."""


class EngineGroup(GenerationInterface):
    """Sleep and refit for an engine's actors (`group.workers`); the subclass sets `cfg`, `group` and `slots`."""

    cfg: GenerationConfig
    group: ActorGroup
    slots: int = 1
    """Worker slots (devices) per actor: refit-group ranks and per-device bucket descriptors per actor."""
    who: str = "worker"
    """What an actor is called in a fingerprint mismatch."""

    def __init__(self) -> None:
        self.sleep_state = SleepState()  # the actors' state as this side last set it (they start awake)
        self._refit_info: RefitInfo | None = None

    @property
    def actors(self) -> list[Any]:
        return self.group.workers


    def set_call_timeout(self, timeout_s: float) -> None:
        self.group.timeout_s = timeout_s

    def check_alive(self) -> None:
        self.group.check_alive(EngineActor.info, ALIVE_TIMEOUT_S)

    # ------------------------------------------------------------------ sleep and wake
    @property
    def asleep(self) -> bool:
        return not self.sleep_state.awake

    def prepare_for_generation(self, tags: list[str] | None = None, **kwargs: object) -> bool:
        """Wake the `tags` parts of every actor (None: weights and KV cache) that are asleep; nothing to do when
        they are awake."""
        parts = self.sleep_state.to_wake(tags)
        if parts:
            self.group.call_all(EngineActor.wake_up, parts)
            self.sleep_state.woke(parts)
        return True

    def finish_generation(self, **kwargs: object) -> bool:
        """Put a colocated engine to sleep (on a GPU its weights to host memory and its KV cache dropped, on a CPU
        the state alone); an engine on workers of its own stays awake."""
        if self.cfg.colocated.enabled and not self.sleep_state.asleep:
            self.group.call_all(EngineActor.sleep, 1)
            self.sleep_state.slept()
        return True

    def sleep_once_started(self) -> list[ray.ObjectRef[object]]:
        """Colocated: each actor's sleep call, queued behind its start (an actor runs its calls in order); the
        handles are ready once every actor sleeps. On workers of its own: none."""
        if not self.cfg.colocated.enabled:
            return []
        self.sleep_state.slept()
        return cast(list["ray.ObjectRef[object]"], self.group.call_async(EngineActor.sleep, 1))

    def state(self) -> list[str]:
        """Each actor's sleep state in words, as the actor itself holds it."""
        return self.group.call_all(EngineActor.state)

    # ------------------------------------------------------------------ refit
    def prepare_refit_info(self, state_dict_info: StateDictInfo) -> None:
        """Every later refit must carry exactly these names, shapes and dtypes (checked in the actors)."""
        self._refit_info = {n: (tuple(int(d) for d in s), str(dt)) for n, (s, dt) in state_dict_info.items()}
        self.group.call_all(EngineActor.prepare_refit_info, self._refit_info)

    def _fault(self, index: int) -> str | None:
        """Test-only: the parameter actor `index` corrupts before loading (FAULT_ENV, on FAULT_REPLICA_ENV's actor)."""
        name = os.environ.get(FAULT_ENV)
        return name if name and index == int(os.environ.get(FAULT_REPLICA_ENV, "0")) else None

    def expected_fingerprint(self, items: list[tuple[str, torch.Tensor]]) -> str:
        """The fingerprint the actors must report after loading full tensors `items`."""
        return weight_fingerprint(items)

    def _check(self, fps: list[str], expected: str | None) -> str:
        return check_fingerprints(fps, expected, who=self.who)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Send full HF-named tensors to every actor (object store) and load them; the checked fingerprint."""
        items = [(n, t.detach().to("cpu").contiguous()) for n, t in named_tensors]
        ref = ray.put(items)
        fps = self.group.get([self.group.submit(i, EngineActor.update_weights, ref, self._fault(i))  # type: ignore[arg-type]
                              for i in range(len(self.actors))])
        return self._check(fps, self.expected_fingerprint(items))

    def update_weights_from_buckets(self, buckets: Iterable[object]) -> str:
        """Every actor loads each bucket where the policy wrote it (the IPC buffers of the policy ranks on its
        devices, or the object store); the checked fingerprint. The last bucket carries `end_refit` along when the
        buckets know their count."""
        digests: list[dict[str, str]] = [{} for _ in self.actors]
        ended = False
        for k, box in enumerate(buckets):
            ended = getattr(buckets, "planned", None) == k + 1
            parts = self.group.get([self.group.submit(i, EngineActor.load_bucket, self._box_for(box, i), self._fault(i),
                                                      ended) for i in range(len(self.actors))])
            for i, part in enumerate(parts):
                digests[i].update(part)
        if not ended:
            self.group.call_all(EngineActor.end_refit)
        return self._check([self._complete(d) for d in digests], None)

    def _box_for(self, box: object, index: int) -> RefitBucket:
        """What actor `index` loads of a bucket: of per-device buckets, those of the policy ranks on its own slots;
        any other box as it is."""
        if not is_per_device(box):
            return cast("RefitBucket", box)
        return slots_of(cast(PerDeviceBuckets, box), index * self.slots, self.slots)

    def _complete(self, digests: dict[str, str]) -> str:
        missing = sorted(set(self._refit_info or {}) - set(digests))
        if missing:
            raise RuntimeError(f"refit did not carry {missing[:5]} (prepare_refit_info announced them)")
        return fingerprint_of_digests(digests)

    @property
    def engine_world_size(self) -> int:
        """Processes that join the refit group."""
        return len(self.actors) * self.slots

    def init_collective_async(self, master_addr: str, master_port: int, rank_offset: int, world_size: int,
                              timeout_s: float = 300.0) -> list[ray.ObjectRef[object]]:
        """Start joining the refit group (actor i's workers take ranks rank_offset + i * slots + k)."""
        return [self.group.submit(i, EngineActor.init_collective, master_addr, master_port, rank_offset + i * self.slots,
                                  world_size, timeout_s) for i in range(len(self.actors))]

    def wait_collective_init(self, futures: list[ray.ObjectRef[object]]) -> None:
        self.group.get(futures)

    def update_weights_from_collective_async(self) -> list[ray.ObjectRef[str]]:
        """Start receiving a broadcast; finish with `wait_collective_update(futures)`."""
        return [self.group.submit(i, EngineActor.update_weights_from_collective, self._fault(i))
                for i in range(len(self.actors))]

    def wait_collective_update(self, futures: list[ray.ObjectRef[str]], expected: str | None = None) -> str:
        """Wait for a collective refit; the actors must agree (and match `expected`, the sender's, if given)."""
        return self._check(self.group.get(futures), expected)
