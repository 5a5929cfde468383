"""Ports for tests that must name a listener's port before it binds (a rank table, a
process told where to listen)."""

from __future__ import annotations

import random
import socket

#: Below the kernel's ephemeral range (``ip_local_port_range``, 32768 and up by default):
#: ports the system never hands to an outgoing connection or a listener on port 0, so
#: another process cannot take one between the check and the bind unless it names it too.
_LOW, _HIGH = 20000, 32000


def free_port() -> int:
    """A port on 127.0.0.1 that no one listens on now, outside the ephemeral range."""
    for _ in range(1000):
        port = random.randrange(_LOW, _HIGH)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{_LOW}, {_HIGH})")
