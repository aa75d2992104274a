"""Benchmark the colocated refit alone: the policy (its configured backend, on Ray) hands its weights to a vLLM
engine on the same node, N times; printed and saved beside its limits measured in the same run (benchmarks.limits):

- bare load: the same engine class in this process loading the same weights in place, as a refit does;
- memcpy: copying the model's bytes once.

    make smollm2 && .venv/bin/python -m benchmarks.refit model=smollm2_135m      # 540 MB fp32
    .venv/bin/python -m benchmarks.refit --refits 20                              # the default tiny model
    .venv/bin/python -m benchmarks.refit model=smollm2_135m policy.dtensor_cfg.lora_cfg.enabled=true \
        policy.dtensor_cfg.lora_cfg.refit=adapter                                 # LoRA: the adapters alone

Extra arguments are Hydra overrides (e.g. policy.refit_buffer_size_gb=1). The refit runs on the device the run
would (`cluster.device`, resolved as `rlpost train` resolves it): with cluster.device=cuda the bundles hold GPUs,
the policy computes on CUDA and the engine is a GPU engine with sleep mode, asleep before each refit as between a
run's steps (the CUDA IPC refit); on CPU the same on CPU bundles. Results go to results/bench_refit.json, the latest
run per configuration.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from benchmarks.harness import RESULTS_DIR, Row, host, now, run_key, save_latest

if TYPE_CHECKING:
    from rlpost.config.schema.master import MasterConfig
    from rlpost.distributed.virtual_cluster import RayVirtualCluster

RESULTS = RESULTS_DIR / "bench_refit.json"


CPU_BUNDLE_CPUS = 0.4
"""CPUs of the one bundle on a CPU machine (the policy rank and the engine share it)."""


@dataclass(frozen=True)
class RefitSetup:
    """Where the benchmark's policy and engine run."""

    device: str
    """'cuda' or 'cpu': where the policy and the engine compute."""
    use_gpus: bool
    """The bundle reserves a GPU (shared by the colocated policy rank and engine, half each)."""
    cpus_per_bundle: float
    """CPUs the bundle reserves: the run's two colocated groups' worth on a GPU, CPU_BUNDLE_CPUS on a CPU."""

    def cluster(self) -> RayVirtualCluster:
        """The one-bundle cluster the policy and the engine share (not yet placed: nothing starts here)."""
        from rlpost.distributed.virtual_cluster import RayVirtualCluster

        return RayVirtualCluster("bench-refit", 1, use_gpus=self.use_gpus, cpus_per_bundle=self.cpus_per_bundle,
                                 max_colocated_worker_groups=2)


def refit_setup(cfg: MasterConfig, device: str | None = None) -> RefitSetup:
    """The setup for `cfg`: its cluster.device resolved as a run resolves it (a GPU that cannot be used is refused,
    rlpost.runtime.cuda_driver), or `device` when given."""
    from rlpost.distributed.virtual_cluster import resolve_device

    device = device or resolve_device(cfg.cluster)
    on_gpu = device == "cuda"
    return RefitSetup(device, on_gpu, cfg.cluster.worker_num_cpus * 2 if on_gpu else CPU_BUNDLE_CPUS)


def refit_times(cfg: MasterConfig, refits: int) -> tuple[list[float], int]:
    """Seconds of each of `refits` colocated refits (policy -> engine, fingerprint-checked) on a local Ray, and the
    bytes each moves (with LoRA served as an adapter, `lora_cfg.refit=adapter`, the adapters' alone). As in a run:
    the engine starts first and goes to sleep before the policy is built, and sleeps again before each refit."""
    import ray

    from rlpost.algorithms.refit import refit_policy_generation
    from rlpost.config.schema.generation import VllmConfig
    from rlpost.distributed.virtual_cluster import init_ray
    from rlpost.models.generation.vllm_generation import VllmGeneration
    from rlpost.models.policy.lm_policy import Policy

    gen = cfg.generation
    if not isinstance(gen, VllmConfig):
        raise SystemExit("benchmarks.refit measures the vLLM engine's refit (generation=vllm)")
    setup = refit_setup(cfg)
    if cfg.model.tiny is not None:  # built on first use, as a run builds it
        from rlpost.models.tiny import ensure_tiny_model

        ensure_tiny_model(cfg.model.tiny, cfg.model.path)
    init_ray(cfg.cluster)  # the Ray a run starts
    cluster = setup.cluster()
    from rlpost.config.lora_params import adapter_config

    key, lora = cfg.policy.lora_settings("policy")
    adapter = adapter_config(key, lora, str(cfg.policy.model_name)) if lora.enabled and lora.refit == "adapter" \
        else None
    engine = policy = None
    try:
        engine = VllmGeneration(gen, cluster, str(cfg.policy.model_name), timeout_s=cfg.cluster.call_timeout_s,
                                hf_overrides=dict(cfg.policy.hf_config_overrides), lora_adapter=adapter)
        engine.wait_started()
        engine.finish_generation()  # colocated: asleep, its memory free for the policy
        policy = Policy(cluster, cfg.policy, device=setup.device, timeout_s=cfg.cluster.call_timeout_s)
        info = policy.prepare_refit_info(gen.vllm_cfg.precision)
        engine.prepare_refit_info(info)
        moved = sum(math.prod(shape) * dtype.itemsize for shape, dtype in info.values())
        out = []
        for _ in range(refits):
            engine.finish_generation()  # between a run's steps the engine sleeps while the policy trains
            out.append(refit_policy_generation(policy, engine, True, gen.vllm_cfg.precision,
                                               cfg.policy.refit_buffer_size_gb))
        return out, moved
    finally:
        if engine is not None:
            engine.shutdown()
        if policy is not None:
            policy.shutdown()
        cluster.shutdown()
        ray.shutdown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.refit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refits", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1, help="refits excluded from the statistics (the first maps)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("overrides", nargs="*")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from rlpost.config.load import load_master_config
    from rlpost.config.schema.master import MasterConfig

    _, cfg = load_master_config(args.overrides)
    if not isinstance(cfg, MasterConfig) or "Vllm" not in cfg.generation._target_:
        print("benchmarks.refit measures the vLLM engine's refit (generation=vllm)", file=sys.stderr)
        return 2
    times, moved = refit_times(cfg, args.refits + args.warmup)
    measured = times[args.warmup:] or times
    from benchmarks.limits import bare_loads, memcpy_gbps

    loads = bare_loads(cfg)
    gbps, nbytes = memcpy_gbps(cfg)
    best, median = min(measured), statistics.median(measured)
    result = {
        "overrides": args.overrides,
        "device": refit_setup(cfg).device,
        "model_bytes": nbytes,
        "moved_bytes": moved,
        "refit_s": {"first": round(times[0], 4), "best": round(best, 4), "median": round(median, 4)},
        "refit_gbps_median": round(moved / median / 1e9, 3),
        "limits": {**{k: round(v, 4) for k, v in loads.items()}, "memcpy_gbps": round(gbps, 2)},
        "host": host(),
        "date": now(),
    }
    print(json.dumps(result, indent=1))
    print(f"refit moving {moved / 1e6:.1f} MB (model {nbytes / 1e6:.1f} MB): median {median:.3f}s (best {best:.3f}s) = "
          f"{result['refit_gbps_median']:.2f} GB/s vs memcpy {gbps:.2f} GB/s; the engine's bare in-place load "
          f"{loads['bare_load_s']:.3f}s")
    save_latest(args.out, run_key(args), result)
    return 0


def table_rows(result: dict[str, Any]) -> list[Row]:
    """The suite's rows for one result: the median refit beside the engine's bare load and beside memcpy."""
    lim, median = result["limits"], result["refit_s"]["median"]
    return [Row("refit (median)", f"{median:.3f} s", f"{lim['bare_load_s']:.3f} s bare in-place load",
                median / lim["bare_load_s"]),
            Row("refit (median)", f"{result['refit_gbps_median']:.2f} GB/s", f"{lim['memcpy_gbps']:.2f} GB/s memcpy",
                result["refit_gbps_median"] / lim["memcpy_gbps"])]


if __name__ == "__main__":
    sys.exit(main())
