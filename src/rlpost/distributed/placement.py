"""Which actors each Ray node holds, so that a lost node is named with what it took down.

Worker groups record each actor's node when they create it (`place`) and drop their records when they shut down
(`forget`). When a call finds an actor dead or failing, `lost_among` asks Ray whether a node of the group died;
the message then names the node and every rlpost actor that was on it (the policy's ranks, engine replicas, ...).
"""

from __future__ import annotations

import socket
import threading

_HELD: dict[str, list[str]] = {}
_LOCK = threading.Lock()


def place(node_id: str, what: str) -> None:
    """Record that actor `what` ("policy rank 1") runs on node `node_id`."""
    if node_id:
        with _LOCK:
            _HELD.setdefault(node_id, []).append(what)


def forget(whats: list[str]) -> None:
    """Drop the records of actors that were shut down."""
    gone = set(whats)
    with _LOCK:
        for node_id in list(_HELD):
            _HELD[node_id] = [w for w in _HELD[node_id] if w not in gone]
            if not _HELD[node_id]:
                del _HELD[node_id]


def held_on(node_id: str) -> list[str]:
    """The actors recorded on `node_id`, in the order they were placed."""
    with _LOCK:
        return list(_HELD.get(node_id, []))


def summary() -> str | None:
    """'<node>: <actors>; <node>: <actors>' over every node holding rlpost actors, when there is more than one node
    (one node says nothing new); None otherwise."""
    with _LOCK:
        held = {k: list(v) for k, v in _HELD.items()}
    if len(held) < 2:
        return None
    import ray

    labels = {str(n.get("NodeID")): node_label(n) for n in ray.nodes()}
    return "; ".join(f"{labels.get(node_id, node_id[:8])}: {', '.join(what)}" for node_id, what in held.items())


def node_label(node: dict[str, object]) -> str:
    """'<ip> (<first 8 of its id>)' of a `ray.nodes()` entry."""
    return f"{node.get('NodeManagerAddress', '?')} ({str(node.get('NodeID', ''))[:8]})"


RAYLET_PROBE_S = 2.0
"""How long a node's raylet may take to accept a connection before the node counts as lost."""


def _raylet_answers(node: dict[str, object]) -> bool:
    """Whether the node's raylet accepts a TCP connection. Ray's control plane declares a node dead only after its
    health checks have failed for a while; an actor call fails as soon as the actor's process is gone, so the
    raylet is asked directly whether its node is still there."""
    host, port = node.get("NodeManagerAddress"), node.get("NodeManagerPort")
    if not isinstance(host, str) or not isinstance(port, int):
        return True  # nothing to ask: take Ray's word that it lives
    try:
        with socket.create_connection((host, port), timeout=RAYLET_PROBE_S):
            return True
    except OSError:
        return False


def lost_among(node_ids: list[str]) -> str | None:
    """When one of `node_ids` is gone (Ray reports it dead, or its raylet no longer answers): one line naming the
    first such node and what it held; else None (they live, or Ray cannot say). A rank whose peer's node died often
    fails first itself (its collective sees the connection close): the lost node, not that rank, is the cause."""
    wanted = [n for n in dict.fromkeys(node_ids) if n]
    if not wanted:
        return None
    try:
        import ray

        nodes = {str(n.get("NodeID")): n for n in ray.nodes()}
    except Exception:  # noqa: BLE001 - Ray itself is gone: the caller's own message stands
        return None
    for node_id in wanted:
        node = nodes.get(node_id)
        if node is not None and (not node.get("Alive", True) or not _raylet_answers(node)):
            held = held_on(node_id)
            what = f"; it held {', '.join(held)}" if held else ""
            return f"node {node_label(node)} was lost{what}"
    return None
