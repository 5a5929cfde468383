"""A UCX peer process for tests and measurements: registers memory and serves RMA on it.

Run as ``python tests/peer_ucx.py NBYTES SEED [--no-peer-errors]``. It fills NBYTES with bytes
from ``numpy.random.default_rng(SEED)``, registers them, prints one JSON line (worker
address, packed rkey, base, length, pid) and then progresses its worker (sleeping on the
event fd) while it reads commands, one per line, from stdin:

* ``read OFFSET NBYTES``: answers the region's bytes as one hex line;
* ``quit`` (or end of input): cleans up and exits.
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np

from aio_datadist._routes.ucx import worker as ucx


def main() -> None:
    nbytes, seed = int(sys.argv[1]), int(sys.argv[2])
    buf = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    context = ucx.UcxContext(name="peer")
    worker = ucx.UcxWorker(context, name="peer")
    reg = ucx.Registration(context, buf.ctypes.data, nbytes)
    stop = threading.Event()
    server = threading.Thread(target=worker.serve, args=(stop,), daemon=True)
    server.start()
    hello = {
        "address": worker.address().hex(),
        "rkey": reg.rkey.hex(),
        "addr": reg.addr,
        "nbytes": reg.nbytes,
        "tls": ucx.ucx_info().get("transports"),
    }
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "read":
            off, n = int(words[1]), int(words[2])
            print(buf[off : off + n].tobytes().hex(), flush=True)
    stop.set()
    worker.signal()
    server.join()
    reg.close()
    worker.close()
    context.close()


if __name__ == "__main__":
    main()
