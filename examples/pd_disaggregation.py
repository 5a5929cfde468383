"""Prefill/decode disaggregation across two processes over TCP, with byte checks and figures.

Run: python examples/pd_disaggregation.py [--requests 32] [--blocks-per-request 16]

A prompt (prefill) process registers a paged KV cache, fills it, and listens on 127.0.0.1.
The decoder process (this one) registers its own paged cache, links to the prompt over TCP
and, for every request, pulls the request's blocks layer by layer through the async API
while its event loop keeps running. Every byte is checked against what the prompt wrote;
the script prints the bandwidth and the per-request latency (p50/p99).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

import numpy as np

# numpy buffers stand in for device memory here: use the host runtime even where an
# accelerator exists (device caches on an accelerator are not host-addressable).
os.environ["AIO_DATADIST_RUNTIME"] = "host"

from aio_datadist import (
    AsyncLLMDataDist,
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)

PROMPT_ID, DECODER_ID = 1, 2
LAYERS = 8  # K and V per layer: 16 tensors
BLOCKS = 256
BLOCK_BYTES = 64 * 1024  # e.g. 16 tokens x 8 heads x 128 dims x fp16 x 2 (K or V)


def kv_desc() -> CacheDesc:
    return CacheDesc(2 * LAYERS, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8, Placement.DEVICE)


def prompt_tensor(t: int) -> np.ndarray:
    """What the prompt's model wrote into tensor ``t`` (reproducible on the decoder)."""
    rng = np.random.default_rng(1000 + t)
    return rng.integers(0, 256, (BLOCKS, BLOCK_BYTES), dtype=np.uint8)


def options(listen: str | None = None) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = 10_000
    if listen is not None:
        cfg.listen_ip_info = listen
    return cfg.generate_options()


def run_prompt(port: int) -> None:
    """The prefill process: blocking API; serves pulls on library threads until told to stop."""
    tensors = [prompt_tensor(t) for t in range(2 * LAYERS)]
    dd = LLMDataDist(LLMRole.PROMPT, PROMPT_ID)
    dd.init(options(f"127.0.0.1:{port}"))
    cache = dd.cache_manager.register_blocks_cache(
        kv_desc(), [int(t.ctypes.data) for t in tensors], BlocksCacheKey(PROMPT_ID, 0)
    )
    print("ready", flush=True)
    sys.stdin.readline()  # the decoder says when it is done
    dd.cache_manager.unregister_cache(cache.cache_id)
    dd.finalize()


def matches(
    local: list[np.ndarray], expected: list[np.ndarray], src: list[int], dst: list[int]
) -> bool:
    """True when every pulled block holds what the prompt wrote."""
    return all(
        np.array_equal(mine[dst], theirs[src]) for mine, theirs in zip(local, expected, strict=True)
    )


async def ticker(lags: list[float], stop: asyncio.Event) -> None:
    """Another coroutine of the serving loop: it must keep running during transfers."""
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - start - 0.001)


async def run_decoder(port: int, requests: int, per_request: int) -> None:
    expected = [prompt_tensor(t) for t in range(2 * LAYERS)]
    local = [np.full((BLOCKS, BLOCK_BYTES), 0, dtype=np.uint8) for _ in range(2 * LAYERS)]
    async with AsyncLLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        await dd.init(options())
        cm = dd.cache_manager
        cache = await cm.register_blocks_cache(
            kv_desc(), [int(t.ctypes.data) for t in local], BlocksCacheKey(DECODER_ID, 0)
        )
        info = LLMClusterInfo()
        info.remote_cluster_id = PROMPT_ID
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", port)
        ret, rets = await dd.link_clusters([info], 5000)
        assert ret == LLMStatusCode.LLM_SUCCESS, (ret, rets)

        lags: list[float] = []
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(lags, stop))
        rng = np.random.default_rng(7)
        latencies: list[float] = []
        moved = 0
        for _ in range(requests):
            src = rng.choice(BLOCKS, per_request, replace=False).tolist()
            dst = rng.choice(BLOCKS, per_request, replace=False).tolist()
            t0 = time.perf_counter()
            for layer in range(LAYERS):  # layer by layer, as a decoder that starts early would
                await cm.pull_blocks(
                    BlocksCacheKey(PROMPT_ID, 0),
                    cache,
                    src,
                    dst,
                    src_layer_range=range(layer, layer + 1),
                    dst_layer_range=range(layer, layer + 1),
                )
            latencies.append(time.perf_counter() - t0)
            moved += 2 * LAYERS * per_request * BLOCK_BYTES
            # check every byte on a worker thread: the serving loop stays responsive
            if not await asyncio.to_thread(matches, local, expected, src, dst):
                raise SystemExit("byte mismatch")
        stop.set()
        await tick
        await dd.unlink_clusters([info], 5000)
        await cm.unregister_cache(cache.cache_id)

    lat = np.array(latencies) * 1e3
    elapsed = float(np.sum(latencies))
    print(
        f"verified {requests} requests x {LAYERS} layers x {per_request} blocks "
        f"({moved / 2**20:.0f} MiB), every byte checked"
    )
    print(
        f"request latency p50 {np.percentile(lat, 50):.2f} ms, p99 {np.percentile(lat, 99):.2f} ms;"
        f" throughput {moved / elapsed / 1e9:.2f} GB/s"
    )
    print(f"event-loop lag while transferring: max {max(lags, default=0) * 1e3:.2f} ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["decoder", "prompt"], default="decoder")
    parser.add_argument("--port", type=int, default=0, help="TCP port (0: any free one)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--blocks-per-request", type=int, default=16)
    args = parser.parse_args()
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be from 0 to 65535, got {args.port}")
    if args.requests < 1:
        parser.error(f"--requests must be at least 1, got {args.requests}")
    if not 1 <= args.blocks_per_request <= BLOCKS:
        parser.error(
            f"--blocks-per-request must be from 1 to {BLOCKS}, got {args.blocks_per_request}"
        )
    if args.role == "prompt":
        run_prompt(args.port)
        return
    port = args.port or free_port()
    prompt = subprocess.Popen(
        [sys.executable, __file__, "--role", "prompt", "--port", str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert prompt.stdout is not None and prompt.stdin is not None
        if prompt.stdout.readline().strip() != "ready":
            raise SystemExit("the prompt process did not start")
        print(f"prompt process {prompt.pid} listens on 127.0.0.1:{port} (TCP)")
        asyncio.run(run_decoder(port, args.requests, args.blocks_per_request))
        prompt.stdin.write("done\n")
        prompt.stdin.flush()
        if prompt.wait(30) != 0:
            raise SystemExit(f"the prompt process failed ({prompt.returncode})")
    finally:
        if prompt.poll() is None:
            prompt.kill()


if __name__ == "__main__":
    main()
