/* fake_cudart.c: a stand-in for libcudart over host memory, for tests on machines with no GPU.
 *
 * It implements the CUDA runtime functions aio_datadist loads, with the real prototypes and
 * error codes, and behaves like a device where it matters to the caller:
 *
 * - "Device" memory is a memfd mapping per cudaMalloc, stored XOR 0x5A, so host code that
 *   reads or writes it directly (instead of copying through the runtime) sees wrong bytes.
 *   IPC handles name the memfd, and another process maps it through /proc/<pid>/fd.
 * - Copies are checked against their cudaMemcpyKind (device side inside a device range,
 *   host side outside), and asynchronous work is queued per stream and runs only when the
 *   caller synchronises (stream, event, cudaFree), so a missing wait shows up as wrong bytes.
 *   Asynchronous copies touching pageable host memory run at once, as the real runtime does,
 *   and are counted as "pageable_async".
 * - cudaLaunchKernel runs the "dd_copy_rows" kernel of the PTX the caller loaded, on the host;
 *   its rows may name device memory and cudaHostAlloc memory (mapped), nothing else.
 *
 * Knobs (environment, read at each call): FAKE_CUDA_DEVICES (default 1);
 * FAKE_CUDA_FAIL_MALLOC_OVER / FAKE_CUDA_FAIL_HOSTALLOC_OVER=<bytes>: larger allocations fail
 * with cudaErrorMemoryAllocation; FAKE_CUDA_KERNEL_BROKEN=1: the kernel drops the last byte of
 * every row. Build flags: -DFAKE_CUDA_BATCH_ABI=12 (default: 12.8's cudaMemcpyBatchAsync with
 * failIdx), 13 (13.0's, without) or 0 (none, a 12.2 runtime); -DFAKE_CUDA_NO_KERNELS leaves
 * out the library API (an 11.8 runtime).
 *
 * Call log: fake_cuda_count("cudaMemcpyAsync") and friends; fake_cuda_reset() zeroes it.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef FAKE_CUDA_BATCH_ABI
#define FAKE_CUDA_BATCH_ABI 12
#endif

typedef int cudaError_t;
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
typedef struct { unsigned x, y, z; } dim3;
typedef struct { char reserved[64]; } cudaIpcMemHandle_t;
typedef struct { int type; int id; } mem_location;
typedef struct {
    int srcAccessOrder;
    mem_location srcLocHint, dstLocHint;
    unsigned flags;
} cudaMemcpyAttributes;
typedef struct {
    int type;
    int device;
    void *devicePointer;
    void *hostPointer;
} cudaPointerAttributes;

enum {
    OK = 0,
    E_INVALID_VALUE = 1,
    E_MEMORY_ALLOCATION = 2,
    E_INVALID_MEMCPY_DIRECTION = 21,
    E_NO_DEVICE = 100,
    E_INVALID_DEVICE = 101,
    E_DEVICE_UNINITIALIZED = 201,
    E_INVALID_PTX = 218,
    E_INVALID_HANDLE = 400,
    E_SYMBOL_NOT_FOUND = 500,
    E_ILLEGAL_ADDRESS = 700,
    E_HOST_ALREADY_REGISTERED = 712,
    E_HOST_NOT_REGISTERED = 713
};

#define KEY 0x5Au

/* ---- call log ---- */

static const char *const NAMES[] = {
    "cudaGetDeviceCount", "cudaSetDevice", "cudaMalloc", "cudaFree", "cudaHostAlloc",
    "cudaMallocHost", "cudaFreeHost", "cudaHostRegister", "cudaHostUnregister", "cudaMemcpy",
    "cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemcpyBatchAsync", "cudaStreamCreateWithFlags",
    "cudaStreamSynchronize", "cudaStreamDestroy", "cudaEventCreateWithFlags", "cudaEventRecord",
    "cudaEventSynchronize", "cudaEventDestroy", "cudaIpcGetMemHandle", "cudaIpcOpenMemHandle",
    "cudaIpcCloseMemHandle", "cudaPointerGetAttributes", "cudaLibraryLoadData",
    "cudaLibraryGetKernel", "cudaLaunchKernel", "pageable_async", "batch_rows", "kernel_rows"};
#define NNAMES (sizeof NAMES / sizeof *NAMES)
static long g_counts[NNAMES];

static void count(const char *name, long by)
{
    for (size_t i = 0; i < NNAMES; i++)
        if (strcmp(NAMES[i], name) == 0)
            __atomic_add_fetch(&g_counts[i], by, __ATOMIC_RELAXED);
}

long fake_cuda_count(const char *name)
{
    for (size_t i = 0; i < NNAMES; i++)
        if (strcmp(NAMES[i], name) == 0)
            return __atomic_load_n(&g_counts[i], __ATOMIC_RELAXED);
    return -1;
}

void fake_cuda_reset(void)
{
    for (size_t i = 0; i < NNAMES; i++)
        __atomic_store_n(&g_counts[i], 0, __ATOMIC_RELAXED);
}

/* ---- state ---- */

enum { R_DEVICE = 1, R_PINNED = 2, R_REGISTERED = 3, R_IPC = 4 };

typedef struct range {
    struct range *next;
    uint64_t base, size;
    int kind;
    int fd; /* R_DEVICE: the memfd */
} range_t;

enum { OP_COPY = 1, OP_MEMSET, OP_EVENT, OP_KERNEL };

typedef struct op {
    struct op *next;
    int type;
    uint64_t dst, src, len; /* OP_KERNEL: src = row table, len = rows */
    int value;
    struct event *ev;
    uint64_t seq;
} op_t;

typedef struct stream {
    uint32_t magic;
    op_t *head, *tail;
    struct stream *next;
} stream_t;

typedef struct event {
    uint32_t magic;
    stream_t *stream;
    uint64_t recorded, done; /* sequence numbers of records issued / executed */
} event_t;

#define STREAM_MAGIC 0x57AEA300u
#define EVENT_MAGIC 0xE7E47000u

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static range_t *g_ranges;
static stream_t *g_streams;
static int g_sticky;
static __thread int t_last;
static __thread int t_device;

static long env_long(const char *name, long dflt)
{
    const char *v = getenv(name);
    return v && *v ? strtol(v, NULL, 10) : dflt;
}

static cudaError_t ret(cudaError_t e)
{
    if (e != OK)
        t_last = e;
    return e;
}

/* The range of `kind` (0: any) holding [addr, addr + len); g_mu held. */
static range_t *find(uint64_t addr, uint64_t len, int kind)
{
    for (range_t *r = g_ranges; r; r = r->next)
        if (addr >= r->base && addr - r->base < r->size && len <= r->size - (addr - r->base) &&
            (kind == 0 || r->kind == kind))
            return r;
    return NULL;
}

static int is_dev(uint64_t addr, uint64_t len)
{
    range_t *r = find(addr, len ? len : 1, 0);
    return r && (r->kind == R_DEVICE || r->kind == R_IPC);
}

/* Does any byte of [addr, addr + len) lie in device memory? */
static int touches_dev(uint64_t addr, uint64_t len)
{
    for (range_t *r = g_ranges; r; r = r->next)
        if ((r->kind == R_DEVICE || r->kind == R_IPC) && addr < r->base + r->size &&
            r->base < addr + (len ? len : 1))
            return 1;
    return 0;
}

static int is_pinned(uint64_t addr, uint64_t len)
{
    range_t *r = find(addr, len ? len : 1, 0);
    return r && (r->kind == R_PINNED || r->kind == R_REGISTERED);
}

static range_t *add_range(uint64_t base, uint64_t size, int kind, int fd)
{
    range_t *r = calloc(1, sizeof *r);
    if (r == NULL)
        return NULL;
    r->base = base;
    r->size = size;
    r->kind = kind;
    r->fd = fd;
    r->next = g_ranges;
    g_ranges = r;
    return r;
}

static void drop_range(range_t *r)
{
    range_t **pp = &g_ranges;
    while (*pp != r)
        pp = &(*pp)->next;
    *pp = r->next;
    free(r);
}

/* ---- execution ---- */

static void xcopy(uint64_t dst, uint64_t src, uint64_t len)
{
    int dd = is_dev(dst, len), sd = is_dev(src, len);
    unsigned char *d = (unsigned char *)(uintptr_t)dst;
    const unsigned char *s = (const unsigned char *)(uintptr_t)src;
    if (dd == sd) {
        memmove(d, s, len);
        return;
    }
    for (uint64_t i = 0; i < len; i++)
        d[i] = s[i] ^ KEY;
}

/* What a kernel may touch: device memory, and pinned memory cudaHostAlloc mapped. */
static int kernel_reaches(uint64_t addr, uint64_t len)
{
    range_t *r = find(addr, len ? len : 1, 0);
    return r && (r->kind == R_DEVICE || r->kind == R_IPC || r->kind == R_PINNED);
}

static void run_kernel(uint64_t table, uint64_t rows)
{
    if (!is_dev(table, rows * 24)) {
        g_sticky = E_ILLEGAL_ADDRESS;
        return;
    }
    int broken = env_long("FAKE_CUDA_KERNEL_BROKEN", 0) != 0;
    for (uint64_t i = 0; i < rows; i++) {
        uint64_t r[3];
        unsigned char *p = (unsigned char *)r;
        const unsigned char *q = (const unsigned char *)(uintptr_t)(table + 24 * i);
        for (int b = 0; b < 24; b++)
            p[b] = q[b] ^ KEY;
        if (!kernel_reaches(r[0], r[2]) || !kernel_reaches(r[1], r[2])) {
            g_sticky = E_ILLEGAL_ADDRESS;
            return;
        }
        xcopy(r[0], r[1], broken && r[2] ? r[2] - 1 : r[2]);
    }
    count("kernel_rows", (long)rows);
}

static void run_op(op_t *o)
{
    switch (o->type) {
    case OP_COPY:
        xcopy(o->dst, o->src, o->len);
        break;
    case OP_MEMSET:
        memset((void *)(uintptr_t)o->dst, (unsigned char)o->value ^ KEY, o->len);
        break;
    case OP_EVENT:
        if (o->ev->magic == EVENT_MAGIC && o->ev->done < o->seq)
            o->ev->done = o->seq;
        break;
    case OP_KERNEL:
        run_kernel(o->src, o->len);
        break;
    }
}

/* Run queued work of s; stop after the op `until` when given. g_mu held. */
static void drain(stream_t *s, event_t *until, uint64_t seq)
{
    while (s->head) {
        op_t *o = s->head;
        s->head = o->next;
        if (s->head == NULL)
            s->tail = NULL;
        run_op(o);
        free(o);
        if (until && until->done >= seq)
            return;
    }
}

static void drain_all(void)
{
    for (stream_t *s = g_streams; s; s = s->next)
        drain(s, NULL, 0);
}

static int known_stream(cudaStream_t st)
{
    for (stream_t *s = g_streams; s; s = s->next)
        if (s == (stream_t *)st)
            return 1;
    return 0;
}

static cudaError_t enqueue(stream_t *s, op_t o)
{
    op_t *p = malloc(sizeof *p);
    if (p == NULL)
        return E_MEMORY_ALLOCATION;
    *p = o;
    p->next = NULL;
    if (s->tail)
        s->tail->next = p;
    else
        s->head = p;
    s->tail = p;
    return OK;
}

/* Check a copy of `kind` (cudaMemcpyKind); g_mu held. */
static cudaError_t check_copy(uint64_t dst, uint64_t src, uint64_t len, int kind)
{
    if (len == 0)
        return OK;
    if (dst == 0 || src == 0)
        return E_INVALID_VALUE;
    int dd = is_dev(dst, len), sd = is_dev(src, len);
    if ((!dd && touches_dev(dst, len)) || (!sd && touches_dev(src, len)))
        return E_INVALID_VALUE; /* straddles the end of a device allocation */
    switch (kind) {
    case 0:
        return !dd && !sd ? OK : E_INVALID_VALUE;
    case 1:
        return dd && !sd ? OK : E_INVALID_VALUE;
    case 2:
        return !dd && sd ? OK : E_INVALID_VALUE;
    case 3:
        return dd && sd ? OK : E_INVALID_VALUE;
    case 4:
        return OK;
    default:
        return E_INVALID_MEMCPY_DIRECTION;
    }
}

/* Queue a checked copy on s (NULL: run now); pageable host memory runs at once. */
static cudaError_t queue_copy(stream_t *s, uint64_t dst, uint64_t src, uint64_t len)
{
    if (len == 0)
        return OK;
    int dd = is_dev(dst, len), sd = is_dev(src, len);
    int pageable = (!dd && !is_pinned(dst, len) && sd) || (!sd && !is_pinned(src, len) && dd);
    if (s == NULL || pageable) {
        if (pageable) {
            count("pageable_async", 1);
            if (s)
                drain(s, NULL, 0);
        }
        xcopy(dst, src, len);
        return OK;
    }
    op_t o = {.type = OP_COPY, .dst = dst, .src = src, .len = len};
    return enqueue(s, o);
}

/* ---- the runtime API ---- */

cudaError_t cudaGetDeviceCount(int *n)
{
    count("cudaGetDeviceCount", 1);
    long d = env_long("FAKE_CUDA_DEVICES", 1);
    *n = (int)(d < 0 ? 0 : d);
    return ret(d > 0 ? OK : E_NO_DEVICE);
}

cudaError_t cudaSetDevice(int device)
{
    count("cudaSetDevice", 1);
    if (g_sticky)
        return ret(g_sticky);
    if (device < 0 || device >= env_long("FAKE_CUDA_DEVICES", 1))
        return ret(E_INVALID_DEVICE);
    t_device = device;
    return OK;
}

cudaError_t cudaRuntimeGetVersion(int *v)
{
#if defined(FAKE_CUDA_NO_KERNELS)
    *v = 11080;
#elif FAKE_CUDA_BATCH_ABI == 13
    *v = 13000;
#elif FAKE_CUDA_BATCH_ABI == 12
    *v = 12080;
#else
    *v = 12020;
#endif
    return OK;
}

cudaError_t cudaGetLastError(void)
{
    int e = g_sticky ? g_sticky : t_last;
    t_last = OK;
    return e;
}

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
    case OK: return "cudaSuccess";
    case E_INVALID_VALUE: return "cudaErrorInvalidValue";
    case E_MEMORY_ALLOCATION: return "cudaErrorMemoryAllocation";
    case E_INVALID_MEMCPY_DIRECTION: return "cudaErrorInvalidMemcpyDirection";
    case E_NO_DEVICE: return "cudaErrorNoDevice";
    case E_INVALID_DEVICE: return "cudaErrorInvalidDevice";
    case E_DEVICE_UNINITIALIZED: return "cudaErrorDeviceUninitialized";
    case E_INVALID_PTX: return "cudaErrorInvalidPtx";
    case E_INVALID_HANDLE: return "cudaErrorInvalidResourceHandle";
    case E_SYMBOL_NOT_FOUND: return "cudaErrorSymbolNotFound";
    case E_ILLEGAL_ADDRESS: return "cudaErrorIllegalAddress";
    case E_HOST_ALREADY_REGISTERED: return "cudaErrorHostMemoryAlreadyRegistered";
    case E_HOST_NOT_REGISTERED: return "cudaErrorHostMemoryNotRegistered";
    default: return "cudaErrorUnknown";
    }
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case OK: return "no error";
    case E_INVALID_VALUE: return "invalid argument";
    case E_MEMORY_ALLOCATION: return "out of memory";
    case E_NO_DEVICE: return "no CUDA-capable device is detected";
    case E_INVALID_DEVICE: return "invalid device ordinal";
    case E_ILLEGAL_ADDRESS: return "an illegal memory access was encountered";
    default: return "fake error";
    }
}

cudaError_t cudaMalloc(void **p, size_t n)
{
    count("cudaMalloc", 1);
    long limit = env_long("FAKE_CUDA_FAIL_MALLOC_OVER", -1);
    if (limit >= 0 && (long)n > limit)
        return ret(E_MEMORY_ALLOCATION);
    if (p == NULL || n == 0)
        return ret(E_INVALID_VALUE);
    int fd = memfd_create("fake-cuda-device", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)n) != 0) {
        if (fd >= 0)
            close(fd);
        return ret(E_MEMORY_ALLOCATION);
    }
    void *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        close(fd);
        return ret(E_MEMORY_ALLOCATION);
    }
    pthread_mutex_lock(&g_mu);
    add_range((uint64_t)(uintptr_t)m, n, R_DEVICE, fd);
    pthread_mutex_unlock(&g_mu);
    *p = m;
    return OK;
}

cudaError_t cudaFree(void *p)
{
    count("cudaFree", 1);
    if (p == NULL)
        return OK;
    pthread_mutex_lock(&g_mu);
    drain_all(); /* like the real one, cudaFree waits for the device */
    range_t *r = find((uint64_t)(uintptr_t)p, 1, R_DEVICE);
    if (r == NULL || r->base != (uint64_t)(uintptr_t)p) {
        pthread_mutex_unlock(&g_mu);
        return ret(E_INVALID_VALUE);
    }
    munmap(p, r->size);
    close(r->fd);
    drop_range(r);
    pthread_mutex_unlock(&g_mu);
    return OK;
}

static cudaError_t host_alloc(void **p, size_t n)
{
    long limit = env_long("FAKE_CUDA_FAIL_HOSTALLOC_OVER", -1);
    if (limit >= 0 && (long)n > limit)
        return ret(E_MEMORY_ALLOCATION);
    if (p == NULL || n == 0)
        return ret(E_INVALID_VALUE);
    void *m = NULL;
    if (posix_memalign(&m, 4096, n) != 0)
        return ret(E_MEMORY_ALLOCATION);
    memset(m, 0, n);
    pthread_mutex_lock(&g_mu);
    add_range((uint64_t)(uintptr_t)m, n, R_PINNED, -1);
    pthread_mutex_unlock(&g_mu);
    *p = m;
    return OK;
}

cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags)
{
    count("cudaHostAlloc", 1);
    (void)flags;
    return host_alloc(p, n);
}

cudaError_t cudaMallocHost(void **p, size_t n)
{
    count("cudaMallocHost", 1);
    return host_alloc(p, n);
}

cudaError_t cudaFreeHost(void *p)
{
    count("cudaFreeHost", 1);
    pthread_mutex_lock(&g_mu);
    drain_all();
    range_t *r = find((uint64_t)(uintptr_t)p, 1, R_PINNED);
    if (r == NULL || r->base != (uint64_t)(uintptr_t)p) {
        pthread_mutex_unlock(&g_mu);
        return ret(E_INVALID_VALUE);
    }
    drop_range(r);
    pthread_mutex_unlock(&g_mu);
    free(p);
    return OK;
}

cudaError_t cudaHostRegister(void *p, size_t n, unsigned flags)
{
    count("cudaHostRegister", 1);
    (void)flags;
    if (p == NULL || n == 0)
        return ret(E_INVALID_VALUE);
    pthread_mutex_lock(&g_mu);
    cudaError_t e = OK;
    uint64_t a = (uint64_t)(uintptr_t)p;
    for (range_t *r = g_ranges; r; r = r->next)
        if (a < r->base + r->size && r->base < a + n)
            e = r->kind == R_DEVICE || r->kind == R_IPC ? E_INVALID_VALUE
                                                        : E_HOST_ALREADY_REGISTERED;
    if (e == OK)
        add_range(a, n, R_REGISTERED, -1);
    pthread_mutex_unlock(&g_mu);
    return ret(e);
}

cudaError_t cudaHostUnregister(void *p)
{
    count("cudaHostUnregister", 1);
    pthread_mutex_lock(&g_mu);
    drain_all();
    range_t *r = find((uint64_t)(uintptr_t)p, 1, R_REGISTERED);
    cudaError_t e = r && r->base == (uint64_t)(uintptr_t)p ? OK : E_HOST_NOT_REGISTERED;
    if (e == OK)
        drop_range(r);
    pthread_mutex_unlock(&g_mu);
    return ret(e);
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *a, const void *p)
{
    count("cudaPointerGetAttributes", 1);
    if (a == NULL)
        return ret(E_INVALID_VALUE);
    pthread_mutex_lock(&g_mu);
    range_t *r = find((uint64_t)(uintptr_t)p, 1, 0);
    memset(a, 0, sizeof *a);
    if (r && (r->kind == R_DEVICE || r->kind == R_IPC)) {
        a->type = 2;
        a->devicePointer = (void *)p;
    } else if (r) {
        a->type = 1;
        a->hostPointer = (void *)p;
        a->devicePointer = (void *)p;
    }
    a->device = t_device;
    pthread_mutex_unlock(&g_mu);
    return OK;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, int kind)
{
    count("cudaMemcpy", 1);
    if (g_sticky)
        return ret(g_sticky);
    pthread_mutex_lock(&g_mu);
    cudaError_t e = check_copy((uint64_t)(uintptr_t)dst, (uint64_t)(uintptr_t)src, n, kind);
    if (e == OK && n)
        xcopy((uint64_t)(uintptr_t)dst, (uint64_t)(uintptr_t)src, n);
    pthread_mutex_unlock(&g_mu);
    return ret(e);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, cudaStream_t st)
{
    count("cudaMemcpyAsync", 1);
    if (g_sticky)
        return ret(g_sticky);
    pthread_mutex_lock(&g_mu);
    cudaError_t e = st && !known_stream(st) ? E_INVALID_HANDLE : OK;
    if (e == OK)
        e = check_copy((uint64_t)(uintptr_t)dst, (uint64_t)(uintptr_t)src, n, kind);
    if (e == OK)
        e = queue_copy(st, (uint64_t)(uintptr_t)dst, (uint64_t)(uintptr_t)src, n);
    pthread_mutex_unlock(&g_mu);
    return ret(e);
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t st)
{
    count("cudaMemsetAsync", 1);
    if (g_sticky)
        return ret(g_sticky);
    pthread_mutex_lock(&g_mu);
    cudaError_t e = st && !known_stream(st) ? E_INVALID_HANDLE : OK;
    if (e == OK && n && !is_dev((uint64_t)(uintptr_t)p, n))
        e = E_INVALID_VALUE;
    if (e == OK && n) {
        op_t o = {.type = OP_MEMSET, .dst = (uint64_t)(uintptr_t)p, .len = n, .value = value};
        if (st)
            e = enqueue((stream_t *)st, o);
        else
            run_op(&o);
    }
    pthread_mutex_unlock(&g_mu);
    return ret(e);
}

#if FAKE_CUDA_BATCH_ABI == 12 || FAKE_CUDA_BATCH_ABI == 13
static cudaError_t batch(void *const *dsts, const void *const *srcs, const size_t *sizes,
                         size_t n, cudaMemcpyAttributes *attrs, size_t *idxs, size_t nattrs,
                         size_t *fail_idx, cudaStream_t st)
{
    count("cudaMemcpyBatchAsync", 1);
    if (g_sticky)
        return ret(g_sticky);
    if (fail_idx)
        *fail_idx = SIZE_MAX;
    if (st == NULL || n == 0 || dsts == NULL || srcs == NULL || sizes == NULL ||
        attrs == NULL || idxs == NULL || nattrs == 0 || nattrs > n || idxs[0] != 0)
        return ret(E_INVALID_VALUE);
    for (size_t k = 0; k < nattrs; k++)
        if (attrs[k].srcAccessOrder < 1 || attrs[k].srcAccessOrder > 3)
            return ret(E_INVALID_VALUE);
    pthread_mutex_lock(&g_mu);
    cudaError_t e = known_stream(st) ? OK : E_INVALID_HANDLE;
    for (size_t i = 0; e == OK && i < n; i++) {
        e = check_copy((uint64_t)(uintptr_t)dsts[i], (uint64_t)(uintptr_t)srcs[i], sizes[i], 4);
        if (e != OK && fail_idx)
            *fail_idx = i;
    }
    for (size_t i = 0; e == OK && i < n; i++)
        e = queue_copy(st, (uint64_t)(uintptr_t)dsts[i], (uint64_t)(uintptr_t)srcs[i], sizes[i]);
    pthread_mutex_unlock(&g_mu);
    if (e == OK)
        count("batch_rows", (long)n);
    return ret(e);
}
#endif

#if FAKE_CUDA_BATCH_ABI == 12
cudaError_t cudaMemcpyBatchAsync(void **dsts, void **srcs, size_t *sizes, size_t n,
                                 cudaMemcpyAttributes *attrs, size_t *idxs, size_t nattrs,
                                 size_t *fail_idx, cudaStream_t st)
{
    return batch(dsts, (const void *const *)srcs, sizes, n, attrs, idxs, nattrs, fail_idx, st);
}
#elif FAKE_CUDA_BATCH_ABI == 13
cudaError_t cudaMemcpyBatchAsync(void *const *dsts, const void *const *srcs, const size_t *sizes,
                                 size_t n, cudaMemcpyAttributes *attrs, size_t *idxs,
                                 size_t nattrs, cudaStream_t st)
{
    return batch(dsts, srcs, sizes, n, attrs, idxs, nattrs, NULL, st);
}
#endif

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *out, unsigned flags)
{
    count("cudaStreamCreateWithFlags", 1);
    (void)flags;
    stream_t *s = calloc(1, sizeof *s);
    if (s == NULL)
        return ret(E_MEMORY_ALLOCATION);
    s->magic = STREAM_MAGIC;
    pthread_mutex_lock(&g_mu);
    s->next = g_streams;
    g_streams = s;
    pthread_mutex_unlock(&g_mu);
    *out = s;
    return OK;
}

cudaError_t cudaStreamSynchronize(cudaStream_t st)
{
    count("cudaStreamSynchronize", 1);
    pthread_mutex_lock(&g_mu);
    cudaError_t e = st && !known_stream(st) ? E_INVALID_HANDLE : OK;
    if (e == OK && st)
        drain((stream_t *)st, NULL, 0);
    if (e == OK)
        e = g_sticky;
    pthread_mutex_unlock(&g_mu);
    return ret(e);
}

cudaError_t cudaStreamDestroy(cudaStream_t st)
{
    count("cudaStreamDestroy", 1);
    pthread_mutex_lock(&g_mu);
    stream_t **pp = &g_streams;
    while (*pp && *pp != (stream_t *)st)
        pp = &(*pp)->next;
    cudaError_t e = *pp ? OK : E_INVALID_HANDLE;
    if (e == OK) {
        stream_t *s = *pp;
        drain(s, NULL, 0);
        *pp = s->next;
        s->magic = 0;
        free(s);
    }
    pthread_mutex_unlock(&g_mu);
    return ret(e);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *out, unsigned flags)
{
    count("cudaEventCreateWithFlags", 1);
    (void)flags;
    event_t *ev = calloc(1, sizeof *ev);
    if (ev == NULL)
        return ret(E_MEMORY_ALLOCATION);
    ev->magic = EVENT_MAGIC;
    *out = ev;
    return OK;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t st)
{
    count("cudaEventRecord", 1);
    event_t *ev = e;
    if (ev == NULL || ev->magic != EVENT_MAGIC)
        return ret(E_INVALID_HANDLE);
    pthread_mutex_lock(&g_mu);
    cudaError_t rc = st && known_stream(st) ? OK : E_INVALID_HANDLE;
    if (rc == OK) {
        ev->stream = st;
        ev->recorded++;
        op_t o = {.type = OP_EVENT, .ev = ev, .seq = ev->recorded};
        rc = enqueue((stream_t *)st, o);
    }
    pthread_mutex_unlock(&g_mu);
    return ret(rc);
}

cudaError_t cudaEventSynchronize(cudaEvent_t e)
{
    count("cudaEventSynchronize", 1);
    event_t *ev = e;
    if (ev == NULL || ev->magic != EVENT_MAGIC)
        return ret(E_INVALID_HANDLE);
    pthread_mutex_lock(&g_mu);
    if (ev->stream && ev->done < ev->recorded && known_stream(ev->stream))
        drain(ev->stream, ev, ev->recorded);
    cudaError_t rc = g_sticky;
    pthread_mutex_unlock(&g_mu);
    return ret(rc);
}

cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    count("cudaEventDestroy", 1);
    event_t *ev = e;
    if (ev == NULL || ev->magic != EVENT_MAGIC)
        return ret(E_INVALID_HANDLE);
    pthread_mutex_lock(&g_mu);
    /* Queued records still point at the event: run them before it goes. */
    if (ev->stream && ev->done < ev->recorded && known_stream(ev->stream))
        drain(ev->stream, ev, ev->recorded);
    ev->magic = 0;
    pthread_mutex_unlock(&g_mu);
    free(ev);
    return OK;
}

/* ---- IPC ---- */

typedef struct {
    char magic[8];
    int64_t pid;
    int64_t fd;
    uint64_t size;
} fake_ipc;

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p)
{
    count("cudaIpcGetMemHandle", 1);
    if (h == NULL)
        return ret(E_INVALID_VALUE);
    pthread_mutex_lock(&g_mu);
    range_t *r = find((uint64_t)(uintptr_t)p, 1, R_DEVICE);
    cudaError_t e = r ? OK : E_INVALID_VALUE;
    if (r) {
        fake_ipc f = {{'D', 'D', 'F', 'A', 'K', 'E', 'I', 'P'}, getpid(), r->fd, r->size};
        memset(h, 0, sizeof *h);
        memcpy(h->reserved, &f, sizeof f);
    }
    pthread_mutex_unlock(&g_mu);
    return ret(e);
}

cudaError_t cudaIpcOpenMemHandle(void **p, cudaIpcMemHandle_t h, unsigned flags)
{
    count("cudaIpcOpenMemHandle", 1);
    (void)flags;
    fake_ipc f;
    memcpy(&f, h.reserved, sizeof f);
    if (p == NULL || memcmp(f.magic, "DDFAKEIP", 8) != 0)
        return ret(E_INVALID_VALUE);
    if (f.pid == getpid())
        return ret(E_DEVICE_UNINITIALIZED); /* real runtimes refuse their own process */
    char path[64];
    snprintf(path, sizeof path, "/proc/%lld/fd/%lld", (long long)f.pid, (long long)f.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return ret(E_INVALID_HANDLE);
    void *m = mmap(NULL, f.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return ret(E_INVALID_HANDLE);
    pthread_mutex_lock(&g_mu);
    add_range((uint64_t)(uintptr_t)m, f.size, R_IPC, -1);
    pthread_mutex_unlock(&g_mu);
    *p = m;
    return OK;
}

cudaError_t cudaIpcCloseMemHandle(void *p)
{
    count("cudaIpcCloseMemHandle", 1);
    pthread_mutex_lock(&g_mu);
    drain_all();
    range_t *r = find((uint64_t)(uintptr_t)p, 1, R_IPC);
    cudaError_t e = r && r->base == (uint64_t)(uintptr_t)p ? OK : E_INVALID_VALUE;
    if (e == OK) {
        munmap(p, r->size);
        drop_range(r);
    }
    pthread_mutex_unlock(&g_mu);
    return ret(e);
}

/* ---- kernels ---- */

#ifndef FAKE_CUDA_NO_KERNELS
static char g_library, g_kernel; /* handles of the one library and kernel */

cudaError_t cudaLibraryLoadData(void **lib, const void *code, void *jo, void **jv, unsigned nj,
                                void *lo, void **lv, unsigned nl)
{
    count("cudaLibraryLoadData", 1);
    (void)jo, (void)jv, (void)nj, (void)lo, (void)lv, (void)nl;
    if (lib == NULL || code == NULL || strstr(code, ".entry dd_copy_rows(") == NULL)
        return ret(E_INVALID_PTX);
    *lib = &g_library;
    return OK;
}

cudaError_t cudaLibraryGetKernel(void **kernel, void *lib, const char *name)
{
    count("cudaLibraryGetKernel", 1);
    if (kernel == NULL || lib != &g_library || strcmp(name, "dd_copy_rows") != 0)
        return ret(E_SYMBOL_NOT_FOUND);
    *kernel = &g_kernel;
    return OK;
}

cudaError_t cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args, size_t shm,
                             cudaStream_t st)
{
    count("cudaLaunchKernel", 1);
    if (g_sticky)
        return ret(g_sticky);
    if (func != &g_kernel || args == NULL || grid.x == 0 || grid.y != 1 || grid.z != 1 ||
        block.x == 0 || block.x > 1024 || block.y != 1 || block.z != 1 || shm != 0)
        return ret(E_INVALID_VALUE);
    pthread_mutex_lock(&g_mu);
    cudaError_t e = st && known_stream(st) ? OK : E_INVALID_HANDLE;
    if (e == OK) {
        op_t o = {.type = OP_KERNEL, .src = *(uint64_t *)args[0], .len = *(uint64_t *)args[1]};
        e = enqueue((stream_t *)st, o);
    }
    pthread_mutex_unlock(&g_mu);
    return ret(e);
}
#endif
