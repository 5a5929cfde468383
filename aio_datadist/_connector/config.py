"""A connector's settings: read once from the serving engine's extra config, checked.

Keys (all optional but ``host``, which the engine adapter fills in):

========================  ==========================================================  =======
key                       meaning                                                     default
========================  ==========================================================  =======
``host``                  the address peers reach this worker at (control and data)  engine's
``port``                  control port of TP rank 0; rank r listens on ``port + r``    0: free
``data_port``             transfer port of TP rank 0 (``data_port + r``)              0: free
``mode``                  ``"pull"`` (D reads P's blocks) or ``"push"`` (P writes     pull
                          D's blocks layer by layer as it computes them)
``link_secret``           shared secret for control channels and transfer links       env
``abort_timeout``         s a prefill keeps a finished request's blocks for D          480
``load_timeout``          s a decode waits for one request's KV before failing it     120
``connect_timeout``       s to reach a peer and link to it                            10
``transport`` ...         ``LLMConfig`` settings passed to the engine: ``transport``,
                          ``same_host``, ``ucx``, ``ucx_lanes``, ``busy_poll_us``,
                          ``sync_kv_timeout`` (ms, default 30000), ``metrics``
========================  ==========================================================  =======
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aio_datadist.config import LLMConfig

__all__ = ("ENGINE_SETTINGS", "MODES", "MODE_PULL", "MODE_PUSH", "ConnectorConfig")

MODE_PULL = "pull"
MODE_PUSH = "push"
MODES = (MODE_PULL, MODE_PUSH)

#: ``LLMConfig`` properties a connector passes through, and the type each takes.
ENGINE_SETTINGS: Mapping[str, type] = {
    "transport": str,
    "same_host": bool,
    "ucx": bool,
    "ucx_lanes": int,
    "busy_poll_us": int,
    "sync_kv_timeout": int,
    "metrics": bool,
}
_DEFAULT_SYNC_KV_TIMEOUT_MS = 30_000
_OWN_KEYS = (
    "host",
    "port",
    "data_port",
    "mode",
    "link_secret",
    "abort_timeout",
    "load_timeout",
    "connect_timeout",
)


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{key} must be true or false, got {value!r}")


def _int(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{key} must be an integer, got {value!r}") from None
    if not low <= number <= high:
        raise ValueError(f"{key} must be in [{low}, {high}], got {number}")
    return number


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{key} must be a number of seconds, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{key} must be a number of seconds, got {value!r}") from None
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{key} must be a positive number of seconds, got {value!r}")
    return number


@dataclass(frozen=True)
class ConnectorConfig:
    """Checked connector settings (see the module's table)."""

    host: str
    port: int = 0
    data_port: int = 0
    mode: str = MODE_PULL
    link_secret: str | None = field(default=None, repr=False)
    abort_timeout_s: float = 480.0
    load_timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    engine: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, *, default_host: str) -> ConnectorConfig:
        """Read ``extra`` (the engine's ``kv_connector_extra_config``).

        :raises ValueError: an unknown key or a bad value, with the key named.
        """
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k not in _OWN_KEYS and k not in ENGINE_SETTINGS)
        if unknown:
            known = ", ".join(sorted((*_OWN_KEYS, *ENGINE_SETTINGS)))
            raise ValueError(f"unknown connector setting(s) {unknown}; known: {known}")
        host = extra.get("host", default_host)
        if not isinstance(host, str) or not host:
            raise ValueError(f"host must be a non-empty string, got {host!r}")
        mode = extra.get("mode", MODE_PULL)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
        secret = extra.get("link_secret")
        if secret is not None and (not isinstance(secret, str) or not secret):
            raise ValueError("link_secret must be a non-empty string")
        engine: dict[str, Any] = {"sync_kv_timeout": _DEFAULT_SYNC_KV_TIMEOUT_MS}
        for key, kind in ENGINE_SETTINGS.items():
            if key not in extra:
                continue
            value = extra[key]
            if kind is bool:
                engine[key] = _bool(key, value)
            elif kind is int:
                engine[key] = _int(key, value, 0, 2**31 - 1)
            else:
                if not isinstance(value, str):
                    raise ValueError(f"{key} must be a string, got {value!r}")
                engine[key] = value
        config = cls(
            host=host,
            port=_int("port", extra.get("port", 0), 0, 65535),
            data_port=_int("data_port", extra.get("data_port", 0), 0, 65535),
            mode=mode,
            link_secret=secret,
            abort_timeout_s=_seconds("abort_timeout", extra.get("abort_timeout", 480)),
            load_timeout_s=_seconds("load_timeout", extra.get("load_timeout", 120)),
            connect_timeout_s=_seconds("connect_timeout", extra.get("connect_timeout", 10)),
            engine=engine,
        )
        config.llm_config(listen=None, device_id=0)  # LLMConfig checks the engine settings
        return config

    def rank_port(self, base: int, rank: int) -> int:
        """The port TP rank ``rank`` uses for ``base`` (0 stays 0: a free port)."""
        if base == 0:
            return 0
        port = base + rank
        if port > 65535:
            raise ValueError(f"port {base} + rank {rank} is beyond 65535")
        return port

    def llm_config(self, *, listen: str | None, device_id: int) -> LLMConfig:
        """The engine's ``LLMConfig``: cache manager mode, remote-accessible caches, this
        config's engine settings and secret, listening on ``listen`` ("ip:port").

        :raises ValueError: an engine setting ``LLMConfig`` refuses (its message kept).
        """
        cfg = LLMConfig()
        cfg.device_id = device_id
        cfg.enable_cache_manager = True
        cfg.enable_remote_cache_accessible = True
        if listen is not None:
            cfg.listen_ip_info = listen
        if self.link_secret is not None:
            cfg.link_secret = self.link_secret
        for key, value in self.engine.items():
            try:
                setattr(cfg, key, value)
            except (TypeError, ValueError, RuntimeError) as exc:  # LLMException too
                raise ValueError(f"{key}: {exc}") from exc
        return cfg
