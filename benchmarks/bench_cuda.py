"""Benchmark: the CUDA runtime's block copies against torch on the same GPU, in the same run.

Cases (blocks of 64 KiB, GB/s means 1e9 bytes per second, median of REPS timed runs after
one warm-up):

* swap_blocks H2D and D2H: NBLOCKS blocks between a pinned host pool cache and a device
  blocks cache through ``CacheManager.swap_blocks``, with a random block mapping and with
  the identity mapping (runs merge into one copy), by the copy kernel (which reads or writes
  the mapped pinned pool itself; the default for many rows), by ``cudaMemcpyBatchAsync`` and
  by a ``cudaMemcpyAsync`` loop, against torch's
  ``dev.copy_(pinned_host, non_blocking=True)`` of the same bytes as one tensor;
* copy_blocks: NBLOCKS blocks to NBLOCKS other blocks (random mapping) inside one device
  blocks cache through ``CacheManager.copy_blocks``, against ``t.index_copy_(0, dst_idx,
  t.index_select(0, src_idx))`` on a ``(2 * NBLOCKS, 16384)`` float32 CUDA tensor.

Each ours/torch line prints the ratio (torch time / ours: > 1 means faster than torch); the
copy_blocks and swap figures are also given with the copy kernel and cudaMemcpyBatchAsync
switched off, to show what each path brings, and copy_blocks split into planning (Python:
checking the block map, building the copy table) and copying (the runtime's native call
and the GPU). Needs torch with CUDA and a GPU; exits 0 with
a message otherwise. Run::

    python benchmarks/bench_cuda.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

BLOCK = 64 << 10
NBLOCKS = 4096
REPS = 10


def median_seconds(fn: Callable[[], None], sync: Callable[[], None], reps: int = REPS) -> float:
    """Median wall time of ``fn`` (completed by ``sync``) after one untimed warm-up."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def report(name: str, nbytes: int, ours: float, theirs: float, what: str) -> None:
    print(
        f"{name:<34} ours {gbps(nbytes, ours):7.2f} GB/s ({ours * 1e3:7.3f} ms)   "
        f"{what} {gbps(nbytes, theirs):7.2f} GB/s ({theirs * 1e3:7.3f} ms)   "
        f"ratio {theirs / ours:5.2f}x"
    )


def main() -> int:
    try:
        import torch
    except ImportError:
        print("bench_cuda: torch is not installed; nothing to compare against")
        return 0
    if not torch.cuda.is_available():
        print("bench_cuda: torch sees no CUDA device; nothing to measure")
        return 0
    from aio_datadist._runtime.base import RuntimeUnavailable
    from aio_datadist._runtime.cuda import open_runtime

    try:
        open_runtime(0).close()
    except RuntimeUnavailable as exc:
        print(f"bench_cuda: the CUDA runtime is unavailable: {exc}")
        return 0

    os.environ["AIO_DATADIST_RUNTIME"] = "cuda"
    from aio_datadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement

    total = NBLOCKS * BLOCK
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.mem_pool_cfg = f'{{"memory_size": {3 * total + (64 << 20)}}}'
    cfg.host_mem_pool_cfg = f'{{"memory_size": {total + (64 << 20)}}}'
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(dict(cfg.generate_options()))
    try:
        cm = dd.cache_manager
        service: Any = dd._engine.caches
        runtime: Any = service.runtime
        torch.cuda.init()
        sync = torch.cuda.synchronize
        print(
            f"device: {torch.cuda.get_device_name(0)}; libcudart {runtime.library.path} "
            f"version {runtime.library.version}; features {sorted(runtime.features)}"
        )
        print(f"{NBLOCKS} blocks of {BLOCK >> 10} KiB = {total >> 20} MiB per copy")

        # -- swap_blocks ------------------------------------------------------------------
        shape = [NBLOCKS, BLOCK]
        dev = cm.allocate_blocks_cache(CacheDesc(1, shape, DataType.DT_UINT8))
        host = cm.allocate_blocks_cache(CacheDesc(1, shape, DataType.DT_UINT8, Placement.HOST))
        host.as_numpy()[0][:] = 7
        rng = np.random.default_rng(0)
        perm = rng.permutation(NBLOCKS)
        mappings = {
            "random": {int(i): int(j) for i, j in enumerate(perm)},
            "identity": {i: i for i in range(NBLOCKS)},
        }
        t_host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        t_dev = torch.empty(total, dtype=torch.uint8, device="cuda")
        h2d_torch = median_seconds(lambda: t_dev.copy_(t_host, non_blocking=True), sync)
        d2h_torch = median_seconds(lambda: t_host.copy_(t_dev, non_blocking=True), sync)
        for label, mapping in mappings.items():
            for kernel, batch in ((True, True), (False, True), (False, False)):
                runtime.set_feature("copy_kernel", kernel)
                runtime.set_feature("memcpy_batch", batch)
                tag = ", kernel" if kernel else ("" if batch else ", no batch API")
                h2d = median_seconds(lambda m=mapping: cm.swap_blocks(host, dev, m), sync)
                d2h = median_seconds(lambda m=mapping: cm.swap_blocks(dev, host, m), sync)
                report(f"swap H2D {label}{tag}", total, h2d, h2d_torch, "torch copy_")
                report(f"swap D2H {label}{tag}", total, d2h, d2h_torch, "torch copy_")
            swap_planning = median_seconds(
                lambda m=mapping: service.release(service.plan_swap_blocks(host, dev, m)),
                lambda: None,
            )
            print(f"{'':<34} of which planning {swap_planning * 1e3:.3f} ms")
        runtime.set_feature("copy_kernel", True)
        runtime.set_feature("memcpy_batch", True)
        cm.deallocate_blocks_cache(host)
        cm.deallocate_blocks_cache(dev)

        # -- copy_blocks ------------------------------------------------------------------
        both = cm.allocate_blocks_cache(CacheDesc(1, [2 * NBLOCKS, BLOCK], DataType.DT_UINT8))
        src = rng.permutation(NBLOCKS)
        dst = NBLOCKS + rng.permutation(NBLOCKS)
        info = {int(s): [int(d)] for s, d in zip(src, dst, strict=True)}
        t = torch.zeros((2 * NBLOCKS, BLOCK // 4), dtype=torch.float32, device="cuda")
        s_idx = torch.as_tensor(src, device="cuda")
        d_idx = torch.as_tensor(dst, device="cuda")
        theirs = median_seconds(lambda: t.index_copy_(0, d_idx, t.index_select(0, s_idx)), sync)
        planning = median_seconds(
            lambda: service.release(service.plan_copy_blocks(both, info)), lambda: None
        )

        def run_batches(batches: Any, kind: Any) -> None:
            for ops in batches:
                runtime.copy_batch(ops, kind)

        for kernel, batch in ((True, True), (False, True), (False, False)):
            runtime.set_feature("copy_kernel", kernel)
            runtime.set_feature("memcpy_batch", batch)
            tag = "kernel" if kernel else ("batch API" if batch else "cudaMemcpyAsync loop")
            ours = median_seconds(lambda: cm.copy_blocks(both, info), sync)
            report(f"copy_blocks ({tag})", total, ours, theirs, "torch index")
            plan = service.plan_copy_blocks(both, info)
            service.release(plan)
            moving = median_seconds(lambda p=plan: run_batches(p.batches, p.kind), sync)
            print(
                f"{'':<34} of which planning {planning * 1e3:.3f} ms, copying {moving * 1e3:.3f} ms"
            )
        if runtime.kernel_note:
            print(f"copy kernel unavailable: {runtime.kernel_note}")
        runtime.set_feature("copy_kernel", True)
        runtime.set_feature("memcpy_batch", True)
        cm.deallocate_blocks_cache(both)
    finally:
        dd.finalize()
    return 0


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()  # --help; no options
    sys.exit(main())
