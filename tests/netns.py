"""Two network namespaces joined by a veth pair: two hosts, simulated on one kernel.

Processes run in either namespace with :meth:`VethPair.command`; traffic between them
crosses the veth pair as it would cross a network (``10.231.x.1`` in ``a``, ``10.231.x.2``
in ``b``). Both namespaces share this kernel and pid namespace, so UCX still sees one host
and would move bytes with cma: give each process :meth:`VethPair.ucx_env` (UCX's tcp
transport on its veth device only) for UCX traffic to cross the pair too.

Needs root and ``ip`` (iproute2); :func:`why_not` says what is missing. ``tc netem`` delay is
optional (:meth:`VethPair.delay`; kernels without ``sch_netem`` refuse it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from types import TracebackType
from typing import Self

__all__ = ("VethPair", "why_not")


def why_not() -> str | None:
    """Why two namespaces cannot be made here (None when they can be tried)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


class VethPair:
    """Namespaces ``a`` and ``b`` of this process (named after its pid), joined by a veth
    pair; removed on :meth:`close`.

    :raises OSError: a namespace or the pair cannot be made (nothing is left behind).
    """

    def __init__(self, tag: str = "") -> None:
        unique = f"{os.getpid() % 100000}{tag}"
        self.a, self.b = f"aiodd-{unique}-a", f"aiodd-{unique}-b"
        self.dev_a, self.dev_b = f"ad{unique}a"[:15], f"ad{unique}b"[:15]
        subnet = 231
        self.ip_a, self.ip_b = f"10.{subnet}.0.1", f"10.{subnet}.0.2"
        self._made: list[str] = []
        try:
            for ns in (self.a, self.b):
                _ip("netns", "add", ns)
                self._made.append(ns)
            _ip("link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b)
            for ns, dev, addr in ((self.a, self.dev_a, self.ip_a), (self.b, self.dev_b, self.ip_b)):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def command(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` run in namespace ``ns`` (``self.a`` or ``self.b``)."""
        return ["ip", "netns", "exec", ns, *argv]

    def ucx_env(self, ns: str) -> dict[str, str]:
        """Environment that makes UCX in namespace ``ns`` use its tcp transport over the
        pair's device there, and nothing else."""
        device = self.dev_a if ns == self.a else self.dev_b
        return {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": device}

    def delay(self, microseconds: int) -> bool:
        """Delay every packet each way by ``microseconds`` (``tc netem``); False when the
        kernel refuses (no ``sch_netem``)."""
        try:
            for ns, dev in ((self.a, self.dev_a), (self.b, self.dev_b)):
                qdisc = ["tc", "qdisc", "replace", "dev", dev, "root", "netem"]
                done = subprocess.run(
                    ["ip", "netns", "exec", ns, *qdisc, "delay", f"{microseconds}us"],
                    capture_output=True,
                    timeout=30,
                    check=False,
                )
                if done.returncode:
                    return False
        except (OSError, subprocess.SubprocessError):
            return False
        return True

    def close(self) -> None:
        """Remove both namespaces (the veth pair goes with them)."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        self._made.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
