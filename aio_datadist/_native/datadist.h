/* datadist.h: every C symbol of the aio_datadist native layer that Python may call.
 *
 * build_ffi.py feeds the region between the cdef markers to cffi's cdef, so that region
 * holds plain declarations only: no preprocessor lines, no macros.
 *
 * Conventions: functions return 0 (DD_OK) or one of the negative DD_E* codes; addresses
 * travel as uint64_t so the same calls describe host or device memory; nothing here
 * calls back into Python, so every call may run with the GIL released.
 */
#ifndef AIO_DATADIST_H
#define AIO_DATADIST_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* cdef-begin */

enum {
    DD_OK = 0,
    DD_ENOMEM = -1,   /* no room: pool full, mmap failed, bookkeeping could not grow */
    DD_EHANDLE = -2,  /* unknown, stale or already freed pool handle */
    DD_EINVAL = -3,   /* argument out of range */
    DD_ECLOSED = -4,  /* pool used after dd_pool_close */
    DD_ESYS = -5,     /* a system call failed (errno says why) */
    DD_ETIMEDOUT = -6,   /* the deadline passed before the transfer finished */
    DD_ECLOSED_PEER = -7, /* the peer closed the connection: EOF, ECONNRESET or EPIPE */
    DD_EAGAIN = -8        /* not finished yet: ask again later */
};

enum {
    DD_PAGE_SHIFT_MIN = 10,   /* smallest pool page: 1 KiB */
    DD_PAGE_SHIFT_MAX = 30,   /* largest pool page: 1 GiB */
    DD_COPY_MAX_THREADS = 64  /* most threads (caller included) one batch may use */
};

/* ---- pool.c: page allocator over an arena it never touches ---- */

typedef struct dd_pool dd_pool;

typedef struct {
    uint64_t capacity;      /* bytes managed */
    uint64_t used;          /* bytes allocated, page-rounded */
    uint64_t free;          /* capacity - used */
    uint64_t largest_free;  /* biggest contiguous allocatable run, bytes */
    uint64_t allocations;   /* live allocations */
    uint64_t page_size;     /* bytes */
} dd_pool_stats;

/* Manage [base, base + size); size is rounded down to whole pages of 1 << page_shift. */
int dd_pool_create(uint64_t base, uint64_t size, unsigned page_shift, dd_pool **out);
/* Free the bookkeeping; later calls on the pool return DD_ECLOSED. Idempotent. */
int dd_pool_close(dd_pool *pool);
/* Close if needed, then free the pool object itself; pool must not be used again. */
void dd_pool_destroy(dd_pool *pool);
/* Allocate nbytes rounded up to pages; *addr is page aligned relative to base. */
int dd_pool_alloc(dd_pool *pool, uint64_t nbytes, uint64_t *addr, uint64_t *handle);
int dd_pool_free(dd_pool *pool, uint64_t handle);
int dd_pool_get_stats(dd_pool *pool, dd_pool_stats *out);

/* ---- copy.c: memcpy, single and batched ---- */

/* Copy nbytes from src to dst; the ranges must not overlap. */
int dd_copy(uint64_t dst, uint64_t src, uint64_t nbytes);
/* Set nbytes of host memory at addr to the byte value (memset); DD_EINVAL for a null addr
 * with nbytes > 0, a range that wraps, or a value outside 0..255. */
int dd_fill(uint64_t addr, int value, uint64_t nbytes);
/* ops holds n rows of (dst, src, nbytes). Rows may not overlap one another's destinations
 * nor any source. nthreads == 0 means dd_copy_get_threads(). */
int dd_copy_batch(const uint64_t *ops, size_t n, unsigned nthreads);
/* Default thread count for dd_copy_batch; 1 disables splitting. */
int dd_copy_set_threads(unsigned nthreads);
unsigned dd_copy_get_threads(void);
/* Batches moving fewer bytes than this run on the calling thread only. */
uint64_t dd_copy_split_threshold(void);
/* dd_copy_batch across processes: the rows' src addresses (write == 0) or dst addresses
 * (write == 1) are in process pid's address space, moved with process_vm_readv /
 * process_vm_writev, up to IOV_MAX merged ranges a call. Returns DD_OK, DD_EINVAL (bad
 * arguments or rows; nothing moved), or DD_ESYS with *err_no the first errno met: EPERM or
 * EACCES (the kernel refuses access to pid), ESRCH (no such process), EFAULT (an address
 * is not mapped on one side); bytes before the failure may have moved. pid 0: both sides
 * are in this process (the peer's memory mapped here, dd_host_map_peer), moved with memcpy,
 * which cannot report an unmapped address: the caller has checked every row. */
int dd_vm_copy_batch(int pid, int write, const uint64_t *ops, size_t n, unsigned nthreads,
                     int *err_no);
/* The one bounds check of a blocks access, which every path that serves or moves one
 * applies: seg bytes (last bytes at each tensor's last block) at each of blocks[0, nblocks)
 * of tensors [start, start + count) of a blocks cache whose ntensors tensors start at bases,
 * each num_blocks blocks of block_bytes. Returns DD_OK, DD_EINVAL (a null pointer), or the
 * first refusal met, checked in this order: */
enum {
    DD_BLOCKS_ETENSORS = 1, /* count is 0, or the tensors run past the cache's */
    DD_BLOCKS_ESEG = 2,     /* seg is 0, or seg or last is over a block */
    DD_BLOCKS_EBLOCK = 3,   /* a block is not below num_blocks: *bad receives the first */
    DD_BLOCKS_EADDR = 4     /* a tensor's base is 0, or its blocks wrap around the address space */
};
int dd_blocks_check(const uint64_t *bases, uint64_t ntensors, uint64_t block_bytes,
                    uint64_t num_blocks, uint64_t start, uint64_t count, const uint64_t *blocks,
                    size_t nblocks, uint64_t seg, uint64_t last, uint64_t *bad);
/* dd_blocks_check, then the access's (addr, len) rows, per tensor then per block, into rows
 * (room for cap rows); DD_EINVAL, nothing written, when they need more. */
int dd_blocks_rows(uint64_t *rows, size_t cap, const uint64_t *bases, uint64_t ntensors,
                   uint64_t block_bytes, uint64_t num_blocks, uint64_t start, uint64_t count,
                   const uint64_t *blocks, size_t nblocks, uint64_t seg, uint64_t last,
                   uint64_t *bad);
/* The (addr, len) rows of blocks: for each of ntensors tensors t (starting at bases[t]) and
 * each of nblocks blocks k, seg bytes at bases[t] + blocks[k] * row_bytes, into rows (2 *
 * ntensors * nblocks values). DD_EINVAL, nothing written, when dd_blocks_check refuses them
 * (a block not below num_rows, seg 0 or over row_bytes, an address that wraps); with no
 * tensors, DD_OK and nothing written. */
int dd_block_rows(uint64_t *rows, const uint64_t *bases, size_t ntensors, uint64_t row_bytes,
                  uint64_t num_rows, const uint64_t *blocks, size_t nblocks, uint64_t seg);
/* The (dst, src, seg) ops of a blocks copy (as dd_vm_copy_blocks moves them: block
 * dst_blocks[k] of each tensor t of the dst side with block src_blocks[k] of tensor t of the
 * src side, each side's rows as for dd_block_rows), tensor then block, into ops (3 * ntensors
 * * nblocks values). DD_EINVAL, nothing written, when a side's rows are refused as by
 * dd_block_rows. */
int dd_blocks_ops(uint64_t *ops, const uint64_t *dst_bases, uint64_t dst_row_bytes,
                  uint64_t dst_num_rows, const uint64_t *dst_blocks, const uint64_t *src_bases,
                  uint64_t src_row_bytes, uint64_t src_num_rows, const uint64_t *src_blocks,
                  size_t ntensors, size_t nblocks, uint64_t seg);
/* dd_vm_copy_batch of blocks: seg bytes of block src_blocks[k] of each tensor t of the src
 * side into block dst_blocks[k] of tensor t of the dst side (each side's rows as for
 * dd_block_rows), in tensor then block order. write == 0: the src side is in pid's address
 * space; write == 1: the dst side is. Returns as dd_vm_copy_batch; DD_EINVAL (nothing moved)
 * when a side's rows are refused as by dd_block_rows. */
int dd_vm_copy_blocks(int pid, int write, const uint64_t *dst_bases, uint64_t dst_row_bytes,
                      uint64_t dst_num_rows, const uint64_t *dst_blocks,
                      const uint64_t *src_bases, uint64_t src_row_bytes, uint64_t src_num_rows,
                      const uint64_t *src_blocks, size_t ntensors, size_t nblocks, uint64_t seg,
                      unsigned nthreads, int *err_no);

/* Background copies: a cross-process copy the copy workers run while the caller goes on.
 * A signal is an eventfd (non-blocking, close-on-exec) the workers add 1 to each time a
 * task started with it ends; an event loop reads it, then reaps its tasks. */
typedef struct dd_copy_signal dd_copy_signal;
typedef struct dd_copy_task dd_copy_task;
/* A new signal; DD_ESYS (errno set) when no eventfd could be made. */
int dd_copy_signal_open(dd_copy_signal **out);
int dd_copy_signal_fd(const dd_copy_signal *signal);
/* Done with the signal: its fd stays open until every task started with it ended. */
void dd_copy_signal_close(dd_copy_signal *signal);
/* Background copies of fewer bytes than this are copied by their caller. */
uint64_t dd_copy_background_min(void);
/* dd_vm_copy_batch started in the background: ops are checked (DD_EINVAL, nothing moved)
 * and copied, and *task is the running copy, whose end posts `signal`. A batch under
 * dd_copy_background_min(), or one no worker thread could be started for, is copied by
 * the caller instead: *task is NULL and the call returns as dd_vm_copy_batch. */
int dd_vm_copy_batch_start(int pid, int write, const uint64_t *ops, size_t n, unsigned nthreads,
                           dd_copy_signal *signal, dd_copy_task **task, int *err_no);
/* dd_vm_copy_blocks started in the background, as dd_vm_copy_batch_start. */
int dd_vm_copy_blocks_start(int pid, int write, const uint64_t *dst_bases,
                            uint64_t dst_row_bytes, uint64_t dst_num_rows,
                            const uint64_t *dst_blocks, const uint64_t *src_bases,
                            uint64_t src_row_bytes, uint64_t src_num_rows,
                            const uint64_t *src_blocks, size_t ntensors, size_t nblocks,
                            uint64_t seg, unsigned nthreads, dd_copy_signal *signal,
                            dd_copy_task **task, int *err_no);
/* The outcome of a background copy, freeing the task: DD_EAGAIN while it runs (wait == 0;
 * the task stays), else as dd_vm_copy_batch (wait == 1 sleeps until it ended). */
int dd_copy_task_reap(dd_copy_task *task, int wait, int *err_no);

/* ---- hostmem.c: host memory ---- */

/* Page-aligned, zero-filled, committed lazily on first touch. */
int dd_host_alloc(uint64_t nbytes, uint64_t *addr);
/* dd_host_alloc backed by a memory file sealed at its size, whose descriptor (close-on-exec)
 * is *fd: a same-host peer may map it (dd_host_map_peer). Unmap with dd_host_free, then
 * close *fd. DD_ENOMEM, or DD_ESYS (errno set) when no memory file could be made. */
int dd_host_alloc_shared(uint64_t nbytes, uint64_t *addr, int *fd);
/* Map here, read-write, the shared memory process pid holds open as descriptor fd_no:
 * taken with pidfd_getfd (allowed where process_vm_readv is), and mapped only when it is a
 * regular file of inode ino and exactly nbytes (rounded up to pages) sealed against
 * shrinking. *addr: its start here; unmap with dd_host_free. DD_ESYS with errno set
 * (EPERM/EACCES: refused; ESRCH: no such process; EBADF: not that file; ENOSYS: a kernel
 * before 5.6). */
int dd_host_map_peer(int pid, int fd_no, uint64_t ino, uint64_t nbytes, uint64_t *addr);
int dd_host_free(uint64_t addr, uint64_t nbytes);
/* Commit and map now every page of [addr, addr + nbytes) (page-aligned memory from
 * dd_host_alloc or dd_host_alloc_shared), so that no later access faults on it:
 * MADV_POPULATE_WRITE, or, before Linux 5.14, each page's first byte written back to
 * itself. DD_ENOMEM when the memory cannot be had (the pages populated so far stay). */
int dd_host_populate(uint64_t addr, uint64_t nbytes);
uint64_t dd_host_page_size(void);

/* ---- net.c: scatter-gather socket I/O ----
 *
 * iov holds n rows of (addr, len); the rows are one stream of bytes, sent or received in
 * order, zero-length rows skipped. deadline_ns is an absolute dd_monotonic_ns() time;
 * <= 0 means no deadline. Every call uses MSG_DONTWAIT and waits in poll() when the
 * socket is not ready, so blocking and non-blocking sockets behave alike and the fd's
 * mode is left alone. Returns DD_OK, DD_EINVAL (fd < 0, or a row with len > 0 has a null
 * address or wraps; checked before any I/O), DD_ETIMEDOUT, DD_ECLOSED_PEER, or DD_ESYS
 * with errno set by the failing call. *done (may be NULL) receives the bytes moved, also
 * on failure. Sends use MSG_NOSIGNAL: a closed peer never raises SIGPIPE. */
int dd_sock_sendv(int fd, const uint64_t *iov, size_t n, int64_t deadline_ns, uint64_t *done);
int dd_sock_recvv(int fd, const uint64_t *iov, size_t n, int64_t deadline_ns, uint64_t *done);
/* One-row conveniences of the above. */
int dd_sock_send(int fd, uint64_t addr, uint64_t len, int64_t deadline_ns, uint64_t *done);
int dd_sock_recv(int fd, uint64_t addr, uint64_t len, int64_t deadline_ns, uint64_t *done);
/* Wait until fd is readable (or has an error or hangup to report): first poll without
 * sleeping for up to spin_ns, then sleep in poll() until deadline_ns (<= 0: no deadline).
 * The first check never sleeps, even with spin_ns 0 and a deadline in the past. Returns
 * DD_OK, DD_ETIMEDOUT, DD_EINVAL (fd < 0 or spin_ns < 0) or DD_ESYS (errno set). */
int dd_sock_wait_readable(int fd, int64_t spin_ns, int64_t deadline_ns);
/* CLOCK_MONOTONIC now, in ns: the clock of deadline_ns. */
int64_t dd_monotonic_ns(void);
/* TCP_NODELAY when nodelay >= 0 (ignored by non-TCP sockets); SO_SNDBUF / SO_RCVBUF when
 * > 0; negative sizes are DD_EINVAL. */
int dd_sock_tune(int fd, int nodelay, int sndbuf, int rcvbuf);

/* ---- serve.c: small pulls and pushes of blocks answered from the reader thread ----
 *
 * A serve table lists the blocks caches peers may read and write in host memory;
 * dd_serve_requests answers the well-formed PULL and PUSH frames of listed caches waiting
 * on a link's socket (see serve.c) and leaves every other frame, and every refusal, to the
 * caller. */

enum {
    DD_SERVE_PARTIAL = 1 /* an answer went out in part: the caller sends the rest */
};

typedef struct dd_serve_table dd_serve_table;

typedef struct {
    uint64_t caches;  /* caches listed */
    uint64_t pinned;  /* transfers in flight over listed or dropped caches */
    uint64_t served;  /* requests answered whole by dd_serve_requests, ever */
    uint64_t partial; /* answers it sent in part, ever */
} dd_serve_stats;

typedef struct {
    uint64_t served;     /* requests answered whole by this call */
    int pending;         /* a frame waits that the caller must read */
    uint64_t request_id; /* DD_SERVE_PARTIAL (or a failure): the request being answered */
    uint64_t kind;       /* DD_SERVE_PARTIAL: the answer's frame kind (PULL_DATA, PUSH_ACK) */
    uint64_t nbytes;     /* DD_SERVE_PARTIAL: the answer's payload bytes */
    uint64_t sent;       /* bytes of the answer (40-byte header first) the kernel took */
    uint64_t nrows;      /* DD_SERVE_PARTIAL: payload rows written to rows */
    void *pin;           /* DD_SERVE_PARTIAL of a pull: held until dd_serve_unpin */
} dd_serve_out;

int dd_serve_table_new(dd_serve_table **out);
/* No call may use the table during or after this. */
void dd_serve_table_free(dd_serve_table *t);
/* Replace the listed caches: rows holds n rows of (ident, ntensors, row_bytes, num_rows),
 * addrs the tensors' base addresses, ntensors per row in row order (naddrs in all).
 * Unchanged caches keep their pins; dropped ones are waited out until no transfer uses
 * them (DD_ETIMEDOUT when deadline_ns, absolute, passed first; <= 0: no deadline). */
int dd_serve_table_set(dd_serve_table *t, const uint64_t *rows, size_t n, const uint64_t *addrs,
                       size_t naddrs, int64_t deadline_ns);
int dd_serve_table_stats(dd_serve_table *t, dd_serve_stats *out);
/* Release the pin of a DD_SERVE_PARTIAL answer (NULL: nothing to release). */
void dd_serve_unpin(dd_serve_table *t, void *pin);
/* Answer the PULL and PUSH frames waiting on fd that t can serve, up to the first that it
 * cannot (out->pending then says a frame waits) or until none waits. rows is scratch of
 * cap (addr, len) pairs; requests of more rows, or of more than max_bytes, are left. The
 * rest of a small push (up to 256 KiB) still arriving is busy-polled for up to spin_ns;
 * a push not all there then is left. Returns DD_OK, DD_SERVE_PARTIAL, DD_EINVAL, or DD_ECLOSED_PEER / DD_ESYS when the
 * socket failed after a request was taken (the link cannot go on). Never sleeps, and never
 * waits to send. */
int dd_serve_requests(dd_serve_table *t, int fd, uint64_t max_bytes, int64_t spin_ns,
                      uint64_t *rows, size_t cap, dd_serve_out *out);

/* ---- pump.c: the one parser of a link's frames, and its requests awaiting answers ----
 *
 * Whoever waits reads, one at a time: a blocking waiter while it spins (dd_pump_wait), an
 * event loop from its selector (dd_pump_poll), else the link's reader thread
 * (dd_pump_run), which takes every frame that needs Python. Answers of requests entered
 * in the table complete in C. */

enum {
    DD_PUMP_FRAME = 1,   /* a frame for the caller: its header is in header, the rest unread */
    DD_PUMP_PEER = 2,    /* one of the peer's requests waits at the socket, nothing taken */
    DD_PUMP_DONE = 3,    /* unclaimed requests completed: take them (dd_pump_take_done) */
    DD_PUMP_STALLED = 4  /* the peer stalled mid-frame for the stall time */
};
/* A request's outcome. */
enum {
    DD_PUMP_OK = 0,
    DD_PUMP_LATE = 1,   /* its deadline passed mid-payload after `moved` bytes */
    DD_PUMP_BROKEN = 2  /* the link failed (or closed) before it was answered */
};

typedef struct dd_pump dd_pump;

typedef struct {
    uint64_t request_id;
    int64_t outcome; /* DD_PUMP_OK, DD_PUMP_LATE, DD_PUMP_BROKEN */
    uint64_t moved;  /* payload bytes that landed */
} dd_pump_outcome;

/* A pump for socket fd; stall_ns: the longest a frame may go without a byte. */
int dd_pump_new(int fd, int64_t stall_ns, dd_pump **out);
/* No call may use the pump during or after this. */
void dd_pump_free(dd_pump *p);
/* Enter request rid (before it is sent), answered by a frame of kind (PULL_DATA or
 * PUSH_ACK) with nbytes of payload into the rows (nrows (addr, len) pairs that must stay
 * valid until its outcome is taken). DD_EAGAIN: the table cannot hold it (the caller's
 * Python then takes its answer); DD_ECLOSED: the pump closed; DD_EINVAL: bad rows. */
int dd_pump_enter(dd_pump *p, uint64_t rid, unsigned kind, const uint64_t *rows, size_t nrows,
                  uint64_t nbytes, int64_t deadline_ns);
/* Take rid out of the table unless the pump holds it: DD_OK (nothing touches its rows from
 * now on; also when it was never there), or DD_EAGAIN (its payload is moving, or it is done
 * and its outcome not yet taken: whoever takes that completes it). */
int dd_pump_forget(dd_pump *p, uint64_t rid);
/* Wait for rid: for spin_ns read the socket here when nobody else does (else busy-poll),
 * then sleep until until_ns (absolute) while the reader thread reads. DD_OK with the
 * outcome in out; DD_ETIMEDOUT (still pending: it is listed once done); DD_EINVAL (not in
 * the table: whoever took it out completes it). */
int dd_pump_wait(dd_pump *p, uint64_t rid, int64_t spin_ns, int64_t until_ns,
                 dd_pump_outcome *out);
/* Take up to cap outcomes of completed requests nobody claimed; *taken: how many. */
int dd_pump_take_done(dd_pump *p, dd_pump_outcome *out, size_t cap, size_t *taken);
/* The reader thread: read frames until one is Python's (DD_PUMP_FRAME, with its header;
 * DD_PUMP_PEER: the peer's request, unread; the thread holds the socket until its next call),
 * outcomes wait to be taken (DD_PUMP_DONE), idle_ns passed with nothing to read
 * (DD_ETIMEDOUT; <= 0: never), or the socket failed (DD_ECLOSED_PEER, DD_ESYS, ...).
 * spin_first: busy-poll spin_ns for the next frame first (after the peer's requests). */
int dd_pump_run(dd_pump *p, int64_t spin_ns, int spin_first, int64_t idle_ns, uint8_t *header);
/* An event loop: read what the socket holds now, never waiting. DD_OK; DD_EAGAIN (another
 * driver reads); DD_PUMP_FRAME (a frame is the reader thread's now: it was woken; or the
 * pump closed). Outcomes completed are listed (dd_pump_take_done). */
int dd_pump_poll(dd_pump *p);
/* A driver other than the reader thread will read soon (an event loop watching the
 * socket): the reader thread stays off it for the next 5 ms. */
void dd_pump_expect(dd_pump *p);
/* The reader stops: it takes the driver role for good (a driver reading now ends its
 * bounded turn first), every request still in the table completes with DD_PUMP_BROKEN, and
 * later entries are refused (DD_ECLOSED). Only then may the socket close. */
int dd_pump_close(dd_pump *p);

/* ---- ucx_batch.c: batches of UCP RMA requests (UCX reached through the given calls) ---- */

/* The addresses of the UCP functions a batch calls (the caller loaded libucp). */
typedef struct {
    uint64_t get_nbx;         /* ucp_get_nbx */
    uint64_t put_nbx;         /* ucp_put_nbx */
    uint64_t request_free;    /* ucp_request_free */
    uint64_t worker_progress; /* ucp_worker_progress */
    uint64_t worker_signal;   /* ucp_worker_signal */
    uint64_t ep_flush_nbx;    /* ucp_ep_flush_nbx */
    uint64_t worker_arm;      /* ucp_worker_arm */
} dd_ucx_calls;

/* A batch's completion count: the requests of the batch still in flight, and the first
 * failure among them. Each request of a counted batch completes through dd_ucx_counted (the
 * batch's request parameters name it, with the count as user data), which frees it. Touch
 * the fields only through the functions below. */
typedef struct {
    int64_t pending;       /* requests whose completion has not run yet */
    int32_t status;        /* the first failure's ucs_status_t; 0: none */
    uint64_t request_free; /* ucp_request_free */
    uint64_t signal;       /* ucp_worker_signal */
    uint64_t notify;       /* the worker signalled when the count reaches 0 (0: none) */
    int32_t busy;          /* completions running now (the count is not freed under them) */
} dd_ucx_count;

/* A count for one batch of calls c (0 pending); NULL when out of memory. */
dd_ucx_count *dd_ucx_count_new(const dd_ucx_calls *c);
/* Have the completion that takes count to 0 signal worker (ucp_worker_signal), so that a
 * thread sleeping on that worker's event fd learns of a batch another worker progressed.
 * Set it any time before sleeping, then look at the count (dd_ucx_count_left): either that
 * look sees 0 or the last completion sees worker and signals it. */
int dd_ucx_count_notify(dd_ucx_count *count, uint64_t worker);
/* Free count unless requests still complete into it, or a
 * completion still runs (DD_EAGAIN: nothing freed). */
int dd_ucx_count_free(dd_ucx_count *count);
/* Make count as new, for the next batch (no failure, no notify worker): DD_EAGAIN while a
 * request or a completion still runs (nothing changed). */
int dd_ucx_count_reset(dd_ucx_count *count);
/* How many requests of count are still in flight; *status: the first failure (0: none). */
int64_t dd_ucx_count_left(const dd_ucx_count *count, int *status);
/* The UCP completion (ucp_send_nbx_callback_t) of a counted batch: records a failure, frees
 * the request and takes it off the count (the last one signals the count's notify worker and
 * writes its notify fd). */
void dd_ucx_counted(void *request, int8_t status, void *user_data);
/* For each span i (rows of `stride` words from spans: address, length), the row of keys
 * (rows of 2 words: address, end; sorted by address) that holds it whole: the nearest row
 * starting at or below it, or one of the 16 before that (rows may overlap). Returns n with
 * found[i] set for every span, else the index of the first span no row holds; DD_EINVAL for
 * bad arguments. */
int64_t dd_ucx_find(const uint64_t *keys, size_t nkeys, const uint64_t *spans, size_t stride,
                    size_t n, int32_t *found);

enum { DD_UCX_MAX_PARTS = 8 }; /* the most parts one transfer is cut into */

typedef struct dd_ucx_lane dd_ucx_lane;

/* One part of a transfer (dd_ucx_transfer): the bytes one worker moves. */
typedef struct {
    uint64_t ep;            /* the endpoint, on the part's worker */
    const uint64_t *rkeys;  /* the remote keys unpacked on ep, one per row of the keys */
    uint64_t param;         /* request parameters naming dd_ucx_counted and count */
    dd_ucx_count *count;    /* what the part's requests complete into */
    dd_ucx_lane *lane;      /* the thread progressing ep's worker, woken once the part
                             * started (NULL: the caller progresses it) */
    int started;            /* out: 1 when the part's requests were started */
    int status;             /* out: the ucs_status_t UCX refused a request with (0: none) */
    int done;               /* out (with progress): 1 when every request of the part completed
                             * in the call; its count was then made as new (dd_ucx_count_reset) */
    int failed;             /* out (done): the ucs_status_t of the first that failed (0: none) */
} dd_ucx_part;

/* Whole blocks of two blocks layouts, paired as dd_blocks_ops pairs them (local = dst,
 * remote = src): the ops of a transfer, made in the call that starts it. */
typedef struct {
    const uint64_t *local_bases;  /* the local side's first tensor's base, then the others' */
    uint64_t local_block_bytes;
    uint64_t local_num_blocks;
    const uint64_t *local_blocks;
    const uint64_t *remote_bases; /* the same for the peer's side */
    uint64_t remote_block_bytes;
    uint64_t remote_num_blocks;
    const uint64_t *remote_blocks;
    size_t ntensors;
    size_t nblocks;
    uint64_t seg;
} dd_blocks_pair;

/* Start a transfer: one get (write == 0: remote -> local) or put per op (local, remote,
 * nbytes) of ops (n rows; with ops NULL, the ntensors * nblocks ops of pair instead), the
 * remote side through the key row of keys (nkeys rows of address, end, sorted by address)
 * that holds it (as dd_ucx_find). First every op is checked and its key found; then the
 * bytes, in op order, are cut into up to nparts runs of about equal bytes (at multiples of
 * 4 KiB; one run below 8 KiB) and run r is started on parts[r], its neighbouring pieces that
 * continue each other on both sides through one key merged into one request, the lanes'
 * runs first (each lane woken once its run started). With flush, a flush of each part's
 * endpoint follows its run (puts are then done once they reached the peer's memory). A
 * part's requests left in flight complete into its count. Then, with progress_ns > 0, the
 * call progresses worker (the worker of parts[0]) until parts[0]'s count reads 0, a round
 * finds nothing to do, or progress_ns passed, and marks done each part whose requests all
 * completed by then (its count made as new: the next transfer may use it at once).
 * Returns the number of ops when the runs were started (a part's status says what UCX
 * refused: its earlier requests started, the parts after it did not); the index of the
 * first op no key row holds (nothing started); DD_EINVAL for bad arguments, with *bad >= 0
 * the index of an op that is empty, has no local address or wraps, or with *bad == -2 a pair
 * whose sides dd_blocks_ops refuses (nothing started); DD_ENOMEM. */
int64_t dd_ucx_transfer(const dd_ucx_calls *c, int write, int flush, const uint64_t *ops,
                        size_t n, const dd_blocks_pair *pair, const uint64_t *keys,
                        size_t nkeys, dd_ucx_part *parts, size_t nparts, int64_t *bad,
                        uint64_t worker, int64_t progress_ns);
/* Progress worker without sleeping until count reads 0 (1) or spin_ns passed (0): a
 * waiter's busy-poll before it sleeps. DD_EINVAL for bad arguments. */
int dd_ucx_spin(const dd_ucx_calls *c, uint64_t worker, const dd_ucx_count *count,
                int64_t spin_ns);
/* Progress worker until a round finds nothing to do (1; 0 when the first one did not) or
 * budget_ns passed with work left (2; <= 0: no limit). DD_EINVAL for bad arguments. */
int dd_ucx_drain(const dd_ucx_calls *c, uint64_t worker, int64_t budget_ns);

/* Who progresses a worker besides its serving thread (dd_ucx_serve), shared with the
 * threads that wait on the worker themselves. */
typedef struct {
    int32_t waiters; /* threads progressing the worker now: the serving thread stands down */
    int32_t look;    /* set before a write to wake_fd: the serving call must return */
    int32_t parked;  /* (out) the serving thread stands down, asleep on wake_fd only:
                      * DD_UCX_PARKED_TIMED, it looks at the waiters again by itself soon;
                      * DD_UCX_PARKED, the last waiter to leave writes wake_fd (without look)
                      * to resume it */
} dd_ucx_turn;

enum { DD_UCX_PARKED_TIMED = 1, DD_UCX_PARKED = 2 };

/* A serving thread's wait on worker (its event fd efd), in one native call: progress until
 * idle, arm the worker and sleep on efd and wake_fd (-1: none), again and again, until
 * deadline_ns (monotonic; <= 0: none) passed, or, with until_work, a round of progress found
 * work (1; 0 for the others). While turn->waiters > 0 it does not progress and sleeps on
 * wake_fd only (turn->parked set meanwhile): the first such sleep after a round with no
 * waiter lasts at most spin_ns and looks at the waiters again by itself (DD_UCX_PARKED_TIMED:
 * a waiter that leaves within it need not write wake_fd), the later ones until wake_fd is
 * written (DD_UCX_PARKED; without spin_ns, the first too). A write to wake_fd is read
 * here: it ends the call when turn->look is set (look is cleared), and otherwise only wakes
 * the thread to look at turn->waiters again. DD_ESYS when arming (errno EIO) or polling failed. *idle counts
 * wake-ups in a row that found nothing to do (kept by the caller between calls): from the
 * fifth, each sleep waits first, from 50 us doubling to 1 ms, as a lane's does (a tcp
 * endpoint can keep efd readable). After a round that found work it progresses without
 * sleeping for up to spin_ns (<= 0: not at all), so that the peer's next request, which
 * usually follows within it, is served without a wake-up. */
int dd_ucx_serve(const dd_ucx_calls *c, uint64_t worker, int efd, int wake_fd,
                 int64_t deadline_ns, int until_work, int *idle, dd_ucx_turn *turn,
                 int64_t spin_ns);
/* Set turn->waiters; how the serving thread is parked (0: not; both sequentially consistent
 * with the serving thread's own store and load, so that the last waiter to leave either
 * sees it parked or it sees no waiter). */
int dd_ucx_turn_waiters(dd_ucx_turn *turn, int32_t waiters);

/* A thread of its own that progresses a worker (UCS_THREAD_MODE_MULTI) until stopped: it
 * progresses until idle, arms the worker and sleeps on its event fd efd; ucp_worker_signal
 * (as dd_ucx_transfer does for a part started on the worker) wakes it. Wake-ups that find nothing to do again and again (a tcp endpoint can keep the
 * fd readable) stretch its sleep from 50 us to 1 ms. */
/* Start the thread for worker (its event fd efd); NULL when no thread can be made (errno). */
dd_ucx_lane *dd_ucx_lane_start(const dd_ucx_calls *c, uint64_t worker, int efd);
/* Stop the thread, wait for it and free the lane (the worker stays). */
int dd_ucx_lane_stop(dd_ucx_lane *lane);

/* cdef-end */

/* Shared inside the native layer only (not part of the Python surface). */

/* A short pause between two polls of a busy-polling wait (about a microsecond). */
void dd_cpu_relax(void);
/* net.c for pump.c: receive the rows' bytes from skip bytes in (busy-polling until
 * spin_end, then sleeping until deadline_ns), as dd_sock_recvv; whether fd is readable
 * (or failed) now: 1, 0, or -1 (errno set). */
int dd_net_recv_rows(int fd, const uint64_t *iov, size_t n, uint64_t skip, int64_t deadline_ns,
                     int64_t spin_end, uint64_t *done);
int dd_net_ready_now(int fd);

#ifdef __cplusplus
}
#endif

#endif /* AIO_DATADIST_H */
