/* acl_rt.c: one Ascend device through a dlopen'd libascendcl: memory, batched copies, errors.
 *
 * The function table is process-wide (one libascendcl per process); each dd_acl_rt copies it
 * at open, so its calls never race with a later dd_acl_load. ACL binds contexts to threads:
 * every entry point that touches the device first makes the runtime's context current on
 * the calling thread (aclrtSetCurrentContext), so the engine's worker threads may call too.
 *
 * Copies: a batch either runs row by row through the synchronous aclrtMemcpy, or is queued
 * on the runtime's stream with aclrtMemcpyAsync and waited for with aclrtSynchronizeStream.
 * The CANN documentation requires 64-byte aligned addresses for aclrtMemcpyAsync, and on
 * several products leaves an asynchronous copy from or to host memory that is not page
 * locked undefined; so only aligned rows whose host side lies in this runtime's
 * aclrtMallocHost memory are queued. The batch lock serialises batches on the one stream.
 *
 * Lock order: batch lock, then the runtime lock, then the process lock.
 */
#define _GNU_SOURCE
#include "acl_rt.h"
#include "datadist.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_LIBRARY "libascendcl.so"
#define PATH_MAX_BYTES 4096

typedef struct {
    dd_aclInit_fn init;
    dd_aclFinalize_fn finalize;
    dd_aclGetRecentErrMsg_fn recent_err_msg; /* optional */
    dd_aclrtSetDevice_fn set_device;
    dd_aclrtResetDevice_fn reset_device;
    dd_aclrtGetDeviceCount_fn get_device_count;
    dd_aclrtGetCurrentContext_fn get_current_context;
    dd_aclrtSetCurrentContext_fn set_current_context;
    dd_aclrtMalloc_fn malloc;
    dd_aclrtFree_fn free;
    dd_aclrtMallocHost_fn malloc_host;
    dd_aclrtFreeHost_fn free_host;
    dd_aclrtMemcpy_fn memcpy;
    dd_aclrtMemcpyAsync_fn memcpy_async;
    dd_aclrtCreateStream_fn create_stream;
    dd_aclrtDestroyStream_fn destroy_stream;
    dd_aclrtSynchronizeStream_fn synchronize_stream;
    dd_aclrtMemset_fn memset_device; /* optional */
} acl_table;

typedef struct {
    uint64_t addr;
    uint64_t size;
    int host; /* 1: aclrtMallocHost (page locked), 0: aclrtMalloc */
} allocation;

struct dd_acl_rt {
    acl_table fn;
    int32_t device;
    aclrtContext ctx;
    aclrtStream stream;       /* created on the first queued copy; batch lock */
    pthread_mutex_t batch;    /* one batch at a time on the stream; also guards stream */
    pthread_mutex_t lock;     /* allocations and the closing / released flags */
    allocation *allocs;
    size_t nallocs, cap;
    int closing;              /* dd_acl_close ran: no new allocations or copies */
    int released;             /* aclrtResetDevice ran: the object may be freed */
};

static struct {
    pthread_mutex_t lock;
    void *handle;
    char path[PATH_MAX_BYTES];
    acl_table fn;
    int inited;       /* aclInit succeeded (or the application had called it) */
    int owns_init;    /* this process's aclInit was ours, so aclFinalize is ours too */
    int finalized;
    unsigned open;    /* runtimes whose device is not reset yet */
} g = {.lock = PTHREAD_MUTEX_INITIALIZER};

static _Thread_local int32_t t_code;
static _Thread_local char t_msg[DD_ACL_MSG_MAX];

static void clear_error(void) {
    t_code = 0;
    t_msg[0] = '\0';
}

static int classify(aclError rc) {
    switch (rc) {
    case DD_ACL_ERROR_INVALID_PARAM:
    case DD_ACL_ERROR_RT_PARAM_INVALID:
    case DD_ACL_ERROR_RT_INVALID_DEVICEID:
    case DD_ACL_ERROR_INVALID_DEVICE:
        return DD_EINVAL;
    case DD_ACL_ERROR_BAD_ALLOC:
    case DD_ACL_ERROR_RT_MEMORY_ALLOCATION:
        return DD_ENOMEM;
    case DD_ACL_ERROR_RT_NO_DEVICE:
        return DD_ACL_ENODEV;
    default:
        return DD_ACL_EFAIL;
    }
}

/* Record the calling thread's first failure since its last clear_error; return its class. */
static int fail(const acl_table *fn, const char *what, aclError rc) {
    if (t_code == 0) {
        t_code = rc;
        int len = snprintf(t_msg, sizeof t_msg, "%s returned ACL error %d", what, rc);
        const char *detail = fn->recent_err_msg ? fn->recent_err_msg() : NULL;
        if (detail && *detail && len > 0 && (size_t)len < sizeof t_msg)
            snprintf(t_msg + len, sizeof t_msg - (size_t)len, ": %s", detail);
    }
    return classify(rc);
}

#define RESOLVE(h, t, field, name, required)                                                 \
    do {                                                                                     \
        void *p_ = dlsym((h), (name));                                                       \
        if (!p_ && (required)) {                                                             \
            snprintf(err, cap, "%s has no symbol %s", path, (name));                         \
            return DD_ACL_ENOLIB;                                                            \
        }                                                                                    \
        memcpy(&(t)->field, &p_, sizeof p_);                                                 \
    } while (0)

static int resolve(void *h, const char *path, acl_table *t, char *err, size_t cap) {
    RESOLVE(h, t, init, "aclInit", 1);
    RESOLVE(h, t, finalize, "aclFinalize", 1);
    RESOLVE(h, t, recent_err_msg, "aclGetRecentErrMsg", 0);
    RESOLVE(h, t, set_device, "aclrtSetDevice", 1);
    RESOLVE(h, t, reset_device, "aclrtResetDevice", 1);
    RESOLVE(h, t, get_device_count, "aclrtGetDeviceCount", 1);
    RESOLVE(h, t, get_current_context, "aclrtGetCurrentContext", 1);
    RESOLVE(h, t, set_current_context, "aclrtSetCurrentContext", 1);
    RESOLVE(h, t, malloc, "aclrtMalloc", 1);
    RESOLVE(h, t, free, "aclrtFree", 1);
    RESOLVE(h, t, malloc_host, "aclrtMallocHost", 1);
    RESOLVE(h, t, free_host, "aclrtFreeHost", 1);
    RESOLVE(h, t, memcpy, "aclrtMemcpy", 1);
    RESOLVE(h, t, memcpy_async, "aclrtMemcpyAsync", 1);
    RESOLVE(h, t, create_stream, "aclrtCreateStream", 1);
    RESOLVE(h, t, destroy_stream, "aclrtDestroyStream", 1);
    RESOLVE(h, t, synchronize_stream, "aclrtSynchronizeStream", 1);
    RESOLVE(h, t, memset_device, "aclrtMemset", 0);
    return DD_OK;
}

static void set_err(char *err, size_t cap, const char *text) {
    if (err && cap)
        snprintf(err, cap, "%s", text ? text : "unknown error");
}

int dd_acl_load(const char *path, char *err, size_t cap) {
    char scratch[8];
    if (!err || !cap) {
        err = scratch;
        cap = sizeof scratch;
    }
    err[0] = '\0';
    if (!path || !*path)
        path = DEFAULT_LIBRARY;
    if (strlen(path) >= PATH_MAX_BYTES) {
        set_err(err, cap, "library path too long");
        return DD_EINVAL;
    }
    pthread_mutex_lock(&g.lock);
    int rc = DD_OK;
    if (g.handle && strcmp(g.path, path) == 0)
        goto out;
    if (g.handle && g.open) {
        snprintf(err, cap, "%s is in use by %u open runtime(s); cannot switch to %s", g.path,
                 g.open, path);
        rc = DD_ACL_EBUSY;
        goto out;
    }
    dlerror();
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        set_err(err, cap, dlerror());
        rc = DD_ACL_ENOLIB;
        goto out;
    }
    acl_table t;
    memset(&t, 0, sizeof t);
    rc = resolve(h, path, &t, err, cap);
    if (rc != DD_OK) {
        dlclose(h);
        goto out;
    }
    if (h != g.handle) {
        /* The previous library (if any) stays mapped: ACL state is not meant to be unloaded. */
        g.handle = h;
        g.fn = t;
        g.inited = g.owns_init = g.finalized = 0;
    } else {
        dlclose(h); /* the same object under another name: drop the extra reference */
    }
    snprintf(g.path, sizeof g.path, "%s", path);
out:
    pthread_mutex_unlock(&g.lock);
    return rc;
}

static int init_locked(void) {
    if (!g.handle)
        return DD_ACL_ENOLIB;
    if (g.finalized)
        return DD_ACL_EFINALIZED;
    if (g.inited)
        return DD_OK;
    aclError r = g.fn.init(NULL);
    if (r != DD_ACL_SUCCESS && r != DD_ACL_ERROR_REPEAT_INITIALIZE)
        return fail(&g.fn, "aclInit", r);
    g.inited = 1;
    g.owns_init = r == DD_ACL_SUCCESS;
    return DD_OK;
}

int dd_acl_init(void) {
    clear_error();
    pthread_mutex_lock(&g.lock);
    int rc = init_locked();
    pthread_mutex_unlock(&g.lock);
    return rc;
}

int dd_acl_device_count(uint32_t *count) {
    clear_error();
    if (!count)
        return DD_EINVAL;
    pthread_mutex_lock(&g.lock);
    int rc = init_locked();
    if (rc == DD_OK) {
        uint32_t n = 0;
        aclError r = g.fn.get_device_count(&n);
        if (r != DD_ACL_SUCCESS)
            rc = fail(&g.fn, "aclrtGetDeviceCount", r);
        else
            *count = n;
    }
    pthread_mutex_unlock(&g.lock);
    return rc;
}

int dd_acl_open(int32_t device_id, dd_acl_rt **out) {
    clear_error();
    if (!out || device_id < 0)
        return DD_EINVAL;
    pthread_mutex_lock(&g.lock);
    int rc = init_locked();
    dd_acl_rt *rt = NULL;
    if (rc != DD_OK)
        goto out;
    rt = calloc(1, sizeof *rt);
    if (!rt) {
        rc = DD_ENOMEM;
        goto out;
    }
    rt->fn = g.fn;
    rt->device = device_id;
    aclError r = rt->fn.set_device(device_id);
    if (r != DD_ACL_SUCCESS) {
        rc = fail(&rt->fn, "aclrtSetDevice", r);
        goto out;
    }
    r = rt->fn.get_current_context(&rt->ctx);
    if (r != DD_ACL_SUCCESS || !rt->ctx) {
        rc = fail(&rt->fn, "aclrtGetCurrentContext", r ? r : DD_ACL_ERROR_RT_PARAM_INVALID);
        rt->fn.reset_device(device_id);
        goto out;
    }
    pthread_mutex_init(&rt->batch, NULL);
    pthread_mutex_init(&rt->lock, NULL);
    g.open++;
    *out = rt;
    rt = NULL;
out:
    pthread_mutex_unlock(&g.lock);
    free(rt);
    return rc;
}

/* Make the runtime's context current on the calling thread. */
static int bind(dd_acl_rt *rt) {
    aclError r = rt->fn.set_current_context(rt->ctx);
    return r == DD_ACL_SUCCESS ? DD_OK : fail(&rt->fn, "aclrtSetCurrentContext", r);
}

/* aclrtResetDevice once the runtime is closed and owns no memory; rt->lock held. */
static int release_locked(dd_acl_rt *rt) {
    if (rt->released || !rt->closing || rt->nallocs)
        return DD_OK;
    rt->released = 1;
    aclError r = rt->fn.reset_device(rt->device);
    pthread_mutex_lock(&g.lock);
    g.open--;
    pthread_mutex_unlock(&g.lock);
    return r == DD_ACL_SUCCESS ? DD_OK : fail(&rt->fn, "aclrtResetDevice", r);
}

int dd_acl_close(dd_acl_rt *rt) {
    clear_error();
    if (!rt)
        return DD_EINVAL;
    pthread_mutex_lock(&rt->batch);
    pthread_mutex_lock(&rt->lock);
    int rc = DD_OK;
    if (!rt->closing) {
        rt->closing = 1;
        if (rt->stream) {
            rc = bind(rt);
            aclError r = rt->fn.destroy_stream(rt->stream);
            if (r != DD_ACL_SUCCESS && rc == DD_OK)
                rc = fail(&rt->fn, "aclrtDestroyStream", r);
            rt->stream = NULL;
        }
        int rc2 = release_locked(rt);
        if (rc == DD_OK)
            rc = rc2;
    }
    pthread_mutex_unlock(&rt->lock);
    pthread_mutex_unlock(&rt->batch);
    return rc;
}

void dd_acl_destroy(dd_acl_rt *rt) {
    if (!rt || !rt->released)
        return; /* still holds the device: leave it to process exit rather than call ACL here */
    pthread_mutex_destroy(&rt->batch);
    pthread_mutex_destroy(&rt->lock);
    free(rt->allocs);
    free(rt);
}

static int alloc_common(dd_acl_rt *rt, uint64_t nbytes, uint64_t *addr, int host) {
    clear_error();
    if (!rt || !addr || nbytes == 0 || nbytes > SIZE_MAX)
        return DD_EINVAL;
    pthread_mutex_lock(&rt->lock);
    int rc = DD_OK;
    if (rt->closing) {
        rc = DD_ECLOSED;
        goto out;
    }
    if (rt->nallocs == rt->cap) {
        size_t cap = rt->cap ? 2 * rt->cap : 8;
        allocation *grown = realloc(rt->allocs, cap * sizeof *grown);
        if (!grown) {
            rc = DD_ENOMEM;
            goto out;
        }
        rt->allocs = grown;
        rt->cap = cap;
    }
    rc = bind(rt);
    if (rc != DD_OK)
        goto out;
    void *p = NULL;
    aclError r = host ? rt->fn.malloc_host(&p, (size_t)nbytes)
                      : rt->fn.malloc(&p, (size_t)nbytes, ACL_MEM_MALLOC_HUGE_FIRST);
    if (r != DD_ACL_SUCCESS) {
        rc = fail(&rt->fn, host ? "aclrtMallocHost" : "aclrtMalloc", r);
        goto out;
    }
    rt->allocs[rt->nallocs++] = (allocation){(uint64_t)(uintptr_t)p, nbytes, host};
    *addr = (uint64_t)(uintptr_t)p;
out:
    pthread_mutex_unlock(&rt->lock);
    return rc;
}

static int free_common(dd_acl_rt *rt, uint64_t addr, int host) {
    clear_error();
    if (!rt)
        return DD_EINVAL;
    pthread_mutex_lock(&rt->lock);
    int rc = DD_EINVAL;
    size_t i = 0;
    while (i < rt->nallocs && !(rt->allocs[i].addr == addr && rt->allocs[i].host == host))
        i++;
    if (i == rt->nallocs || rt->released)
        goto out;
    rc = bind(rt);
    if (rc != DD_OK)
        goto out;
    void *p = (void *)(uintptr_t)addr;
    aclError r = host ? rt->fn.free_host(p) : rt->fn.free(p);
    if (r != DD_ACL_SUCCESS) {
        rc = fail(&rt->fn, host ? "aclrtFreeHost" : "aclrtFree", r);
        goto out;
    }
    rt->allocs[i] = rt->allocs[--rt->nallocs];
    rc = release_locked(rt);
out:
    pthread_mutex_unlock(&rt->lock);
    return rc;
}

int dd_acl_malloc(dd_acl_rt *rt, uint64_t nbytes, uint64_t *addr) {
    return alloc_common(rt, nbytes, addr, 0);
}

int dd_acl_free(dd_acl_rt *rt, uint64_t addr) { return free_common(rt, addr, 0); }

int dd_acl_malloc_host(dd_acl_rt *rt, uint64_t nbytes, uint64_t *addr) {
    return alloc_common(rt, nbytes, addr, 1);
}

int dd_acl_free_host(dd_acl_rt *rt, uint64_t addr) { return free_common(rt, addr, 1); }

/* True when [addr, addr + nbytes) lies inside one page-locked allocation of the runtime. */
static int page_locked(dd_acl_rt *rt, uint64_t addr, uint64_t nbytes) {
    int found = 0;
    pthread_mutex_lock(&rt->lock);
    for (size_t i = 0; i < rt->nallocs && !found; i++) {
        const allocation *a = &rt->allocs[i];
        found = a->host && addr >= a->addr && addr - a->addr <= a->size &&
                nbytes <= a->size - (addr - a->addr);
    }
    pthread_mutex_unlock(&rt->lock);
    return found;
}

static int queueable(dd_acl_rt *rt, int kind, uint64_t dst, uint64_t src, uint64_t nbytes) {
    if ((dst | src) % DD_ACL_ASYNC_ALIGN)
        return 0;
    switch (kind) {
    case DD_ACL_HOST_TO_DEVICE:
        return page_locked(rt, src, nbytes);
    case DD_ACL_DEVICE_TO_HOST:
        return page_locked(rt, dst, nbytes);
    default:
        return 1;
    }
}

/* The runtime's stream, created on first use; rt->batch held. */
static int ensure_stream(dd_acl_rt *rt) {
    if (rt->stream)
        return DD_OK;
    aclError r = rt->fn.create_stream(&rt->stream);
    if (r == DD_ACL_SUCCESS)
        return DD_OK;
    rt->stream = NULL;
    return fail(&rt->fn, "aclrtCreateStream", r);
}

/* Wait for the stream, even after a failure (rc): nothing issued may outlive the call.
 * Returns rc, or the wait's failure when rc was DD_OK; rt->batch held. */
static int wait_stream(dd_acl_rt *rt, int rc) {
    aclError r = rt->fn.synchronize_stream(rt->stream);
    if (r != DD_ACL_SUCCESS) {
        int rc2 = fail(&rt->fn, "aclrtSynchronizeStream", r);
        if (rc == DD_OK)
            rc = rc2;
    }
    return rc;
}

int dd_acl_copy_batch(dd_acl_rt *rt, const uint64_t *ops, size_t n, int kind,
                      uint64_t *async_rows) {
    clear_error();
    if (async_rows)
        *async_rows = 0;
    if (!rt || (n && !ops) || kind < DD_ACL_HOST_TO_HOST || kind > DD_ACL_DEVICE_TO_DEVICE)
        return DD_EINVAL;
    for (size_t i = 0; i < n; i++) {
        uint64_t dst = ops[3 * i], src = ops[3 * i + 1], len = ops[3 * i + 2];
        if (len && (!dst || !src || dst + len < dst || src + len < src || len > SIZE_MAX))
            return DD_EINVAL;
    }
    pthread_mutex_lock(&rt->lock);
    int closing = rt->closing;
    pthread_mutex_unlock(&rt->lock);
    if (closing)
        return DD_ECLOSED;
    if (kind == DD_ACL_HOST_TO_HOST)
        return dd_copy_batch(ops, n, 0);

    pthread_mutex_lock(&rt->batch);
    uint64_t queued = 0;
    int rc = rt->closing ? DD_ECLOSED : bind(rt);
    size_t i = 0;
    while (rc == DD_OK && i < n) {
        uint64_t dst = ops[3 * i], src = ops[3 * i + 1], len = ops[3 * i + 2];
        size_t j = i + 1;
        if (len == 0) {
            i = j;
            continue;
        }
        while (j < n && (ops[3 * j + 2] == 0 ||
                         (ops[3 * j] == dst + len && ops[3 * j + 1] == src + len))) {
            len += ops[3 * j + 2];
            j++;
        }
        i = j;
        void *d = (void *)(uintptr_t)dst;
        const void *s = (const void *)(uintptr_t)src;
        aclError r;
        if (queueable(rt, kind, dst, src, len)) {
            rc = ensure_stream(rt);
            if (rc != DD_OK)
                break;
            r = rt->fn.memcpy_async(d, (size_t)len, s, (size_t)len, (aclrtMemcpyKind)kind,
                                    rt->stream);
            if (r != DD_ACL_SUCCESS) {
                rc = fail(&rt->fn, "aclrtMemcpyAsync", r);
                break;
            }
            queued++;
        } else {
            r = rt->fn.memcpy(d, (size_t)len, s, (size_t)len, (aclrtMemcpyKind)kind);
            if (r != DD_ACL_SUCCESS) {
                rc = fail(&rt->fn, "aclrtMemcpy", r);
                break;
            }
        }
    }
    if (queued)
        rc = wait_stream(rt, rc);
    pthread_mutex_unlock(&rt->batch);
    if (async_rows)
        *async_rows = queued;
    return rc;
}

int dd_acl_on_stream(dd_acl_rt *rt, int (*issue)(aclrtStream stream, void *arg), void *arg) {
    clear_error();
    if (!rt || !issue)
        return DD_EINVAL;
    pthread_mutex_lock(&rt->batch);
    int rc = rt->closing ? DD_ECLOSED : bind(rt);
    if (rc == DD_OK)
        rc = ensure_stream(rt);
    if (rc == DD_OK)
        rc = wait_stream(rt, issue(rt->stream, arg));
    pthread_mutex_unlock(&rt->batch);
    return rc;
}

int dd_acl_synchronize(dd_acl_rt *rt) {
    clear_error();
    if (!rt)
        return DD_EINVAL;
    pthread_mutex_lock(&rt->batch);
    int rc = DD_OK;
    if (rt->stream) {
        rc = bind(rt);
        if (rc == DD_OK) {
            aclError r = rt->fn.synchronize_stream(rt->stream);
            if (r != DD_ACL_SUCCESS)
                rc = fail(&rt->fn, "aclrtSynchronizeStream", r);
        }
    }
    pthread_mutex_unlock(&rt->batch);
    return rc;
}

int dd_acl_memset(dd_acl_rt *rt, uint64_t addr, int32_t value, uint64_t nbytes) {
    clear_error();
    if (!rt || value < 0 || value > 255 || (nbytes && !addr) || addr + nbytes < addr ||
        nbytes > SIZE_MAX)
        return DD_EINVAL;
    if (nbytes == 0)
        return DD_OK;
    if (!rt->fn.memset_device)
        return DD_ACL_ENOLIB;
    pthread_mutex_lock(&rt->batch);
    int rc = rt->closing ? DD_ECLOSED : bind(rt);
    if (rc == DD_OK) {
        aclError r = rt->fn.memset_device((void *)(uintptr_t)addr, (size_t)nbytes, value,
                                          (size_t)nbytes);
        if (r != DD_ACL_SUCCESS)
            rc = fail(&rt->fn, "aclrtMemset", r);
    }
    pthread_mutex_unlock(&rt->batch);
    return rc;
}

int dd_acl_last_error(int32_t *code, char *msg, size_t cap) {
    if (code)
        *code = t_code;
    if (msg && cap)
        snprintf(msg, cap, "%s", t_msg);
    return DD_OK;
}

int dd_acl_finalize(void) {
    clear_error();
    pthread_mutex_lock(&g.lock);
    int rc = DD_OK;
    if (!g.handle || g.finalized)
        goto out;
    if (g.open) {
        rc = DD_ACL_EBUSY;
        goto out;
    }
    if (g.inited && g.owns_init) {
        aclError r = g.fn.finalize();
        if (r != DD_ACL_SUCCESS)
            rc = fail(&g.fn, "aclFinalize", r);
    }
    g.finalized = 1;
out:
    pthread_mutex_unlock(&g.lock);
    return rc;
}
