"""A free TCP port for a rendezvous (torch.distributed's TCPStore, a stateless process group, a Ray head).

Ports are drawn below the kernel's ephemeral range and above Ray's worker ports (10002-19999). A port the OS
hands out for port 0 comes from the ephemeral range, where any outgoing connection (Ray's gRPC opens many) can
take it between the probe and the server binding it; below that range only another explicit bind can."""

from __future__ import annotations

import random
import socket
from pathlib import Path

RENDEZVOUS_LOW = 20000
_TRIES = 64
_draw = random.SystemRandom()  # not the global generator: runs seeded alike would draw the same ports


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where /proc does not say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "") -> int:
    """A port that `host` ("" = all addresses) can bind now, outside the ephemeral range when one is free there."""
    high = ephemeral_low()
    if high - RENDEZVOUS_LOW >= _TRIES:
        for port in _draw.sample(range(RENDEZVOUS_LOW, high), _TRIES):
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
