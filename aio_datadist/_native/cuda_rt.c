/* cuda_rt.c: the CUDA runtime through dlopen: memory, batched and staged copies, IPC.
 *
 * The few CUDA runtime prototypes used here are written out below with opaque handles and
 * int error codes, so the build needs no CUDA headers. Function pointers come from dlsym.
 *
 * Streams: each copy call checks a lane (stream, events, staging ring, scratch tables) out
 * of its ctx's free list and gives it back when done, so concurrent callers never share a
 * stream; a call returns only once its stream is idle. Lanes are created on demand.
 */
#define _GNU_SOURCE
#include "cuda_rt.h"
#include "datadist.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_abi.h"
#include "cuda_kernels_ptx.h"

struct dd_cuda_lib {
    struct dd_cuda_lib *next;
    void *handle;
    int version;
    unsigned features;
    cuerr (*GetDeviceCount)(int *);
    cuerr (*SetDevice)(int);
    cuerr (*Malloc)(void **, size_t);
    cuerr (*Free)(void *);
    cuerr (*HostAlloc)(void **, size_t, unsigned);
    cuerr (*MallocHost)(void **, size_t);
    cuerr (*FreeHost)(void *);
    cuerr (*HostRegister)(void *, size_t, unsigned);
    cuerr (*HostUnregister)(void *);
    cuerr (*Memcpy)(void *, const void *, size_t, int);
    cuerr (*MemcpyAsync)(void *, const void *, size_t, int, custream);
    cuerr (*MemsetAsync)(void *, int, size_t, custream);
    cuerr (*StreamCreateWithFlags)(custream *, unsigned);
    cuerr (*StreamSynchronize)(custream);
    cuerr (*StreamDestroy)(custream);
    cuerr (*EventCreateWithFlags)(cuevent *, unsigned);
    cuerr (*EventRecord)(cuevent, custream);
    cuerr (*EventSynchronize)(cuevent);
    cuerr (*EventDestroy)(cuevent);
    const char *(*GetErrorString)(cuerr);
    const char *(*GetErrorName)(cuerr);
    cuerr (*GetLastError)(void);
    cuerr (*IpcGetMemHandle)(cu_ipc_handle *, void *);
    cuerr (*IpcOpenMemHandle)(void **, cu_ipc_handle, unsigned);
    cuerr (*IpcCloseMemHandle)(void *);
    cuerr (*PointerGetAttributes)(cu_pointer_attrs *, const void *);
    cuerr (*RuntimeGetVersion)(int *);
    fn_batch12 Batch12;
    fn_batch13 Batch13;
    cuerr (*LibraryLoadData)(void **, const void *, void *, void **, unsigned, void *, void **,
                             unsigned);
    cuerr (*LibraryGetKernel)(void **, void *, const char *);
    cuerr (*LaunchKernel)(const void *, cu_dim3, cu_dim3, void **, size_t, custream);
    /* The copy kernel, loaded once per library (CUDA libraries are context independent). */
    pthread_mutex_t kmu;
    int kstate; /* 0 untried, 1 loaded, -1 unavailable */
    void *kernel;
    char knote[DD_CUDA_ERRMSG_BYTES];
};

/* ---- per-thread last error ---- */

static __thread int tl_code;
static __thread char tl_msg[DD_CUDA_ERRMSG_BYTES];

static int map_error(cuerr e)
{
    switch (e) {
    case CU_ERR_MEMORY_ALLOCATION:
        return DD_ENOMEM;
    case CU_ERR_INVALID_VALUE:
    case CU_ERR_INVALID_DEVICE:
    case CU_ERR_INVALID_MEMCPY_DIRECTION:
        return DD_EINVAL;
    default:
        return DD_CUDA_ERROR;
    }
}

/* Record the failure of CUDA function `fn` for this thread; returns the DD_* code. */
static int fail(const dd_cuda_lib *lib, const char *fn, cuerr e)
{
    const char *name = lib->GetErrorName ? lib->GetErrorName(e) : NULL;
    const char *text = lib->GetErrorString ? lib->GetErrorString(e) : NULL;
    tl_code = e;
    snprintf(tl_msg, sizeof tl_msg, "%s: %s: %s", fn, name ? name : "cudaError",
             text ? text : "unknown error");
    /* Clear a non-sticky error so the next call does not report it again. */
    if (lib->GetLastError)
        lib->GetLastError();
    return map_error(e);
}

static void note(int code, const char *msg)
{
    tl_code = code;
    snprintf(tl_msg, sizeof tl_msg, "%s", msg);
}

/* Forget the last failure at the start of each public call, so a report never goes stale. */
static void reset_error(void)
{
    tl_code = 0;
    tl_msg[0] = '\0';
}

int dd_cuda_last_error(char *buf, size_t len)
{
    if (buf && len)
        snprintf(buf, len, "%s", tl_msg);
    return tl_code;
}

#define CK(lib, call, fn)                                                                    \
    do {                                                                                     \
        cuerr e_ = (call);                                                                   \
        if (e_ != CU_SUCCESS)                                                                \
            return fail((lib), (fn), e_);                                                    \
    } while (0)

static int use_device(const dd_cuda_lib *lib, int device)
{
    CK(lib, lib->SetDevice(device), "cudaSetDevice");
    return DD_OK;
}

/* ---- loading ---- */

static pthread_mutex_t g_libs_mu = PTHREAD_MUTEX_INITIALIZER;
static dd_cuda_lib *g_libs;

static const char *const DEFAULT_NAMES[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12",
                                            "libcudart.so.11.0"};

static void *sym(void *h, const char *name)
{
    return dlsym(h, name);
}

#define BIND(field, name) do { void *p_ = sym(h, name); memcpy(&lib->field, &p_, sizeof p_); } while (0)

/* Fill lib's table from handle h; returns the first missing required symbol, or NULL. */
static const char *bind_all(dd_cuda_lib *lib, void *h)
{
    BIND(GetDeviceCount, "cudaGetDeviceCount");
    BIND(SetDevice, "cudaSetDevice");
    BIND(Malloc, "cudaMalloc");
    BIND(Free, "cudaFree");
    BIND(HostAlloc, "cudaHostAlloc");
    BIND(MallocHost, "cudaMallocHost");
    BIND(FreeHost, "cudaFreeHost");
    BIND(HostRegister, "cudaHostRegister");
    BIND(HostUnregister, "cudaHostUnregister");
    BIND(Memcpy, "cudaMemcpy");
    BIND(MemcpyAsync, "cudaMemcpyAsync");
    BIND(MemsetAsync, "cudaMemsetAsync");
    BIND(StreamCreateWithFlags, "cudaStreamCreateWithFlags");
    BIND(StreamSynchronize, "cudaStreamSynchronize");
    BIND(StreamDestroy, "cudaStreamDestroy");
    BIND(EventCreateWithFlags, "cudaEventCreateWithFlags");
    BIND(EventRecord, "cudaEventRecord");
    BIND(EventSynchronize, "cudaEventSynchronize");
    BIND(EventDestroy, "cudaEventDestroy");
    BIND(GetErrorString, "cudaGetErrorString");
    BIND(GetErrorName, "cudaGetErrorName");
    BIND(GetLastError, "cudaGetLastError");
    BIND(IpcGetMemHandle, "cudaIpcGetMemHandle");
    BIND(IpcOpenMemHandle, "cudaIpcOpenMemHandle");
    BIND(IpcCloseMemHandle, "cudaIpcCloseMemHandle");
    BIND(PointerGetAttributes, "cudaPointerGetAttributes");
    BIND(RuntimeGetVersion, "cudaRuntimeGetVersion");
    BIND(LibraryLoadData, "cudaLibraryLoadData");
    BIND(LibraryGetKernel, "cudaLibraryGetKernel");
    BIND(LaunchKernel, "cudaLaunchKernel");

#define REQUIRE(field, name) if (!lib->field) return name
    REQUIRE(GetDeviceCount, "cudaGetDeviceCount");
    REQUIRE(SetDevice, "cudaSetDevice");
    REQUIRE(Malloc, "cudaMalloc");
    REQUIRE(Free, "cudaFree");
    if (!lib->HostAlloc && !lib->MallocHost)
        return "cudaHostAlloc";
    REQUIRE(FreeHost, "cudaFreeHost");
    REQUIRE(HostRegister, "cudaHostRegister");
    REQUIRE(HostUnregister, "cudaHostUnregister");
    REQUIRE(Memcpy, "cudaMemcpy");
    REQUIRE(MemcpyAsync, "cudaMemcpyAsync");
    REQUIRE(StreamCreateWithFlags, "cudaStreamCreateWithFlags");
    REQUIRE(StreamSynchronize, "cudaStreamSynchronize");
    REQUIRE(StreamDestroy, "cudaStreamDestroy");
    REQUIRE(EventCreateWithFlags, "cudaEventCreateWithFlags");
    REQUIRE(EventRecord, "cudaEventRecord");
    REQUIRE(EventSynchronize, "cudaEventSynchronize");
    REQUIRE(EventDestroy, "cudaEventDestroy");
    REQUIRE(GetErrorString, "cudaGetErrorString");
    REQUIRE(IpcGetMemHandle, "cudaIpcGetMemHandle");
    REQUIRE(IpcOpenMemHandle, "cudaIpcOpenMemHandle");
    REQUIRE(IpcCloseMemHandle, "cudaIpcCloseMemHandle");
#undef REQUIRE

    int v = 0;
    if (lib->RuntimeGetVersion && lib->RuntimeGetVersion(&v) != CU_SUCCESS)
        v = 0;
    lib->version = v;
    /* Only the prototypes this file knows: a wrong guess would corrupt the stack. */
    void *batch = sym(h, "cudaMemcpyBatchAsync");
    if (batch && v >= 12080 && v < 13000)
        memcpy(&lib->Batch12, &batch, sizeof batch);
    else if (batch && v >= 13000 && v < 14000)
        memcpy(&lib->Batch13, &batch, sizeof batch);
    lib->features = 0;
    if (lib->Batch12 || lib->Batch13)
        lib->features |= DD_CUDA_FEAT_BATCH;
    if (lib->LibraryLoadData && lib->LibraryGetKernel && lib->LaunchKernel && v >= 12000)
        lib->features |= DD_CUDA_FEAT_KERNELS;
    if (lib->MemsetAsync)
        lib->features |= DD_CUDA_FEAT_MEMSET;
    if (lib->PointerGetAttributes)
        lib->features |= DD_CUDA_FEAT_ATTRIBUTES;
    return NULL;
}
#undef BIND

/* Try one name; on failure append the reason to err. */
static dd_cuda_lib *try_load(const char *name, char *err, size_t errlen)
{
    size_t used = err ? strlen(err) : 0;
    void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        const char *why = dlerror();
        if (err && used < errlen)
            snprintf(err + used, errlen - used, "%s%s", used ? "; " : "", why ? why : name);
        return NULL;
    }
    for (dd_cuda_lib *l = g_libs; l; l = l->next) {
        if (l->handle == h) {
            dlclose(h); /* drop the extra reference; the library stays loaded */
            return l;
        }
    }
    dd_cuda_lib *lib = calloc(1, sizeof *lib);
    if (lib == NULL) {
        dlclose(h);
        if (err && used < errlen)
            snprintf(err + used, errlen - used, "%sout of memory", used ? "; " : "");
        return NULL;
    }
    const char *missing = bind_all(lib, h);
    if (missing) {
        if (err && used < errlen)
            snprintf(err + used, errlen - used, "%s%s: no symbol %s", used ? "; " : "", name,
                     missing);
        free(lib);
        dlclose(h);
        return NULL;
    }
    lib->handle = h;
    pthread_mutex_init(&lib->kmu, NULL);
    lib->next = g_libs;
    g_libs = lib;
    return lib;
}

int dd_cuda_load(const char *path, dd_cuda_lib **out, char *err, size_t errlen)
{
    reset_error();
    if (out == NULL)
        return DD_EINVAL;
    if (err && errlen)
        err[0] = '\0';
    dd_cuda_lib *lib = NULL;
    pthread_mutex_lock(&g_libs_mu);
    if (path && path[0]) {
        lib = try_load(path, err, errlen);
    } else {
        for (size_t i = 0; lib == NULL && i < sizeof DEFAULT_NAMES / sizeof *DEFAULT_NAMES; i++)
            lib = try_load(DEFAULT_NAMES[i], err, errlen);
    }
    pthread_mutex_unlock(&g_libs_mu);
    if (lib == NULL)
        return DD_CUDA_ENOLIB;
    *out = lib;
    return DD_OK;
}

unsigned dd_cuda_features(const dd_cuda_lib *lib) { return lib ? lib->features : 0; }

int dd_cuda_runtime_version(const dd_cuda_lib *lib) { return lib ? lib->version : 0; }

int dd_cuda_device_count(dd_cuda_lib *lib, int *count)
{
    reset_error();
    if (lib == NULL || count == NULL)
        return DD_EINVAL;
    int c = 0;
    cuerr e = lib->GetDeviceCount(&c);
    if (e != CU_SUCCESS) {
        /* No device, no driver, a stub library: all mean "none usable here". */
        fail(lib, "cudaGetDeviceCount", e);
        c = 0;
    }
    *count = c < 0 ? 0 : c;
    return DD_OK;
}

/* ---- memory ---- */

int dd_cuda_malloc(dd_cuda_lib *lib, int device, uint64_t nbytes, uint64_t *addr)
{
    reset_error();
    if (lib == NULL || addr == NULL || nbytes == 0 || nbytes > SIZE_MAX)
        return DD_EINVAL;
    int rc = use_device(lib, device);
    if (rc)
        return rc;
    void *p = NULL;
    CK(lib, lib->Malloc(&p, (size_t)nbytes), "cudaMalloc");
    *addr = (uint64_t)(uintptr_t)p;
    return DD_OK;
}

int dd_cuda_free(dd_cuda_lib *lib, int device, uint64_t addr)
{
    reset_error();
    if (lib == NULL || addr == 0)
        return DD_EINVAL;
    int rc = use_device(lib, device);
    if (rc)
        return rc;
    CK(lib, lib->Free((void *)(uintptr_t)addr), "cudaFree");
    return DD_OK;
}

static int host_alloc(dd_cuda_lib *lib, uint64_t nbytes, void **p)
{
    if (lib->HostAlloc) {
        CK(lib, lib->HostAlloc(p, (size_t)nbytes, CU_HOST_ALLOC_PORTABLE | CU_HOST_ALLOC_MAPPED),
           "cudaHostAlloc");
    } else {
        CK(lib, lib->MallocHost(p, (size_t)nbytes), "cudaMallocHost");
    }
    return DD_OK;
}

int dd_cuda_host_alloc(dd_cuda_lib *lib, int device, uint64_t nbytes, uint64_t *addr)
{
    reset_error();
    if (lib == NULL || addr == NULL || nbytes == 0 || nbytes > SIZE_MAX)
        return DD_EINVAL;
    int rc = use_device(lib, device);
    if (rc)
        return rc;
    void *p = NULL;
    rc = host_alloc(lib, nbytes, &p);
    if (rc)
        return rc;
    *addr = (uint64_t)(uintptr_t)p;
    return DD_OK;
}

int dd_cuda_host_free(dd_cuda_lib *lib, int device, uint64_t addr)
{
    reset_error();
    if (lib == NULL || addr == 0)
        return DD_EINVAL;
    int rc = use_device(lib, device);
    if (rc)
        return rc;
    CK(lib, lib->FreeHost((void *)(uintptr_t)addr), "cudaFreeHost");
    return DD_OK;
}

int dd_cuda_host_register(dd_cuda_lib *lib, int device, uint64_t addr, uint64_t nbytes)
{
    reset_error();
    if (lib == NULL || addr == 0 || nbytes == 0 || nbytes > SIZE_MAX || addr + nbytes < addr)
        return DD_EINVAL;
    int rc = use_device(lib, device);
    if (rc)
        return rc;
    CK(lib, lib->HostRegister((void *)(uintptr_t)addr, (size_t)nbytes, CU_HOST_REGISTER_PORTABLE),
       "cudaHostRegister");
    return DD_OK;
}

int dd_cuda_host_unregister(dd_cuda_lib *lib, int device, uint64_t addr)
{
    reset_error();
    if (lib == NULL || addr == 0)
        return DD_EINVAL;
    int rc = use_device(lib, device);
    if (rc)
        return rc;
    CK(lib, lib->HostUnregister((void *)(uintptr_t)addr), "cudaHostUnregister");
    return DD_OK;
}

int dd_cuda_pointer_types(dd_cuda_lib *lib, int device, const uint64_t *addrs, size_t n,
                          uint8_t *out)
{
    reset_error();
    if (lib == NULL || (n && (addrs == NULL || out == NULL)))
        return DD_EINVAL;
    if (lib->PointerGetAttributes == NULL) {
        note(0, "cudaPointerGetAttributes is missing from this CUDA runtime");
        return DD_CUDA_ENOSYS;
    }
    int rc = use_device(lib, device);
    if (rc)
        return rc;
    for (size_t i = 0; i < n; i++) {
        cu_pointer_attrs a;
        memset(&a, 0, sizeof a);
        cuerr e = lib->PointerGetAttributes(&a, (const void *)(uintptr_t)addrs[i]);
        if (e != CU_SUCCESS) {
            /* Runtimes before 11.0 answer "invalid value" for memory they do not know. */
            if (lib->GetLastError)
                lib->GetLastError();
            out[i] = 0;
            continue;
        }
        out[i] = a.type >= 0 && a.type <= 3 ? (uint8_t)a.type : 0;
    }
    return DD_OK;
}

/* ---- IPC ---- */

int dd_cuda_ipc_get(dd_cuda_lib *lib, int device, uint64_t addr, uint8_t *handle)
{
    reset_error();
    if (lib == NULL || addr == 0 || handle == NULL)
        return DD_EINVAL;
    int rc = use_device(lib, device);
    if (rc)
        return rc;
    cu_ipc_handle h;
    CK(lib, lib->IpcGetMemHandle(&h, (void *)(uintptr_t)addr), "cudaIpcGetMemHandle");
    memcpy(handle, h.reserved, sizeof h.reserved);
    return DD_OK;
}

int dd_cuda_ipc_open(dd_cuda_lib *lib, int device, const uint8_t *handle, uint64_t *addr)
{
    reset_error();
    if (lib == NULL || handle == NULL || addr == NULL)
        return DD_EINVAL;
    int rc = use_device(lib, device);
    if (rc)
        return rc;
    cu_ipc_handle h;
    memcpy(h.reserved, handle, sizeof h.reserved);
    void *p = NULL;
    CK(lib, lib->IpcOpenMemHandle(&p, h, CU_IPC_LAZY_PEER_ACCESS), "cudaIpcOpenMemHandle");
    *addr = (uint64_t)(uintptr_t)p;
    return DD_OK;
}

int dd_cuda_ipc_close(dd_cuda_lib *lib, int device, uint64_t addr)
{
    reset_error();
    if (lib == NULL || addr == 0)
        return DD_EINVAL;
    int rc = use_device(lib, device);
    if (rc)
        return rc;
    CK(lib, lib->IpcCloseMemHandle((void *)(uintptr_t)addr), "cudaIpcCloseMemHandle");
    return DD_OK;
}

/* ---- contexts and lanes ---- */

/* Rows longer than this are cut for the copy kernel, so one huge row still spreads over
 * many blocks (a block copies one row at a time). */
#define KERNEL_PIECE (256ull << 10)
#define KERNEL_THREADS 256u
#define KERNEL_MAX_BLOCKS 65535u
#define STAGE_ALIGN 4096ull

typedef struct lane {
    struct lane *next;
    custream stream;
    cuevent ev[DD_CUDA_STAGE_SLOTS_MAX];
    unsigned nev;
    uint64_t stage[DD_CUDA_STAGE_SLOTS_MAX]; /* pinned chunk buffers, allocated lazily */
    uint64_t *tab; /* merged device-side rows (3 words each) */
    size_t tabcap;
    uint64_t *htab; /* host-side rows of staged copies */
    size_t htabcap;
    void **bdst, **bsrc; /* argument arrays of cudaMemcpyBatchAsync */
    size_t *bsz;
    size_t bcap;
    uint64_t kops_host; /* pinned copy of the kernel's row table */
    uint64_t kops_dev;  /* device copy of it */
    size_t kcap;        /* rows both hold */
} lane_t;

struct dd_cuda_ctx {
    dd_cuda_lib *lib;
    int device;
    uint64_t chunk;
    unsigned slots;
    unsigned features;
    pthread_mutex_t mu;  /* lanes and features */
    pthread_mutex_t kmu; /* one kernel self-test at a time */
    lane_t *free;
    int kstate; /* copy kernel on this device: 0 untested, 1 passed, -1 unusable */
    char knote[DD_CUDA_ERRMSG_BYTES];
};

struct dd_cuda_stage {
    dd_cuda_ctx *ctx;
    lane_t *lane;
    int dir;
    const uint64_t *iov;
    size_t n;
    uint64_t total, chunk, nchunks;
    uint64_t given, issued;
    size_t irow;   /* device-side cursor of the next chunk to issue */
    uint64_t ioff;
    int pending;   /* H2D: a handed-out chunk waits for its DMA */
    int failed;
};

int dd_cuda_ctx_create(dd_cuda_lib *lib, int device, uint64_t stage_chunk, unsigned stage_slots,
                       dd_cuda_ctx **out)
{
    if (lib == NULL || out == NULL || device < 0 || stage_chunk == 0 ||
        stage_chunk > (1ull << 40) || stage_slots < 2 || stage_slots > DD_CUDA_STAGE_SLOTS_MAX)
        return DD_EINVAL;
    dd_cuda_ctx *ctx = calloc(1, sizeof *ctx);
    if (ctx == NULL)
        return DD_ENOMEM;
    ctx->lib = lib;
    ctx->device = device;
    ctx->chunk = (stage_chunk + STAGE_ALIGN - 1) & ~(STAGE_ALIGN - 1);
    ctx->slots = stage_slots;
    ctx->features = lib->features;
    pthread_mutex_init(&ctx->mu, NULL);
    pthread_mutex_init(&ctx->kmu, NULL);
    *out = ctx;
    return DD_OK;
}

static void lane_destroy(dd_cuda_ctx *ctx, lane_t *ln)
{
    const dd_cuda_lib *lib = ctx->lib;
    if (ln->stream) {
        lib->StreamSynchronize(ln->stream);
        lib->StreamDestroy(ln->stream);
    }
    for (unsigned i = 0; i < ln->nev; i++)
        lib->EventDestroy(ln->ev[i]);
    for (unsigned i = 0; i < DD_CUDA_STAGE_SLOTS_MAX; i++)
        if (ln->stage[i])
            lib->FreeHost((void *)(uintptr_t)ln->stage[i]);
    if (ln->kops_host)
        lib->FreeHost((void *)(uintptr_t)ln->kops_host);
    if (ln->kops_dev)
        lib->Free((void *)(uintptr_t)ln->kops_dev);
    if (lib->GetLastError)
        lib->GetLastError();
    free(ln->tab);
    free(ln->htab);
    free(ln->bdst);
    free(ln->bsrc);
    free(ln->bsz);
    free(ln);
}

void dd_cuda_ctx_destroy(dd_cuda_ctx *ctx)
{
    if (ctx == NULL)
        return;
    if (ctx->lib->SetDevice(ctx->device) == CU_SUCCESS) {
        while (ctx->free) {
            lane_t *ln = ctx->free;
            ctx->free = ln->next;
            lane_destroy(ctx, ln);
        }
    }
    pthread_mutex_destroy(&ctx->mu);
    pthread_mutex_destroy(&ctx->kmu);
    free(ctx);
}

int dd_cuda_ctx_set_feature(dd_cuda_ctx *ctx, unsigned feature, int enabled)
{
    if (ctx == NULL || (feature != DD_CUDA_FEAT_BATCH && feature != DD_CUDA_FEAT_KERNELS))
        return DD_EINVAL;
    pthread_mutex_lock(&ctx->mu);
    if (!enabled)
        ctx->features &= ~feature;
    else
        ctx->features |= feature & ctx->lib->features;
    pthread_mutex_unlock(&ctx->mu);
    return DD_OK;
}

unsigned dd_cuda_ctx_features(dd_cuda_ctx *ctx)
{
    pthread_mutex_lock(&ctx->mu);
    unsigned f = ctx->features;
    pthread_mutex_unlock(&ctx->mu);
    return f;
}

const char *dd_cuda_ctx_kernel_note(dd_cuda_ctx *ctx) { return ctx->knote; }

/* Check a lane out; the caller has selected the device. */
static int lane_get(dd_cuda_ctx *ctx, lane_t **out)
{
    pthread_mutex_lock(&ctx->mu);
    lane_t *ln = ctx->free;
    if (ln)
        ctx->free = ln->next;
    pthread_mutex_unlock(&ctx->mu);
    if (ln) {
        *out = ln;
        return DD_OK;
    }
    const dd_cuda_lib *lib = ctx->lib;
    ln = calloc(1, sizeof *ln);
    if (ln == NULL)
        return DD_ENOMEM;
    cuerr e = lib->StreamCreateWithFlags(&ln->stream, CU_STREAM_NON_BLOCKING);
    if (e != CU_SUCCESS) {
        ln->stream = NULL;
        int rc = fail(lib, "cudaStreamCreateWithFlags", e);
        lane_destroy(ctx, ln);
        return rc;
    }
    for (; ln->nev < ctx->slots; ln->nev++) {
        e = lib->EventCreateWithFlags(&ln->ev[ln->nev], CU_EVENT_DISABLE_TIMING);
        if (e != CU_SUCCESS) {
            int rc = fail(lib, "cudaEventCreateWithFlags", e);
            lane_destroy(ctx, ln);
            return rc;
        }
    }
    *out = ln;
    return DD_OK;
}

/* Give a lane back once its stream is idle; a lane whose stream failed is destroyed. */
static void lane_put(dd_cuda_ctx *ctx, lane_t *ln, int ok)
{
    if (!ok) {
        lane_destroy(ctx, ln);
        return;
    }
    pthread_mutex_lock(&ctx->mu);
    ln->next = ctx->free;
    ctx->free = ln;
    pthread_mutex_unlock(&ctx->mu);
}

static int grow(void **p, size_t *cap, size_t want, size_t elem)
{
    if (want <= *cap)
        return DD_OK;
    size_t n = *cap ? *cap : 64;
    while (n < want)
        n *= 2;
    void *q = realloc(*p, n * elem);
    if (q == NULL)
        return DD_ENOMEM;
    *p = q;
    *cap = n;
    return DD_OK;
}

static int grow_tab(uint64_t **tab, size_t *cap, size_t rows)
{
    void *p = *tab;
    size_t c = *cap;
    int rc = grow(&p, &c, rows, 3 * sizeof(uint64_t));
    *tab = p;
    *cap = c;
    return rc;
}

/* Check every row, then write the merged non-empty rows to ln->tab; *m receives how many. */
static int merge_rows(lane_t *ln, const uint64_t *ops, size_t n, size_t *m)
{
    for (size_t i = 0; i < n; i++) {
        const uint64_t *r = ops + 3 * i;
        if (r[2] == 0)
            continue;
        if (r[0] == 0 || r[1] == 0 || r[0] + r[2] < r[0] || r[1] + r[2] < r[1] || r[2] > SIZE_MAX)
            return DD_EINVAL;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const uint64_t *r = ops + 3 * i;
        if (r[2] == 0)
            continue;
        if (k && ln->tab[3 * (k - 1)] + ln->tab[3 * (k - 1) + 2] == r[0] &&
            ln->tab[3 * (k - 1) + 1] + ln->tab[3 * (k - 1) + 2] == r[1]) {
            ln->tab[3 * (k - 1) + 2] += r[2];
            continue;
        }
        if (grow_tab(&ln->tab, &ln->tabcap, k + 1))
            return DD_ENOMEM;
        ln->tab[3 * k] = r[0];
        ln->tab[3 * k + 1] = r[1];
        ln->tab[3 * k + 2] = r[2];
        k++;
    }
    *m = k;
    return DD_OK;
}

static int issue_loop(dd_cuda_ctx *ctx, lane_t *ln, const uint64_t *rows, size_t m, int kind)
{
    const dd_cuda_lib *lib = ctx->lib;
    for (size_t i = 0; i < m; i++) {
        const uint64_t *r = rows + 3 * i;
        CK(lib,
           lib->MemcpyAsync((void *)(uintptr_t)r[0], (const void *)(uintptr_t)r[1], (size_t)r[2],
                            kind, ln->stream),
           "cudaMemcpyAsync");
    }
    return DD_OK;
}

static int issue_batch(dd_cuda_ctx *ctx, lane_t *ln, const uint64_t *rows, size_t m)
{
    const dd_cuda_lib *lib = ctx->lib;
    if (m > ln->bcap) {
        size_t cap = ln->bcap ? ln->bcap : 64;
        while (cap < m)
            cap *= 2;
        void **d = realloc(ln->bdst, cap * sizeof *d);
        if (d)
            ln->bdst = d;
        void **s = realloc(ln->bsrc, cap * sizeof *s);
        if (s)
            ln->bsrc = s;
        size_t *z = realloc(ln->bsz, cap * sizeof *z);
        if (z)
            ln->bsz = z;
        if (d == NULL || s == NULL || z == NULL)
            return DD_ENOMEM;
        ln->bcap = cap;
    }
    for (size_t i = 0; i < m; i++) {
        ln->bdst[i] = (void *)(uintptr_t)rows[3 * i];
        ln->bsrc[i] = (void *)(uintptr_t)rows[3 * i + 1];
        ln->bsz[i] = (size_t)rows[3 * i + 2];
    }
    cu_memcpy_attrs attr;
    memset(&attr, 0, sizeof attr);
    attr.src_access_order = CU_SRC_ACCESS_ORDER_STREAM;
    size_t idx = 0, fail_idx = 0;
    cuerr e;
    if (lib->Batch13)
        e = lib->Batch13(ln->bdst, (const void *const *)ln->bsrc, ln->bsz, m, &attr, &idx, 1,
                         ln->stream);
    else
        e = lib->Batch12(ln->bdst, ln->bsrc, ln->bsz, m, &attr, &idx, 1, &fail_idx, ln->stream);
    if (e != CU_SUCCESS)
        return fail(lib, "cudaMemcpyBatchAsync", e);
    return DD_OK;
}

/* Issue m rows with the copy engines: one batch call when the runtime has it, else a loop.
 * A refused batch is retried as a loop (copies are idempotent: no destination overlaps a
 * source); if the loop succeeds, batching is switched off for this ctx. */
static int issue_engine(dd_cuda_ctx *ctx, lane_t *ln, const uint64_t *rows, size_t m, int kind,
                        int mode)
{
    if (m == 0)
        return DD_OK;
    unsigned features = dd_cuda_ctx_features(ctx);
    if (mode != DD_CUDA_MODE_LOOP && m > 1 && (features & DD_CUDA_FEAT_BATCH)) {
        int rc = issue_batch(ctx, ln, rows, m);
        if (rc == DD_OK || rc == DD_ENOMEM)
            return rc;
        char why[DD_CUDA_ERRMSG_BYTES];
        snprintf(why, sizeof why, "%s", tl_msg);
        rc = issue_loop(ctx, ln, rows, m, kind);
        if (rc == DD_OK) {
            dd_cuda_ctx_set_feature(ctx, DD_CUDA_FEAT_BATCH, 0);
            note(0, why); /* keep the reason batching was switched off */
        }
        return rc;
    }
    return issue_loop(ctx, ln, rows, m, kind);
}

/* ---- the copy kernel ---- */

static int kernel_load(dd_cuda_lib *lib)
{
    pthread_mutex_lock(&lib->kmu);
    if (lib->kstate == 0) {
        void *library = NULL, *kernel = NULL;
        cuerr e = lib->LibraryLoadData(&library, dd_cuda_kernels_ptx, NULL, NULL, 0, NULL, NULL, 0);
        if (e == CU_SUCCESS)
            e = lib->LibraryGetKernel(&kernel, library, "dd_copy_rows");
        if (e == CU_SUCCESS) {
            lib->kernel = kernel;
            lib->kstate = 1;
        } else {
            fail(lib, "cudaLibraryLoadData", e);
            snprintf(lib->knote, sizeof lib->knote, "%s", tl_msg);
            lib->kstate = -1;
        }
    }
    int ok = lib->kstate == 1;
    pthread_mutex_unlock(&lib->kmu);
    return ok;
}

/* Launch the kernel over m rows of ln->tab on ln's stream (cut into pieces first). */
static int launch_rows(dd_cuda_ctx *ctx, lane_t *ln, size_t m)
{
    dd_cuda_lib *lib = ctx->lib;
    size_t pieces = 0;
    for (size_t i = 0; i < m; i++)
        pieces += (size_t)((ln->tab[3 * i + 2] + KERNEL_PIECE - 1) / KERNEL_PIECE);
    if (pieces > ln->kcap) {
        size_t cap = ln->kcap ? ln->kcap : 256;
        while (cap < pieces)
            cap *= 2;
        if (ln->kops_host)
            lib->FreeHost((void *)(uintptr_t)ln->kops_host);
        if (ln->kops_dev)
            lib->Free((void *)(uintptr_t)ln->kops_dev);
        ln->kops_host = ln->kops_dev = 0;
        ln->kcap = 0;
        void *h = NULL, *d = NULL;
        int rc = host_alloc(lib, cap * 3 * sizeof(uint64_t), &h);
        if (rc)
            return rc;
        ln->kops_host = (uint64_t)(uintptr_t)h;
        CK(lib, lib->Malloc(&d, cap * 3 * sizeof(uint64_t)), "cudaMalloc");
        ln->kops_dev = (uint64_t)(uintptr_t)d;
        ln->kcap = cap;
    }
    uint64_t *t = (uint64_t *)(uintptr_t)ln->kops_host;
    size_t k = 0;
    for (size_t i = 0; i < m; i++) {
        uint64_t d = ln->tab[3 * i], s = ln->tab[3 * i + 1], len = ln->tab[3 * i + 2];
        for (uint64_t off = 0; off < len; off += KERNEL_PIECE, k++) {
            t[3 * k] = d + off;
            t[3 * k + 1] = s + off;
            t[3 * k + 2] = len - off < KERNEL_PIECE ? len - off : KERNEL_PIECE;
        }
    }
    CK(lib,
       lib->MemcpyAsync((void *)(uintptr_t)ln->kops_dev, t, k * 3 * sizeof(uint64_t), DD_CUDA_H2D,
                        ln->stream),
       "cudaMemcpyAsync");
    uint64_t dev_ops = ln->kops_dev, nrows = k;
    void *args[2] = {&dev_ops, &nrows};
    cu_dim3 grid = {k < KERNEL_MAX_BLOCKS ? (unsigned)k : KERNEL_MAX_BLOCKS, 1, 1};
    cu_dim3 block = {KERNEL_THREADS, 1, 1};
    CK(lib, lib->LaunchKernel(lib->kernel, grid, block, args, 0, ln->stream), "cudaLaunchKernel");
    return DD_OK;
}

/* Copy a known pattern through the kernel on this device once and compare, so a kernel the
 * driver mis-JITs (or a PTX mistake) degrades to the copy engines instead of corrupting
 * caches. Called with ctx->mu NOT held. */
#define SELFTEST_BYTES 8192u

static int kernel_selftest(dd_cuda_ctx *ctx, lane_t *ln)
{
    dd_cuda_lib *lib = ctx->lib;
    unsigned char *pat = malloc(SELFTEST_BYTES), *got = malloc(SELFTEST_BYTES);
    unsigned char *want = malloc(SELFTEST_BYTES);
    void *buf = NULL;
    int rc = DD_ENOMEM;
    if (pat == NULL || got == NULL || want == NULL)
        goto out;
    for (unsigned i = 0; i < SELFTEST_BYTES; i++)
        pat[i] = (unsigned char)(i * 131u + 7u);
    cuerr e = lib->Malloc(&buf, 2 * SELFTEST_BYTES);
    if (e != CU_SUCCESS) {
        rc = fail(lib, "cudaMalloc", e);
        buf = NULL;
        goto out;
    }
    uint64_t src = (uint64_t)(uintptr_t)buf, dst = src + SELFTEST_BYTES;
    e = lib->Memcpy(buf, pat, SELFTEST_BYTES, DD_CUDA_H2D);
    if (e == CU_SUCCESS)
        e = lib->Memcpy((void *)(uintptr_t)dst, pat, SELFTEST_BYTES, DD_CUDA_H2D);
    if (e != CU_SUCCESS) {
        rc = fail(lib, "cudaMemcpy", e);
        goto out;
    }
    /* 16-byte words, bytes (odd offsets), 4-byte words. */
    static const uint64_t rows[3][3] = {{0, 0, 4096}, {4096 + 3, 4096 + 5, 1001},
                                        {6144 + 4, 6144 + 8, 1024}};
    if (grow_tab(&ln->tab, &ln->tabcap, 3)) {
        rc = DD_ENOMEM;
        goto out;
    }
    memcpy(want, pat, SELFTEST_BYTES);
    for (int r = 0; r < 3; r++) {
        ln->tab[3 * r] = dst + rows[r][0];
        ln->tab[3 * r + 1] = src + rows[r][1];
        ln->tab[3 * r + 2] = rows[r][2];
        memcpy(want + rows[r][0], pat + rows[r][1], rows[r][2]);
    }
    rc = launch_rows(ctx, ln, 3);
    if (rc == DD_OK) {
        e = lib->StreamSynchronize(ln->stream);
        if (e == CU_SUCCESS)
            e = lib->Memcpy(got, (void *)(uintptr_t)dst, SELFTEST_BYTES, DD_CUDA_D2H);
        if (e != CU_SUCCESS)
            rc = fail(lib, "cudaStreamSynchronize", e);
        else if (memcmp(got, want, SELFTEST_BYTES) != 0) {
            note(0, "copy kernel self-test produced wrong bytes");
            rc = DD_CUDA_ERROR;
        }
    }
out:
    if (buf)
        lib->Free(buf);
    free(pat);
    free(got);
    free(want);
    return rc;
}

/* 1 when the copy kernel may be used on ctx's device (tested once per ctx). */
static int kernel_ready(dd_cuda_ctx *ctx, lane_t *ln)
{
    if (!(dd_cuda_ctx_features(ctx) & DD_CUDA_FEAT_KERNELS))
        return 0;
    pthread_mutex_lock(&ctx->kmu);
    if (ctx->kstate == 0) {
        if (!kernel_load(ctx->lib)) {
            ctx->kstate = -1;
            snprintf(ctx->knote, sizeof ctx->knote, "%s", ctx->lib->knote);
        } else if (kernel_selftest(ctx, ln) != DD_OK) {
            ctx->kstate = -1;
            snprintf(ctx->knote, sizeof ctx->knote, "%s", tl_msg);
        } else {
            ctx->kstate = 1;
        }
    }
    int ok = ctx->kstate == 1;
    pthread_mutex_unlock(&ctx->kmu);
    return ok;
}

/* ---- copies ---- */

/* A host-device batch goes to the kernel (which reads or writes mapped pinned host memory over
 * the bus itself, in one launch) from this many merged rows; fewer, longer rows go to the copy
 * engines, one DMA each, which the kernel does not beat. */
#define KERNEL_HOST_ROWS 16

static int sync_lane(dd_cuda_ctx *ctx, lane_t *ln)
{
    CK(ctx->lib, ctx->lib->StreamSynchronize(ln->stream), "cudaStreamSynchronize");
    return DD_OK;
}

int dd_cuda_copy(dd_cuda_ctx *ctx, const uint64_t *ops, size_t n, int kind, int mode)
{
    reset_error();
    if (ctx == NULL || (n && ops == NULL) || kind < DD_CUDA_H2H || kind > DD_CUDA_DEFAULT ||
        mode < DD_CUDA_MODE_ENGINE || mode > DD_CUDA_MODE_KERNEL)
        return DD_EINVAL;
    if (n == 0)
        return DD_OK;
    int rc = use_device(ctx->lib, ctx->device);
    if (rc)
        return rc;
    lane_t *ln;
    if ((rc = lane_get(ctx, &ln)))
        return rc;
    /* First, as its one-time self-test uses the lane's tables too (so a host batch is judged
     * by its row count before merging, and again after). */
    int kernel = mode == DD_CUDA_MODE_KERNEL &&
                 (kind == DD_CUDA_D2D ||
                  ((kind == DD_CUDA_H2D || kind == DD_CUDA_D2H) && n >= KERNEL_HOST_ROWS)) &&
                 kernel_ready(ctx, ln);
    size_t m = 0;
    rc = merge_rows(ln, ops, n, &m);
    if (rc) {
        lane_put(ctx, ln, 1);
        return rc;
    }
    if (kind != DD_CUDA_D2D && m < KERNEL_HOST_ROWS) /* rows merged into few long ones */
        kernel = 0;
    if (kernel && m > 0)
        rc = launch_rows(ctx, ln, m);
    else
        rc = issue_engine(ctx, ln, ln->tab, m, kind, mode);
    int src = sync_lane(ctx, ln);
    if (rc == DD_OK)
        rc = src;
    lane_put(ctx, ln, src == DD_OK);
    return rc;
}

int dd_cuda_memset(dd_cuda_ctx *ctx, uint64_t addr, int value, uint64_t nbytes)
{
    reset_error();
    if (ctx == NULL || (nbytes && addr == 0) || nbytes > SIZE_MAX)
        return DD_EINVAL;
    if (nbytes == 0)
        return DD_OK;
    const dd_cuda_lib *lib = ctx->lib;
    if (lib->MemsetAsync == NULL) {
        note(0, "cudaMemsetAsync is missing from this CUDA runtime");
        return DD_CUDA_ENOSYS;
    }
    int rc = use_device(lib, ctx->device);
    if (rc)
        return rc;
    lane_t *ln;
    if ((rc = lane_get(ctx, &ln)))
        return rc;
    cuerr e = lib->MemsetAsync((void *)(uintptr_t)addr, value, (size_t)nbytes, ln->stream);
    rc = e == CU_SUCCESS ? DD_OK : fail(lib, "cudaMemsetAsync", e);
    int src = sync_lane(ctx, ln);
    if (rc == DD_OK)
        rc = src;
    lane_put(ctx, ln, src == DD_OK);
    return rc;
}

/* ---- staging rings ---- */

static int stage_buffers(dd_cuda_ctx *ctx, lane_t *ln)
{
    for (unsigned i = 0; i < ctx->slots; i++) {
        if (ln->stage[i])
            continue;
        void *p = NULL;
        int rc = host_alloc(ctx->lib, ctx->chunk, &p);
        if (rc)
            return rc;
        ln->stage[i] = (uint64_t)(uintptr_t)p;
    }
    return DD_OK;
}

static uint64_t chunk_bytes(const dd_cuda_stage *st, uint64_t c)
{
    uint64_t start = c * st->chunk;
    return st->total - start < st->chunk ? st->total - start : st->chunk;
}

static int stage_close(dd_cuda_stage *st, int commit);

/* Issue the DMA of the next chunk (st->issued) between its slot and the device rows. */
static int stage_issue(dd_cuda_stage *st)
{
    dd_cuda_ctx *ctx = st->ctx;
    lane_t *ln = st->lane;
    uint64_t c = st->issued;
    unsigned s = (unsigned)(c % ctx->slots);
    uint64_t want = chunk_bytes(st, c), off = 0;
    size_t k = 0;
    while (off < want) {
        const uint64_t *r = st->iov + 2 * st->irow;
        uint64_t take = r[1] - st->ioff;
        if (take > want - off)
            take = want - off;
        if (take) {
            uint64_t dev = r[0] + st->ioff, host = ln->stage[s] + off;
            if (grow_tab(&ln->tab, &ln->tabcap, k + 1))
                return DD_ENOMEM;
            ln->tab[3 * k] = st->dir == DD_CUDA_D2H ? host : dev;
            ln->tab[3 * k + 1] = st->dir == DD_CUDA_D2H ? dev : host;
            ln->tab[3 * k + 2] = take;
            k++;
        }
        off += take;
        st->ioff += take;
        if (st->ioff == r[1]) {
            st->irow++;
            st->ioff = 0;
        }
    }
    int rc = issue_engine(ctx, ln, ln->tab, k, st->dir, DD_CUDA_MODE_ENGINE);
    if (rc)
        return rc;
    CK(ctx->lib, ctx->lib->EventRecord(ln->ev[s], ln->stream), "cudaEventRecord");
    st->issued++;
    return DD_OK;
}

static int stage_open(dd_cuda_ctx *ctx, int dir, const uint64_t *iov, size_t n,
               dd_cuda_stage **out)
{
    if (ctx == NULL || out == NULL || (n && iov == NULL) ||
        (dir != DD_CUDA_H2D && dir != DD_CUDA_D2H))
        return DD_EINVAL;
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t a = iov[2 * i], len = iov[2 * i + 1];
        if (len && (a == 0 || a + len < a || total + len < total))
            return DD_EINVAL;
        total += len;
    }
    int rc = use_device(ctx->lib, ctx->device);
    if (rc)
        return rc;
    dd_cuda_stage *st = calloc(1, sizeof *st);
    if (st == NULL)
        return DD_ENOMEM;
    st->ctx = ctx;
    st->dir = dir;
    st->iov = iov;
    st->n = n;
    st->total = total;
    st->chunk = ctx->chunk;
    st->nchunks = (total + ctx->chunk - 1) / ctx->chunk;
    if ((rc = lane_get(ctx, &st->lane))) {
        free(st);
        return rc;
    }
    if (total)
        rc = stage_buffers(ctx, st->lane);
    /* Reads start at once: the first `slots` chunks are in flight before anyone asks. */
    while (rc == DD_OK && dir == DD_CUDA_D2H && st->issued < st->nchunks &&
           st->issued < ctx->slots)
        rc = stage_issue(st);
    if (rc) {
        st->failed = 1;
        stage_close(st, 0);
        return rc;
    }
    *out = st;
    return DD_OK;
}

static int stage_next(dd_cuda_stage *st, uint64_t *addr, uint64_t *len)
{
    if (st == NULL || addr == NULL || len == NULL)
        return DD_EINVAL;
    if (st->failed)
        return DD_CUDA_ERROR;
    dd_cuda_ctx *ctx = st->ctx;
    const dd_cuda_lib *lib = ctx->lib;
    int rc = use_device(lib, ctx->device);
    if (rc == DD_OK && st->dir == DD_CUDA_D2H) {
        /* The caller is done with the chunk handed out last: refill its slot. */
        if (st->given > 0 && st->issued < st->nchunks)
            rc = stage_issue(st);
    } else if (rc == DD_OK && st->pending) {
        /* The caller filled the chunk handed out last: send it on its way. */
        st->pending = 0;
        rc = stage_issue(st);
    }
    if (rc) {
        st->failed = 1;
        return rc;
    }
    if (st->given == st->nchunks) {
        *addr = 0;
        *len = 0;
        return DD_OK;
    }
    unsigned s = (unsigned)(st->given % ctx->slots);
    /* D2H: wait for this chunk's bytes; H2D: wait until the slot's previous DMA read it. */
    if (st->dir == DD_CUDA_D2H || st->given >= ctx->slots) {
        cuerr e = lib->EventSynchronize(st->lane->ev[s]);
        if (e != CU_SUCCESS) {
            st->failed = 1;
            return fail(lib, "cudaEventSynchronize", e);
        }
    }
    *addr = st->lane->stage[s];
    *len = chunk_bytes(st, st->given);
    st->given++;
    st->pending = st->dir == DD_CUDA_H2D;
    return DD_OK;
}

static int stage_close(dd_cuda_stage *st, int commit)
{
    if (st == NULL)
        return DD_EINVAL;
    dd_cuda_ctx *ctx = st->ctx;
    int rc = use_device(ctx->lib, ctx->device);
    if (rc == DD_OK && st->pending && commit && !st->failed)
        rc = stage_issue(st);
    int src = sync_lane(ctx, st->lane);
    if (rc == DD_OK)
        rc = src;
    if (rc == DD_OK && st->failed)
        rc = DD_CUDA_ERROR;
    lane_put(ctx, st->lane, src == DD_OK);
    free(st);
    return rc;
}

/* Host side of a staged copy: walk the host rows alongside the chunks. */
typedef struct {
    const uint64_t *rows; /* compacted (dst, src, len) rows */
    int host_col;         /* 1: host is the source (H2D), 0: the destination (D2H) */
    size_t row;
    uint64_t off;
} host_cursor;

/* Copy the chunk [addr, addr + len) of pinned memory to or from the host rows. */
static int host_chunk(lane_t *ln, host_cursor *hc, uint64_t addr, uint64_t len)
{
    size_t k = 0;
    uint64_t done = 0;
    while (done < len) {
        const uint64_t *r = hc->rows + 3 * hc->row;
        uint64_t take = r[2] - hc->off;
        if (take > len - done)
            take = len - done;
        uint64_t host = r[hc->host_col] + hc->off, pinned = addr + done;
        if (grow_tab(&ln->htab, &ln->htabcap, k + 1))
            return DD_ENOMEM;
        ln->htab[3 * k] = hc->host_col ? pinned : host;
        ln->htab[3 * k + 1] = hc->host_col ? host : pinned;
        ln->htab[3 * k + 2] = take;
        k++;
        done += take;
        hc->off += take;
        if (hc->off == r[2]) {
            hc->row++;
            hc->off = 0;
        }
    }
    return dd_copy_batch(ln->htab, k, 0);
}

int dd_cuda_copy_staged(dd_cuda_ctx *ctx, const uint64_t *ops, size_t n, int kind)
{
    reset_error();
    if (ctx == NULL || (n && ops == NULL) || (kind != DD_CUDA_H2D && kind != DD_CUDA_D2H))
        return DD_EINVAL;
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        const uint64_t *r = ops + 3 * i;
        if (r[2] == 0)
            continue;
        if (r[0] == 0 || r[1] == 0 || r[0] + r[2] < r[0] || r[1] + r[2] < r[1] || r[2] > SIZE_MAX)
            return DD_EINVAL;
        m++;
    }
    if (m == 0)
        return DD_OK;
    uint64_t *rows = malloc(m * 3 * sizeof(uint64_t)), *iov = malloc(m * 2 * sizeof(uint64_t));
    if (rows == NULL || iov == NULL) {
        free(rows);
        free(iov);
        return DD_ENOMEM;
    }
    int dev_col = kind == DD_CUDA_H2D ? 0 : 1;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const uint64_t *r = ops + 3 * i;
        if (r[2] == 0)
            continue;
        memcpy(rows + 3 * k, r, 3 * sizeof(uint64_t));
        iov[2 * k] = r[dev_col];
        iov[2 * k + 1] = r[2];
        k++;
    }
    dd_cuda_stage *st = NULL;
    int rc = stage_open(ctx, kind, iov, m, &st);
    if (rc == DD_OK) {
        host_cursor hc = {rows, kind == DD_CUDA_H2D, 0, 0};
        for (;;) {
            uint64_t addr = 0, len = 0;
            rc = stage_next(st, &addr, &len);
            if (rc || len == 0)
                break;
            rc = host_chunk(st->lane, &hc, addr, len);
            if (rc)
                break;
        }
        int crc = stage_close(st, rc == DD_OK);
        if (rc == DD_OK)
            rc = crc;
    }
    free(rows);
    free(iov);
    return rc;
}

int dd_cuda_stage_open(dd_cuda_ctx *ctx, int dir, const uint64_t *iov, size_t n,
                       dd_cuda_stage **out)
{
    reset_error();
    return stage_open(ctx, dir, iov, n, out);
}

int dd_cuda_stage_next(dd_cuda_stage *st, uint64_t *addr, uint64_t *len)
{
    reset_error();
    return stage_next(st, addr, len);
}

int dd_cuda_stage_close(dd_cuda_stage *st, int commit)
{
    reset_error();
    return stage_close(st, commit);
}
