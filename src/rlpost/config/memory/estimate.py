"""Whether a run fits, from its config and the model's config.json alone: each worker's estimate (rlpost.config.memory
.workers) laid onto the devices, the peak of the fullest device over the phases of a step, and, when it does not fit,
the first change that makes it fit.

On a GPU the workers that share a device (a colocated engine and the policy) are summed phase by phase: what sleeps
or is offloaded then counts in host memory. On the CPU every worker of a node shares its RAM, and a process keeps the
pages it once touched, so the node's figure is the sum of each worker's peak.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

from rlpost.config.device_defaults import run_device
from rlpost.config.lora_params import is_megatron, model_shape
from rlpost.config.memory.shape import BYTES, ModelShape
from rlpost.config.memory.workers import GIB, Usage, Worker, driver_worker, engine_worker, policy_worker
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.supervised_master import SupervisedMasterConfig

Config = MasterConfig | SupervisedMasterConfig


@dataclass
class Estimate:
    """The memory plan of a run."""

    device: str
    """cpu or cuda."""
    device_gib: float | None
    """One device's memory (a GPU's, or a node's RAM on CPU); None when unknown (cuda without NVML or
    cluster.gpu_memory_gb)."""
    workers: list[Worker]
    """Every worker group."""
    peak_gib: float
    """The fullest device's peak over the step's phases."""
    peak_phase: str
    """The phase of that peak ('all' on CPU, where the peaks add up)."""
    peak_items: dict[str, float]
    """What makes that peak, GiB by item, largest first."""
    host_gib: float
    """Host memory of the busiest node besides its devices (offloaded and CPU-kept state); on CPU it
    is part of the peak."""

    @property
    def fits(self) -> bool | None:
        return None if self.device_gib is None else self.peak_gib <= self.device_gib

    def worker_rows(self) -> list[dict[str, Any]]:
        """The `workers` entry of `rlpost plan --json`: one per rank, its peak over the phases and its items."""
        out = []
        for w in self.workers:
            phase, items = worker_peak(w)
            for rank in range(w.ranks):
                out.append({"group": w.group, "rank": rank, "device": w.device, "phase": phase,
                            "estimate_gib": round(sum(items.values()) / GIB, 3),
                            "items": {k: round(v / GIB, 3) for k, v in items.items()}})
        return out


def _on_device(w: Worker, u: Usage) -> dict[str, float]:
    """What a process holds in one phase as its device sees it: on CPU its host items count too (one RAM)."""
    return {**u.device, **u.host} if w.device == "cpu" else dict(u.device)


def worker_peak(w: Worker) -> tuple[str, dict[str, float]]:
    """(phase, items in bytes) of a worker's largest phase."""
    phase = max(w.phases, key=lambda ph: sum(_on_device(w, w.phases[ph]).values()))
    return phase, _on_device(w, w.phases[phase])


def device_gib(cfg: Config, device: str) -> float | None:
    """One device's memory in GiB: cluster.gpu_memory_gb, else NVML's first GPU (cuda) or this machine's RAM (cpu)."""
    if device == "cuda":
        if cfg.cluster.gpu_memory_gb is not None:
            return float(cfg.cluster.gpu_memory_gb)
        try:
            import pynvml

            pynvml.nvmlInit()
            return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total / GIB
        except Exception:  # noqa: BLE001 - no bindings, driver or GPU: unknown
            return None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def _engine(cfg: MasterConfig, shape: ModelShape, device: str, dev_bytes: float | None) -> Worker | None:
    from rlpost.config.layout import layout_of

    gen = cfg.generation
    v = getattr(gen, "vllm_cfg", None)
    lay = layout_of(cfg)
    if v is None:  # the HF engine generates with the policy's own workers
        return None
    max_len = v.max_model_len or cfg.policy.max_total_sequence_length
    kv = (v.kv_cache_space_gb * GIB if v.kv_cache_space_gb is not None
          else min(max(shape.kv_bytes_per_token(v.precision) * max_len * 256, 2**24), GIB))
    return engine_worker(shape, v.precision, lay.gen_tp, lay.gen_world, device, device_bytes=dev_bytes,
                         utilization=v.gpu_memory_utilization, kv_cache_bytes=kv, eager=bool(v.enforce_eager),
                         colocated=lay.colocated,
                         max_num_seqs=int((getattr(gen, "vllm_kwargs", None) or {}).get("max_num_seqs", 256)))


def _shape_of(cfg: Config) -> ModelShape | None:
    """The policy's model with its adapters."""
    key, lora = cfg.policy.lora_settings("policy")
    hf = model_shape(cfg)
    return ModelShape.from_hf(hf, lora, is_megatron(key)) if hf is not None else None


def estimate(cfg: Config) -> Estimate | None:
    """The run's memory plan; None when the model's layout is one rlpost cannot count."""
    device = run_device(cfg.cluster.device)
    shape = _shape_of(cfg)
    if shape is None:
        return None
    dev_gib = device_gib(cfg, device)
    dev_bytes = dev_gib * GIB if dev_gib is not None else None
    world = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    workers: list[Worker] = []
    if isinstance(cfg, MasterConfig):
        from rlpost.config.layout import layout_of

        world = layout_of(cfg).train_world
        engine = _engine(cfg, shape, device, dev_bytes)
        kl = float(getattr(cfg.loss_fn, "reference_policy_kl_penalty", 0.0) or 0.0)
        workers.append(policy_worker(cfg.policy, shape, device, world, reference=kl != 0.0,
                                     colocated_engine=engine is not None and engine.shares_device_with is not None))
        if engine is not None:
            workers.append(engine)
            if device == "cpu" and layout_of(cfg).refit == "ipc":
                _add_refit_buffer(workers, cfg, shape)
        from rlpost.config.algorithms import side_memory

        workers += side_memory(cfg, device, world)
    else:
        workers.append(policy_worker(cfg.policy, shape, device, world, reference=cfg.algo == "dpo"))
    workers.append(driver_worker())
    return _lay_out(device, dev_gib, workers, cfg.cluster.num_nodes)


def _add_refit_buffer(workers: list[Worker], cfg: MasterConfig, shape: ModelShape) -> None:
    """The colocated refit's shared-memory buffer on CPU: the policy rank writes each bucket into it and the engine
    worker beside it maps it, so it is resident in both (kept from one refit to the next); the engine copies each
    bucket's tensors out of it as it loads them, which its allocator keeps. On a GPU the buffer is a transient CUDA
    allocation during the refit, below the phases' peaks."""
    dtype_bytes = BYTES.get(cfg.generation.weight_dtype(), 4)
    # a bucket holds whole layer groups (rlpost.distributed.weight_buckets): a decoder layer, or the embedding (a tied
    # output layer is not sent apart: the engine derives it); larger than the buffer's size, it sets the bucket's
    group = max(shape.vocab * shape.hidden, shape.layer_params) * dtype_bytes
    bucket = max(min(dtype_bytes * shape.params, (cfg.policy.refit_buffer_size_gb or 0.25) * GIB), group)
    # the engine loads the head it derives as it loads the embedding, a copy each
    loaded = max(bucket, 2 * shape.vocab * shape.hidden * dtype_bytes) if shape.tied else bucket
    for w in workers:
        for usage in w.phases.values():
            usage.device["refit buffer"] = bucket
            if w.group == "engine":
                usage.device["refit load copy"] = loaded


def _lay_out(device: str, dev_gib: float | None, workers: list[Worker], nodes: int) -> Estimate:
    host = sum(max(sum(u.host.values()) for u in w.phases.values()) * w.ranks for w in workers) / max(nodes, 1)
    if device == "cpu":  # one RAM per node: every process's peak, the node's share of the workers
        items: dict[str, float] = {}
        for w in workers:
            share = w.ranks / max(nodes, 1) if w.group != "driver" else 1
            for k, v in worker_peak(w)[1].items():
                items[f"{w.group} {k}"] = items.get(f"{w.group} {k}", 0.0) + v * share
        peak, phase = sum(items.values()), "all"
    else:  # one GPU: the policy rank and whatever shares its device, phase by phase; or an engine GPU of its own
        shared = [w for w in workers if w.group == "policy" or w.shares_device_with == "policy"]
        phases = {ph for w in shared for ph in w.phases}
        candidates = []
        for ph in phases:
            got: dict[str, float] = {}
            for w in shared:
                u = w.phases.get(ph) or w.phases[worker_peak(w)[0]]
                got.update({f"{w.group} {k}": v for k, v in u.device.items()})
            candidates.append((sum(got.values()), ph, got))
        for w in workers:
            if w.device == "cuda" and w not in shared:
                ph, got = worker_peak(w)
                candidates.append((sum(got.values()), ph, {f"{w.group} {k}": v for k, v in got.items()}))
        peak, phase, items = max(candidates, key=lambda c: c[0])
    ordered = dict(sorted(((k, v / GIB) for k, v in items.items()), key=lambda kv: -kv[1]))
    return Estimate(device, dev_gib, workers, peak / GIB, phase, ordered, host / GIB)


def _set(cfg: Config, dotted: str, value: object) -> Config:
    """A deep copy of `cfg` with one field set (no checks: an estimate of a variant)."""
    out = copy.deepcopy(cfg)
    *parents, last = dotted.split(".")
    node: Any = out
    for name in parents:
        node = getattr(node, name)
    setattr(node, last, value)
    return out


def fixes(cfg: Config) -> list[tuple[str, Config]]:
    """The changes that would shrink the run, as (override, the changed config), in the order a user would try them:
    activation checkpointing, half the micro-batch tokens, offload, LoRA, a lower engine share."""
    p = cfg.policy
    out: list[tuple[str, Config]] = []
    backend = "megatron_cfg" if hasattr(p, "megatron_cfg") else "dtensor_cfg"
    block = getattr(p, backend)
    if not block.activation_checkpointing:
        out.append((f"policy.{backend}.activation_checkpointing=true",
                    _set(cfg, f"policy.{backend}.activation_checkpointing", True)))
    if p.dynamic_batching.enabled and (p.dynamic_batching.train_mb_tokens or 0) > p.max_total_sequence_length:
        half = max(p.max_total_sequence_length, (p.dynamic_batching.train_mb_tokens or 0) // 2)
        out.append((f"policy.dynamic_batching.train_mb_tokens={half}",
                    _set(cfg, "policy.dynamic_batching.train_mb_tokens", half)))
    elif p.train_micro_batch_size > 1:
        half = p.train_micro_batch_size // 2
        out.append((f"policy.train_micro_batch_size={half}", _set(cfg, "policy.train_micro_batch_size", half)))
    if run_device(cfg.cluster.device) == "cuda" and backend == "dtensor_cfg" and not block.cpu_offload:
        out.append(("policy.dtensor_cfg.cpu_offload=true", _set(cfg, "policy.dtensor_cfg.cpu_offload", True)))
    key, lora = p.lora_settings("policy")
    if not lora.enabled and key.endswith("lora_cfg"):
        out.append((f"{key}.enabled=true", _set(cfg, f"{key}.enabled", True)))
    v = getattr(getattr(p, "generation", None), "vllm_cfg", None)
    if v is not None and run_device(cfg.cluster.device) == "cuda" and v.gpu_memory_utilization > 0.3:
        out.append(("policy.generation.vllm_cfg.gpu_memory_utilization=0.3",
                    _set(cfg, "policy.generation.vllm_cfg.gpu_memory_utilization", 0.3)))
    return out


def first_fix(cfg: Config) -> tuple[str, Estimate] | None:
    """The first change of `fixes` with which the run fits, and its estimate; None when none does alone."""
    for override, changed in fixes(cfg):
        est = estimate(changed)
        if est is not None and est.fits:
            return override, est
    return None
