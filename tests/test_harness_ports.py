"""Ports for servers the tests and benchmarks start (rewind.bench.harness)."""

from __future__ import annotations

import socket

import pytest

from rewind.bench.harness import LOOPBACK, free_port_run


def test_a_run_of_free_ports_can_all_be_bound() -> None:
    base = free_port_run(3)
    held = []
    try:
        for port in range(base, base + 3):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind((LOOPBACK, port))
    finally:
        for sock in held:
            sock.close()


def test_a_taken_port_is_not_in_the_run() -> None:
    """With the port after a free one held, the run starts elsewhere."""
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind((LOOPBACK, 0))
    taken.listen()
    try:
        busy = taken.getsockname()[1]
        for _ in range(20):
            base = free_port_run(2)
            assert busy not in (base, base + 1)
    finally:
        taken.close()


def test_no_run_is_an_error_not_a_hang() -> None:
    with pytest.raises(RuntimeError, match="no run of"):
        free_port_run(70000, tries=2)
