"""`rlpost launch kuberay [options] -- train [overrides]`: print a KubeRay RayJob manifest that runs `rlpost train`
on a Ray cluster the KubeRay operator creates for it (a head pod and --workers worker pods from --image, the run
directory on a shared volume), and deletes when the job ends. Apply it with `kubectl apply -f`."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import yaml

RUNS_MOUNT = "/runs"


@dataclass(frozen=True)
class KubeRayJob:
    """What the manifest is made from."""

    name: str
    image: str
    train_args: list[str]
    workers: int
    """Worker pods beside the head (the run's cluster.num_nodes is workers + 1)."""
    cpus: int
    gpus: int
    memory: str
    pvc: str
    """A PersistentVolumeClaim mounted on every pod at /runs: the run directory lives there."""

    def manifest(self) -> str:
        run_dir = f"{RUNS_MOUNT}/{self.name}"
        args = ["rlpost", "train", *self.train_args, "cluster.address=auto", f"hydra.run.dir={run_dir}"]
        return yaml.safe_dump({
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "metadata": {"name": self.name},
            "spec": {
                "entrypoint": " ".join(shlex.quote(a) for a in args),
                "shutdownAfterJobFinishes": True,
                "ttlSecondsAfterFinished": 600,
                "rayClusterSpec": {
                    "headGroupSpec": {"rayStartParams": {"num-cpus": str(self.cpus)},
                                      "template": self._pod("ray-head")},
                    "workerGroupSpecs": [{
                        "groupName": "workers", "replicas": self.workers, "minReplicas": self.workers,
                        "maxReplicas": self.workers, "rayStartParams": {"num-cpus": str(self.cpus)},
                        "template": self._pod("ray-worker"),
                    }] if self.workers else [],
                },
            },
        }, sort_keys=False)

    def _pod(self, container: str) -> dict[str, object]:
        limits: dict[str, object] = {"cpu": str(self.cpus), "memory": self.memory}
        if self.gpus:
            limits["nvidia.com/gpu"] = str(self.gpus)
        return {"spec": {
            "containers": [{
                "name": container, "image": self.image,
                "resources": {"limits": limits, "requests": dict(limits)},
                "volumeMounts": [{"name": "runs", "mountPath": RUNS_MOUNT}, {"name": "shm", "mountPath": "/dev/shm"}],
            }],
            "volumes": [{"name": "runs", "persistentVolumeClaim": {"claimName": self.pvc}},
                        {"name": "shm", "emptyDir": {"medium": "Memory"}}],
        }}
