"""Nightly fuzz run: mutated frames through the decoders and through a live TCP server.

Usage (from the repository root)::

    python tools/fuzz.py [--frames 100000] [--seed 1]

Pushes ``--frames`` mutated frames through every decoder a server applies (plus a tenth
as many mutated region-board tables and UCX tables), then as many through a live server in
this process: most over handshaken links, one in ten as the first frame of a new
connection. Checks that
the server stays up, that open descriptors, threads, pool use and pins come back to where
they were, and that a good client still gets exact bytes. Prints counts and exits 1 on any
failure. CI runs a bounded slice of the same code (``tests/test_fuzz.py``).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aio_datadist import _argtypes as argtypes
from tests.wirefuzz import (
    FuzzReport,
    ServingEngine,
    fuzz_parsers,
    fuzz_server,
    good_client_works,
    resources_flat,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--frames", type=argtypes.positive_int, default=100_000, help="frames per stage"
    )
    parser.add_argument(
        "--seed", type=argtypes.non_negative_int, default=1, help="random seed (the run replays)"
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    report = FuzzReport()

    start = time.perf_counter()
    fuzz_parsers(rng, args.frames, report)
    parse_s = time.perf_counter() - start

    engine = ServingEngine()
    try:
        start = time.perf_counter()
        handshakes = args.frames // 10
        with resources_flat(engine) as leaked:
            fuzz_server(engine, rng, args.frames - handshakes, handshakes, report)
        serve_s = time.perf_counter() - start
        good = good_client_works(engine)
    finally:
        engine.close()

    print(f"seed {args.seed}")
    print(f"decoders: {args.frames} frames + {args.frames // 10} board tables in {parse_s:.1f} s")
    for reason, count in report.parser.most_common():
        print(f"  {count:8d}  {reason}")
    print(
        f"live server: {report.frames} frames ({report.handshakes} links handshaken) "
        f"in {serve_s:.1f} s"
    )
    for outcome, count in report.outcomes.most_common():
        print(f"  {count:8d}  {outcome}")
    print(f"resources after the run (deltas): {leaked}")
    print(f"a good client afterwards: {'exact bytes' if good else 'FAILED'}")
    stuck = sum(n for o, n in report.outcomes.items() if "timeout" in o or "garbled" in o)
    ok = (
        good
        and not stuck
        and leaked["fds"] <= 0
        and leaked["threads"] <= 0
        and leaked["pool_bytes"] == 0
        and leaked["pins"] == 0
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
