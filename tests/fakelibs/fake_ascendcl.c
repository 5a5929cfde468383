/* fake_ascendcl.c: a stand-in libascendcl.so for the tests: host memory behind ACL prototypes.
 *
 * It exports the ACL entry points the runtime binds, with the documented prototypes, and
 * checks what ACL checks, so the tests prove the call sequence and the arguments:
 *   - every call but aclInit fails with ACL_ERROR_UNINITIALIZE before aclInit; a second
 *     aclInit returns ACL_ERROR_REPEAT_INITIALIZE;
 *   - aclrtSetDevice checks the device id and makes the device's default context current on
 *     the calling thread only; memory, stream and copy calls need a live current context
 *     (ACL_ERROR_RT_CONTEXT_NULL), other threads bind it with aclrtSetCurrentContext;
 *     aclrtResetDevice is reference counted and, at zero, releases the device's memory and
 *     streams and kills its context;
 *   - aclrtMemcpy / aclrtMemcpyAsync check destMax >= count, that each address is device or
 *     host memory as the copy kind says and that device ranges lie inside one allocation of
 *     the current device; aclrtMemcpyAsync also refuses HOST_TO_HOST, addresses not 64-byte
 *     aligned, a stream of another context, and host memory not from aclrtMallocHost; it
 *     queues the copy, which only aclrtSynchronizeStream performs.
 *   - aclrtMemset checks count <= maxCount and that the range lies in one device allocation
 *     of the current device or in aclrtMallocHost memory; built without it when
 *     FAKE_ACL_NO_MEMSET is defined (the symbol is optional for the runtime).
 * Device memory is a PROT_NONE reservation (the host faults on touching it) backed by a
 * separate mapping that the fake copies through.
 *
 * Environment, read at every call:
 *   FAKE_ACL_DEVICES                device count (default 1)
 *   FAKE_ACL_LOG                    file that receives one line per call: "name args -> rc"
 *   FAKE_ACL_FAIL_MALLOC_OVER       aclrtMalloc of more bytes fails: ACL_ERROR_RT_MEMORY_ALLOCATION
 *   FAKE_ACL_FAIL_MALLOC_HOST_OVER  the same for aclrtMallocHost
 *   FAKE_ACL_FAIL                   "name:code[,name:code...]": the named call fails with code
 * Test helpers (not ACL): fake_acl_read / fake_acl_write move bytes of device memory,
 * fake_acl_count reports live objects.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

typedef int aclError;

enum {
    OK = 0,
    INVALID_PARAM = 100000,
    UNINITIALIZE = 100001,
    REPEAT_INITIALIZE = 100002,
    RT_PARAM_INVALID = 107000,
    RT_INVALID_DEVICEID = 107001,
    RT_CONTEXT_NULL = 107002,
    RT_STREAM_CONTEXT = 107003,
    RT_FEATURE_NOT_SUPPORT = 207000,
    RT_MEMORY_ALLOCATION = 207001,
    RT_RESOURCE_ALLOC_FAIL = 207005
};

enum { H2H = 0, H2D = 1, D2H = 2, D2D = 3, DEFAULT_KIND = 4 };

#define MAX_DEVICES 64
#define MAX_ALLOCS 4096
#define MAX_STREAMS 256

typedef struct {
    int device;
    int dead;
} context;

typedef struct {
    char *dst;
    const char *src;
    size_t n;
} queued_copy;

typedef struct {
    context *ctx;
    queued_copy *ops;
    size_t nops, cap;
} stream;

typedef struct {
    uintptr_t addr; /* the device address: a PROT_NONE reservation */
    char *back;     /* where the bytes live */
    size_t size, mapped;
    context *ctx;
} device_block;

typedef struct {
    char *ptr;
    size_t size, mapped;
} host_block;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int inited;
static struct {
    int refs;
    context *ctx;
} devices[MAX_DEVICES];
static device_block dblocks[MAX_ALLOCS];
static size_t ndblocks;
static host_block hblocks[MAX_ALLOCS];
static size_t nhblocks;
static stream *streams[MAX_STREAMS];
static size_t nstreams;

static _Thread_local context *t_ctx;
static _Thread_local char t_err[256];
static _Thread_local char t_err_out[256];

static void note(const char *fmt, ...) {
    const char *path = getenv("FAKE_ACL_LOG");
    if (!path || !*path)
        return;
    FILE *f = fopen(path, "a");
    if (!f)
        return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
    fclose(f);
}

static aclError finish(const char *name, aclError rc) {
    if (rc != OK)
        snprintf(t_err, sizeof t_err, "fake %s failed with %d", name, rc);
    return rc;
}

/* The code FAKE_ACL_FAIL assigns to name, or 0. */
static aclError injected(const char *name) {
    const char *spec = getenv("FAKE_ACL_FAIL");
    size_t len = strlen(name);
    while (spec && *spec) {
        if (strncmp(spec, name, len) == 0 && spec[len] == ':')
            return (aclError)strtol(spec + len + 1, NULL, 10);
        spec = strchr(spec, ',');
        if (spec)
            spec++;
    }
    return OK;
}

static int device_count(void) {
    const char *s = getenv("FAKE_ACL_DEVICES");
    long n = s && *s ? strtol(s, NULL, 10) : 1;
    return n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : (int)n;
}

static size_t limit(const char *var) {
    const char *s = getenv(var);
    return s && *s ? (size_t)strtoull(s, NULL, 10) : SIZE_MAX;
}

static int ctx_live(void) { return t_ctx && !t_ctx->dead; }

static size_t page_round(size_t n) {
    size_t page = 4096;
    return (n + page - 1) / page * page;
}

static device_block *device_block_of(uintptr_t a) {
    for (size_t i = 0; i < ndblocks; i++)
        if (a >= dblocks[i].addr && a < dblocks[i].addr + dblocks[i].mapped)
            return &dblocks[i];
    return NULL;
}

static int pinned(const char *p, size_t n) {
    for (size_t i = 0; i < nhblocks; i++) {
        const host_block *h = &hblocks[i];
        if (p >= h->ptr && (size_t)(p - h->ptr) <= h->size && n <= h->size - (size_t)(p - h->ptr))
            return 1;
    }
    return 0;
}

static stream *stream_of(void *s) {
    for (size_t i = 0; i < nstreams; i++)
        if (streams[i] == s)
            return streams[i];
    return NULL;
}

static void drop_stream(size_t i) {
    free(streams[i]->ops);
    free(streams[i]);
    streams[i] = streams[--nstreams];
}

/* Host pointer of a device range inside one block of the current device, or NULL. */
static char *device_bytes(uintptr_t a, size_t n) {
    device_block *b = device_block_of(a);
    if (!b || b->ctx != t_ctx || n > b->size || a - b->addr > b->size - n)
        return NULL;
    return b->back + (a - b->addr);
}

/* Check a copy as ACL does and translate its addresses; kind may be DEFAULT_KIND. */
static aclError resolve_copy(void *dst, size_t dest_max, const void *src, size_t count, int kind,
                             char **d, const char **s, int *resolved_kind) {
    if (!dst || !src || count > dest_max || kind < H2H || kind > DEFAULT_KIND)
        return INVALID_PARAM;
    int dst_dev = device_block_of((uintptr_t)dst) != NULL;
    int src_dev = device_block_of((uintptr_t)src) != NULL;
    if (kind == DEFAULT_KIND)
        kind = (src_dev << 1) | dst_dev;
    if (dst_dev != (kind & 1) || src_dev != (kind >> 1))
        return RT_PARAM_INVALID;
    *d = dst_dev ? device_bytes((uintptr_t)dst, count) : (char *)dst;
    *s = src_dev ? device_bytes((uintptr_t)src, count) : (const char *)src;
    if (!*d || !*s)
        return RT_PARAM_INVALID;
    *resolved_kind = kind;
    return OK;
}

aclError aclInit(const char *config_path) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclInit");
    if (!rc && inited)
        rc = REPEAT_INITIALIZE;
    if (!rc)
        inited = 1;
    note("aclInit config=%s -> %d", config_path ? config_path : "NULL", rc);
    pthread_mutex_unlock(&mu);
    return finish("aclInit", rc);
}

aclError aclFinalize(void) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclFinalize");
    if (!rc && !inited)
        rc = UNINITIALIZE;
    if (!rc)
        inited = 0;
    note("aclFinalize -> %d", rc);
    pthread_mutex_unlock(&mu);
    return finish("aclFinalize", rc);
}

const char *aclGetRecentErrMsg(void) {
    if (!t_err[0])
        return NULL;
    memcpy(t_err_out, t_err, sizeof t_err_out);
    t_err[0] = '\0';
    return t_err_out;
}

aclError aclrtGetDeviceCount(uint32_t *count) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclrtGetDeviceCount");
    if (!rc && !inited)
        rc = UNINITIALIZE;
    if (!rc && !count)
        rc = INVALID_PARAM;
    if (!rc)
        *count = (uint32_t)device_count();
    note("aclrtGetDeviceCount count=%d -> %d", rc ? -1 : (int)*count, rc);
    pthread_mutex_unlock(&mu);
    return finish("aclrtGetDeviceCount", rc);
}

aclError aclrtSetDevice(int32_t device) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclrtSetDevice");
    if (!rc && !inited)
        rc = UNINITIALIZE;
    if (!rc && (device < 0 || device >= device_count()))
        rc = RT_INVALID_DEVICEID;
    if (!rc && devices[device].refs == 0) {
        devices[device].ctx = calloc(1, sizeof(context));
        if (!devices[device].ctx)
            rc = RT_RESOURCE_ALLOC_FAIL;
        else
            devices[device].ctx->device = device;
    }
    if (!rc) {
        devices[device].refs++;
        t_ctx = devices[device].ctx;
    }
    note("aclrtSetDevice device=%d -> %d", device, rc);
    pthread_mutex_unlock(&mu);
    return finish("aclrtSetDevice", rc);
}

aclError aclrtResetDevice(int32_t device) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclrtResetDevice");
    size_t leaked = 0;
    if (!rc && !inited)
        rc = UNINITIALIZE;
    if (!rc && (device < 0 || device >= MAX_DEVICES || devices[device].refs == 0))
        rc = RT_INVALID_DEVICEID;
    if (!rc && --devices[device].refs == 0) {
        context *ctx = devices[device].ctx;
        ctx->dead = 1; /* kept allocated: threads may still hold it as current */
        devices[device].ctx = NULL;
        for (size_t i = ndblocks; i-- > 0;) {
            if (dblocks[i].ctx != ctx)
                continue;
            leaked++;
            munmap((void *)dblocks[i].addr, dblocks[i].mapped);
            munmap(dblocks[i].back, dblocks[i].mapped);
            dblocks[i] = dblocks[--ndblocks];
        }
        for (size_t i = nstreams; i-- > 0;)
            if (streams[i]->ctx == ctx)
                drop_stream(i);
    }
    note("aclrtResetDevice device=%d leaked=%zu -> %d", device, leaked, rc);
    pthread_mutex_unlock(&mu);
    return finish("aclrtResetDevice", rc);
}

aclError aclrtGetCurrentContext(void **context_out) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclrtGetCurrentContext");
    if (!rc && !inited)
        rc = UNINITIALIZE;
    if (!rc && !context_out)
        rc = INVALID_PARAM;
    if (!rc && !ctx_live())
        rc = RT_CONTEXT_NULL;
    if (!rc)
        *context_out = t_ctx;
    note("aclrtGetCurrentContext -> %d", rc);
    pthread_mutex_unlock(&mu);
    return finish("aclrtGetCurrentContext", rc);
}

aclError aclrtSetCurrentContext(void *ctx) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclrtSetCurrentContext");
    if (!rc && !inited)
        rc = UNINITIALIZE;
    int known = 0;
    for (int i = 0; i < MAX_DEVICES && !known; i++)
        known = ctx && devices[i].ctx == ctx;
    if (!rc && !known)
        rc = RT_PARAM_INVALID; /* unknown, or its device was reset */
    if (!rc)
        t_ctx = ctx;
    note("aclrtSetCurrentContext -> %d", rc);
    pthread_mutex_unlock(&mu);
    return finish("aclrtSetCurrentContext", rc);
}

aclError aclrtMalloc(void **dev_ptr, size_t size, int policy) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclrtMalloc");
    int base = policy & 0xff, extra = policy & ~0xff;
    if (!rc && !inited)
        rc = UNINITIALIZE;
    if (!rc && !ctx_live())
        rc = RT_CONTEXT_NULL;
    if (!rc && (!dev_ptr || size == 0 || base > 5 || (extra & ~(0x100 | 0x1000))))
        rc = INVALID_PARAM;
    if (!rc && (size > limit("FAKE_ACL_FAIL_MALLOC_OVER") || ndblocks == MAX_ALLOCS))
        rc = RT_MEMORY_ALLOCATION;
    if (!rc) {
        size_t mapped = page_round(size);
        void *addr = mmap(NULL, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                          -1, 0);
        void *back = mmap(NULL, mapped, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (addr == MAP_FAILED || back == MAP_FAILED) {
            if (addr != MAP_FAILED)
                munmap(addr, mapped);
            if (back != MAP_FAILED)
                munmap(back, mapped);
            rc = RT_MEMORY_ALLOCATION;
        } else {
            dblocks[ndblocks++] = (device_block){(uintptr_t)addr, back, size, mapped, t_ctx};
            *dev_ptr = addr;
        }
    }
    note("aclrtMalloc size=%zu policy=%d -> %d", size, policy, rc);
    pthread_mutex_unlock(&mu);
    return finish("aclrtMalloc", rc);
}

aclError aclrtFree(void *dev_ptr) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclrtFree");
    device_block *b = device_block_of((uintptr_t)dev_ptr);
    if (!rc && !inited)
        rc = UNINITIALIZE;
    if (!rc && !ctx_live())
        rc = RT_CONTEXT_NULL;
    if (!rc && (!b || b->addr != (uintptr_t)dev_ptr))
        rc = INVALID_PARAM;
    if (!rc && b->ctx != t_ctx)
        rc = RT_PARAM_INVALID; /* memory of another device's context */
    if (!rc) {
        munmap((void *)b->addr, b->mapped);
        munmap(b->back, b->mapped);
        *b = dblocks[--ndblocks];
    }
    note("aclrtFree -> %d", rc);
    pthread_mutex_unlock(&mu);
    return finish("aclrtFree", rc);
}

aclError aclrtMallocHost(void **host_ptr, size_t size) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclrtMallocHost");
    if (!rc && !inited)
        rc = UNINITIALIZE;
    if (!rc && !ctx_live())
        rc = RT_CONTEXT_NULL;
    if (!rc && (!host_ptr || size == 0))
        rc = INVALID_PARAM;
    if (!rc && (size > limit("FAKE_ACL_FAIL_MALLOC_HOST_OVER") || nhblocks == MAX_ALLOCS))
        rc = RT_MEMORY_ALLOCATION;
    if (!rc) {
        size_t mapped = page_round(size);
        void *p = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            rc = RT_MEMORY_ALLOCATION;
        } else {
            hblocks[nhblocks++] = (host_block){p, size, mapped};
            *host_ptr = p;
        }
    }
    note("aclrtMallocHost size=%zu -> %d", size, rc);
    pthread_mutex_unlock(&mu);
    return finish("aclrtMallocHost", rc);
}

aclError aclrtFreeHost(void *host_ptr) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclrtFreeHost");
    size_t i = 0;
    while (i < nhblocks && hblocks[i].ptr != host_ptr)
        i++;
    if (!rc && !inited)
        rc = UNINITIALIZE;
    if (!rc && i == nhblocks)
        rc = INVALID_PARAM;
    if (!rc) {
        munmap(hblocks[i].ptr, hblocks[i].mapped);
        hblocks[i] = hblocks[--nhblocks];
    }
    note("aclrtFreeHost -> %d", rc);
    pthread_mutex_unlock(&mu);
    return finish("aclrtFreeHost", rc);
}

aclError aclrtMemcpy(void *dst, size_t dest_max, const void *src, size_t count, int kind) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclrtMemcpy");
    char *d = NULL;
    const char *s = NULL;
    int resolved = kind;
    if (!rc && !inited)
        rc = UNINITIALIZE;
    if (!rc && !ctx_live())
        rc = RT_CONTEXT_NULL;
    if (!rc)
        rc = resolve_copy(dst, dest_max, src, count, kind, &d, &s, &resolved);
    if (!rc)
        memmove(d, s, count);
    note("aclrtMemcpy kind=%d count=%zu destMax=%zu -> %d", kind, count, dest_max, rc);
    pthread_mutex_unlock(&mu);
    return finish("aclrtMemcpy", rc);
}

aclError aclrtMemcpyAsync(void *dst, size_t dest_max, const void *src, size_t count, int kind,
                          void *stream_handle) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclrtMemcpyAsync");
    stream *st = stream_of(stream_handle);
    char *d = NULL;
    const char *s = NULL;
    int resolved = kind;
    if (!rc && !inited)
        rc = UNINITIALIZE;
    if (!rc && !ctx_live())
        rc = RT_CONTEXT_NULL;
    if (!rc && !st)
        rc = RT_PARAM_INVALID;
    if (!rc && st->ctx != t_ctx)
        rc = RT_STREAM_CONTEXT;
    if (!rc && kind == H2H)
        rc = RT_FEATURE_NOT_SUPPORT;
    if (!rc && (((uintptr_t)dst | (uintptr_t)src) % 64))
        rc = INVALID_PARAM;
    if (!rc)
        rc = resolve_copy(dst, dest_max, src, count, kind, &d, &s, &resolved);
    if (!rc && ((resolved == H2D && !pinned(s, count)) || (resolved == D2H && !pinned(d, count))))
        rc = RT_PARAM_INVALID; /* pageable host memory: undefined on real hardware */
    if (!rc && st->nops == st->cap) {
        size_t cap = st->cap ? 2 * st->cap : 16;
        queued_copy *grown = realloc(st->ops, cap * sizeof *grown);
        if (!grown)
            rc = RT_RESOURCE_ALLOC_FAIL;
        else {
            st->ops = grown;
            st->cap = cap;
        }
    }
    if (!rc)
        st->ops[st->nops++] = (queued_copy){d, s, count};
    note("aclrtMemcpyAsync kind=%d count=%zu destMax=%zu -> %d", kind, count, dest_max, rc);
    pthread_mutex_unlock(&mu);
    return finish("aclrtMemcpyAsync", rc);
}

aclError aclrtCreateStream(void **stream_out) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclrtCreateStream");
    if (!rc && !inited)
        rc = UNINITIALIZE;
    if (!rc && !ctx_live())
        rc = RT_CONTEXT_NULL;
    if (!rc && (!stream_out || nstreams == MAX_STREAMS))
        rc = !stream_out ? INVALID_PARAM : RT_RESOURCE_ALLOC_FAIL;
    if (!rc) {
        stream *st = calloc(1, sizeof *st);
        if (!st) {
            rc = RT_RESOURCE_ALLOC_FAIL;
        } else {
            st->ctx = t_ctx;
            streams[nstreams++] = st;
            *stream_out = st;
        }
    }
    note("aclrtCreateStream -> %d", rc);
    pthread_mutex_unlock(&mu);
    return finish("aclrtCreateStream", rc);
}

aclError aclrtDestroyStream(void *stream_handle) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclrtDestroyStream");
    size_t pending = 0, i = 0;
    while (i < nstreams && streams[i] != stream_handle)
        i++;
    if (!rc && !inited)
        rc = UNINITIALIZE;
    if (!rc && i == nstreams)
        rc = RT_PARAM_INVALID;
    if (!rc) {
        pending = streams[i]->nops;
        drop_stream(i);
    }
    note("aclrtDestroyStream pending=%zu -> %d", pending, rc);
    pthread_mutex_unlock(&mu);
    return finish("aclrtDestroyStream", rc);
}

aclError aclrtSynchronizeStream(void *stream_handle) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclrtSynchronizeStream");
    stream *st = stream_of(stream_handle);
    size_t done = 0;
    if (!rc && !inited)
        rc = UNINITIALIZE;
    if (!rc && !st)
        rc = RT_PARAM_INVALID;
    if (!rc)
        for (; done < st->nops; done++)
            memmove(st->ops[done].dst, st->ops[done].src, st->ops[done].n);
    if (st)
        st->nops = 0; /* a failed synchronisation loses the queued copies */
    note("aclrtSynchronizeStream copies=%zu -> %d", done, rc);
    pthread_mutex_unlock(&mu);
    return finish("aclrtSynchronizeStream", rc);
}

#ifndef FAKE_ACL_NO_MEMSET
aclError aclrtMemset(void *dev_ptr, size_t max_count, int32_t value, size_t count) {
    pthread_mutex_lock(&mu);
    aclError rc = injected("aclrtMemset");
    char *d = NULL;
    if (!rc && !inited)
        rc = UNINITIALIZE;
    if (!rc && !ctx_live())
        rc = RT_CONTEXT_NULL;
    if (!rc && (!dev_ptr || count > max_count))
        rc = INVALID_PARAM;
    if (!rc) {
        d = device_block_of((uintptr_t)dev_ptr) ? device_bytes((uintptr_t)dev_ptr, count)
            : pinned(dev_ptr, count)           ? (char *)dev_ptr
                                               : NULL;
        if (!d)
            rc = RT_PARAM_INVALID;
    }
    if (!rc)
        memset(d, value, count);
    note("aclrtMemset count=%zu maxCount=%zu value=%d -> %d", count, max_count, value, rc);
    pthread_mutex_unlock(&mu);
    return finish("aclrtMemset", rc);
}
#endif

/* ---- test helpers, not part of ACL ---- */

int fake_acl_read(uint64_t device_addr, void *out, size_t n) {
    pthread_mutex_lock(&mu);
    device_block *b = device_block_of((uintptr_t)device_addr);
    int ok = b && n <= b->size && device_addr - b->addr <= b->size - n;
    if (ok)
        memcpy(out, b->back + (device_addr - b->addr), n);
    pthread_mutex_unlock(&mu);
    return ok ? 0 : -1;
}

int fake_acl_write(uint64_t device_addr, const void *in, size_t n) {
    pthread_mutex_lock(&mu);
    device_block *b = device_block_of((uintptr_t)device_addr);
    int ok = b && n <= b->size && device_addr - b->addr <= b->size - n;
    if (ok)
        memcpy(b->back + (device_addr - b->addr), in, n);
    pthread_mutex_unlock(&mu);
    return ok ? 0 : -1;
}

/* what: "device" (live aclrtMalloc blocks), "host" (aclrtMallocHost), "streams",
 * "refs:<id>" (aclrtSetDevice references of a device), "inited". */
long fake_acl_count(const char *what) {
    pthread_mutex_lock(&mu);
    long n = -1;
    if (strcmp(what, "device") == 0)
        n = (long)ndblocks;
    else if (strcmp(what, "host") == 0)
        n = (long)nhblocks;
    else if (strcmp(what, "streams") == 0)
        n = (long)nstreams;
    else if (strcmp(what, "inited") == 0)
        n = inited;
    else if (strncmp(what, "refs:", 5) == 0) {
        long id = strtol(what + 5, NULL, 10);
        n = id >= 0 && id < MAX_DEVICES ? devices[id].refs : -1;
    }
    pthread_mutex_unlock(&mu);
    return n;
}
