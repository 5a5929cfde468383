"""Flood a serving process from a linked peer that pipelines pulls and reads the answers
slowly; print the server's memory.

Usage (from the repository root)::

    python tools/flood.py [--pulls small|rows] [--seconds 40] [--read-every-ms 1]

The server is the bounds tests' engine in a process of its own (``tests/peer_serving.py``)
with the default serve limits. A raw peer, after a real handshake, sends pulls as fast as
the server takes them (``small``: three 128-byte blocks of each of two tensors; ``rows``:
18 pulls of two million one-byte rows each) and reads one answer every ``--read-every-ms``
(0: none) for ``--seconds``; meanwhile the server's resident memory is sampled every 0.1 s.
Then the peer reads every answer left, checking each byte, and the link's stats are shown.
Exits 1 when an answer is missing or wrong.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aio_datadist import _argtypes as argtypes
from aio_datadist._transport.base import ServeLimits
from tests.wirefuzz import (
    BLOCK_BYTES,
    BLOCKS,
    Flood,
    RawPeer,
    ServingProcess,
    blocks_access,
    blocks_bytes,
    pull_frame,
)

MiB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pulls", choices=("small", "rows"), default="small")
    parser.add_argument(
        "--seconds", type=argtypes.positive_float, default=40.0, help="how long the flood lasts"
    )
    parser.add_argument(
        "--read-every-ms",
        type=argtypes.non_negative_float,
        default=1.0,
        help="the peer's pace (0: it reads nothing)",
    )
    args = parser.parse_args()
    if args.pulls == "small":
        blocks, seg, batch, count = np.array([2, 7, 5]), BLOCK_BYTES, 1000, 0
    else:
        blocks, seg, batch, count = np.arange(1_000_000) % BLOCKS, 1, 1, 18
    access, expected = blocks_access(blocks, seg), blocks_bytes(blocks, seg)
    limits = ServeLimits()
    server = ServingProcess(limits.queued_bytes, limits.requests)
    try:
        with RawPeer(server.port) as peer:
            peer.sock.settimeout(120.0)
            start_rss = peak = server.rss()
            flood = Flood(peer, lambda rid: pull_frame(rid, access, len(expected)), batch, count)
            stop = threading.Event()

            def pace() -> None:
                while not stop.wait(args.read_every_ms / 1000) and flood.answered < flood.sent:
                    flood.read_one(expected)

            reader = threading.Thread(target=pace, daemon=True)
            if args.read_every_ms > 0:
                reader.start()
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                peak = max(peak, server.rss())
                time.sleep(0.1)
            end_rss = server.rss()
            stop.set()
            if reader.is_alive():
                reader.join()
            paced = flood.answered
            began = time.perf_counter()
            answered = flood.read_all(expected)
            drain_s = time.perf_counter() - began
            try:
                stats = server.stats(peer.cluster_id)
            except LookupError:
                stats = None
    finally:
        server.close()
    pace_text = (
        f"one answer read every {args.read_every_ms:g} ms"
        if args.read_every_ms
        else ("no answer read")
    )
    print(f"{args.pulls} pulls for {args.seconds:g} s, {pace_text}: {flood.sent:,} pulls sent")
    print(
        f"server RSS: {start_rss / MiB:.1f} MiB at the start, peak {peak / MiB:.1f} MiB "
        f"(+{(peak - start_rss) / MiB:.1f} MiB), {end_rss / MiB:.1f} MiB at the end"
    )
    print(
        f"answers: {paced:,} read during the flood, {answered - paced:,} after it in "
        f"{drain_s:.1f} s; all {answered:,} exact"
    )
    if stats is not None:
        print(
            f"link: {stats['pauses']:,} pauses, {stats['paused_s']:.1f} s paused, at most "
            f"{stats['requests_max']:,} requests and {stats['queued_bytes_max']:,} bytes held"
        )
    return 0 if answered == flood.sent else 1


if __name__ == "__main__":
    sys.exit(main())
