"""A serving process for the backpressure tests: the bounds tests' engine
(``tests.wirefuzz.ServingEngine``, listening on TCP) with the given serve limits.

Usage: python tests/peer_serving.py QUEUED_BYTES REQUESTS

Prints its port, then answers each line of stdin: ``stats CLUSTER_ID`` with the stats of the
live link to that cluster as JSON (``null`` when there is none); ``threads`` with ``null``
once it wrote every thread's stack to stderr (to tell why a test failed); ``quit`` (or the
end of stdin) finalizes the engine and exits.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import sys

from aio_datadist._transport import tcp
from aio_datadist._transport.base import ServeLimits
from tests.wirefuzz import ServingEngine


def main() -> None:
    queued_bytes, requests = (int(a) for a in sys.argv[1:3])
    tcp.SERVE_LIMITS = ServeLimits(queued_bytes=queued_bytes, requests=requests)
    engine = ServingEngine()
    try:
        print(engine.port, flush=True)
        for line in sys.stdin:
            command, *args = line.split()
            if command == "quit":
                break
            if command == "stats":
                stats = engine.dd._engine.link_stats(int(args[0]))
                answer = None if stats is None else dataclasses.asdict(stats)
                print(json.dumps(answer), flush=True)
            if command == "threads":
                faulthandler.dump_traceback(sys.stderr, all_threads=True)
                print("null", flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
