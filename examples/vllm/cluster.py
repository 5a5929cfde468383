"""Start and stop vLLM instances (``vllm serve``) and the proxy, for the example, the tests
and the benchmark.

An :class:`Instance` is one OpenAI-compatible vLLM server in a process of its own, logging to
a file; ``kv`` gives it a KV connector. On a CPU each instance gets its own cores
(``VLLM_CPU_OMP_THREADS_BIND``), or the OpenMP threads of two instances spin against each
other.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def connector(mode: str = "pull", role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for ``AioDataDistConnector``."""
    return {
        "kv_connector": "AioDataDistConnector",
        "kv_connector_module_path": "aio_datadist.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"host": "127.0.0.1", "mode": mode, **extra},
    }


def nixl_connector(role: str = "kv_both") -> dict[str, Any]:
    """A ``--kv-transfer-config`` for vLLM's own NixlConnector."""
    return {"kv_connector": "NixlConnector", "kv_role": role}


@dataclass
class Instance:
    """One vLLM server."""

    name: str
    model: str
    port: int = field(default_factory=free_port)
    kv: dict[str, Any] | None = None
    cpus: str | None = None
    python: str = sys.executable
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path = Path("/tmp")
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Its base URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        """Where its output goes."""
        return self.log_dir / f"vllm-{self.name}.log"

    def start(self) -> Instance:
        """Start the server process (returns at once; :meth:`wait_ready` waits)."""
        command = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--served-model-name", "model",
            "--host", "127.0.0.1", "--port", str(self.port),
            *self.args,
        ]  # fmt: skip
        if self.kv is not None:
            command += ["--kv-transfer-config", json.dumps(self.kv)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")  # the log file shows each line as it comes
        if self.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        env.update(self.env)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        return self

    def alive(self) -> bool:
        """Whether the process runs."""
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, timeout: float = 300.0) -> Instance:
        """Wait until ``/health`` answers 200.

        :raises RuntimeError: the process ended first (the log's tail says why), or the time
            ran out.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"vLLM {self.name} exited:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM {self.name} not ready in {timeout:g} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of its log."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(line for line in text if "Location" not in line)[-6000:] if text else ""

    def kill(self) -> None:
        """SIGKILL the whole process group (vLLM's engine and workers too)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop it (SIGTERM, then SIGKILL after ``timeout``)."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        else:  # the engine's children may outlive the server a moment
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{"name{labels}": value}``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    continue
        return out


def metric(metrics: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def post(url: str, body: dict[str, Any], timeout: float = 300.0) -> tuple[int, dict[str, Any]]:
    """POST JSON; (status, the JSON answer)."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, {"error": str(exc)}


def complete(url: str, prompt: str, **fields: Any) -> tuple[int, dict[str, Any]]:
    """A greedy completion of ``prompt`` (``max_tokens`` 16 unless given)."""
    body = {"model": "model", "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, **fields}  # fmt: skip
    return post(url + "/v1/completions", body)


def stream(url: str, prompt: str, **fields: Any) -> str:
    """A greedy completion of ``prompt``, streamed (server-sent events); its text."""
    body = {"model": "model", "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "stream": True, **fields}  # fmt: skip
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    parts = []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                parts.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(parts)


@dataclass
class ProxyProcess:
    """The example's proxy in a process of its own."""

    prefill: list[str]
    decode: list[str]
    mode: str = "pull"
    port: int = field(default_factory=free_port)
    python: str = sys.executable
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Its base URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ProxyProcess:
        """Start it and wait until it answers."""
        command = [self.python, str(HERE / "proxy.py"), "--port", str(self.port),
                   "--mode", self.mode]  # fmt: skip
        for url in self.prefill:
            command += ["--prefill", url]
        for url in self.decode:
            command += ["--decode", url]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("the proxy exited")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        raise RuntimeError("the proxy did not start")

    def stop(self) -> None:
        """Stop it."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
