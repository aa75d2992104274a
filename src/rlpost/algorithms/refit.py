"""refit_policy_generation: the policy's current weights into the rollout engine, verified; and
wake_for_generation, which readies a sleeping engine that needs no new weights.

Colocated: the policy's rank 0 writes one bucket of at most refit_buffer_size_gb at a time into its
reusable shared-memory segment (one node: rlpost.distributed.shm_buckets) or the Ray object store
(rlpost.distributed.weight_buckets) and the engines load it from there; the driver only forwards the
descriptor or the reference. Non-colocated: rank 0
broadcasts over a torch.distributed group it shares with the engine workers (gloo on CPU, NCCL on
GPU). Either way both sides compute a weight fingerprint and a mismatch aborts: a silently stale
engine is the bug this prevents.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rlpost.models.fingerprint import FingerprintMismatch
from rlpost.models.generation.interfaces import GenerationInterface
from rlpost.models.policy.interfaces import ColocatablePolicyInterface, WeightBuckets

DEFAULT_CHUNK_BYTES = 256 * 2**20


def refit_policy_generation(
    policy: ColocatablePolicyInterface,
    policy_generation: GenerationInterface,
    colocated_inference: bool,
    dtype: str = "float32",
    refit_buffer_size_gb: float | None = None,
) -> float:
    """Refit and check; returns the seconds it took."""
    t0 = time.perf_counter()
    if colocated_inference:  # the engine shares the device: free the optimizer's share before it wakes
        policy.offload_before_refit()
    policy_generation.prepare_for_generation(tags=["weights"])
    if colocated_inference:
        bucket = int(refit_buffer_size_gb * 2**30) if refit_buffer_size_gb else DEFAULT_CHUNK_BYTES
        load_buckets(policy_generation, policy.export_weight_buckets(dtype, bucket))
    else:
        collective_refit(policy_generation, lambda: policy.broadcast_weights_collective(dtype))
    if colocated_inference:  # and the model's, before the engine allocates its KV cache
        policy.offload_after_refit()
    policy_generation.prepare_for_generation(tags=["kv_cache"])
    return time.perf_counter() - t0


def wake_for_generation(policy: ColocatablePolicyInterface, policy_generation: GenerationInterface,
                        colocated_inference: bool) -> bool:
    """Wake a sleeping engine that already serves the policy's weights (after a validation, or between dynamic
    sampling's batches); True when it was asleep. A colocated policy leaves the device first, as for a refit."""
    if not policy_generation.asleep:
        return False
    if colocated_inference:
        policy.offload_before_refit()
        policy.offload_after_refit()
    policy_generation.prepare_for_generation()
    return True


def load_buckets(policy_generation: GenerationInterface, buckets: WeightBuckets) -> str:
    """The engines load every bucket where rank 0 wrote it; the checked fingerprint (FingerprintMismatch when
    the engines loaded other weights than the policy exported)."""
    engine_fp = policy_generation.update_weights_from_buckets(buckets)
    if engine_fp != buckets.fingerprint:
        raise FingerprintMismatch(
            f"refit check failed: the engine loaded weights with fingerprint {engine_fp}, "
            f"the policy sent {buckets.fingerprint}"
        )
    return engine_fp


def collective_refit(policy_generation: GenerationInterface, send: Callable[[], str]) -> str:
    """The engines receive over the refit group while `send` broadcasts (it returns the sender's fingerprint);
    the checked fingerprint. A receiver that died breaks the broadcast: it is named, not the sender."""
    futures = policy_generation.update_weights_from_collective_async()
    try:
        sent = send()
    except Exception:
        policy_generation.check_alive()
        raise
    return policy_generation.wait_collective_update(futures, expected=sent)  # FingerprintMismatch on a difference


def init_refit_collective(
    policy: ColocatablePolicyInterface, policy_generation: GenerationInterface, host: str, port: int
) -> None:
    """Non-colocated: policy rank 0 (rank 0) and every engine worker (ranks 1..) join one group."""
    world = 1 + policy_generation.engine_world_size
    engine_f = policy_generation.init_collective_async(host, port, 1, world)
    policy.init_refit_collective(host, port, world)
    policy_generation.wait_collective_init(engine_f)
