/* cuda_abi.h: the slice of the CUDA runtime ABI that cuda_rt.c calls, written from the CUDA
 * runtime API documentation so the build needs no CUDA headers. Handles are opaque pointers,
 * cudaError_t is an int. tests/test_runtime_cuda.py compiles these against the real headers
 * where they are installed, to keep the layouts and constants honest. */
#ifndef AIO_DATADIST_CUDA_ABI_H
#define AIO_DATADIST_CUDA_ABI_H

#include <stddef.h>

#define CU_IPC_HANDLE_BYTES 64

typedef int cuerr;
typedef void *custream;
typedef void *cuevent;
typedef struct { unsigned x, y, z; } cu_dim3;
typedef struct { char reserved[CU_IPC_HANDLE_BYTES]; } cu_ipc_handle;
typedef struct { int type; int id; } cu_mem_location;
typedef struct {
    int src_access_order; /* enum cudaMemcpySrcAccessOrder */
    cu_mem_location src_hint;
    cu_mem_location dst_hint;
    unsigned flags;
} cu_memcpy_attrs;
/* struct cudaPointerAttributes (CUDA >= 11): type, device, devicePointer, hostPointer. The
 * tail leaves room should a runtime write more. */
typedef struct {
    int type;
    int device;
    void *device_pointer;
    void *host_pointer;
    char tail[64];
} cu_pointer_attrs;

enum {
    CU_SUCCESS = 0,
    CU_ERR_INVALID_VALUE = 1,
    CU_ERR_MEMORY_ALLOCATION = 2,
    CU_ERR_INVALID_MEMCPY_DIRECTION = 21,
    CU_ERR_INVALID_DEVICE = 101,
    CU_STREAM_NON_BLOCKING = 1,
    CU_EVENT_DISABLE_TIMING = 2,
    CU_HOST_ALLOC_PORTABLE = 1,
    CU_HOST_ALLOC_MAPPED = 2,
    CU_HOST_REGISTER_PORTABLE = 1,
    CU_IPC_LAZY_PEER_ACCESS = 1,
    CU_SRC_ACCESS_ORDER_STREAM = 1
};

/* Batched copies: CUDA 12.8 and 12.9 take a failIdx before the stream; 13.x does not. */
typedef cuerr (*fn_batch12)(void **, void **, size_t *, size_t, cu_memcpy_attrs *, size_t *,
                            size_t, size_t *, custream);
typedef cuerr (*fn_batch13)(void *const *, const void *const *, const size_t *, size_t,
                            cu_memcpy_attrs *, size_t *, size_t, custream);

#endif /* AIO_DATADIST_CUDA_ABI_H */
