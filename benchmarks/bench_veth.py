#!/usr/bin/env python3
"""The harness's W1/W2/W3 between two network namespaces joined by a veth pair (root).

    sudo python benchmarks/bench_veth.py [--variants aio-tcp-async aio-ucx-tcp-async ...]
        [--ops read write] [--delay-us 0] [--perftest 3]

Two hosts, simulated on one kernel: the shared harness (``benchmarks/bench_adapter.py``)
runs in namespace ``b``, its target process in namespace ``a``, so the link crosses the
veth pair (the same-host route off). UCX variants run with UCX's tcp transport on the veth
devices only (on one kernel UCX would otherwise read with cma, as on one host). Prints the
harness's figures and CPU time per GB of each run, one row per variant and op, as the
harness's table does. ``--delay-us`` adds ``tc netem`` delay each way (where the kernel has
``sch_netem``). ``--perftest N`` first runs UCX's own ``ucx_perftest`` (``ucp_get`` of
256 MiB, from the ``libucx`` wheel) N times over the same transport and devices, the
yardstick of W1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aio_datadist import _argtypes as argtypes  # noqa: E402
from tests.netns import VethPair, why_not  # noqa: E402

ADAPTER = ROOT / "benchmarks" / "bench_adapter.py"
VARIANTS = [
    "aio-tcp-async",
    "aio-tcp-blocking",
    "aio-ucx-tcp-async",
    "aio-ucx-tcp-blocking",
]


def run(pair: VethPair, variant: str, op: str) -> dict[str, object]:
    """One harness run: its RESULT, with the CPU figures of its AIO_CPU line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(AIO_BENCH_TARGET_NETNS=pair.a, AIO_BENCH_LISTEN_IP=pair.ip_a)
    if "ucx" in variant:
        env.update(pair.ucx_env(pair.b))
        env["AIO_BENCH_TARGET_ENV"] = json.dumps(pair.ucx_env(pair.a))
    done = subprocess.run(
        pair.command(pair.b, [sys.executable, str(ADAPTER), "--variant", variant, "--op", op]),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    result: dict[str, object] = {"peer": variant, "op": op, "status": "FAILED"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result.update(json.loads(line[len("RESULT ") :]))
        elif line.startswith("AIO_CPU "):
            result["cpu"] = json.loads(line[len("AIO_CPU ") :])
    if result["status"] != "ok":
        result.setdefault("error", (done.stdout + done.stderr)[-2000:])
    return result


def perftest(pair: VethPair) -> str:
    """One ``ucx_perftest`` ``ucp_get`` run of 256 MiB x 20 across the pair: its overall
    bandwidth in GB/s (it prints MiB/s)."""
    import libucx  # type: ignore[import-not-found,unused-ignore]

    home = Path(libucx.__file__).parent
    tool = str(home / "bin" / "ucx_perftest")
    port = str(13337 + os.getpid() % 1000)
    env = dict(os.environ, LD_LIBRARY_PATH=str(home / "lib"))
    server = subprocess.Popen(
        pair.command(pair.a, [tool, "-p", port]),
        env={**env, **pair.ucx_env(pair.a)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        args = [tool, pair.ip_a, "-p", port, "-t", "ucp_get", "-s", str(256 << 20)]
        for _ in range(50):  # until the server listens
            done = subprocess.run(
                pair.command(pair.b, [*args, "-n", "20", "-w", "2", "-f"]),
                env={**env, **pair.ucx_env(pair.b)},
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            if done.returncode == 0:
                mib_s = float(done.stdout.split()[-3])  # overall bandwidth, MiB/s
                return f"{mib_s * (1 << 20) / 1e9:.2f}"
            time.sleep(0.1)
        return "failed"
    finally:
        server.wait(30)


def row(r: dict[str, object]) -> str:
    """One table row: the harness's figures, then CPU seconds per GB of W1 and W2."""
    if r["status"] != "ok":
        return f"{r['peer']:<22} {r['op']:<6} FAILED: {str(r.get('error', ''))[:200]}"
    cpu = r.get("cpu") or {}
    assert isinstance(cpu, dict)
    per_gb = [cpu.get(w, {}).get("cpu_s_per_gb", float("nan")) for w in ("W1", "W2")]
    route = (cpu.get("routes") or ["?"])[0]
    return (
        f"{r['peer']:<22} {r['op']:<6} {r['W1_GBps']:7.2f} {r['W2_GBps']:8.2f} "
        f"{r['W3_p50_us']:10.1f} {r['W3_p99_us']:10.1f} {per_gb[0]:9.3f} {per_gb[1]:9.3f}  {route}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=VARIANTS, help="adapter variants")
    parser.add_argument("--ops", nargs="+", choices=("read", "write"), default=["read", "write"])
    parser.add_argument("--delay-us", type=argtypes.non_negative_int, default=0)
    parser.add_argument(
        "--perftest", type=argtypes.non_negative_int, default=0, help="ucx_perftest runs first"
    )
    args = parser.parse_args()
    reason = why_not()
    if reason is not None:
        parser.error(reason)
    with VethPair("bench") as pair:
        if args.delay_us and not pair.delay(args.delay_us):
            parser.error("tc netem is not available (the kernel has no sch_netem)")
        print(f"veth pair {pair.dev_a} ({pair.ip_a}, ns {pair.a}) <-> {pair.dev_b} ({pair.ip_b})")
        for i in range(args.perftest):
            print(
                f"ucx_perftest ucp_get 256 MiB, tcp over the pair, run {i + 1}: "
                f"{perftest(pair)} GB/s",
                flush=True,
            )
        print(
            f"{'variant':<22} {'op':<6} {'W1 GB/s':>7} {'W2 GB/s':>8} {'W3 p50 us':>10} "
            f"{'W3 p99 us':>10} {'W1 cpu/GB':>9} {'W2 cpu/GB':>9}  first route"
        )
        for variant in args.variants:
            for op in args.ops:
                print(row(run(pair, variant, op)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
