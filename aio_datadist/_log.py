"""Library logging: structlog bound loggers over stdlib ``logging``, silent until switched on.

The library never calls ``structlog.configure``. Every logger wraps
``logging.getLogger("aio_datadist.<name>")``, so nothing is printed unless the application
configures stdlib logging or calls :func:`enable_logging` (or sets ``AIO_DATADIST_LOG``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import IO, Any

import structlog

__all__ = ("get_logger", "enable_logging", "LOG_ENV")

LOG_ENV = "AIO_DATADIST_LOG"
_ROOT = "aio_datadist"


def _render(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> tuple[tuple[str], dict[str, Any]]:
    name = str(event.pop("event", ""))
    # Handed to stdlib as is, so that handlers print the traceback (True, an exception or
    # an exc_info tuple) instead of its repr among the fields.
    exc_info = event.pop("exc_info", None)
    fields = " ".join(f"{k}={v}" for k, v in event.items())
    message = f"{name} {fields}" if fields else name
    kwargs: dict[str, Any] = {"extra": {"fields": dict(event)}}
    if exc_info:
        kwargs["exc_info"] = exc_info
    return (message,), kwargs


def get_logger(name: str, *, under: str = _ROOT, **context: Any) -> structlog.stdlib.BoundLogger:
    """Return a bound logger named ``<under>.<name>`` (``aio_datadist.<name>`` by default)
    carrying ``context`` fields.

    ``under`` places an integration's logger in its host's hierarchy (the vLLM connector
    logs under ``vllm.aio_datadist``, so that vLLM's logging configuration shows its lines
    beside vLLM's own); the library itself always logs under ``aio_datadist``.
    """
    logger: structlog.stdlib.BoundLogger = structlog.wrap_logger(
        logging.getLogger(f"{under}.{name}"),
        processors=[structlog.stdlib.filter_by_level, _render],
        wrapper_class=structlog.stdlib.BoundLogger,
        context_class=dict,
        cache_logger_on_first_use=False,
    )
    return logger.bind(**context) if context else logger


# A library adds only a NullHandler, so stdlib's last-resort handler stays quiet too.
logging.getLogger(_ROOT).addHandler(logging.NullHandler())
_handler: logging.Handler | None = None


def enable_logging(level: int | str = logging.INFO, stream: IO[str] | None = None) -> None:
    """Print this library's log events to ``stream`` (stderr by default) at ``level``.

    The one switch for the library's logs; the environment variable ``AIO_DATADIST_LOG``
    (``debug``, ``info``, ``warning``) does the same at import. Only the ``aio_datadist``
    logger is touched; calling again replaces the handler.
    """
    global _handler
    root = logging.getLogger(_ROOT)
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            raise ValueError(f"unknown log level {level!r}")
    if _handler is not None:
        root.removeHandler(_handler)
    _handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    _handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(_handler)
    root.setLevel(level)


def _enable_from_env() -> None:
    value = os.environ.get(LOG_ENV, "").strip()
    if value:
        enable_logging(value)
