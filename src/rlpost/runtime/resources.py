"""Resource metrics of a step (`logger.resource_metrics`), sampled on the driver, logged under resources/:

- `resources/<actor>/cpu_percent`, `resources/<actor>/rss_gib`, `resources/<actor>/peak_rss_gib` (the peak resident
  set so far, Linux's VmHWM, summed over the actor's processes): each live Ray actor of this job (policy ranks,
  engine replicas, a critic, a teacher, a reward model's scorer, ...), its process and the processes it started;
  CPU % is over the time since the previous sample (since the process started, at the first), 100 = one core busy.
  An actor is named after its Ray actor name without the group's unique suffix (`policy-0`, `vllm-0`), else its
  class.
- `resources/<actor>/gpu_memory_gib`, `resources/<actor>/peak_gpu_gib` (the largest sampled so far) and
  `resources/gpu<i>/{utilization_pct,memory_used_gib}` where NVML answers
  (nvidia-ml-py): a process's device memory and each device's load, as NeMo RL's `logger.monitor_gpus` shows them;
  another node's devices are `resources/node_<ip>/gpu<i>/...`.
- `resources/driver/{cpu_percent,rss_gib}`: the driver process itself (not its children: a local Ray's processes).
- `resources/generation_tokens_per_s`, `resources/training_tokens_per_s`: tokens the engine generated over the
  generation phase, tokens the update trained on over the training phase (the whole step when the algorithm has no
  such phase: SFT, DPO).

No worker is asked anything: the driver reads its node's processes through psutil, and a probe actor of no CPU
(`NodeSampler`, pinned to its node) reads each other node's, so sampling costs no call into a busy worker and works
the same for every backend. A probe that does not answer within `PROBE_WAIT_S` is left out of that step.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from typing import Any

import psutil

GIB = float(2**30)
PROBE_WAIT_S = 5.0
"""How long a step's row waits for the other nodes' probes."""
_UNIQUE_SUFFIX = re.compile(r"-[0-9a-f]{6,}$")
"""Worker groups name their actors `<prefix>-<rank>-<id of the group>` (rlpost.distributed.worker_groups)."""


def actor_label(name: str, class_name: str) -> str:
    """The metric name of an actor: its Ray name without the group's unique suffix, else its class; only characters
    every tracker accepts in a metric name."""
    label = _UNIQUE_SUFFIX.sub("", name) if name else class_name.lower()
    return re.sub(r"[^A-Za-z0-9_.-]", "_", label) or "actor"


def tokens_per_s(generated_tokens: float | None, trained_tokens: float, times: Mapping[str, float]
                 ) -> dict[str, float]:
    """resources/{generation,training}_tokens_per_s of a step from its token counts and its phase times (s)."""
    out: dict[str, float] = {}
    gen_s = times.get("generation", 0.0)
    if generated_tokens is not None and gen_s > 0:
        out["resources/generation_tokens_per_s"] = generated_tokens / gen_s
    train_s = times.get("policy_training") or times.get("total_step_time", 0.0)
    if train_s > 0:
        out["resources/training_tokens_per_s"] = trained_tokens / train_s
    return out


class _ProcessTree:
    """A process and its descendants: CPU time and RSS summed, CPU % over the time between samples."""

    def __init__(self, proc: psutil.Process, with_children: bool = True) -> None:
        self.proc = proc
        self.with_children = with_children
        self.last_cpu: float | None = None
        self.last_wall = 0.0

    def _members(self) -> list[psutil.Process]:
        if not self.with_children:
            return [self.proc]
        try:
            return [self.proc, *self.proc.children(recursive=True)]
        except psutil.Error:
            return [self.proc]

    def sample(self) -> dict[str, float] | None:
        cpu = rss = peak = 0.0
        for p in self._members():
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    cpu += t.user + t.system + t.children_user + t.children_system
                    rss += p.memory_info().rss
                peak += peak_rss(p.pid)
            except psutil.Error:
                if p is self.proc:
                    return None  # the actor's process is gone
        now = time.monotonic()
        if self.last_cpu is None:  # first sample: the average since the process started
            wall = max(time.time() - self.proc.create_time(), 1e-6)
            pct = 100.0 * cpu / wall
        else:
            pct = 100.0 * (cpu - self.last_cpu) / max(now - self.last_wall, 1e-6)
        self.last_cpu, self.last_wall = cpu, now
        return {"cpu_percent": max(pct, 0.0), "rss_gib": rss / GIB, "peak_rss_gib": max(peak, rss) / GIB}


def peak_rss(pid: int) -> float:
    """The process's peak resident set so far in bytes (Linux's VmHWM), 0 where the kernel does not say."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


class _Nvml:
    """NVML, when the bindings and a driver answer: per-process device memory and per-device utilisation."""

    def __init__(self) -> None:
        self.nv: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - no bindings, no driver or no GPU: nothing to sample
            self.nv = None
            self.handles = []

    def devices(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for i, h in enumerate(self.handles):
            try:
                out[f"resources/gpu{i}/utilization_pct"] = float(self.nv.nvmlDeviceGetUtilizationRates(h).gpu)
                out[f"resources/gpu{i}/memory_used_gib"] = self.nv.nvmlDeviceGetMemoryInfo(h).used / GIB
            except Exception:  # noqa: BLE001, S112 - a device that does not answer is left out
                continue
        return out

    def memory_by_pid(self) -> dict[int, float]:
        used: dict[int, float] = {}
        for h in self.handles:
            try:
                procs = self.nv.nvmlDeviceGetComputeRunningProcesses(h)
            except Exception:  # noqa: BLE001, S112
                continue
            for p in procs:
                used[p.pid] = used.get(p.pid, 0.0) + (p.usedGpuMemory or 0) / GIB
        return used


def _job_actors() -> dict[str, dict[str, int]]:
    """node id -> {label: pid} of the live actors of this Ray job, the probes left out ({} without Ray)."""
    try:
        import ray

        if not ray.is_initialized():
            return {}
        job = ray.get_runtime_context().get_job_id()
        table = ray._private.state.actors()  # noqa: SLF001 - the GCS actor table: name, pid, node (no dashboard)
    except Exception:  # noqa: BLE001 - a Ray without that table: no per-actor numbers
        return {}
    found: dict[str, dict[str, int]] = {}
    labels: set[str] = set()
    for info in table.values():
        if info.get("State") != "ALIVE" or info.get("JobID") != job or not info.get("Pid"):
            continue
        if info.get("ActorClassName") == NodeSampler.__name__:
            continue
        label = actor_label(str(info.get("Name") or ""), str(info.get("ActorClassName") or "actor"))
        n, base = 1, label
        while label in labels:
            n += 1
            label = f"{base}_{n}"
        labels.add(label)
        found.setdefault(str((info.get("Address") or {}).get("NodeID")), {})[label] = int(info["Pid"])
    return found


class NodeSampler:
    """The processes and devices of one node: each actor's process tree by pid (kept between samples, so CPU %
    covers the time since the last one) and NVML. The driver holds one for its node; other nodes run one as a
    probe actor."""

    def __init__(self) -> None:
        self._trees: dict[int, _ProcessTree] = {}
        self._gpu_peaks: dict[int, float] = {}
        """pid -> the largest device memory sampled of it (NVML reports only the current use)."""
        self._nvml = _Nvml()

    def _tree(self, pid: int) -> _ProcessTree | None:
        if pid not in self._trees:
            try:
                self._trees[pid] = _ProcessTree(psutil.Process(pid))
            except psutil.Error:
                return None
        return self._trees[pid]

    def sample(self, actors: dict[str, int], devices: str = "resources/gpu",
               extra_pids: dict[str, int] | None = None) -> dict[str, float]:
        """resources/<label>/* of the actors (label -> pid) on this node, the devices as `<devices><i>/*`, and
        the device memory of `extra_pids` (label -> pid, e.g. the driver)."""
        out: dict[str, float] = {}
        gpu_mem = self._nvml.memory_by_pid() if self._nvml.handles else {}
        for label, pid in actors.items():
            tree = self._tree(pid)
            got = tree.sample() if tree is not None else None
            if got is None:
                continue
            out.update({f"resources/{label}/{k}": v for k, v in got.items()})
            if pid in gpu_mem:
                out[f"resources/{label}/gpu_memory_gib"] = gpu_mem[pid]
                peak = max(self._gpu_peaks.get(pid, 0.0), gpu_mem[pid])
                self._gpu_peaks[pid] = out[f"resources/{label}/peak_gpu_gib"] = peak
        for label, pid in (extra_pids or {}).items():
            if pid in gpu_mem:
                out[f"resources/{label}/gpu_memory_gib"] = gpu_mem[pid]
        out.update({k.replace("resources/gpu", devices, 1): v for k, v in self._nvml.devices().items()})
        live = set(actors.values())
        self._trees = {pid: t for pid, t in self._trees.items() if pid in live}
        self._gpu_peaks = {pid: v for pid, v in self._gpu_peaks.items() if pid in live}
        return out


class ResourceMonitor:
    """Samples the driver and this job's actors on every node (see the module docstring); one instance per run."""

    def __init__(self) -> None:
        self._driver = _ProcessTree(psutil.Process(os.getpid()), with_children=False)  # its children: Ray's own
        self._local = NodeSampler()
        self._probes: dict[str, Any] = {}
        """node id -> the NodeSampler actor on that node."""

    def sample(self) -> dict[str, float]:
        """resources/* of every process now (no token rates: `tokens_per_s`)."""
        out: dict[str, float] = {}
        driver = self._driver.sample() or {}
        out.update({f"resources/driver/{k}": v for k, v in driver.items()})
        by_node = _job_actors()
        here = _this_node()
        out.update(self._local.sample(by_node.pop(here, {}), extra_pids={"driver": os.getpid()}))
        if by_node:
            out.update(self._remote(by_node))
        return out

    def _remote(self, by_node: dict[str, dict[str, int]]) -> dict[str, float]:
        """The other nodes' samples, from their probes (started at the first need); a probe that fails is dropped
        (its node is gone: the worker groups end the run), one that is late is left out of this row."""
        import ray

        ips = _node_ips()
        calls = {}
        for node, actors in by_node.items():
            probe = self._probes.get(node) or self._start_probe(node)
            if probe is not None:
                prefix = f"resources/node_{ips.get(node, node[:8])}/gpu"
                calls[probe.sample.remote(actors, prefix)] = node
        if not calls:
            return {}
        ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=PROBE_WAIT_S)
        out: dict[str, float] = {}
        for ref in ready:
            try:
                out.update(ray.get(ref, timeout=PROBE_WAIT_S))
            except Exception:  # noqa: BLE001 - the probe or its node died: no numbers from there
                self._probes.pop(calls[ref], None)
        return out

    def _start_probe(self, node: str) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        try:
            probe = ray.remote(NodeSampler).options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        except Exception:  # noqa: BLE001 - a node that cannot take an actor: not sampled
            return None
        self._probes[node] = probe
        return probe


def _this_node() -> str:
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001
        return ""


def _node_ips() -> dict[str, str]:
    """node id -> its IP address, for the names of another node's device metrics."""
    try:
        import ray

        return {str(n["NodeID"]): str(n["NodeManagerAddress"]) for n in ray.nodes()}
    except Exception:  # noqa: BLE001
        return {}
