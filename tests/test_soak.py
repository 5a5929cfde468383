"""A bounded slice of the soak (``tools/soak.py``): mixed transfers with a real peer process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aio_datadist._routes.ucx import worker as ucx

SOAK = Path(__file__).resolve().parent.parent / "tools" / "soak.py"
ROUTES = ["link", "samehost"] + (["ucx"] if ucx.available() is None else [])


@pytest.mark.parametrize("route", ROUTES)
def test_soak_slice(route: str) -> None:
    args = ["--transfers", "400", "--seed", "3", "--route", route, "--cancel-rate", "0.3"]
    done = subprocess.run(
        [sys.executable, str(SOAK), *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["problems"] == [] and report["mismatches"] == 0
    assert sum(report["completed"].values()) + report["cancelled"] == 400
    assert report["pool_used_at_end"] == {"blocking": 0, "async": 0}
