"""Small steps of the launch scripts, run as `python -m rlpost.launch.nodes <command>` on a cluster node.

    port HOST                      a free port for the Ray head on HOST (this node)
    wait ADDRESS NODES TIMEOUT_S   until the Ray cluster at ADDRESS has NODES nodes alive (exit 3 if not in time)
    state RUN_DIR                  'resume' when the run's last attempt may be continued by starting it again,
                                   else its state ('finished', 'failed', or 'none' when no attempt recorded one)
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path


def alive_nodes(address: str) -> int:
    """Nodes alive in the Ray cluster at `address` (joined as a driver for the question, then left); 0 when nothing
    answers there yet."""
    import ray

    from rlpost.distributed.virtual_cluster import ClusterUnavailable, probe_head

    try:
        probe_head(address, timeout_s=2.0)  # ray.init would retry for minutes against a head not yet listening
    except ClusterUnavailable:
        return 0

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, configure_logging=False)
    try:
        return len([n for n in ray.nodes() if n.get("Alive")])
    finally:
        ray.shutdown()


def wait_for_nodes(address: str, nodes: int, timeout_s: float) -> int:
    """Poll until `nodes` nodes are alive; the count seen last. Connection errors count as none alive (the head may
    still be starting)."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    while True:
        try:
            seen = alive_nodes(address)
        except Exception:  # noqa: BLE001 - not up yet: asked again until the deadline
            seen = 0
        if seen >= nodes or time.monotonic() >= deadline:
            return seen
        time.sleep(2.0)


def main(argv: list[str]) -> int:
    cmd, args = (argv[0], argv[1:]) if argv else ("", [])
    if cmd == "port" and len(args) == 1:
        from rlpost.distributed.ports import free_port

        print(free_port(args[0]))
        return 0
    if cmd == "wait" and len(args) == 3:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        want = int(args[1])
        seen = wait_for_nodes(args[0], want, float(args[2]))
        if seen < want:
            print(f"rlpost launch: error: {seen} of {want} Ray node(s) joined the head at {args[0]} within "
                  f"{float(args[2]):.0f}s; see the ray-<node>.log files beside this one", file=sys.stderr)
            return 3
        print(f"rlpost launch: {seen} Ray node(s) up at {args[0]}")
        return 0
    if cmd == "state" and len(args) == 1:
        from rlpost.runtime.run_status import read_status, resumable

        status = read_status(Path(args[0]))
        print("resume" if resumable(status) else (status["state"] if status else "none"))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
