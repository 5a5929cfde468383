/* cuda_rt.h: the CUDA runtime, reached through dlopen at run time (no CUDA headers needed).
 *
 * build_ffi.py feeds the region between the cdef markers to cffi's cdef, so that region
 * holds plain declarations only. Conventions are those of datadist.h: 0 (DD_OK) or a
 * negative code, addresses as uint64_t, no callbacks into Python (every call may run with
 * the GIL released).
 *
 * Objects:
 *   dd_cuda_lib  one loaded libcudart and its function table. Loaded once per path, never
 *                unloaded (unloading a CUDA runtime with live memory is undefined).
 *   dd_cuda_ctx  copy machinery for one device: a free list of "lanes". A lane is one
 *                non-blocking stream, its events, a ring of pinned staging buffers and
 *                scratch tables. Each copy call checks a lane out for its whole duration
 *                and returns it afterwards, so concurrent callers never share a stream and
 *                never wait for each other; lanes are created on demand and reused.
 *   dd_cuda_stage  a staging ring in progress (see dd_cuda_stage_open).
 *
 * Memory calls take (lib, device) rather than a ctx, so memory can still be freed after the
 * ctx that copied into it was destroyed. Every call selects its device first (cudaSetDevice
 * is per thread).
 *
 * Errors: a failed CUDA call is recorded per thread; dd_cuda_last_error() describes the last
 * one of the calling thread ("cudaMalloc: cudaErrorMemoryAllocation: out of memory").
 * cudaErrorMemoryAllocation maps to DD_ENOMEM, cudaErrorInvalidValue / InvalidDevice /
 * InvalidMemcpyDirection to DD_EINVAL, every other CUDA error to DD_CUDA_ERROR.
 */
#ifndef AIO_DATADIST_CUDA_RT_H
#define AIO_DATADIST_CUDA_RT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* cdef-begin */

enum {
    DD_CUDA_ERROR = -16,  /* a CUDA call failed: dd_cuda_last_error() says which and why */
    DD_CUDA_ENOLIB = -17, /* the library could not be loaded, or lacks a required symbol */
    DD_CUDA_ENOSYS = -18  /* the loaded runtime lacks an optional function this call needs */
};

enum {
    DD_CUDA_H2H = 0, /* the values of cudaMemcpyKind */
    DD_CUDA_H2D = 1,
    DD_CUDA_D2H = 2,
    DD_CUDA_D2D = 3,
    DD_CUDA_DEFAULT = 4
};

enum {
    DD_CUDA_MODE_ENGINE = 0, /* copy engines: cudaMemcpyBatchAsync when usable, else a loop */
    DD_CUDA_MODE_LOOP = 1,   /* copy engines, one cudaMemcpyAsync per (merged) row */
    DD_CUDA_MODE_KERNEL = 2  /* one gather-scatter kernel (D2D; H2D/D2H of many rows whose host
                                side is mapped pinned memory); ENGINE when unavailable */
};

enum {
    DD_CUDA_FEAT_BATCH = 1,      /* cudaMemcpyBatchAsync with a prototype this build knows */
    DD_CUDA_FEAT_KERNELS = 2,    /* cudaLibraryLoadData + cudaLaunchKernel (CUDA >= 12.0) */
    DD_CUDA_FEAT_MEMSET = 4,     /* cudaMemsetAsync */
    DD_CUDA_FEAT_ATTRIBUTES = 8  /* cudaPointerGetAttributes */
};

enum {
    DD_CUDA_IPC_HANDLE_BYTES = 64,
    DD_CUDA_STAGE_SLOTS_MAX = 16,
    DD_CUDA_ERRMSG_BYTES = 512
};

typedef struct dd_cuda_lib dd_cuda_lib;
typedef struct dd_cuda_ctx dd_cuda_ctx;
typedef struct dd_cuda_stage dd_cuda_stage;

/* Load a CUDA runtime: `path` (a file path or soname) when not NULL, else the first of
 * libcudart.so, libcudart.so.13, libcudart.so.12, libcudart.so.11.0 that loads. Loading a
 * path loaded before returns the same object. On DD_CUDA_ENOLIB, err (errlen bytes) says
 * what failed. */
int dd_cuda_load(const char *path, dd_cuda_lib **out, char *err, size_t errlen);
/* DD_CUDA_FEAT_* bits of the loaded runtime (batch and kernels may be switched off later). */
unsigned dd_cuda_features(const dd_cuda_lib *lib);
/* cudaRuntimeGetVersion, e.g. 12080; 0 when the runtime cannot say. */
int dd_cuda_runtime_version(const dd_cuda_lib *lib);
/* Number of devices; 0 (and DD_OK) when the runtime reports none or no driver, with the
 * reason left in dd_cuda_last_error(). */
int dd_cuda_device_count(dd_cuda_lib *lib, int *count);
/* The calling thread's last CUDA failure: returns its cudaError_t (0: none) and writes a
 * NUL-terminated description into buf. */
int dd_cuda_last_error(char *buf, size_t len);

/* ---- memory ---- */
int dd_cuda_malloc(dd_cuda_lib *lib, int device, uint64_t nbytes, uint64_t *addr);
int dd_cuda_free(dd_cuda_lib *lib, int device, uint64_t addr);
/* Pinned host memory, portable and mapped (cudaHostAlloc). */
int dd_cuda_host_alloc(dd_cuda_lib *lib, int device, uint64_t nbytes, uint64_t *addr);
int dd_cuda_host_free(dd_cuda_lib *lib, int device, uint64_t addr);
/* Pin (portable) or unpin existing host memory (cudaHostRegister / cudaHostUnregister). */
int dd_cuda_host_register(dd_cuda_lib *lib, int device, uint64_t addr, uint64_t nbytes);
int dd_cuda_host_unregister(dd_cuda_lib *lib, int device, uint64_t addr);
/* out[i] = the cudaMemoryType of addrs[i] as cudaPointerGetAttributes reports it: 0 not
 * known to CUDA (pageable host memory), 1 pinned host, 2 device, 3 managed.
 * DD_CUDA_ENOSYS without cudaPointerGetAttributes. */
int dd_cuda_pointer_types(dd_cuda_lib *lib, int device, const uint64_t *addrs, size_t n,
                          uint8_t *out);

/* ---- IPC (same host, other processes) ---- */
/* handle receives DD_CUDA_IPC_HANDLE_BYTES bytes naming the allocation that holds addr. */
int dd_cuda_ipc_get(dd_cuda_lib *lib, int device, uint64_t addr, uint8_t *handle);
/* Map a peer's allocation; *addr is its base in this process (lazy peer access enabled). */
int dd_cuda_ipc_open(dd_cuda_lib *lib, int device, const uint8_t *handle, uint64_t *addr);
int dd_cuda_ipc_close(dd_cuda_lib *lib, int device, uint64_t addr);

/* ---- copies ---- */
/* stage_chunk: bytes per staging buffer (rounded up to 4 KiB); stage_slots: buffers per
 * lane, 2..DD_CUDA_STAGE_SLOTS_MAX. Staging buffers are allocated on first staged use. */
int dd_cuda_ctx_create(dd_cuda_lib *lib, int device, uint64_t stage_chunk, unsigned stage_slots,
                       dd_cuda_ctx **out);
/* Synchronise and free every lane; the ctx must be idle and is freed. */
void dd_cuda_ctx_destroy(dd_cuda_ctx *ctx);
/* Switch cudaMemcpyBatchAsync (feature DD_CUDA_FEAT_BATCH) or kernels off (0) or back on (1,
 * when the runtime has them). */
int dd_cuda_ctx_set_feature(dd_cuda_ctx *ctx, unsigned feature, int enabled);
unsigned dd_cuda_ctx_features(dd_cuda_ctx *ctx);
/* Why the copy kernel is unavailable on this ctx ("" when it is, or was not tried yet). */
const char *dd_cuda_ctx_kernel_note(dd_cuda_ctx *ctx);

/* ops holds n rows (dst, src, nbytes); both sides device memory or pinned host memory, of
 * the direction `kind`. Rows are checked first (a null address or a wrap: DD_EINVAL, nothing
 * copied), rows continuing each other on both sides are merged, the rest is issued on the
 * lane's stream in `mode` and the call returns once every byte arrived. */
int dd_cuda_copy(dd_cuda_ctx *ctx, const uint64_t *ops, size_t n, int kind, int mode);
/* As dd_cuda_copy for kind H2D or D2H when the host side is pageable: the bytes pass through
 * the lane's ring of pinned buffers, so the CPU copy of one chunk overlaps the DMA of the
 * previous ones. */
int dd_cuda_copy_staged(dd_cuda_ctx *ctx, const uint64_t *ops, size_t n, int kind);
/* Set nbytes of device memory at addr to `value` (DD_CUDA_ENOSYS without cudaMemsetAsync). */
int dd_cuda_memset(dd_cuda_ctx *ctx, uint64_t addr, int value, uint64_t nbytes);

/* ---- staging rings for streaming device memory (sockets) ----
 *
 * iov holds n rows (device addr, len): one stream of device bytes, in order; it must stay
 * valid and unchanged until dd_cuda_stage_close. dir DD_CUDA_D2H reads the rows: each
 * dd_cuda_stage_next hands out the next chunk of them in pinned host memory, while later
 * chunks are already in flight. dir DD_CUDA_H2D writes the rows: each dd_cuda_stage_next
 * hands out a pinned buffer to fill with the next chunk, and issues the DMA of the chunk
 * filled before. A chunk is valid until the next dd_cuda_stage_next or close; *len == 0
 * means the stream is done. dd_cuda_stage_close waits for outstanding DMA; with commit != 0
 * (H2D) it first issues the last filled chunk, with commit == 0 the unissued chunk is
 * dropped. close frees the stage (also after a failure). */
int dd_cuda_stage_open(dd_cuda_ctx *ctx, int dir, const uint64_t *iov, size_t n,
                       dd_cuda_stage **out);
int dd_cuda_stage_next(dd_cuda_stage *st, uint64_t *addr, uint64_t *len);
int dd_cuda_stage_close(dd_cuda_stage *st, int commit);

/* cdef-end */

#ifdef __cplusplus
}
#endif

#endif /* AIO_DATADIST_CUDA_RT_H */
