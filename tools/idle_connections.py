"""Threads of a serving process while connections idle in their handshake.

Starts ``tests/peer_prompt.py`` (a TCP listener) from the checkout ROOT, opens N connections
that never send a byte, and prints the server's thread count before and while they wait::

    python tools/idle_connections.py --root . --connections 500
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from aio_datadist import _argtypes as argtypes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--connections", type=argtypes.positive_int, default=500)
    args = parser.parse_args()
    root = args.root.resolve()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.Popen(
        [sys.executable, str(root / "tests" / "peer_prompt.py"), str(port), "4", "4096"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stdin is not None
    conns: list[socket.socket] = []
    try:
        if proc.stdout.readline().split()[:1] != [b"ready"]:
            print("the server did not start", file=sys.stderr)
            return 1
        tasks = Path(f"/proc/{proc.pid}/task")
        before = len(os.listdir(tasks))
        for _ in range(args.connections):
            conns.append(socket.create_connection(("127.0.0.1", port)))
        time.sleep(1.0)
        during = len(os.listdir(tasks))
        print(
            f"{args.connections} idle connections: threads {before} -> {during} "
            f"(+{during - before})"
        )
    finally:
        for conn in conns:
            conn.close()
        proc.stdin.close()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
