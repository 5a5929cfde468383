/* acl_rt.h: the Ascend runtime of the native layer: libascendcl (ACL) and libhccl, reached
 * through dlopen so that one build serves machines with and without CANN.
 *
 * build_ffi.py feeds the region between the cdef markers to cffi. That region holds the
 * dd_acl_* / dd_hccl_* surface Python calls, with the conventions of datadist.h: 0 (DD_OK)
 * or a negative code, addresses as uint64_t, nothing calls back into Python (every call may
 * run with the GIL released).
 *
 * Below the cdef region are the ACL and HCCL types and prototypes that acl_rt.c and hccl.c
 * resolve with dlsym. They are written from the public CANN documentation (AscendCL API
 * reference for acl_base.h / acl_rt.h, HCCL API reference for hccl.h / hccl_types.h); no
 * CANN header is needed to build.
 */
#ifndef AIO_DATADIST_ACL_RT_H
#define AIO_DATADIST_ACL_RT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* cdef-begin */

enum {
    DD_ACL_ENOLIB = -20,      /* the library could not be loaded or lacks a required symbol */
    DD_ACL_ENODEV = -21,      /* ACL reports no device (ACL_ERROR_RT_NO_DEVICE) */
    DD_ACL_EFAIL = -22,       /* an ACL call failed: dd_acl_last_error() says which and why */
    DD_ACL_EFINALIZED = -23,  /* dd_acl_finalize() ran: ACL cannot be used again here */
    DD_ACL_EBUSY = -24        /* refused while runtimes are open (library switch, finalize) */
};

/* Copy directions; the values are those of aclrtMemcpyKind. */
enum {
    DD_ACL_HOST_TO_HOST = 0,
    DD_ACL_HOST_TO_DEVICE = 1,
    DD_ACL_DEVICE_TO_HOST = 2,
    DD_ACL_DEVICE_TO_DEVICE = 3
};

enum {
    DD_ACL_MSG_MAX = 512,            /* bytes of dd_acl_last_error()'s message, NUL included */
    DD_ACL_ASYNC_ALIGN = 64,         /* aclrtMemcpyAsync needs both addresses aligned to this */
    DD_HCCL_ROOT_INFO_BYTES = 4108   /* sizeof(HcclRootInfo) */
};

typedef struct dd_acl_rt dd_acl_rt;

/* ---- acl_rt.c: one device of libascendcl ----
 *
 * dd_acl_load resolves the function table from path (NULL: "libascendcl.so"); loading the
 * loaded path again is a no-op, another path replaces the table only while no runtime is
 * open (DD_ACL_EBUSY otherwise). On DD_ACL_ENOLIB, err (cap bytes) receives the reason.
 *
 * aclInit runs once per process, on the first dd_acl_init (ACL_ERROR_REPEAT_INITIALIZE, an
 * application that initialised ACL itself, counts as success). ACL stays initialised for
 * the process lifetime: the CANN documentation allows one aclInit per process, so
 * aclFinalize runs only when the application asks for it through dd_acl_finalize.
 *
 * A dd_acl_rt holds one device (aclrtSetDevice at open, aclrtResetDevice at release), its
 * default context, which every call binds to the calling thread first (so worker threads
 * may call), and one stream created on the first asynchronous copy. dd_acl_close destroys
 * the stream; the device is reset at once when no allocation of the runtime is live, else
 * when the last one is freed, so arenas outliving the engine are still freed validly.
 * dd_acl_destroy frees the object once the device was reset; it never calls ACL.
 *
 * When an ACL call fails, the returned code classifies it (DD_EINVAL for ACL parameter and
 * device-id errors, DD_ENOMEM for allocation failures, DD_ACL_ENODEV, else DD_ACL_EFAIL)
 * and dd_acl_last_error gives the ACL code and message (from aclGetRecentErrMsg when the
 * library has it) of the calling thread's last failure; every call clears it first. */
int dd_acl_load(const char *path, char *err, size_t cap);
int dd_acl_init(void);
int dd_acl_device_count(uint32_t *count);
int dd_acl_open(int32_t device_id, dd_acl_rt **out);
int dd_acl_close(dd_acl_rt *rt);
void dd_acl_destroy(dd_acl_rt *rt);
/* Device memory (aclrtMalloc, ACL_MEM_MALLOC_HUGE_FIRST) and page-locked host memory
 * (aclrtMallocHost); nbytes > 0. Freeing an address the runtime did not hand out is
 * DD_EINVAL and calls nothing. Allocations and copies after dd_acl_close are DD_ECLOSED. */
int dd_acl_malloc(dd_acl_rt *rt, uint64_t nbytes, uint64_t *addr);
int dd_acl_free(dd_acl_rt *rt, uint64_t addr);
int dd_acl_malloc_host(dd_acl_rt *rt, uint64_t nbytes, uint64_t *addr);
int dd_acl_free_host(dd_acl_rt *rt, uint64_t addr);
/* ops holds n rows of (dst, src, nbytes) in direction kind (DD_ACL_*); rows that continue
 * each other on both sides are merged, zero-length rows skipped, and every row is checked
 * (non-null, no wrap) before anything moves. HOST_TO_HOST is a plain memcpy (dd_copy_batch).
 * Otherwise a row goes to aclrtMemcpyAsync on the runtime's stream when both addresses are
 * DD_ACL_ASYNC_ALIGN-aligned and its host side (if any) lies in page-locked memory of this
 * runtime, else to the synchronous aclrtMemcpy; then the stream is synchronised, also after
 * a failure, so no copy is in flight on return. Batches of one runtime are serialised.
 * *async_rows (may be NULL) receives how many rows went to the stream. */
int dd_acl_copy_batch(dd_acl_rt *rt, const uint64_t *ops, size_t n, int kind,
                      uint64_t *async_rows);
/* aclrtSynchronizeStream on the runtime's stream, when it has one. */
int dd_acl_synchronize(dd_acl_rt *rt);
/* Set nbytes of device memory at addr to the byte value with aclrtMemset (synchronous;
 * serialised with the runtime's batches). DD_ACL_ENOLIB when the loaded library has no
 * aclrtMemset (it is optional here), DD_EINVAL for a null addr, a wrapping range or a value
 * outside 0..255, DD_ECLOSED after dd_acl_close. */
int dd_acl_memset(dd_acl_rt *rt, uint64_t addr, int32_t value, uint64_t nbytes);
/* The calling thread's last ACL failure: code 0 and "" when the last call did not fail. */
int dd_acl_last_error(int32_t *code, char *msg, size_t cap);
/* aclFinalize, when this process initialised ACL and no runtime is open; afterwards every
 * dd_acl_init / dd_acl_open is DD_ACL_EFINALIZED. */
int dd_acl_finalize(void);

/* ---- hccl.c: presence and communicator set-up of libhccl ----
 *
 * dd_hccl_load resolves HcclGetRootInfo, HcclCommInitRootInfo and HcclCommDestroy (required)
 * and HcclCommInitClusterInfo (optional) from path (NULL: "libhccl.so"), with the same
 * reload rule as dd_acl_load minus the open-runtime check. Communicators travel as
 * uint64_t. A failed HCCL call returns DD_EINVAL for HCCL_E_PARA / HCCL_E_PTR, DD_ENOMEM for
 * HCCL_E_MEMORY, else DD_ACL_EFAIL, with its HcclResult in dd_hccl_last_error. */
int dd_hccl_load(const char *path, char *err, size_t cap);
int dd_hccl_has_cluster_info(void);
int dd_hccl_get_root_info(uint8_t *root_info);
int dd_hccl_comm_init_root_info(uint32_t n_ranks, const uint8_t *root_info, uint32_t rank,
                                uint64_t *comm);
int dd_hccl_comm_init_cluster_info(const char *rank_table_path, uint32_t rank, uint64_t *comm);
int dd_hccl_comm_destroy(uint64_t comm);
int32_t dd_hccl_last_error(void);

/* One-sided transfers in a communicator (HcclRegisterGlobalMem, HcclCommBindMem,
 * HcclCommPrepare, HcclBatchPut / HcclBatchGet and their inverses), resolved when present:
 * dd_hccl_has_one_sided says whether all of them are. dd_hccl_bind_mem registers
 * [addr, addr + nbytes) (device memory when on_device, else host) and binds it to comm,
 * giving the registration's handle; dd_hccl_unbind_mem undoes both. dd_hccl_batch moves n
 * rows of (local address, remote address, bytes) between this rank and remote_rank on rt's
 * stream and waits for them: a get reads the remote rows into the local ones, a put writes
 * the local rows to the remote ones. */
int dd_hccl_has_one_sided(void);
int dd_hccl_bind_mem(uint64_t comm, int on_device, uint64_t addr, uint64_t nbytes,
                     uint64_t *handle);
int dd_hccl_unbind_mem(uint64_t comm, uint64_t handle);
int dd_hccl_prepare(uint64_t comm, int32_t timeout_s);
int dd_hccl_batch(dd_acl_rt *rt, uint64_t comm, uint32_t remote_rank, const uint64_t *rows,
                  size_t n, int get);

/* cdef-end */

/* ---- ACL types and prototypes (acl_base.h / acl_rt.h), resolved with dlsym ---- */

typedef int aclError;
typedef void *aclrtStream;
typedef void *aclrtContext;

typedef enum aclrtMemcpyKind {
    ACL_MEMCPY_HOST_TO_HOST = 0,
    ACL_MEMCPY_HOST_TO_DEVICE = 1,
    ACL_MEMCPY_DEVICE_TO_HOST = 2,
    ACL_MEMCPY_DEVICE_TO_DEVICE = 3,
    ACL_MEMCPY_DEFAULT = 4
} aclrtMemcpyKind;

typedef enum aclrtMemMallocPolicy {
    ACL_MEM_MALLOC_HUGE_FIRST = 0,
    ACL_MEM_MALLOC_HUGE_ONLY = 1,
    ACL_MEM_MALLOC_NORMAL_ONLY = 2,
    ACL_MEM_MALLOC_HUGE_FIRST_P2P = 3,
    ACL_MEM_MALLOC_HUGE_ONLY_P2P = 4,
    ACL_MEM_MALLOC_NORMAL_ONLY_P2P = 5
} aclrtMemMallocPolicy;

/* Return codes used here (aclError table of the AscendCL reference; rt_error_codes.h). */
enum {
    DD_ACL_SUCCESS = 0,
    DD_ACL_ERROR_INVALID_PARAM = 100000,
    DD_ACL_ERROR_UNINITIALIZE = 100001,
    DD_ACL_ERROR_REPEAT_INITIALIZE = 100002,
    DD_ACL_ERROR_BAD_ALLOC = 200000,
    DD_ACL_ERROR_INVALID_DEVICE = 200002,
    DD_ACL_ERROR_RT_PARAM_INVALID = 107000,
    DD_ACL_ERROR_RT_INVALID_DEVICEID = 107001,
    DD_ACL_ERROR_RT_MEMORY_ALLOCATION = 207001,
    DD_ACL_ERROR_RT_NO_DEVICE = 207004
};

typedef aclError (*dd_aclInit_fn)(const char *configPath);
typedef aclError (*dd_aclFinalize_fn)(void);
typedef const char *(*dd_aclGetRecentErrMsg_fn)(void);
typedef aclError (*dd_aclrtSetDevice_fn)(int32_t deviceId);
typedef aclError (*dd_aclrtResetDevice_fn)(int32_t deviceId);
typedef aclError (*dd_aclrtGetDeviceCount_fn)(uint32_t *count);
typedef aclError (*dd_aclrtGetCurrentContext_fn)(aclrtContext *context);
typedef aclError (*dd_aclrtSetCurrentContext_fn)(aclrtContext context);
typedef aclError (*dd_aclrtMalloc_fn)(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
typedef aclError (*dd_aclrtFree_fn)(void *devPtr);
typedef aclError (*dd_aclrtMallocHost_fn)(void **hostPtr, size_t size);
typedef aclError (*dd_aclrtFreeHost_fn)(void *hostPtr);
typedef aclError (*dd_aclrtMemcpy_fn)(void *dst, size_t destMax, const void *src, size_t count,
                                      aclrtMemcpyKind kind);
typedef aclError (*dd_aclrtMemcpyAsync_fn)(void *dst, size_t destMax, const void *src,
                                           size_t count, aclrtMemcpyKind kind,
                                           aclrtStream stream);
typedef aclError (*dd_aclrtCreateStream_fn)(aclrtStream *stream);
typedef aclError (*dd_aclrtDestroyStream_fn)(aclrtStream stream);
typedef aclError (*dd_aclrtSynchronizeStream_fn)(aclrtStream stream);
typedef aclError (*dd_aclrtMemset_fn)(void *devPtr, size_t maxCount, int32_t value,
                                      size_t count);

/* ---- HCCL types and prototypes (hccl.h / hccl_types.h), resolved with dlsym ---- */

typedef void *HcclComm;

typedef enum {
    HCCL_SUCCESS = 0,
    HCCL_E_PARA = 1,
    HCCL_E_PTR = 2,
    HCCL_E_MEMORY = 3
    /* further codes (HCCL_E_INTERNAL = 4 ... HCCL_E_REMOTE = 21) are passed through */
} HcclResult;

typedef struct HcclRootInfoDef {
    char internal[DD_HCCL_ROOT_INFO_BYTES];
} HcclRootInfo;

typedef HcclResult (*dd_HcclGetRootInfo_fn)(HcclRootInfo *rootInfo);
typedef HcclResult (*dd_HcclCommInitRootInfo_fn)(uint32_t nRanks, const HcclRootInfo *rootInfo,
                                                 uint32_t rank, HcclComm *comm);
typedef HcclResult (*dd_HcclCommInitClusterInfo_fn)(const char *clusterInfo, uint32_t rank,
                                                    HcclComm *comm);
typedef HcclResult (*dd_HcclCommDestroy_fn)(HcclComm comm);

/* One-sided memory and transfers (hccl_mem.h / hccl_one_sided.h). */
enum { HCCL_MEM_TYPE_DEVICE = 0, HCCL_MEM_TYPE_HOST = 1 };
enum { HCCL_DATA_TYPE_INT8 = 0 };
enum { HCCL_TOPO_FULLMESH = 0 };

typedef struct {
    int32_t type;
    void *addr;
    uint64_t size;
} CommMem;

typedef struct {
    void *localAddr;
    void *remoteAddr;
    uint64_t count;
    int32_t dataType;
} HcclOneSideOpDesc;

typedef struct {
    int32_t topoType;
    uint64_t rsvd0, rsvd1, rsvd2;
} HcclPrepareConfig;

typedef HcclResult (*dd_HcclRegisterGlobalMem_fn)(CommMem *mem, void **memHandle);
typedef HcclResult (*dd_HcclDeregisterGlobalMem_fn)(void *memHandle);
typedef HcclResult (*dd_HcclCommBindMem_fn)(HcclComm comm, void *memHandle);
typedef HcclResult (*dd_HcclCommUnbindMem_fn)(HcclComm comm, void *memHandle);
typedef HcclResult (*dd_HcclCommPrepare_fn)(HcclComm comm, HcclPrepareConfig *config,
                                            int32_t timeout);
typedef HcclResult (*dd_HcclBatchOp_fn)(HcclComm comm, uint32_t remoteRank,
                                        HcclOneSideOpDesc *desc, uint32_t descNum,
                                        aclrtStream stream);

/* Internal to the native layer: run issue(stream, arg) on rt's stream with its context
 * current, under its batch lock, then wait for the stream (also after a failed issue). */
int dd_acl_on_stream(dd_acl_rt *rt, int (*issue)(aclrtStream stream, void *arg), void *arg);

#ifdef __cplusplus
}
#endif

#endif /* AIO_DATADIST_ACL_RT_H */
