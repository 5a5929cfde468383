"""UCX is optional: with no usable libucp everything imports and the loader says why.

Runs everywhere (no UCX needed): each case runs in a fresh interpreter so that the loader's
cached outcome and the environment are its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parent.parent)

PROBE = r"""
import json
import aio_datadist
from aio_datadist._native import ucx as native
from aio_datadist._routes.ucx import worker as ucx
from aio_datadist.status import LLMException, LLMStatusCode

out = {"reason": ucx.available(), "info": ucx.ucx_info(), "path": native.loaded_path()}
try:
    ucx.UcxContext()
except LLMException as exc:
    out["context"] = [exc.status_code.name, str(exc)]
print(json.dumps(out))
"""


def _probe(env_value: str) -> dict[str, object]:
    env = dict(os.environ, AIO_DATADIST_UCX=env_value, PYTHONPATH=ROOT)
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize("path", ["/nonexistent/libucp.so", "/etc/hostname"])
def test_bad_ucx_path_reports_the_reason(path: str) -> None:
    out = _probe(path)
    reason = out["reason"]
    assert isinstance(reason, str) and "AIO_DATADIST_UCX" in reason and path in reason
    assert out["info"] == {"available": False, "reason": reason}
    assert out["path"] is None
    assert out["context"] == ["LLM_FEATURE_NOT_ENABLED", f"UCX is not available: {reason}"]


def test_a_library_that_is_not_libucp_is_refused() -> None:
    libc = "libc.so.6"
    out = _probe(libc)
    reason = out["reason"]
    assert isinstance(reason, str) and "not a usable libucp" in reason
