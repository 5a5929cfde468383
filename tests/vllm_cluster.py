"""The vLLM instances the serving tests share (``tests/test_vllm_serving.py``), launched in
the background as soon as the session knows it runs those tests.

Starting them (a small random Llama made for the session, then three servers, each importing
vLLM and loading the model) takes about two minutes of this machine's two cores. Launched
at collection, that start overlaps the rest of the suite, which spends much of its time
waiting on peers and deadlines, instead of following it. The tests' fixture takes the
instances over (:func:`take`) and stops them; the session's end stops any never taken.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from tests import ports
from tests.vllm_env import vllm_python

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "vllm"))
from cluster import Instance, connector  # noqa: E402

#: Tokens per KV block.
BLOCK = 32
#: Seconds P holds a request's blocks for a decode that does not come.
ABORT_TIMEOUT = 8


@dataclass
class Launched:
    """The started instances (not yet ready): a prefill (P), a decode that recomputes what
    fails to load (D) and a decode that fails such requests (D2); or why there are none."""

    instances: list[Instance]
    python: str | None
    skip: str | None = None


_lock = threading.Lock()
_thread: threading.Thread | None = None
_launched: Launched | None = None
_error: BaseException | None = None
_taken = False
_work: Path | None = None


def start() -> None:
    """Begin launching the instances, once per session, on a thread of its own."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_run, name="vllm-launch", daemon=True)
            _thread.start()


def _run() -> None:
    global _launched, _error
    try:
        _launched = _launch()
    except BaseException as exc:  # handed to the fixture, which raises it
        _error = exc


def _launch() -> Launched:
    python, how = vllm_python()
    if python is None:
        return Launched([], None, skip=how)
    global _work
    work = _work = Path(tempfile.mkdtemp(prefix="aio-datadist-vllm-"))
    model = work / "model"
    subprocess.run(
        [python, str(REPO / "examples/vllm/make_model.py"), str(model)],
        check=True,
        capture_output=True,
    )
    args = ["--max-model-len", "2048", "--enforce-eager", "--dtype", "float32",
            "--block-size", str(BLOCK), "--max-num-batched-tokens", "64"]  # fmt: skip
    extra = {"abort_timeout": ABORT_TIMEOUT, "load_timeout": 20}
    # The engine in the server's process: a third less start-up CPU for each instance.
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    common = dict(model=str(model), python=python, log_dir=work, args=args, env=env)
    p = Instance("p", kv=connector("pull", **extra), cpus="0", port=ports.free_port(), **common)  # type: ignore[arg-type]
    d_kv = connector("pull", **extra)
    d_kv["kv_load_failure_policy"] = "recompute"
    d = Instance("d", kv=d_kv, cpus="1", port=ports.free_port(), **common)  # type: ignore[arg-type]
    d2_kv = connector("pull", **extra)
    d2_kv["kv_load_failure_policy"] = "fail"
    d2 = Instance("d2", kv=d2_kv, cpus="1", port=ports.free_port(), **common)  # type: ignore[arg-type]
    instances = [p, d, d2]
    try:
        for instance in instances:
            instance.start()
    except BaseException:
        for instance in instances:
            instance.stop()
        raise
    return Launched(instances, python)


def take() -> Launched:
    """The launched instances (waiting for the launch; the caller stops them).

    :raises BaseException: what the launch raised.
    """
    global _taken
    start()
    assert _thread is not None
    _thread.join()
    if _error is not None:
        raise _error
    assert _launched is not None
    _taken = True
    return _launched


def stop() -> None:
    """End of the session: stop instances never taken; remove the work directory."""
    if _thread is None:
        return
    _thread.join()
    if _launched is not None and not _taken:
        for instance in _launched.instances:
            instance.stop()
    if _work is not None:
        shutil.rmtree(_work, ignore_errors=True)
