"""``find_free_port``: the rendezvous port is taken where no outgoing connection can take it."""

from __future__ import annotations

import random
import socket

from lightning_mcore_ckpt.launch import local as _launch
from lightning_mcore_ckpt.testing import find_free_port


def test_the_port_is_free_and_below_the_kernels_ephemeral_range() -> None:
    low, high = _launch._ephemeral_ports()
    assert 1024 < low <= high
    ports = {find_free_port() for _ in range(20)}
    for port in ports:
        # Outside the range the kernel gives the local end of a connection, so another job's
        # connection cannot take it before the store binds it ...
        assert _launch._LOWEST_PORT <= port < low, (port, low)
        # ... and free now.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
    # Random, so that jobs started at the same moment do not pick the same port.
    assert len(ports) > 15


def test_a_taken_port_is_not_picked_and_the_jobs_rng_is_untouched() -> None:
    random.seed(1234)
    expected = random.random()
    random.seed(1234)
    taken = []
    try:
        for _ in range(5):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", find_free_port()))
            sock.listen()
            taken.append(sock)
        ports = {s.getsockname()[1] for s in taken}
        assert all(find_free_port() not in ports for _ in range(50))
    finally:
        for sock in taken:
            sock.close()
    assert random.random() == expected
