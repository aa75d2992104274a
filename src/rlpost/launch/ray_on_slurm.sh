#!/bin/bash
# Written by `rlpost launch slurm`: a Ray cluster on this job's nodes, then one `rlpost train` against it.
# The first node runs the Ray head and the driver, every other node a Ray worker. In the run's logs/: each node's
# Ray log (ray-<node>.log), the driver's console (driver.log) and this script's (slurm-<job>.out).
#SBATCH --job-name={{JOB_NAME}}
#SBATCH --output={{LOGS}}/slurm-%j.out
#SBATCH --open-mode=append
{{SBATCH_LINES}}
set -uo pipefail

RUN_DIR={{RUN_DIR}}
LOGS={{LOGS}}
PYTHON={{PYTHON}}
RAY={{RAY}}
RLPOST={{RLPOST}}
MAX_REQUEUES={{MAX_REQUEUES}}
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
mkdir -p "$LOGS"
cd {{WORKDIR}} || exit 2

restart="${SLURM_RESTART_COUNT:-0}"
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node="${nodes[0]}"
head_ip=$(srun --overlap --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk '{print $1}')
port=$("$PYTHON" -m rlpost.launch.nodes port "$head_ip")
address="$head_ip:$port"
cpus="${SLURM_CPUS_ON_NODE:-1}"
gpus="${SLURM_GPUS_ON_NODE:-0}"
echo "rlpost launch: job $SLURM_JOB_ID (restart $restart) on ${#nodes[@]} node(s) ${nodes[*]}; Ray head $address"

steps=()
stop_ray() {
    for pid in "${steps[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    for pid in "${steps[@]}"; do wait "$pid" 2>/dev/null; done
}
srun --overlap --nodes=1 --ntasks=1 -w "$head_node" --output="$LOGS/ray-$head_node.log" --open-mode=append \
    "$RAY" start --head --block --node-ip-address="$head_ip" --port="$port" --num-cpus="$cpus" --num-gpus="$gpus" \
    --include-dashboard=false --disable-usage-stats &
steps+=($!)
for node in "${nodes[@]:1}"; do
    srun --overlap --nodes=1 --ntasks=1 -w "$node" --output="$LOGS/ray-$node.log" --open-mode=append \
        bash -c "exec \"$RAY\" start --block --address=$address --num-cpus=$cpus --num-gpus=$gpus \
            --node-ip-address=\$(hostname --ip-address | awk '{print \$1}') --disable-usage-stats" &
    steps+=($!)
done
if ! "$PYTHON" -m rlpost.launch.nodes wait "$address" "${#nodes[@]}" {{NODES_TIMEOUT_S}}; then
    stop_ray
    exit 3
fi

# The driver: SIGTERM (`--signal=B:TERM@<seconds>`, scancel, preemption) reaches it as Ctrl-C would; it finishes the
# step, saves (checkpointing.save_on_interrupt) and exits 143.
"$RLPOST" train {{TRAIN_ARGS}} cluster.address="$address" hydra.run.dir="$RUN_DIR" >> "$LOGS/driver.log" 2>&1 &
driver=$!
trap 'kill -TERM "$driver" 2>/dev/null' TERM INT
wait "$driver"
rc=$?
while kill -0 "$driver" 2>/dev/null; do wait "$driver"; rc=$?; done
trap - TERM INT
stop_ray

# Not finished but resumable (the signal before a time limit or a preemption, checkpointing.checkpoint_must_save_by,
# a lost node): back in the queue; the next start resumes from the run's last checkpoint.
state=$("$PYTHON" -m rlpost.launch.nodes state "$RUN_DIR")
echo "rlpost launch: driver exited $rc (run $state)"
if [ "$state" = "resume" ] && [ "$restart" -lt "$MAX_REQUEUES" ]; then
    echo "rlpost launch: requeueing job $SLURM_JOB_ID (restart $((restart + 1)) of at most $MAX_REQUEUES)"
    # Slurm ends this instance itself once the job is requeued: exiting first, with the driver's status, would race
    # the requeue and could end the job as FAILED instead.
    if scontrol requeue "$SLURM_JOB_ID"; then
        sleep 300 &
        wait $!
    fi
fi
exit "$rc"
