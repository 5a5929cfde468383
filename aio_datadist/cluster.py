"""``LLMClusterInfo``: the description of one peer for ``link_clusters`` / ``unlink_clusters``.

IPv4 addresses are kept as the reference keeps them: a dotted string is converted with
``inet_aton`` and read as a **little-endian** uint32, so ``"1.2.3.4"`` becomes ``0x04030201``.
``ip_int_to_str`` is the inverse, for transports that need the dotted form back.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterable
from typing import Any

from aio_datadist._validate import check_int, check_type
from aio_datadist.enums import LLMRole
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ("LLMClusterInfo", "LinkResults", "ip_int_to_str", "ip_str_cause", "ip_str_to_int")


def ip_str_to_int(ip: str | int) -> int:
    """Convert a dotted IPv4 string to the reference's little-endian uint32; ints pass through.

    Raises ``RuntimeError("Can not parse ip str:<ip>: <cause>")`` when ``inet_aton`` rejects
    the string; the cause says that host names are not accepted (see :func:`ip_str_cause`).
    """
    if isinstance(ip, str):
        try:
            packed = socket.inet_aton(ip)
        except (OSError, ValueError):
            # ValueError covers embedded NULs and non-ASCII text, which inet_aton refuses
            # differently from a malformed address.
            raise RuntimeError(f"Can not parse ip str:{ip}: {ip_str_cause(ip)}") from None
        return int.from_bytes(packed, byteorder="little")
    return ip


# Letters, digits, '-' and '.', with a letter somewhere: what a host name looks like.
_HOST_NAME = re.compile(r"(?=.*[A-Za-z])[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.?")


def ip_str_cause(ip: str) -> str:
    """Why ``ip`` is refused where an IPv4 address is needed, in words for an error message.

    Host names are never resolved: the reference takes addresses only, and a name that
    resolved differently on the two ends would link the wrong peer.
    """
    if _HOST_NAME.fullmatch(ip):
        return (
            f"{ip!r} is a host name, and a host name such as 'localhost' is not accepted; "
            "pass a dotted IPv4 address such as 127.0.0.1"
        )
    return (
        f"{ip!r} is not a dotted IPv4 address (a host name such as 'localhost' is not "
        "accepted either); pass one such as 127.0.0.1"
    )


def ip_int_to_str(ip: int) -> str:
    """Dotted IPv4 string of an address stored as a little-endian uint32 (inverse of the above).

    Raises ``TypeError`` for a non-int and ``ValueError`` outside uint32.
    """
    check_int("ip", ip, "uint32")
    return socket.inet_ntoa(ip.to_bytes(4, byteorder="little"))


def _check_ip_port(ip: Any, port: Any) -> int:
    check_type("ip", ip, str, int)
    check_int("port", port, "uint16")
    if isinstance(ip, int):
        # The native layer stores the address in a uint32; refuse what it could not hold.
        check_int("ip", ip, "uint32")
        return ip
    return ip_str_to_int(ip)


class LLMClusterInfo:
    """One remote endpoint to link to or unlink from, with the local and remote host ip:ports.

    Addresses are stored as ``(ip, port)`` tuples where ``ip`` is the little-endian uint32 form
    of the IPv4 address (see the module docstring) and ``port`` a uint16.
    """

    __slots__ = (
        "_local_ip_info_list",
        "_remote_cluster_id",
        "_remote_ip_info_list",
        "_remote_role_type",
    )

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | int | None = None
        self._local_ip_info_list: list[tuple[int, int]] = []
        self._remote_ip_info_list: list[tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        """cluster_id (uint64) of the remote endpoint; None until set."""
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, remote_cluster_id: int) -> None:
        # TypeError for a non-int (None included), ValueError outside uint64.
        check_int("remote_cluster_id", remote_cluster_id, "uint64")
        self._remote_cluster_id = remote_cluster_id

    @property
    def remote_role_type(self) -> LLMRole | int | None:
        """Role of the remote endpoint. Stored only; the v2 API never sends it."""
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, remote_role_type: LLMRole | int | None) -> None:
        check_type("remote_role_type", remote_role_type, LLMRole, int, allow_none=True)
        self._remote_role_type = remote_role_type

    @property
    def local_ip_info_list(self) -> list[tuple[int, int]]:
        """Local ``(ip, port)`` entries in the order appended (the live list, as the reference)."""
        return self._local_ip_info_list

    @property
    def remote_ip_info_list(self) -> list[tuple[int, int]]:
        """Remote ``(ip, port)`` entries in the order appended (the live list)."""
        return self._remote_ip_info_list

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        """Add a local host address: ``ip`` dotted IPv4 or uint32 int, ``port`` uint16.

        Raises ``TypeError`` for wrong types, ``ValueError`` for a port outside uint16 or an int
        ip outside uint32, ``RuntimeError("Can not parse ip str:...")`` for an ip string that
        is not an IPv4 address (a host name such as ``"localhost"`` included).
        """
        self._local_ip_info_list.append((_check_ip_port(ip, port), port))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """Add a remote host address (the peer's listen ip:port); same checks as the local one."""
        self._remote_ip_info_list.append((_check_ip_port(ip, port), port))

    def __repr__(self) -> str:
        def fmt(entries: list[tuple[int, int]]) -> str:
            return "[" + ", ".join(f"{_show_ip(ip)}:{port}" for ip, port in entries) + "]"

        return (
            f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, "
            f"remote_role_type={self._remote_role_type}, "
            f"local_ip_info_list={fmt(self._local_ip_info_list)}, "
            f"remote_ip_info_list={fmt(self._remote_ip_info_list)})"
        )


def _show_ip(ip: int) -> str:
    try:
        return ip_int_to_str(ip)
    except (TypeError, ValueError):
        # The lists are live; show whatever a caller may have put there rather than fail repr.
        return repr(ip)


class LinkResults(list[LLMStatusCode]):
    """The per-cluster statuses of ``link_clusters``/``unlink_clusters``, with their reasons.

    It is the documented ``rets`` list (one ``LLMStatusCode`` per cluster, in input order;
    it compares equal to a plain list of the same codes), and also carries ``errors``: for
    each cluster None on success, else the ``LLMException`` (subclass by code, its
    ``status_code`` the same code) whose message says why (connection refused, wrong
    cluster id, authentication, ...), with the underlying error as ``__cause__`` where there
    is one. The calls themselves never raise for these failures.
    """

    def __init__(self, outcomes: Iterable[LLMException | None] = ()) -> None:
        errors = list(outcomes)
        super().__init__(LLMStatusCode.LLM_SUCCESS if e is None else e.status_code for e in errors)
        #: None for each cluster that succeeded, else why it failed.
        self.errors: list[LLMException | None] = errors

    def __repr__(self) -> str:
        return f"LinkResults({list.__repr__(self)})"
