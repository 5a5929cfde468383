"""Every example, benchmark and tool script answers ``--help`` and refuses a bad argument
with argparse's one-line message (exit status 2), before it does any work."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from aio_datadist import _argtypes as argtypes

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for d in ("examples", "benchmarks", "tools") for p in (ROOT / d).glob("*.py"))


def run(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_script_answers_help_and_refuses_a_bad_argument(script: Path) -> None:
    helped = run(script, "--help")
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage:")
    refused = run(script, "--no-such-option")
    assert refused.returncode == 2
    last = refused.stderr.strip().splitlines()[-1]
    assert "error: unrecognized arguments: --no-such-option" in last


@pytest.mark.parametrize(
    ("kind", "text", "want"),
    [
        (argtypes.positive_int, "3", 3),
        (argtypes.non_negative_int, "0", 0),
        (argtypes.positive_float, "0.5", 0.5),
        (argtypes.non_negative_float, "0", 0.0),
        (argtypes.fraction, "1", 1.0),
        (argtypes.port, "65535", 65535),
    ],
)
def test_argument_types_take_good_values(kind: object, text: str, want: float) -> None:
    assert kind(text) == want  # type: ignore[operator]


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        (argtypes.positive_int, "0"),
        (argtypes.positive_int, "1.5"),
        (argtypes.non_negative_int, "-1"),
        (argtypes.positive_float, "0"),
        (argtypes.positive_float, "nan"),
        (argtypes.non_negative_float, "-0.1"),
        (argtypes.fraction, "1.01"),
        (argtypes.port, "65536"),
        (argtypes.port, "x"),
    ],
)
def test_argument_types_refuse_bad_values(kind: object, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        kind(text)  # type: ignore[operator]


def test_a_bad_value_ends_a_script_with_one_line() -> None:
    refused = run(ROOT / "examples" / "pd_disaggregation.py", "--requests", "0")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "pd_disaggregation.py: error: --requests must be at least 1, got 0"
    )


def test_the_getting_started_example_runs() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = run(ROOT / "examples" / "two_processes.py", "--port", str(port))
    assert done.returncode == 0, done.stderr
    assert "every byte checked" in done.stdout
