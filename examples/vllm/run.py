"""Disaggregated serving with vLLM on aio_datadist, in one command.

Starts a prefill instance (P) and a decode instance (D) with ``AioDataDistConnector``, a
single instance without disaggregation, and the proxy; sends each prompt through the proxy
(P, then D) and to the single instance; prints the answers side by side and what moved.

    python examples/vllm/run.py                   # CPU, a tiny random model made on the spot
    python examples/vllm/run.py --mode push       # P pushes each layer as it computes it
    python examples/vllm/run.py --model meta-llama/Llama-3.2-1B-Instruct --gpu
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import Instance, ProxyProcess, complete, connector, metric
from make_model import WORDS, make_model


def prompts(count: int) -> list[str]:
    """Prompts of several lengths, some a multiple of 32 tokens (the block size)."""
    lengths = [7, 32, 45, 64, 100, 128, 200, 256, 333][:count]
    return [" ".join(WORDS[(i * 7 + n) % len(WORDS)] for i in range(n)) for n in lengths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("pull", "push"), default="pull")
    parser.add_argument("--model", help="a model path or name (default: a tiny one made now)")
    parser.add_argument("--gpu", action="store_true", help="three instances share GPU 0")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()

    model = args.model or str(make_model(Path(tempfile.mkdtemp(prefix="tiny-llama-"))))
    common = ["--max-model-len", "2048", "--enforce-eager"]
    if args.gpu:
        common += ["--gpu-memory-utilization", "0.25"]
        cpus: list[str | None] = [None, None, None]
    else:
        common += ["--dtype", "float32", "--block-size", "32"]
        n = os.cpu_count() or 1
        cpus = ["0", "1" if n > 1 else "0", "0"]
    kv = connector(args.mode)
    p = Instance("prefill", model, kv=kv, cpus=cpus[0], args=common, log_dir=args.logs)
    d = Instance("decode", model, kv=kv, cpus=cpus[1], args=common, log_dir=args.logs)
    single = Instance("single", model, cpus=cpus[2], args=common, log_dir=args.logs)
    proxy = ProxyProcess([p.url], [d.url], args.mode)
    instances = [p, d, single]
    try:
        print(f"starting P, D and a single instance of {model} (logs in {args.logs}) ...")
        for instance in instances:
            instance.start()
        for instance in instances:
            instance.wait_ready()
        proxy.start()
        print(f"P {p.url}  D {d.url}  single {single.url}  proxy {proxy.url} ({args.mode})\n")
        same = 0
        texts = prompts(args.prompts)
        for text in texts:
            started = time.monotonic()
            status, answer = complete(proxy.url, text)
            took = time.monotonic() - started
            _, reference = complete(single.url, text)
            if status != 200:
                print(f"proxy answered {status}: {answer}")
                continue
            ours = answer["choices"][0]["text"]
            theirs = reference["choices"][0]["text"]
            same += ours == theirs
            mark = "same" if ours == theirs else "DIFFERENT"
            tokens = answer["usage"]["prompt_tokens"]
            print(f"{tokens:4d}-token prompt, {took * 1000:6.1f} ms: {mark}\n"
                  f"  P/D:    {ours!r}\n  single: {theirs!r}")  # fmt: skip
        stats = d.metrics()
        loads = metric(stats, "vllm:aio_datadist_loads_total")
        nbytes = metric(stats, "vllm:aio_datadist_load_bytes_total")
        moved = metric(stats, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        computed = metric(stats, "vllm:prompt_tokens_by_source_total", source="local_compute")
        print(f"\n{same}/{len(texts)} answers equal the single instance's; D loaded {loads:.0f} "
              f"requests ({nbytes / 2**20:.2f} MiB of KV, {moved:.0f} prompt tokens) and "
              f"computed {computed:.0f} prompt tokens itself")  # fmt: skip
        if args.mode == "push":
            pushed = metric(p.metrics(), "vllm:aio_datadist_pushes_total")
            print(f"P pushed {pushed:.0f} requests layer by layer")
        if same != len(texts):
            raise SystemExit(1)
    finally:
        proxy.stop()
        for instance in instances:
            instance.stop()


if __name__ == "__main__":
    main()
