"""Rendezvous ports come from below the ephemeral range and are bindable when returned."""

from __future__ import annotations

import socket

import pytest

from rlpost.distributed import ports


def test_a_port_is_drawn_below_the_ephemeral_range_and_binds() -> None:
    for _ in range(20):
        port = ports.free_port("127.0.0.1")
        assert ports.RENDEZVOUS_LOW <= port < ports.ephemeral_low()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_the_draw_ignores_the_global_seed() -> None:
    import random

    random.seed(0)
    first = [ports.free_port("127.0.0.1") for _ in range(4)]
    random.seed(0)
    assert [ports.free_port("127.0.0.1") for _ in range(4)] != first


def test_a_held_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = int(held.getsockname()[1])
        monkeypatch.setattr(ports, "RENDEZVOUS_LOW", taken)
        monkeypatch.setattr(ports, "ephemeral_low", lambda: taken + 200)
        drawn = [taken] + [taken + i for i in range(1, 64)]
        monkeypatch.setattr(ports._draw, "sample", lambda population, k: drawn)
        port = ports.free_port("127.0.0.1")
        assert port != taken and port in drawn
