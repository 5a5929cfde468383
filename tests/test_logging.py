"""The library is silent by default and logs structured events once switched on."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import aio_datadist
from aio_datadist import LLMDataDist, LLMRole
from tests.conftest import make_options, pool_cfg

QUIET_SCRIPT = """
import aio_datadist as ll
dd = ll.LLMDataDist(ll.LLMRole.PROMPT, 1)
cfg = ll.LLMConfig(); cfg.device_id = 0; cfg.enable_cache_manager = True
cfg.mem_pool_cfg = '{"memory_size": 1048576}'
dd.init(cfg.generate_options())
c = dd.cache_manager.allocate_cache(ll.CacheDesc(1, [1, 8], ll.DataType.DT_INT8))
dd.cache_manager.deallocate_cache(c)
dd.finalize()
"""


def test_silent_by_default() -> None:
    out = subprocess.run(
        [sys.executable, "-c", QUIET_SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout == "" and out.stderr == ""


def test_env_switch_turns_logging_on() -> None:
    env = {"AIO_DATADIST_LOG": "debug", "PATH": ""}
    import os

    env = {**os.environ, "AIO_DATADIST_LOG": "debug"}
    out = subprocess.run(
        [sys.executable, "-c", QUIET_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    )
    assert out.stdout == ""
    assert "runtime.selected runtime=host" in out.stderr
    assert "cache.allocated" in out.stderr and "cluster_id=1" in out.stderr


def test_enable_logging_binds_context() -> None:
    stream = io.StringIO()
    aio_datadist.enable_logging("DEBUG", stream=stream)
    try:
        dd = LLMDataDist(LLMRole.DECODER, 42)
        dd.init(make_options(device_pool=pool_cfg()))
        try:
            from aio_datadist import CacheDesc, DataType

            cache = dd.cache_manager.allocate_cache(CacheDesc(1, [1, 8], DataType.DT_INT8))
            dd.cache_manager.deallocate_cache(cache)
        finally:
            dd.finalize()
    finally:
        root = logging.getLogger("aio_datadist")
        for handler in list(root.handlers):
            if not isinstance(handler, logging.NullHandler):
                root.removeHandler(handler)
        root.setLevel(logging.NOTSET)
    text = stream.getvalue()
    assert "engine.initialized" in text and "role=DECODER" in text
    assert "cache.allocated cluster_id=42" in text and "cache_id=1" in text
    assert "engine.finalized" in text
