"""vLLM disaggregated serving: AioDataDistConnector (pull, push) beside NixlConnector.

For each connector, starts a prefill (P, core 0) and a decode (D, core 1) instance of one
model on this machine; also a single instance without disaggregation. Each request is a
distinct prompt (no prefix cache hits), greedy, ``--max-tokens`` tokens, streamed from D:

* **D time**: D's request, sent to its answer's end (pull: sent after P's answer; push: sent
  with P's, so it includes P's prefill);
* **TTFT**: the client's first token, from the moment it sent the request (P + D);
* **KV wait**: D's first-token time less one decode step (its inter-token latency): what D
  spent getting the KV, as a share of D time;
* **ITL**: D's median inter-token latency (printed with each row's JSON line).

The single instance's row is its whole request (TTFT and total). Run it with the Python that
has vLLM (and ``pip install --no-deps nixl nixl-cu12`` for NixlConnector)::

    python benchmarks/bench_vllm.py --lengths 512,1024,2048,4096,8192 --repeat 3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "vllm"))

import itertools

from cluster import Instance, complete, connector, nixl_connector
from make_model import WORDS, kv_bytes_per_token, make_model

MODEL = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 8, "head_dim": 64}


def prompt(n: int, seed: int) -> str:
    """``n`` tokens, different for each seed."""
    return " ".join(WORDS[(i * 13 + seed * 7919 + n) % len(WORDS)] for i in range(n))


def streamed(
    url: str, text: str, max_tokens: int, params: dict[str, Any] | None
) -> tuple[float, float, list[float], str]:
    """(first token at, end at, each token's arrival, the text) of a streamed completion."""
    body = {"model": "model", "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    if params is not None:
        body["kv_transfer_params"] = params
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    arrivals, parts = [], []
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.monotonic())
                parts.append(json.loads(line[6:])["choices"][0]["text"])
    return arrivals[0], arrivals[-1], arrivals, "".join(parts)


def prefill(url: str, text: str, params: dict[str, Any]) -> dict[str, Any]:
    status, answer = complete(url, text, max_tokens=1, kv_transfer_params=params)
    if status != 200:
        raise RuntimeError(f"P answered {status}: {answer}")
    return dict(answer.get("kv_transfer_params") or {})


def itl(arrivals: list[float]) -> float:
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return statistics.median(gaps) if gaps else 0.0


def run_pair(kind: str, model: str, args: argparse.Namespace, logs: Path) -> dict[int, Any]:
    """Every length's requests through a P/D pair of ``kind``."""
    common = ["--max-model-len", str(max(args.lengths) + 256), "--enforce-eager",
              "--dtype", "float32", "--block-size", "32"]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "4"}
    if kind == "nixl":
        kv_p, kv_d = nixl_connector(), nixl_connector()
        env_p = {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": "5611"}
        env_d = {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": "5612"}
    else:
        mode = kind.removeprefix("aio-")
        kv_p = kv_d = connector(mode)
        env_p = env_d = env
    p = Instance(f"bench-{kind}-p", model, kv=kv_p, cpus="0", python=args.python, args=common,
                 env=env_p, log_dir=logs)  # fmt: skip
    d = Instance(f"bench-{kind}-d", model, kv=kv_d, cpus="1", python=args.python, args=common,
                 env=env_d, log_dir=logs)  # fmt: skip
    rows: dict[int, Any] = {}
    try:
        p.start(), d.start()
        p.wait_ready(), d.wait_ready()
        address: dict[str, Any] = {}
        for seed in range(2):  # warm both engines up (first forwards build their kernels)
            params = prefill(p.url, prompt(64, 10_000 + seed), {"do_remote_decode": True})
            address = {k: v for k, v in params.items() if k.startswith("remote_")}
            streamed(d.url, prompt(64, 10_000 + seed), 4, params)
        for n in args.lengths:
            samples = []
            for rep in range(args.repeat):
                text = prompt(n, rep)
                start = time.monotonic()
                if kind == "aio-push":
                    transfer = uuid.uuid4().hex
                    to_p = {"do_remote_decode": True, "transfer_mode": "push",
                            "transfer_id": transfer}  # fmt: skip
                    to_d = {"do_remote_prefill": True, "transfer_mode": "push",
                            "transfer_id": transfer, **address}  # fmt: skip
                    with concurrent.futures.ThreadPoolExecutor(2) as pool:
                        decode = pool.submit(streamed, d.url, text, args.max_tokens, to_d)
                        pool.submit(prefill, p.url, text, to_p).result()
                        first, end, arrivals, _ = decode.result()
                    sent = start
                else:
                    params = prefill(p.url, text, {"do_remote_decode": True})
                    sent = time.monotonic()
                    first, end, arrivals, _ = streamed(d.url, text, args.max_tokens, params)
                step = itl(arrivals)
                samples.append(
                    {
                        "d_time": end - sent,
                        "ttft": first - start,
                        "wait": max(first - sent - step, 0.0) / (end - sent),
                        "itl": step,
                    }
                )
            rows[n] = samples
            d_times = [round(s["d_time"], 3) for s in samples]
            line = {"kind": kind, "tokens": n, **summary(samples), "d_times": d_times}
            print(json.dumps(line), flush=True)
    finally:
        d.stop(), p.stop()
    return rows


def run_single(model: str, args: argparse.Namespace, logs: Path) -> dict[int, Any]:
    common = ["--max-model-len", str(max(args.lengths) + 256), "--enforce-eager",
              "--dtype", "float32", "--block-size", "32"]  # fmt: skip
    single = Instance("bench-single", model, cpus="0", python=args.python, args=common,
                      env={"VLLM_CPU_KVCACHE_SPACE": "4"}, log_dir=logs)  # fmt: skip
    rows: dict[int, Any] = {}
    try:
        single.start().wait_ready()
        for seed in range(2):
            streamed(single.url, prompt(64, 10_000 + seed), 4, None)
        for n in args.lengths:
            samples = []
            for rep in range(args.repeat):
                start = time.monotonic()
                first, end, arrivals, _ = streamed(
                    single.url, prompt(n, rep), args.max_tokens, None
                )
                samples.append(
                    {"d_time": end - start, "ttft": first - start, "wait": 0.0,
                     "itl": itl(arrivals)}
                )  # fmt: skip
            rows[n] = samples
            print(json.dumps({"kind": "single", "tokens": n, **summary(samples)}), flush=True)
    finally:
        single.stop()
    return rows


def summary(samples: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(s[key] for s in samples), 4)
            for key in ("d_time", "ttft", "wait", "itl")}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kinds", default="single,aio-pull,aio-push,nixl")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    model = str(make_model(Path(tempfile.mkdtemp(prefix="bench-llama-")), **MODEL))
    per_token = kv_bytes_per_token(MODEL["layers"], MODEL["kv_heads"], MODEL["head_dim"], 4)
    results: dict[str, dict[int, Any]] = {}
    for kind in args.kinds.split(","):
        if kind == "single":
            results[kind] = run_single(model, args, args.logs)
        else:
            results[kind] = run_pair(kind, model, args, args.logs)
    print(f"\nmodel {MODEL}, KV {per_token // 1024} KiB per token (fp32), "
          f"{args.max_tokens} tokens out, medians of {args.repeat}\n")  # fmt: skip
    kinds = list(results)
    print("| prompt | KV MiB | " + " | ".join(
        f"{k} D s | {k} TTFT s | {k} KV wait" for k in kinds if k != "single"
    ) + " | single s | single TTFT s |")  # fmt: skip
    print("|" + "---|" * (3 + 3 * (len(kinds) - ("single" in kinds)) + ("single" in kinds)))
    for n in args.lengths:
        cells = [str(n), f"{n * per_token / 2**20:.0f}"]
        for kind in kinds:
            if kind == "single":
                continue
            s = summary(results[kind][n])
            cells += [f"{s['d_time']:.3f}", f"{s['ttft']:.3f}", f"{100 * s['wait']:.0f} %"]
        if "single" in results:
            s = summary(results["single"][n])
            cells += [f"{s['d_time']:.3f}", f"{s['ttft']:.3f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
