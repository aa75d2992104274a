"""`rlpost launch`: run `rlpost train` on a cluster. Slurm (a batch script that starts Ray on the allocation's nodes,
then the driver), a running Ray cluster (a Ray job), or Kubernetes (a KubeRay RayJob manifest). docs/clusters.md."""
