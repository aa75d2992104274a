"""`rlpost launch <slurm|ray|kuberay> [options] -- train [overrides]`: check the run's config here, then hand it to
the cluster. Bad input exits 2 before anything is submitted; a submission the cluster refuses exits 3."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from rlpost.config.errors import ConfigError, report_config_error

USAGE = """\
usage: rlpost launch slurm [--run-dir DIR] [--max-requeues N] [--dry-run] [--wait] [sbatch options] -- train [overrides]
       rlpost launch ray --address http://HEAD:8265 [--run-dir DIR] [--working-dir DIR] [--dry-run] [--wait]
                         -- train [overrides]
       rlpost launch kuberay --image IMAGE --pvc CLAIM [--workers N] [--cpus N] [--gpus N] [--memory 64Gi]
                             [--name NAME] -- train [overrides]

  slurm     submit a batch script: Ray on the job's nodes, then `rlpost train` against it (docs/clusters.md)
  ray       submit `rlpost train` as a Ray job to a running Ray cluster
  kuberay   print a KubeRay RayJob manifest (kubectl apply -f -)

examples:
  rlpost launch slurm --nodes=2 --gpus-per-node=8 --time=04:00:00 -- train cluster.gpus_per_node=8 \
      policy.train_micro_batch_size=16
  rlpost launch slurm --dry-run -- train grpo.max_num_steps=20 cluster.gpus_per_node=1
  rlpost launch ray --address http://head:8265 --wait -- train cluster.num_nodes=2 cluster.gpus_per_node=1
"""

_SET_BY_LAUNCH = ("cluster.address", "hydra.run.dir")
"""Keys the launcher sets itself."""


def default_run_dir() -> Path:
    """outputs/<date>/<time> under the working directory, as `rlpost train` names a run, made absolute: the nodes
    write it."""
    return (Path("outputs") / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")).absolute()


def split_train(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher arguments, train overrides) of `... -- train overrides`."""
    if "--" not in argv:
        raise ConfigError("rlpost launch", " ".join(argv) or None, "needs `-- train [overrides]` after its options",
                          "e.g. rlpost launch slurm --nodes=2 -- train grpo.max_num_steps=20")
    cut = argv.index("--")
    ours, rest = argv[:cut], argv[cut + 1:]
    if not rest or rest[0] != "train":
        raise ConfigError("rlpost launch", " ".join(rest) or None, "runs `rlpost train`: write `-- train [overrides]`")
    return ours, rest[1:]


def train_overrides(overrides: list[str], num_nodes: int | None, gpus_per_node: int | None = None) -> list[str]:
    """The overrides the job runs with: cluster=ray (joining the launched cluster), and the cluster's shape where the
    scheduler's options give it (the one source of both: a config key that says otherwise is refused). Keys the
    launcher sets itself and sweeps are refused."""
    shape = {"cluster.num_nodes": (num_nodes, "the scheduler's node count (sbatch --nodes, --workers + 1)"),
             "cluster.gpus_per_node": (gpus_per_node, "sbatch --gpus-per-node")}
    for o in overrides:
        if o in ("-m", "--multirun"):
            raise ConfigError("-m", o, "rlpost launch runs one job",
                              "sweep on Slurm with `rlpost train -m hydra/launcher=submitit_slurm ...`")
        key, _, value = o.partition("=")
        key = key.lstrip("+~")
        if key in _SET_BY_LAUNCH:
            raise ConfigError(key, value, "is set by rlpost launch", "use --run-dir for the run directory")
        if key in shape and shape[key][0] is not None and value != str(shape[key][0]):
            raise ConfigError(key, value, f"contradicts {shape[key][1]}, which asks for {shape[key][0]}",
                              "give it once: the launcher sets the key from the scheduler's option")
        if key == "cluster" and value != "ray":
            raise ConfigError("cluster", value, "a launched run joins the Ray cluster its launcher starts",
                              "leave `cluster` out (cluster=ray)")
    given = [f"{key}={value}" for key, (value, _) in shape.items() if value is not None]
    kept = [o for o in overrides if o.partition("=")[0] != "cluster" and o.partition("=")[0].lstrip("+~") not in
            {k for k, (v, _) in shape.items() if v is not None}]
    return ["cluster=ray", *kept, *given]


def check(overrides: list[str], run_dir: Path) -> int:
    """The job's pre-flight on this host (the Ray head and the devices are judged on the nodes); 2 on bad input."""
    from rlpost.checks import LAUNCH
    from rlpost.command_checks import preflight

    return preflight([*overrides, "cluster.address=auto", f"hydra.run.dir={run_dir}"], False, command=LAUNCH)


K8S_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?([KMGTPE]i?|k|m)?")
"""A Kubernetes resource quantity (64Gi, 512M, 1e9 is not accepted)."""


def _run_dir(value: str | None) -> Path:
    """The run directory of `--run-dir` (absolute), or the default; an empty value is refused."""
    if value is None:
        return default_run_dir()
    if not value.strip():
        raise ConfigError("--run-dir", value, "must name a directory", "leave it out for outputs/<date>/<time>")
    return Path(value).absolute()


def _slurm(argv: list[str], train: list[str]) -> int:
    from rlpost.launch import slurm

    p = argparse.ArgumentParser(prog="rlpost launch slurm", add_help=False, allow_abbrev=False)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--max-requeues", type=int, default=3)
    p.add_argument("--nodes-timeout-s", type=float, default=300.0)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--wait", action="store_true")
    ours, sbatch_args = p.parse_known_args(argv)
    if ours.max_requeues < 0:
        raise ConfigError("--max-requeues", ours.max_requeues, "must be >= 0")
    if not ours.nodes_timeout_s > 0:
        raise ConfigError("--nodes-timeout-s", ours.nodes_timeout_s, "must be > 0 (seconds the nodes have to join)")
    run_dir = _run_dir(ours.run_dir)
    overrides = train_overrides(train, slurm.node_count(sbatch_args), slurm.gpus_per_node(sbatch_args))
    if rc := check(overrides, run_dir):
        return rc
    job = slurm.SlurmJob(overrides, sbatch_args, run_dir, ours.max_requeues, nodes_timeout_s=ours.nodes_timeout_s,
                         workdir=Path.cwd())
    script = slurm.render(job)
    if ours.dry_run:
        print(script, end="")
        return 0
    job_id = slurm.submit(job, script)
    state = slurm.job_state(job_id)
    print(f"rlpost launch: Slurm job {job_id} {state.state}; run directory {run_dir}\n"
          f"  logs: {run_dir / 'logs'} (driver.log, ray-<node>.log, slurm-{job_id}.out)\n"
          f"  follow: squeue -j {job_id}; stop: scancel {job_id} (the step finishes and saves)", flush=True)
    if not ours.wait:
        return 0
    end = slurm.wait_for(job_id)
    return end.exit_status if end.exit_status is not None else 3


def _ray(argv: list[str], train: list[str]) -> int:
    from rlpost.launch import ray_job

    p = argparse.ArgumentParser(prog="rlpost launch ray", add_help=False, allow_abbrev=False)
    p.add_argument("--address", required=True)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--working-dir", type=Path, default=None)
    p.add_argument("--rlpost-bin", default="rlpost")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--wait", action="store_true")
    ours, unknown = p.parse_known_args(argv)
    if unknown:
        raise ConfigError("rlpost launch ray", " ".join(unknown), "unknown option(s)", USAGE.splitlines()[1])
    if ours.working_dir is not None and not ours.working_dir.is_dir():
        raise ConfigError("--working-dir", str(ours.working_dir), "is not a directory")
    run_dir = _run_dir(ours.run_dir)
    overrides = train_overrides(train, None)
    if rc := check(overrides, run_dir):
        return rc
    job = ray_job.RayJob(ours.address, overrides, run_dir, ours.working_dir, ours.rlpost_bin)
    if ours.dry_run:
        print(f"entrypoint: {job.entrypoint()}\nruntime_env: {job.runtime_env()}")
        return 0
    job_id = ray_job.submit(job)
    print(f"rlpost launch: Ray job {job_id} submitted to {ours.address}; run directory {run_dir}\n"
          f"  logs: ray job logs {job_id} --address {ours.address}; stop: ray job stop {job_id}", flush=True)
    return ray_job.wait_for(ours.address, job_id) if ours.wait else 0


def _kuberay(argv: list[str], train: list[str]) -> int:
    from rlpost.launch.kuberay import KubeRayJob

    p = argparse.ArgumentParser(prog="rlpost launch kuberay", add_help=False, allow_abbrev=False)
    p.add_argument("--image", required=True)
    p.add_argument("--pvc", required=True)
    p.add_argument("--name", default="rlpost-" + time.strftime("%Y%m%d-%H%M%S"))
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--cpus", type=int, default=8)
    p.add_argument("--gpus", type=int, default=0)
    p.add_argument("--memory", default="64Gi")
    ours, unknown = p.parse_known_args(argv)
    if unknown:
        raise ConfigError("rlpost launch kuberay", " ".join(unknown), "unknown option(s)", USAGE.splitlines()[3])
    for flag, value, least in (("--workers", ours.workers, 0), ("--cpus", ours.cpus, 1), ("--gpus", ours.gpus, 0)):
        if value < least:
            raise ConfigError(flag, value, f"must be >= {least}")
    if not K8S_QUANTITY.fullmatch(ours.memory):
        raise ConfigError("--memory", ours.memory, "must be a Kubernetes memory quantity", "e.g. 64Gi or 512Mi")
    overrides = train_overrides(train, ours.workers + 1, ours.gpus or None)
    if rc := check(overrides, Path("/tmp") / ours.name):
        return rc
    job = KubeRayJob(ours.name, ours.image, overrides, ours.workers, ours.cpus, ours.gpus, ours.memory, ours.pvc)
    print(job.manifest(), end="")
    return 0


def launch(argv: list[str]) -> int:
    """`rlpost launch ...`: the exit status."""
    from rlpost import failures

    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    kinds = {"slurm": _slurm, "ray": _ray, "kuberay": _kuberay}
    kind = kinds.get(argv[0])
    own = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    if kind is not None and any(a in ("-h", "--help") for a in own):
        print(USAGE)
        return 0
    try:
        if kind is None:
            raise ConfigError("rlpost launch", argv[0], f"must be one of {sorted(kinds)}")
        ours, train = split_train(argv[1:])
        return kind(ours, train)
    except ConfigError as err:
        report_config_error(err)
        return 2
    except Exception as exc:  # noqa: BLE001 - the scheduler refused or could not be reached: one line
        print(f"rlpost launch: error: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}",
              file=sys.stderr)
        return failures.EXIT_RUNTIME
