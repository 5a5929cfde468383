"""cffi ABI-mode binding of the part of UCX's UCP API the UCX route needs.

Nothing here is compiled: the declarations below are read by cffi at import and the library
is opened with ``ffi.dlopen`` on first use, so the package builds and imports on machines with
no UCX (and no UCX headers). :func:`load` returns the opened library or raises
:class:`UcxLoadError`; :func:`load_error` says why UCX is not available without raising.

Where libucp comes from, in order:

1. ``AIO_DATADIST_UCX``: a path to a ``libucp.so`` (a system or custom UCX). When it is set
   and cannot be opened, UCX is unavailable; the wheel is not tried behind the user's back.
2. The ``libucx`` wheel (``pip install 'aio_datadist[ucx]'``, package ``libucx-cu12``): its
   ``load_library()`` opens ``libucs``/``libuct``/``libucp`` from the wheel first, so that
   ``libucp``'s dependencies resolve to the wheel's copies, then its ``libucp.so`` is opened.

The declarations copy the UCP 1.22 headers (``ucp/api/ucp.h``, ``ucp_def.h``,
``ucp_compat.h``, ``ucs/type/status.h``) field for field; every struct bound here is a
``field_mask`` struct, so a caller sets only the fields it flags. Layouts have been stable
across the 1.1x series (fields are only appended), and ``tests/test_ucx_binding.py`` compares
every ``sizeof``/``offsetof`` with a C program compiled against the installed headers when a
compiler and the headers are present.

Two things in the headers are not plain declarations and are reproduced by hand:

* ``ucs_status_t`` is a *packed* enum (``__attribute__((packed))``): one signed byte, not an
  ``int``. It is declared as ``int8_t``.
* ``UCS_PTR_IS_ERR``/``UCS_PTR_IS_PTR``/``UCS_PTR_STATUS`` are macros over the pointer value
  returned by the ``*_nbx`` calls: :func:`ptr_status` implements them.
* ``ucp_init`` is a static inline wrapper around ``ucp_init_version(UCP_API_MAJOR,
  UCP_API_MINOR, ...)``; :data:`API_MAJOR`/:data:`API_MINOR` are the headers' values.

A batch of RMA requests is started, checked and progressed by the compiled native layer
(``ucx_batch.c``, one call each), which is not linked against UCX: :func:`call_addresses`
hands it the loaded functions' addresses. The single-request calls (check one, free one)
are bound a second time, by :func:`load_words`, with every pointer declared ``uintptr_t``,
so that handles travel as Python ints with no cdata made per request. On the LP64 ABIs this
package builds for (x86-64, AArch64) a pointer and a ``uintptr_t`` travel alike, which is
also what the native layer's prototypes rely on.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any

import cffi

__all__ = (
    "API_MAJOR",
    "API_MINOR",
    "call_addresses",
    "ENV_VAR",
    "UcxLoadError",
    "ffi",
    "ffi_words",
    "libc",
    "load",
    "load_error",
    "load_words",
    "loaded_path",
    "ptr_status",
    "status_name",
    "word",
    "word_status",
)

ENV_VAR = "AIO_DATADIST_UCX"
"""Environment variable naming the ``libucp.so`` to use instead of the wheel's."""

API_MAJOR = 1
API_MINOR = 17
"""The UCP API version passed to ``ucp_init_version``: the oldest release whose struct layouts
and calls this binding uses (1.17); a newer libucp accepts it."""

_CDEF = r"""
typedef int8_t ucs_status_t;              /* packed enum: one signed byte */
typedef void *ucs_status_ptr_t;
typedef uint64_t ucp_datatype_t;
typedef int ucs_thread_mode_t;
typedef int ucs_memory_type_t;
typedef int ucp_err_handling_mode_t;
typedef int ucs_config_print_flags_t;

typedef struct ucp_context *ucp_context_h;
typedef struct ucp_config ucp_config_t;
typedef struct ucp_worker *ucp_worker_h;
typedef struct ucp_address ucp_address_t;
typedef struct ucp_ep *ucp_ep_h;
typedef struct ucp_mem *ucp_mem_h;
typedef struct ucp_rkey_handle *ucp_rkey_h;
typedef struct ucp_conn_request *ucp_conn_request_h;
typedef struct _IO_FILE FILE;
struct sockaddr;
typedef unsigned int socklen_t;

typedef void (*ucp_request_init_callback_t)(void *request);
typedef void (*ucp_request_cleanup_callback_t)(void *request);
typedef void (*ucp_send_nbx_callback_t)(void *request, ucs_status_t status, void *user_data);
typedef void (*ucp_err_handler_cb_t)(void *arg, ucp_ep_h ep, ucs_status_t status);

typedef struct ucp_err_handler {
    ucp_err_handler_cb_t cb;
    void *arg;
} ucp_err_handler_t;

typedef struct ucs_sock_addr {
    const struct sockaddr *addr;
    socklen_t addrlen;
} ucs_sock_addr_t;

typedef struct {
    unsigned long ucs_bits[16];           /* UCS_CPU_SETSIZE / (8 * sizeof(unsigned long)) */
} ucs_cpu_set_t;

typedef struct ucp_params {
    uint64_t field_mask;
    uint64_t features;
    size_t request_size;
    ucp_request_init_callback_t request_init;
    ucp_request_cleanup_callback_t request_cleanup;
    uint64_t tag_sender_mask;
    int mt_workers_shared;
    size_t estimated_num_eps;
    size_t estimated_num_ppn;
    const char *name;
    size_t node_local_id;
} ucp_params_t;

typedef struct ucp_context_attr {
    uint64_t field_mask;
    size_t request_size;
    ucs_thread_mode_t thread_mode;
    uint64_t memory_types;
    char name[32];                        /* UCP_ENTITY_NAME_MAX */
    size_t device_counter_size;
} ucp_context_attr_t;

typedef struct ucp_worker_params {
    uint64_t field_mask;
    ucs_thread_mode_t thread_mode;
    ucs_cpu_set_t cpu_mask;
    unsigned events;
    void *user_data;
    int event_fd;
    uint64_t flags;
    const char *name;
    size_t am_alignment;
    uint64_t client_id;
} ucp_worker_params_t;

typedef struct ucp_worker_attr {
    uint64_t field_mask;
    ucs_thread_mode_t thread_mode;
    uint32_t address_flags;
    ucp_address_t *address;
    size_t address_length;
    size_t max_am_header;
    char name[32];                        /* UCP_ENTITY_NAME_MAX */
    size_t max_debug_string;
} ucp_worker_attr_t;

typedef struct ucp_ep_params {
    uint64_t field_mask;
    const ucp_address_t *address;
    ucp_err_handling_mode_t err_mode;
    ucp_err_handler_t err_handler;
    void *user_data;
    unsigned flags;
    ucs_sock_addr_t sockaddr;
    ucp_conn_request_h conn_request;
    const char *name;
    ucs_sock_addr_t local_sockaddr;
} ucp_ep_params_t;

typedef struct ucp_mem_map_params {
    uint64_t field_mask;
    void *address;
    size_t length;
    unsigned flags;
    unsigned prot;
    ucs_memory_type_t memory_type;
    const void *exported_memh_buffer;
} ucp_mem_map_params_t;

typedef struct {
    uint32_t op_attr_mask;
    uint32_t flags;
    void *request;
    union {
        ucp_send_nbx_callback_t send;
        void *recv;                       /* the receive callbacks: function pointers too */
        void *recv_stream;
        void *recv_am;
    } cb;
    ucp_datatype_t datatype;
    void *user_data;
    void *reply_buffer;
    ucs_memory_type_t memory_type;
    union {
        size_t *length;
        void *tag_info;
    } recv_info;
    ucp_mem_h memh;
    ucp_datatype_t remote_datatype;
    const void *remote;
    size_t remote_count;
} ucp_request_param_t;

const char *ucs_status_string(ucs_status_t status);

void ucp_get_version(unsigned *major_version, unsigned *minor_version, unsigned *release_number);
const char *ucp_get_version_string(void);
ucs_status_t ucp_config_read(const char *env_prefix, const char *filename,
                             ucp_config_t **config_p);
void ucp_config_release(ucp_config_t *config);
ucs_status_t ucp_config_modify(ucp_config_t *config, const char *name, const char *value);
void ucp_config_print(const ucp_config_t *config, FILE *stream, const char *title,
                      ucs_config_print_flags_t print_flags);

ucs_status_t ucp_init_version(unsigned api_major_version, unsigned api_minor_version,
                              const ucp_params_t *params, const ucp_config_t *config,
                              ucp_context_h *context_p);
void ucp_cleanup(ucp_context_h context_p);
ucs_status_t ucp_context_query(ucp_context_h context_p, ucp_context_attr_t *attr);
void ucp_context_print_info(const ucp_context_h context, FILE *stream);

ucs_status_t ucp_worker_create(ucp_context_h context, const ucp_worker_params_t *params,
                               ucp_worker_h *worker_p);
void ucp_worker_destroy(ucp_worker_h worker);
ucs_status_t ucp_worker_query(ucp_worker_h worker, ucp_worker_attr_t *attr);
void ucp_worker_print_info(ucp_worker_h worker, FILE *stream);
ucs_status_t ucp_worker_get_address(ucp_worker_h worker, ucp_address_t **address_p,
                                    size_t *address_length_p);
void ucp_worker_release_address(ucp_worker_h worker, ucp_address_t *address);
unsigned ucp_worker_progress(ucp_worker_h worker);
ucs_status_t ucp_worker_get_efd(ucp_worker_h worker, int *fd);
ucs_status_t ucp_worker_arm(ucp_worker_h worker);
ucs_status_t ucp_worker_signal(ucp_worker_h worker);
ucs_status_ptr_t ucp_worker_flush_nbx(ucp_worker_h worker, const ucp_request_param_t *param);

ucs_status_t ucp_ep_create(ucp_worker_h worker, const ucp_ep_params_t *params, ucp_ep_h *ep_p);
ucs_status_ptr_t ucp_ep_close_nbx(ucp_ep_h ep, const ucp_request_param_t *param);
ucs_status_ptr_t ucp_ep_flush_nbx(ucp_ep_h ep, const ucp_request_param_t *param);
void ucp_ep_print_info(ucp_ep_h ep, FILE *stream);

ucs_status_t ucp_mem_map(ucp_context_h context, const ucp_mem_map_params_t *params,
                         ucp_mem_h *memh_p);
ucs_status_t ucp_mem_unmap(ucp_context_h context, ucp_mem_h memh);
ucs_status_t ucp_rkey_pack(ucp_context_h context, ucp_mem_h memh, void **rkey_buffer_p,
                           size_t *size_p);
void ucp_rkey_buffer_release(void *rkey_buffer);
ucs_status_t ucp_ep_rkey_unpack(ucp_ep_h ep, const void *rkey_buffer, ucp_rkey_h *rkey_p);
void ucp_rkey_destroy(ucp_rkey_h rkey);

ucs_status_ptr_t ucp_put_nbx(ucp_ep_h ep, const void *buffer, size_t count,
                             uint64_t remote_addr, ucp_rkey_h rkey,
                             const ucp_request_param_t *param);
ucs_status_ptr_t ucp_get_nbx(ucp_ep_h ep, void *buffer, size_t count, uint64_t remote_addr,
                             ucp_rkey_h rkey, const ucp_request_param_t *param);
ucs_status_t ucp_request_check_status(void *request);
void ucp_request_cancel(ucp_worker_h worker, void *request);
void ucp_request_free(void *request);
"""

_LIBC_CDEF = r"""
FILE *open_memstream(char **ptr, size_t *sizeloc);
int fclose(FILE *stream);
void free(void *ptr);
"""

_WORDS_CDEF = r"""
int8_t ucp_request_check_status(uintptr_t request);
void ucp_request_free(uintptr_t request);
"""

ffi = cffi.FFI()
ffi.cdef(_CDEF)
ffi.cdef(_LIBC_CDEF)
#: The single-request calls again, every pointer a ``uintptr_t`` (see the module docstring).
ffi_words = cffi.FFI()
ffi_words.cdef(_WORDS_CDEF)

# ucs_status_t values (ucs/type/status.h).
UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_LAST = -100

STATUS_NAMES: dict[int, str] = {
    0: "UCS_OK",
    1: "UCS_INPROGRESS",
    -1: "UCS_ERR_NO_MESSAGE",
    -2: "UCS_ERR_NO_RESOURCE",
    -3: "UCS_ERR_IO_ERROR",
    -4: "UCS_ERR_NO_MEMORY",
    -5: "UCS_ERR_INVALID_PARAM",
    -6: "UCS_ERR_UNREACHABLE",
    -7: "UCS_ERR_INVALID_ADDR",
    -8: "UCS_ERR_NOT_IMPLEMENTED",
    -9: "UCS_ERR_MESSAGE_TRUNCATED",
    -10: "UCS_ERR_NO_PROGRESS",
    -11: "UCS_ERR_BUFFER_TOO_SMALL",
    -12: "UCS_ERR_NO_ELEM",
    -13: "UCS_ERR_SOME_CONNECTS_FAILED",
    -14: "UCS_ERR_NO_DEVICE",
    -15: "UCS_ERR_BUSY",
    -16: "UCS_ERR_CANCELED",
    -17: "UCS_ERR_SHMEM_SEGMENT",
    -18: "UCS_ERR_ALREADY_EXISTS",
    -19: "UCS_ERR_OUT_OF_RANGE",
    -20: "UCS_ERR_TIMED_OUT",
    -21: "UCS_ERR_EXCEEDS_LIMIT",
    -22: "UCS_ERR_UNSUPPORTED",
    -23: "UCS_ERR_REJECTED",
    -24: "UCS_ERR_NOT_CONNECTED",
    -25: "UCS_ERR_CONNECTION_RESET",
    -80: "UCS_ERR_ENDPOINT_TIMEOUT",
}
UCS_ERR_FIRST_LINK_FAILURE = -40
UCS_ERR_LAST_LINK_FAILURE = -59
UCS_ERR_FIRST_ENDPOINT_FAILURE = -60
UCS_ERR_LAST_ENDPOINT_FAILURE = -89

# ucp_params_t field mask and features.
UCP_PARAM_FIELD_FEATURES = 1 << 0
UCP_PARAM_FIELD_MT_WORKERS_SHARED = 1 << 5
UCP_PARAM_FIELD_NAME = 1 << 8
UCP_FEATURE_RMA = 1 << 1
UCP_FEATURE_WAKEUP = 1 << 4
# ucp_context_attr_t field mask.
UCP_ATTR_FIELD_REQUEST_SIZE = 1 << 0
UCP_ATTR_FIELD_THREAD_MODE = 1 << 1
UCP_ATTR_FIELD_MEMORY_TYPES = 1 << 2
# ucs_thread_mode_t.
UCS_THREAD_MODE_SINGLE = 0
UCS_THREAD_MODE_SERIALIZED = 1
UCS_THREAD_MODE_MULTI = 2
# ucp_worker_params_t field mask and wakeup events.
UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1 << 0
UCP_WORKER_PARAM_FIELD_EVENTS = 1 << 2
UCP_WORKER_PARAM_FIELD_NAME = 1 << 6
UCP_WAKEUP_RMA = 1 << 0
UCP_WAKEUP_TX = 1 << 10
UCP_WAKEUP_RX = 1 << 11
# ucp_worker_attr_t field mask.
UCP_WORKER_ATTR_FIELD_THREAD_MODE = 1 << 0
# ucp_ep_params_t field mask and error handling modes.
UCP_EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0
UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1
UCP_EP_PARAM_FIELD_ERR_HANDLER = 1 << 2
UCP_EP_PARAM_FIELD_NAME = 1 << 7
UCP_ERR_HANDLING_MODE_NONE = 0
UCP_ERR_HANDLING_MODE_PEER = 1
UCP_EP_CLOSE_FLAG_FORCE = 1 << 0
# ucp_mem_map_params_t field mask, flags and protection.
UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1 << 0
UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1 << 1
UCP_MEM_MAP_PARAM_FIELD_FLAGS = 1 << 2
UCP_MEM_MAP_PARAM_FIELD_PROT = 1 << 3
UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE = 1 << 4
UCP_MEM_MAP_PROT_LOCAL_READ = 1 << 0
UCP_MEM_MAP_PROT_LOCAL_WRITE = 1 << 1
UCP_MEM_MAP_PROT_REMOTE_READ = 1 << 8
UCP_MEM_MAP_PROT_REMOTE_WRITE = 1 << 9
UCS_MEMORY_TYPE_HOST = 0
UCS_MEMORY_TYPE_CUDA = 1
# ucp_request_param_t op_attr_mask.
UCP_OP_ATTR_FIELD_CALLBACK = 1 << 1
UCP_OP_ATTR_FIELD_USER_DATA = 1 << 2
UCP_OP_ATTR_FIELD_FLAGS = 1 << 4
UCP_OP_ATTR_FIELD_MEMORY_TYPE = 1 << 6
# ucs_config_print_flags_t.
UCS_CONFIG_PRINT_CONFIG = 1 << 0


class UcxLoadError(OSError):
    """libucp could not be loaded; the message says where it was looked for and why it failed."""


_ERR_WORDS = UCS_ERR_LAST & 0xFFFFFFFFFFFFFFFF


def ptr_status(ptr: Any) -> int:
    """``UCS_PTR_STATUS`` of a ``ucs_status_ptr_t``: ``UCS_OK`` for NULL (done at once), the
    error for an error pointer, ``UCS_INPROGRESS`` for a request pointer."""
    return word_status(int(ffi.cast("uintptr_t", ptr)))


def word_status(value: int) -> int:
    """:func:`ptr_status` of a ``ucs_status_ptr_t`` given as an int."""
    if value == 0:
        return UCS_OK
    if value >= _ERR_WORDS:  # UCS_PTR_IS_ERR
        return value - (1 << 64)
    return UCS_INPROGRESS  # UCS_PTR_IS_PTR


def word(cdata: Any) -> int:
    """The address of a pointer cdata, as an int for :data:`ffi_words` calls."""
    return int(ffi.cast("uintptr_t", cdata))


def status_name(status: int) -> str:
    """The enum name of a ``ucs_status_t`` (``UCS_ERR_<n>`` for codes the table lacks)."""
    name = STATUS_NAMES.get(status)
    if name is not None:
        return name
    if UCS_ERR_LAST_LINK_FAILURE <= status <= UCS_ERR_FIRST_LINK_FAILURE:
        return f"UCS_ERR_LINK_FAILURE({status})"
    if UCS_ERR_LAST_ENDPOINT_FAILURE <= status <= UCS_ERR_FIRST_ENDPOINT_FAILURE:
        return f"UCS_ERR_ENDPOINT_FAILURE({status})"
    return f"UCS_ERR({status})"


_lock = threading.Lock()
_lib: Any = None
_words: Any = None
_path: str | None = None
_error: str | None = None
_wheel_handles: list[Any] = []  # the wheel's ctypes handles: keep its libraries loaded
libc: Any = ffi.dlopen(None)
"""The C library (``open_memstream``/``fclose``/``free``, used to capture UCX's reports)."""


def _wheel_path() -> str:
    try:
        import libucx  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise UcxLoadError(
            f"UCX not found: {ENV_VAR} is not set and the libucx wheel is not installed "
            f"(pip install 'aio_datadist[ucx]'): {exc}"
        ) from None
    try:
        _wheel_handles.extend(h for h in libucx.load_library() if h is not None)
    except OSError as exc:
        raise UcxLoadError(f"the libucx wheel's libraries failed to load: {exc}") from None
    path = os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so")
    if not os.path.isfile(path):
        raise UcxLoadError(f"the libucx wheel has no {path}")
    return path


def _open() -> tuple[Any, str]:
    env = os.environ.get(ENV_VAR)
    if env:
        path = env
        where = f"{ENV_VAR}={env!r}"
    else:
        path = _wheel_path()
        where = f"the libucx wheel ({path})"
    try:
        lib = ffi.dlopen(path)
    except OSError as exc:
        raise UcxLoadError(f"{where}: cannot open libucp: {exc}") from None
    try:
        lib.ucp_init_version  # noqa: B018 - resolve a symbol: is this libucp at all?
        lib.ucp_get_nbx  # noqa: B018
    except AttributeError as exc:
        raise UcxLoadError(f"{where}: not a usable libucp (needs UCX >= 1.10): {exc}") from None
    major, minor, release = (ffi.new("unsigned *") for _ in range(3))
    lib.ucp_get_version(major, minor, release)
    if (major[0], minor[0]) < (API_MAJOR, API_MINOR):
        raise UcxLoadError(
            f"{where}: UCX {major[0]}.{minor[0]}.{release[0]} is older than the "
            f"{API_MAJOR}.{API_MINOR} this binding needs"
        )
    return lib, path


def load() -> Any:
    """Return the opened libucp (``ffi.dlopen`` handle), loading it on the first call.

    Raises:
        UcxLoadError: UCX is not available; the message says why. The outcome is cached:
            later calls raise the same error without looking again.
    """
    global _lib, _path, _error
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib, _path = _open()
            except UcxLoadError as exc:
                _error = str(exc)
        if _lib is None:
            raise UcxLoadError(_error)
        return _lib


def load_words() -> Any:
    """The loaded libucp's hot calls with every pointer an int (:data:`ffi_words`).

    Raises:
        UcxLoadError: as :func:`load`.
    """
    global _words
    load()
    with _lock:
        if _words is None:
            assert _path is not None
            _words = ffi_words.dlopen(_path)  # the library loaded already: the same one
        return _words


def call_addresses(names: Iterable[str]) -> dict[str, int]:
    """The addresses, as ints, of the loaded libucp's functions ``names`` (for the native
    layer's request batches, which call UCX through them).

    Raises:
        UcxLoadError: as :func:`load`.
        AttributeError: the library has no such function.
    """
    lib = load()
    return {name: int(ffi.cast("uintptr_t", ffi.addressof(lib, name))) for name in names}


def load_error() -> str | None:
    """``None`` when UCX loads, else the reason it does not (never raises)."""
    try:
        load()
    except UcxLoadError as exc:
        return str(exc)
    return None


def loaded_path() -> str | None:
    """The path of the loaded libucp, or ``None`` when it is not loaded."""
    return _path


def _reset_for_tests() -> None:
    """Forget the cached outcome, so that a test can load again under another environment."""
    global _lib, _words, _path, _error
    with _lock:
        _lib = _words = _path = _error = None
