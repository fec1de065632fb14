"""Loopback networking helpers shared by servers, launchers and tests."""

from __future__ import annotations

import socket


def find_free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a free TCP port on `host` (racy by nature; bind soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports, held open together so they cannot collide with each other."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def local_ip_towards(host: str) -> str:
    """This machine's address as `host` would see it (the interface routing to it): what a
    process on `host` must connect to. No packet is sent (UDP connect only picks a route)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())
