"""The memory plan as the commands show it: `rlpost plan`'s rows, the `memory` entry of `rlpost plan --json` and a
run's plan.json, and the pre-flight's refusal of a run that cannot fit (rlpost.config.memory computes it)."""

from __future__ import annotations

from typing import Any

from rlpost.config.errors import ConfigError
from rlpost.config.memory.estimate import Config, Estimate, estimate, first_fix

Rows = list[tuple[str, str]]


def _device_name(est: Estimate, cfg: Config) -> str:
    size = f"{est.device_gib:.0f} GiB" if est.device_gib is not None else "size unknown"
    if est.device == "cpu":
        return f"{cfg.cluster.num_nodes} x CPU node ({size} RAM)"
    return f"{cfg.cluster.num_nodes * cfg.cluster.gpus_per_node} x GPU ({size})"


def _largest(est: Estimate, n: int = 3) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in list(est.peak_items.items())[:n])


def memory_rows(cfg: Config) -> Rows:
    """The plan's memory rows: the fullest device's peak and its largest items, host memory, and the verdict (with
    the change that would make the run fit when it does not)."""
    est = estimate(cfg)
    if est is None:
        return [("memory", "not estimated: the model's layout is not one rlpost counts")]
    where = "per node (every process's peak)" if est.device == "cpu" else f"per GPU, at {est.peak_phase}"
    rows = [("memory peak", f"{est.peak_gib:.2f} GiB {where}; largest: {_largest(est)} GiB")]
    if est.device == "cuda" and est.host_gib:
        rows.append(("host memory", f"{est.host_gib:.2f} GiB per node besides the GPUs (offloaded and CPU-kept "
                                    "state, refit buffers)"))
    rows.append(("fits", _verdict(est, cfg)))
    return rows


def _verdict(est: Estimate, cfg: Config) -> str:
    device = _device_name(est, cfg)
    if est.fits is None:
        return f"unknown: {device}; set cluster.gpu_memory_gb to plan for a GPU"
    if est.fits:
        return f"yes, on {device}"
    fix = first_fix(cfg)
    if fix is None:
        return f"no, on {device}: no single change of micro-batch, checkpointing, offload or LoRA is enough"
    override, changed = fix
    return f"no, on {device}; with {override}: {changed.peak_gib:.2f} GiB"


def memory_json(cfg: Config) -> dict[str, Any]:
    """The `memory` entry of `rlpost plan --json` and plan.json."""
    est = estimate(cfg)
    if est is None:
        return {"device_gib": None, "fits": None, "workers": [], "note": "the model's layout is not counted"}
    out: dict[str, Any] = {"device": est.device, "device_gib": est.device_gib, "fits": est.fits,
                           "peak_gib": round(est.peak_gib, 3), "peak_phase": est.peak_phase,
                           "peak_items": {k: round(v, 3) for k, v in est.peak_items.items()},
                           "host_gib": round(est.host_gib, 3), "workers": est.worker_rows()}
    if est.fits is False and (fix := first_fix(cfg)) is not None:
        out["fix"] = {"override": fix[0], "peak_gib": round(fix[1].peak_gib, 3)}
    return out


def check_memory(cfg: Config) -> None:
    """ConfigError when the plan says the run cannot fit its devices (unless cluster.skip_memory_check)."""
    if cfg.cluster.skip_memory_check:
        return
    est = estimate(cfg)
    if est is None or est.fits is not False:
        return
    largest = next(iter(est.peak_items.items()))
    fix = first_fix(cfg)
    hint = (f"with {fix[0]} it needs {fix[1].peak_gib:.1f} GiB" if fix is not None
            else "use more devices, tensor parallelism or a smaller model")
    at, has = (("on each node", f"a node's {est.device_gib:.1f} GiB of RAM") if est.device == "cpu" else
               (f"on a GPU at {est.peak_phase}", f"a GPU's {est.device_gib:.1f} GiB"))
    raise ConfigError("cluster.skip_memory_check", False,
                      f"the memory plan estimates {est.peak_gib:.1f} GiB {at} ({largest[0]}: {largest[1]:.1f} GiB, "
                      f"the largest item), more than {has} (rlpost plan shows the items)",
                      f"{hint}; cluster.skip_memory_check=true starts it anyway")
