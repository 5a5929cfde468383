"""The ``aio-datadist`` command (also ``python -m aio_datadist``).

* ``info``: version, native build, the runtimes found (CUDA, ACL, HCCL: the library or why
  not), UCX and its transports, whether the same-host route is allowed here, logging;
* ``bench``: W1/W2/W3 through the public API on a chosen route and face, beside memcpy and
  a plain socket in the same run (two local processes, or one side for another host);
* ``ping HOST:PORT``: link to a listener (with the secret of ``AIO_DATADIST_LINK_SECRET``)
  and report the link time, the routes and the round-trip time, or why it failed.

Tables and progress bars use ``rich`` where it is installed (``aio_datadist[cli]``); every
command also prints ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence

from aio_datadist import _argtypes as argtypes
from aio_datadist.cli._console import print_json, print_table, progress

__all__ = ("main",)


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, argtypes.port(port)


def _size_mib(text: str) -> int:
    from aio_datadist.cli.bench import layout

    value = argtypes.positive_int(text)
    try:
        layout(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("--size-mib ", "")) from None
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aio-datadist", description="Check a machine, measure and ping aio_datadist links."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,bench,ping}")

    info = sub.add_parser("info", help="what this machine offers aio_datadist")
    info.add_argument("--json", action="store_true", help="print JSON")

    bench = sub.add_parser("bench", help="W1/W2/W3 beside memcpy and a plain socket")
    bench.add_argument(
        "--route",
        choices=("samehost", "tcp", "ucx"),
        default=None,
        help="samehost (one-sided copies; the default on one host), tcp (every byte "
        "over the link; the default with --connect) or ucx (UCP RMA; both sides need "
        "the ucx extra or AIO_DATADIST_UCX)",
    )
    bench.add_argument("--face", choices=("sync", "async"), default="async")
    bench.add_argument("--op", choices=("pull", "push"), default="pull")
    bench.add_argument("--size-mib", type=_size_mib, default=256, help="cache size (W1)")
    bench.add_argument("--iters", type=argtypes.positive_int, default=200, help="W3 transfers")
    bench.add_argument(
        "--connect",
        type=_host_port,
        metavar="HOST:PORT",
        help="measure against a serving side started on another host with --serve",
    )
    bench.add_argument(
        "--plain-port", type=argtypes.port, default=None, help="the plain socket's port"
    )
    bench.add_argument("--serve", action="store_true", help="be the serving side")
    bench.add_argument(
        "--listen", type=_host_port, metavar="HOST:PORT", help="where --serve listens"
    )
    bench.add_argument("--json", action="store_true", help="print JSON")
    bench.add_argument("--quiet", action="store_true", help="no progress display")

    ping = sub.add_parser("ping", help="link to a listener and time round trips")
    ping.add_argument("target", type=_host_port, metavar="HOST:PORT")
    ping.add_argument("--cluster-id", type=argtypes.non_negative_int, default=1)
    ping.add_argument("--count", type=argtypes.positive_int, default=10)
    ping.add_argument("--timeout-ms", type=argtypes.positive_int, default=5000)
    ping.add_argument("--local-ip", default="127.0.0.1", help="this side's IP for the link")
    ping.add_argument("--no-same-host", action="store_true", help="keep to the TCP link")
    ping.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _info(args: argparse.Namespace) -> int:
    from aio_datadist.cli.info import gather, render

    data = gather()
    if args.json:
        print_json(data)
    else:
        print_table("aio_datadist info", ("what", "state", "detail"), render(data))
    return 0


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from aio_datadist.cli import bench as b

    if args.serve:
        if args.listen is None or args.plain_port is None:
            parser.error("--serve needs --listen HOST:PORT and --plain-port PORT")
        host, port = args.listen
        b.serve(
            f"{host}:{port}",
            args.plain_port,
            args.size_mib,
            same_host=args.route not in ("tcp", "ucx"),
            ucx=args.route == "ucx",
        )
        return 0
    route = args.route or ("tcp" if args.connect else "samehost")
    same_host, ucx = route == "samehost", route == "ucx"
    with contextlib.ExitStack() as stack:
        if args.connect is None:
            host = "127.0.0.1"
            port, plain = stack.enter_context(
                b.local_server(args.size_mib, same_host=same_host, ucx=ucx)
            )
        else:
            if args.plain_port is None:
                parser.error("--connect needs --plain-port (the serving side's)")
            (host, port), plain = args.connect, args.plain_port
        bench = b.Bench(
            host, port, plain, args.size_mib, args.face, args.op, same_host, ucx, args.iters
        )
        with progress(5, quiet=args.quiet or args.json) as step:
            results = b.run(bench, step)
    if args.json:
        print_json(results)
        return 0
    title = (
        f"aio-datadist bench: {results['route']} route, {args.face} face, {args.op}, "
        f"{args.size_mib} MiB, to {results['target']} (routes {', '.join(results['link_routes'])})"
    )
    rows = [
        ("memcpy (one thread)", f"{results['memcpy_GBps']} GB/s", "", "", ""),
        ("plain TCP socket", f"{results['socket_GBps']} GB/s", "", "", ""),
    ]
    for w in ("W1", "W2"):
        rows.append(
            (
                w,
                f"{results[w + '_GBps']} GB/s",
                f"{results[w + '_vs_memcpy']}x",
                f"{results[w + '_vs_socket']}x",
                f"{results[w + '_cpu_s_per_GB']} s",
            )
        )
    rows.append(("W3 p50 / p99", f"{results['W3_p50_us']} / {results['W3_p99_us']} us", "", "", ""))
    print_table(title, ("workload", "result", "vs memcpy", "vs socket", "CPU per GB"), rows)
    return 0


def _ping(args: argparse.Namespace) -> int:
    from aio_datadist.cli.ping import ping

    host, port = args.target
    result = ping(
        host,
        port,
        cluster_id=args.cluster_id,
        count=args.count,
        timeout_ms=args.timeout_ms,
        same_host=not args.no_same_host,
        local_ip=args.local_ip,
    )
    if args.json:
        print_json(result)
    elif result["ok"]:
        rtt = result["rtt_us"]
        print_table(
            f"aio-datadist ping {result['target']} (cluster {result['cluster_id']})",
            ("what", "value"),
            [
                ("link", f"{result['link_ms']} ms"),
                ("routes", ", ".join(result["routes"])),
                ("authenticated", "yes" if result["authenticated"] else "no"),
                ("round trip min / p50 / max", f"{rtt['min']} / {rtt['p50']} / {rtt['max']} us"),
            ],
        )
    else:
        print(f"aio-datadist ping {result['target']}: {result['status']}: {result['reason']}")
    return 0 if result["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command with ``argv`` (default: the process's); its exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info(args)
    if args.command == "bench":
        return _bench(args, parser)
    return _ping(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
