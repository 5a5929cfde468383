/* copy.c: single and batched memcpy, within this process or with another one, with a
 * persistent worker pool for big batches.
 *
 * A batch is a table of (dst, src, nbytes) rows read as one stream of bytes. Adjacent rows
 * that continue each other on both sides are merged on the fly, so a run of consecutive
 * blocks becomes one memcpy (and glibc may pick its streaming-store path for it). Big
 * batches are cut by bytes, not rows, into nearly equal slices, so one huge row is shared
 * too. Each call owns its job record (on its stack), queued for the workers; the calling
 * thread claims slices of its own job as well, so a batch completes even when no worker
 * could be started, and concurrent callers never wait for each other's batches.
 *
 * A cross-process batch (dd_vm_copy_batch) moves the same rows with process_vm_readv or
 * process_vm_writev instead of memcpy: one kernel copy between the two address spaces, up
 * to IOV_MAX merged ranges a call, slices spread over the same workers.
 *
 * The same calls with pid 0 copy within this process: a same-host peer's memory mapped
 * here (hostmem.c) is copied with memcpy on the same workers.
 *
 * A copy started in the background (dd_vm_copy_batch_start, dd_vm_copy_blocks_start) is a
 * heap task whose slices only the workers run: the caller returns at once, and the worker
 * that finishes the last slice adds 1 to the task's signal, an eventfd an event loop
 * reads. The signal is reference counted by the tasks started with it, so its fd stays
 * open until the last of them posted, whoever closed it first.
 *
 * Workers are detached, block all signals and sleep on a condition variable; the process
 * exits without waiting for them. After fork() the child starts with no workers (and a
 * background task in flight at the fork never ends there).
 *
 * Waking a sleeping thread costs tens of microseconds here, paid twice a batch (the worker
 * woken for its slice, the caller woken when the worker finishes last): a stream of 4 MiB
 * batches lost about a quarter of its rate to it. So both sides spin briefly first: a
 * worker that finished looks for the next batch for SPIN_NS before it sleeps, and a caller
 * done with its own slices watches the others finish for SPIN_NS before it sleeps.
 */
#define _GNU_SOURCE
#include "datadist.h"

#include <errno.h>
#include <stdbool.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

/* Below this a batch is cheaper to copy than to hand to another thread: a wake-up costs
 * tens of microseconds, 2 MiB copies in about a hundred. */
#define SPLIT_THRESHOLD (2ull << 20)
/* Smallest slice worth a thread of its own. */
#define MIN_SLICE (1ull << 20)
/* Slice boundaries fall on multiples of this within the stream, so slices of page-aligned
 * rows start page aligned and never share a cache line. */
#define SLICE_ALIGN 4096ull
/* How long a worker looks for the next batch, and a caller for its batch's last slice,
 * before sleeping: about one wake-up. */
#define SPIN_NS 100000
/* A background copy smaller than this is copied by its caller (a hand-off and a wake-up of
 * the waiting loop cost more): the smallest slice worth a thread. */
#define BACKGROUND_MIN MIN_SLICE
#define DEFAULT_MAX_THREADS 8u
#define WORKER_STACK (256u << 10)

typedef struct {
    size_t row;   /* first row of the slice */
    uint64_t off; /* byte offset into that row */
    uint64_t len; /* bytes in the slice */
} slice_t;

typedef struct job {
    struct job *qnext;
    const uint64_t *ops;
    size_t n;
    int pid;        /* 0: memcpy in this process; else the peer of a cross-process batch */
    int write;      /* cross-process: 1 writes the peer's memory (dst), 0 reads it (src) */
    atomic_int err; /* cross-process: first errno a slice met (0: none) */
    slice_t sl[DD_COPY_MAX_THREADS];
    unsigned nslices;
    unsigned next;            /* first unclaimed slice */
    atomic_uint pending;      /* slices not finished */
    pthread_cond_t done;      /* caller-owned jobs: signalled (under g.mu) when pending hits 0 */
    dd_copy_signal *signal;   /* background tasks: posted when pending hits 0; else NULL */
} job_t;

struct dd_copy_signal {
    int fd;
    atomic_uint refs; /* the opener's, plus one per running task started with it */
};

struct dd_copy_task {
    job_t j;
    uint64_t *ops; /* the task's own copy of its rows */
};

static struct {
    pthread_mutex_t mu;
    pthread_cond_t work;
    job_t *head, *tail; /* jobs with unclaimed slices */
    unsigned nworkers;
    unsigned idle;
} g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, 0, 0};
/* Batches ever queued: what a spinning worker watches without the lock. */
static atomic_uint_fast64_t g_queued;

static atomic_uint g_default_threads;
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;

int dd_copy(uint64_t dst, uint64_t src, uint64_t nbytes)
{
    if (nbytes == 0)
        return DD_OK;
    if (dst == 0 || src == 0 || nbytes > SIZE_MAX)
        return DD_EINVAL;
    memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)nbytes);
    return DD_OK;
}

int dd_fill(uint64_t addr, int value, uint64_t nbytes)
{
    if (value < 0 || value > 255)
        return DD_EINVAL;
    if (nbytes == 0)
        return DD_OK;
    if (addr == 0 || nbytes > SIZE_MAX || addr + nbytes < addr)
        return DD_EINVAL;
    memset((void *)(uintptr_t)addr, value, (size_t)nbytes);
    return DD_OK;
}

/* Move the gathered ranges of a cross-process slice; false (j->err set) on failure. */
static bool vm_flush(job_t *j, struct iovec *loc, struct iovec *rem, size_t k)
{
    size_t first = 0;
    while (first < k) {
        if (atomic_load(&j->err) != 0)
            return false;
        ssize_t got = j->write ? process_vm_writev(j->pid, loc + first, k - first, rem + first,
                                                   k - first, 0)
                               : process_vm_readv(j->pid, loc + first, k - first, rem + first,
                                                  k - first, 0);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0) {
            int expected = 0;
            atomic_compare_exchange_strong(&j->err, &expected, got < 0 ? errno : EFAULT);
            return false;
        }
        /* A partial transfer stops at a range boundary of either side (the kernel moves
         * whole pages of the remote side); skip what moved and go on. */
        size_t moved = (size_t)got;
        while (first < k && moved >= loc[first].iov_len) {
            moved -= loc[first].iov_len;
            first++;
        }
        if (first < k && moved) {
            loc[first].iov_base = (char *)loc[first].iov_base + moved;
            loc[first].iov_len -= moved;
            rem[first].iov_base = (char *)rem[first].iov_base + moved;
            rem[first].iov_len -= moved;
        }
    }
    return true;
}

/* Move one merged run (d <- s, plen bytes): a memcpy, or a range of a cross-process call. */
static bool put_run(job_t *j, struct iovec *loc, struct iovec *rem, size_t *k, uint64_t d,
                    uint64_t s, uint64_t plen)
{
    if (j->pid == 0) {
        memcpy((void *)(uintptr_t)d, (const void *)(uintptr_t)s, (size_t)plen);
        return true;
    }
    uint64_t here = j->write ? s : d, there = j->write ? d : s;
    loc[*k] = (struct iovec){(void *)(uintptr_t)here, (size_t)plen};
    rem[*k] = (struct iovec){(void *)(uintptr_t)there, (size_t)plen};
    if (++*k < IOV_MAX)
        return true;
    *k = 0;
    return vm_flush(j, loc, rem, IOV_MAX);
}

/* Move len bytes of the row stream, starting off bytes into row `row`. */
static void run_range(job_t *j, size_t row, uint64_t off, uint64_t len)
{
    static _Thread_local struct iovec loc[IOV_MAX], rem[IOV_MAX];
    const uint64_t *ops = j->ops;
    size_t n = j->n, k = 0;
    uint64_t pd = 0, ps = 0, plen = 0; /* pending merged run */
    for (; len > 0 && row < n; row++, off = 0) {
        const uint64_t *r = ops + 3 * row;
        if (r[2] <= off)
            continue;
        uint64_t take = r[2] - off;
        if (take > len)
            take = len;
        uint64_t d = r[0] + off, s = r[1] + off;
        if (plen != 0 && pd + plen == d && ps + plen == s) {
            plen += take;
        } else {
            if (plen != 0 && !put_run(j, loc, rem, &k, pd, ps, plen))
                return;
            pd = d;
            ps = s;
            plen = take;
        }
        len -= take;
    }
    if (plen != 0 && !put_run(j, loc, rem, &k, pd, ps, plen))
        return;
    if (k != 0)
        vm_flush(j, loc, rem, k);
}

static void run_slice(job_t *j, unsigned k)
{
    run_range(j, j->sl[k].row, j->sl[k].off, j->sl[k].len);
}

/* Claim the next slice of j; the caller holds g.mu and knows one is left. */
static unsigned claim(job_t *j)
{
    unsigned k = j->next++;
    if (j->next == j->nslices) {
        /* Fully claimed: unlink, so the record may leave its caller's stack once done. */
        job_t **pp = &g.head, *prev = NULL;
        while (*pp != j) {
            prev = *pp;
            pp = &(*pp)->qnext;
        }
        *pp = j->qnext;
        if (g.tail == j)
            g.tail = prev;
    }
    return k;
}

/* Spin until *counter differs from seen (true) or SPIN_NS passed (false). The spin yields
 * the CPU at every look, so a thread with work (another caller's copy) is never kept off it. */
static bool spin_for_change(const atomic_uint_fast64_t *counter, uint_fast64_t seen)
{
    int64_t until = dd_monotonic_ns() + SPIN_NS;
    do {
        if (atomic_load_explicit(counter, memory_order_relaxed) != seen)
            return true;
        sched_yield();
    } while (dd_monotonic_ns() < until);
    return false;
}

static void signal_release(dd_copy_signal *signal)
{
    if (atomic_fetch_sub(&signal->refs, 1) == 1) {
        close(signal->fd);
        free(signal);
    }
}

/* A background task ended: wake the signal's reader, then drop the task's reference. */
static void signal_post(dd_copy_signal *signal)
{
    uint64_t one = 1;
    while (write(signal->fd, &one, sizeof one) < 0 && errno == EINTR)
        ;
    signal_release(signal);
}

static void *worker_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&g.mu);
    for (;;) {
        if (g.head == NULL) {
            /* Look for the next batch a while before sleeping (see the file comment). */
            uint_fast64_t seen = atomic_load(&g_queued);
            pthread_mutex_unlock(&g.mu);
            spin_for_change(&g_queued, seen);
            pthread_mutex_lock(&g.mu);
        }
        while (g.head == NULL) {
            g.idle++;
            pthread_cond_wait(&g.work, &g.mu);
            g.idle--;
        }
        job_t *j = g.head;
        unsigned k = claim(j);
        pthread_mutex_unlock(&g.mu);
        run_slice(j, k);
        /* Read before the count drops: a finished background task may be freed at once. */
        dd_copy_signal *signal = j->signal;
        if (signal != NULL) {
            if (atomic_fetch_sub(&j->pending, 1) == 1)
                signal_post(signal);
            pthread_mutex_lock(&g.mu);
            continue;
        }
        pthread_mutex_lock(&g.mu);
        if (atomic_fetch_sub(&j->pending, 1) == 1)
            pthread_cond_signal(&j->done);
    }
    return NULL;
}

static void atfork_prepare(void) { pthread_mutex_lock(&g.mu); }
static void atfork_parent(void) { pthread_mutex_unlock(&g.mu); }

static void atfork_child(void)
{
    /* Only the forking thread survives: no workers, no foreign jobs. */
    pthread_mutex_init(&g.mu, NULL);
    pthread_cond_init(&g.work, NULL);
    g.head = g.tail = NULL;
    g.nworkers = 0;
    g.idle = 0;
}

static void register_atfork(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

/* Start workers until `want` exist; called with g.mu held. Failure only means fewer
 * helpers: the caller copies whatever nobody claims. */
static void ensure_workers(unsigned want)
{
    if (g.nworkers >= want)
        return;
    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0)
        return;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, WORKER_STACK);
    /* Workers inherit this mask: signals stay with the interpreter's threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    while (g.nworkers < want) {
        pthread_t t;
        if (pthread_create(&t, &attr, worker_main, NULL) != 0)
            break;
        g.nworkers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
}

/* Cut the stream of `total` bytes into nslices pieces; returns how many are non-empty. */
static unsigned plan_slices(job_t *j, uint64_t total, unsigned nslices)
{
    uint64_t q = total / nslices, rem = total % nslices;
    uint64_t bounds[DD_COPY_MAX_THREADS + 1];
    bounds[0] = 0;
    for (unsigned k = 1; k < nslices; k++) {
        uint64_t b = (q * k + rem * k / nslices) & ~(SLICE_ALIGN - 1);
        bounds[k] = b < bounds[k - 1] ? bounds[k - 1] : b;
    }
    bounds[nslices] = total;

    unsigned out = 0, k = 0;
    uint64_t pos = 0;
    for (size_t row = 0; row < j->n && k < nslices; row++) {
        uint64_t len = j->ops[3 * row + 2];
        /* A slice starts in this row when its first byte lies inside it. */
        while (k < nslices && bounds[k] < pos + len) {
            if (bounds[k + 1] > bounds[k])
                j->sl[out++] = (slice_t){row, bounds[k] - pos, bounds[k + 1] - bounds[k]};
            k++;
        }
        pos += len;
    }
    return out;
}

unsigned dd_copy_get_threads(void)
{
    unsigned n = atomic_load(&g_default_threads);
    if (n == 0) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        n = cpus < 1 ? 1u : cpus > (long)DEFAULT_MAX_THREADS ? DEFAULT_MAX_THREADS : (unsigned)cpus;
        atomic_store(&g_default_threads, n);
    }
    return n;
}

int dd_copy_set_threads(unsigned nthreads)
{
    if (nthreads < 1 || nthreads > DD_COPY_MAX_THREADS)
        return DD_EINVAL;
    atomic_store(&g_default_threads, nthreads);
    return DD_OK;
}

uint64_t dd_copy_split_threshold(void) { return SPLIT_THRESHOLD; }

/* Check every row before copying any, so a bad batch writes nothing; *total: its bytes. */
static int check_rows(const uint64_t *ops, size_t n, uint64_t *total)
{
    uint64_t sum = 0;
    for (size_t i = 0; i < n; i++) {
        const uint64_t *r = ops + 3 * i;
        uint64_t len = r[2];
        if (len == 0)
            continue;
        if (r[0] == 0 || r[1] == 0 || r[0] + len < r[0] || r[1] + len < r[1] ||
            sum + len < sum || len > SIZE_MAX)
            return DD_EINVAL;
        sum += len;
    }
    *total = sum;
    return DD_OK;
}

/* Cut j's total bytes into nslices and queue it, waking up to `wake` idle workers; the
 * caller holds g.mu. */
static void enqueue(job_t *j, uint64_t total, unsigned nslices, unsigned wake)
{
    j->qnext = NULL;
    j->nslices = plan_slices(j, total, nslices);
    j->next = 0;
    atomic_init(&j->pending, j->nslices);
    if (g.tail != NULL)
        g.tail->qnext = j;
    else
        g.head = j;
    g.tail = j;
    atomic_fetch_add(&g_queued, 1);
    if (wake > j->nslices)
        wake = j->nslices;
    if (wake > g.idle)
        wake = g.idle;
    for (unsigned w = 0; w < wake; w++)
        pthread_cond_signal(&g.work);
}

/* How many slices `total` bytes are cut into for up to nthreads threads: none smaller than
 * MIN_SLICE. */
static unsigned slices_for(uint64_t total, unsigned nthreads)
{
    uint64_t by_size = total / MIN_SLICE;
    return by_size < nthreads ? (unsigned)by_size : nthreads;
}

/* Run the batch of j (ops, n, pid, write set) on up to nthreads threads. */
static int run_job(job_t *j, unsigned nthreads)
{
    const uint64_t *ops = j->ops;
    size_t n = j->n;
    if (n == 0)
        return DD_OK;
    if (ops == NULL || nthreads > DD_COPY_MAX_THREADS)
        return DD_EINVAL;
    uint64_t total;
    if (check_rows(ops, n, &total) != DD_OK)
        return DD_EINVAL;

    if (nthreads == 0)
        nthreads = dd_copy_get_threads();
    unsigned nslices = slices_for(total, nthreads);
    if (total < SPLIT_THRESHOLD || nslices <= 1) {
        run_range(j, 0, 0, total);
        return DD_OK;
    }

    j->signal = NULL;
    if (pthread_cond_init(&j->done, NULL) != 0) {
        run_range(j, 0, 0, total);
        return DD_OK;
    }
    pthread_once(&g_atfork_once, register_atfork);

    pthread_mutex_lock(&g.mu);
    ensure_workers(nslices - 1);
    enqueue(j, total, nslices, nslices - 1);
    while (j->next < j->nslices) {
        unsigned k = claim(j);
        pthread_mutex_unlock(&g.mu);
        run_slice(j, k);
        pthread_mutex_lock(&g.mu);
        atomic_fetch_sub(&j->pending, 1);
    }
    if (atomic_load(&j->pending) != 0) {
        /* Watch the workers' slices finish a while before sleeping (see the file comment). */
        pthread_mutex_unlock(&g.mu);
        int64_t until = dd_monotonic_ns() + SPIN_NS;
        while (atomic_load(&j->pending) != 0 && dd_monotonic_ns() < until)
            sched_yield(); /* as spin_for_change: never keeps a thread with work waiting */
        pthread_mutex_lock(&g.mu);
    }
    while (atomic_load(&j->pending) != 0)
        pthread_cond_wait(&j->done, &g.mu);
    pthread_mutex_unlock(&g.mu);
    pthread_cond_destroy(&j->done);
    return DD_OK;
}

int dd_copy_batch(const uint64_t *ops, size_t n, unsigned nthreads)
{
    job_t j;
    j.ops = ops;
    j.n = n;
    j.pid = 0;
    j.write = 0;
    atomic_init(&j.err, 0);
    return run_job(&j, nthreads);
}

int dd_vm_copy_batch(int pid, int write, const uint64_t *ops, size_t n, unsigned nthreads,
                     int *err_no)
{
    if (pid < 0 || (write != 0 && write != 1) || err_no == NULL)
        return DD_EINVAL;
    *err_no = 0;
    job_t j;
    j.ops = ops;
    j.n = n;
    j.pid = pid;
    j.write = write;
    atomic_init(&j.err, 0);
    int rc = run_job(&j, nthreads);
    if (rc != DD_OK)
        return rc;
    *err_no = atomic_load(&j.err);
    return *err_no == 0 ? DD_OK : DD_ESYS;
}

/* ---- background copies ---- */

int dd_copy_signal_open(dd_copy_signal **out)
{
    if (out == NULL)
        return DD_EINVAL;
    dd_copy_signal *signal = malloc(sizeof *signal);
    if (signal == NULL)
        return DD_ENOMEM;
    signal->fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (signal->fd < 0) {
        int saved = errno;
        free(signal);
        errno = saved;
        return DD_ESYS;
    }
    atomic_init(&signal->refs, 1);
    *out = signal;
    return DD_OK;
}

uint64_t dd_copy_background_min(void) { return BACKGROUND_MIN; }

int dd_copy_signal_fd(const dd_copy_signal *signal) { return signal == NULL ? -1 : signal->fd; }

void dd_copy_signal_close(dd_copy_signal *signal)
{
    if (signal != NULL)
        signal_release(signal);
}

/* Start the checked rows `ops` (heap, owned from here) with process pid in the background
 * (see dd_vm_copy_batch_start). */
static int vm_start(int pid, int write, uint64_t *ops, size_t n, unsigned nthreads,
                    dd_copy_signal *signal, dd_copy_task **task, int *err_no)
{
    uint64_t total = 0;
    int rc = check_rows(ops, n, &total);
    if (rc == DD_OK && total >= BACKGROUND_MIN) {
        dd_copy_task *t = malloc(sizeof *t);
        if (t != NULL) {
            t->ops = ops;
            t->j.ops = ops;
            t->j.n = n;
            t->j.pid = pid;
            t->j.write = write;
            atomic_init(&t->j.err, 0);
            t->j.signal = signal;
            atomic_fetch_add(&signal->refs, 1);
            unsigned nslices = slices_for(total, nthreads);
            pthread_once(&g_atfork_once, register_atfork);
            pthread_mutex_lock(&g.mu);
            ensure_workers(nslices);
            if (g.nworkers > 0) {
                enqueue(&t->j, total, nslices, nslices);
                pthread_mutex_unlock(&g.mu);
                *task = t;
                return DD_OK;
            }
            /* No worker could be started: the caller copies it after all. */
            pthread_mutex_unlock(&g.mu);
            signal_release(signal);
            free(t);
        }
    }
    if (rc == DD_OK)
        rc = dd_vm_copy_batch(pid, write, ops, n, nthreads, err_no);
    free(ops);
    return rc;
}

/* The arguments every background start checks; nthreads resolved. */
static bool start_args_ok(int pid, int write, unsigned *nthreads, dd_copy_signal *signal,
                          dd_copy_task **task, int *err_no)
{
    if (task == NULL || err_no == NULL)
        return false;
    *task = NULL;
    *err_no = 0;
    if (pid < 0 || (write != 0 && write != 1) || signal == NULL ||
        *nthreads > DD_COPY_MAX_THREADS)
        return false;
    if (*nthreads == 0)
        *nthreads = dd_copy_get_threads();
    return true;
}

int dd_vm_copy_batch_start(int pid, int write, const uint64_t *ops, size_t n, unsigned nthreads,
                           dd_copy_signal *signal, dd_copy_task **task, int *err_no)
{
    if (!start_args_ok(pid, write, &nthreads, signal, task, err_no) || (n && ops == NULL) ||
        n > SIZE_MAX / (3 * sizeof *ops))
        return DD_EINVAL;
    if (n == 0)
        return DD_OK;
    uint64_t *own = malloc(3 * n * sizeof *own);
    if (own == NULL)
        return DD_ENOMEM;
    memcpy(own, ops, 3 * n * sizeof *own);
    return vm_start(pid, write, own, n, nthreads, signal, task, err_no);
}

int dd_copy_task_reap(dd_copy_task *task, int wait, int *err_no)
{
    if (task == NULL || err_no == NULL)
        return DD_EINVAL;
    if (atomic_load(&task->j.pending) != 0) {
        if (!wait)
            return DD_EAGAIN;
        struct timespec pause = {0, 50000};
        while (atomic_load(&task->j.pending) != 0)
            nanosleep(&pause, NULL);
    }
    *err_no = atomic_load(&task->j.err);
    free(task->ops);
    free(task);
    return *err_no == 0 ? DD_OK : DD_ESYS;
}

/* ---- blocks ---- */

/* Most rows built on the stack; more go to the heap. */
#define STACK_ROWS 64

int dd_blocks_check(const uint64_t *bases, uint64_t ntensors, uint64_t block_bytes,
                    uint64_t num_blocks, uint64_t start, uint64_t count, const uint64_t *blocks,
                    size_t nblocks, uint64_t seg, uint64_t last, uint64_t *bad)
{
    if ((count && bases == NULL) || (nblocks && blocks == NULL) || bad == NULL)
        return DD_EINVAL;
    *bad = 0;
    if (count == 0 || start > ntensors || count > ntensors - start)
        return DD_BLOCKS_ETENSORS;
    if (seg == 0 || seg > block_bytes || last > block_bytes)
        return DD_BLOCKS_ESEG;
    uint64_t top = 0; /* highest block named */
    for (size_t k = 0; k < nblocks; k++) {
        if (blocks[k] >= num_blocks) {
            *bad = blocks[k];
            return DD_BLOCKS_EBLOCK;
        }
        if (blocks[k] > top)
            top = blocks[k];
    }
    if (nblocks == 0)
        return DD_OK;
    /* Every block ends by top * block_bytes + max(seg, last), which is at most the tensor's
     * bytes: it must fit, and no tensor's blocks may wrap around the address space. */
    uint64_t most = seg > last ? seg : last;
    if (top > (UINT64_MAX - most) / block_bytes)
        return DD_BLOCKS_EADDR;
    uint64_t reach = top * block_bytes + most;
    for (uint64_t t = start; t < start + count; t++)
        if (bases[t] == 0 || bases[t] + reach < bases[t])
            return DD_BLOCKS_EADDR;
    return DD_OK;
}

int dd_blocks_rows(uint64_t *rows, size_t cap, const uint64_t *bases, uint64_t ntensors,
                   uint64_t block_bytes, uint64_t num_blocks, uint64_t start, uint64_t count,
                   const uint64_t *blocks, size_t nblocks, uint64_t seg, uint64_t last,
                   uint64_t *bad)
{
    int rc = dd_blocks_check(bases, ntensors, block_bytes, num_blocks, start, count, blocks,
                             nblocks, seg, last, bad);
    if (rc != DD_OK)
        return rc;
    /* count <= ntensors here, so the product cannot overflow unless the caller's cap lies. */
    if (nblocks && (count > cap / nblocks || rows == NULL))
        return DD_EINVAL;
    for (uint64_t t = start; t < start + count; t++)
        for (size_t k = 0; k < nblocks; k++) {
            *rows++ = bases[t] + blocks[k] * block_bytes;
            *rows++ = k + 1 == nblocks ? last : seg;
        }
    return DD_OK;
}

/* One side of a blocks batch: ntensors tensors from bases, whole blocks of seg bytes, checked
 * as a blocks access of them (with no tensors there is nothing to check or move). */
static int blocks_side_ok(const uint64_t *bases, size_t ntensors, uint64_t row_bytes,
                          uint64_t num_rows, const uint64_t *blocks, size_t nblocks, uint64_t seg)
{
    if (nblocks && ntensors > SIZE_MAX / 3 / nblocks)
        return 0;
    uint64_t bad;
    return ntensors == 0 || dd_blocks_check(bases, ntensors, row_bytes, num_rows, 0, ntensors,
                                            blocks, nblocks, seg, seg, &bad) == DD_OK;
}

int dd_block_rows(uint64_t *rows, const uint64_t *bases, size_t ntensors, uint64_t row_bytes,
                  uint64_t num_rows, const uint64_t *blocks, size_t nblocks, uint64_t seg)
{
    if (nblocks && ntensors > SIZE_MAX / 3 / nblocks)
        return DD_EINVAL;
    if (ntensors == 0)
        return DD_OK;
    uint64_t bad;
    return dd_blocks_rows(rows, ntensors * nblocks, bases, ntensors, row_bytes, num_rows, 0,
                          ntensors, blocks, nblocks, seg, seg, &bad) == DD_OK
               ? DD_OK
               : DD_EINVAL;
}

/* The checks of a blocks copy's two sides (as dd_block_rows). */
static bool blocks_ok(const uint64_t *dst_bases, uint64_t dst_row_bytes, uint64_t dst_num_rows,
                      const uint64_t *dst_blocks, const uint64_t *src_bases,
                      uint64_t src_row_bytes, uint64_t src_num_rows, const uint64_t *src_blocks,
                      size_t ntensors, size_t nblocks, uint64_t seg)
{
    return blocks_side_ok(dst_bases, ntensors, dst_row_bytes, dst_num_rows, dst_blocks, nblocks,
                          seg) &&
           blocks_side_ok(src_bases, ntensors, src_row_bytes, src_num_rows, src_blocks, nblocks,
                          seg);
}

/* The (dst, src, seg) rows of a checked blocks copy, tensor then block, into ops. */
static void blocks_ops(uint64_t *ops, const uint64_t *dst_bases, uint64_t dst_row_bytes,
                       const uint64_t *dst_blocks, const uint64_t *src_bases,
                       uint64_t src_row_bytes, const uint64_t *src_blocks, size_t ntensors,
                       size_t nblocks, uint64_t seg)
{
    for (size_t t = 0; t < ntensors; t++)
        for (size_t k = 0; k < nblocks; k++) {
            *ops++ = dst_bases[t] + dst_blocks[k] * dst_row_bytes;
            *ops++ = src_bases[t] + src_blocks[k] * src_row_bytes;
            *ops++ = seg;
        }
}

/* The checked blocks copy as rows, then dd_vm_copy_batch of them, or (with a signal) the
 * same started in the background. */
static int vm_blocks(int pid, int write, const uint64_t *dst_bases, uint64_t dst_row_bytes,
                     const uint64_t *dst_blocks, const uint64_t *src_bases,
                     uint64_t src_row_bytes, const uint64_t *src_blocks, size_t ntensors,
                     size_t nblocks, uint64_t seg, unsigned nthreads, dd_copy_signal *signal,
                     dd_copy_task **task, int *err_no)
{
    size_t n = ntensors * nblocks;
    if (n == 0)
        return DD_OK;
    uint64_t stack[3 * STACK_ROWS];
    /* A background task owns its rows: always on the heap. */
    uint64_t *ops = signal == NULL && n <= STACK_ROWS ? stack : malloc(3 * n * sizeof *ops);
    if (ops == NULL)
        return DD_ENOMEM;
    blocks_ops(ops, dst_bases, dst_row_bytes, dst_blocks, src_bases, src_row_bytes, src_blocks,
               ntensors, nblocks, seg);
    if (signal != NULL)
        return vm_start(pid, write, ops, n, nthreads, signal, task, err_no);
    int rc = dd_vm_copy_batch(pid, write, ops, n, nthreads, err_no);
    if (ops != stack)
        free(ops);
    return rc;
}

int dd_blocks_ops(uint64_t *ops, const uint64_t *dst_bases, uint64_t dst_row_bytes,
                  uint64_t dst_num_rows, const uint64_t *dst_blocks, const uint64_t *src_bases,
                  uint64_t src_row_bytes, uint64_t src_num_rows, const uint64_t *src_blocks,
                  size_t ntensors, size_t nblocks, uint64_t seg)
{
    if ((ops == NULL && ntensors * nblocks) ||
        !blocks_ok(dst_bases, dst_row_bytes, dst_num_rows, dst_blocks, src_bases, src_row_bytes,
                   src_num_rows, src_blocks, ntensors, nblocks, seg))
        return DD_EINVAL;
    blocks_ops(ops, dst_bases, dst_row_bytes, dst_blocks, src_bases, src_row_bytes, src_blocks,
               ntensors, nblocks, seg);
    return DD_OK;
}

int dd_vm_copy_blocks(int pid, int write, const uint64_t *dst_bases, uint64_t dst_row_bytes,
                      uint64_t dst_num_rows, const uint64_t *dst_blocks,
                      const uint64_t *src_bases, uint64_t src_row_bytes, uint64_t src_num_rows,
                      const uint64_t *src_blocks, size_t ntensors, size_t nblocks, uint64_t seg,
                      unsigned nthreads, int *err_no)
{
    if (err_no == NULL)
        return DD_EINVAL;
    *err_no = 0;
    if (pid < 0 || (write != 0 && write != 1) ||
        !blocks_ok(dst_bases, dst_row_bytes, dst_num_rows, dst_blocks, src_bases, src_row_bytes,
                   src_num_rows, src_blocks, ntensors, nblocks, seg))
        return DD_EINVAL;
    return vm_blocks(pid, write, dst_bases, dst_row_bytes, dst_blocks, src_bases, src_row_bytes,
                     src_blocks, ntensors, nblocks, seg, nthreads, NULL, NULL, err_no);
}

int dd_vm_copy_blocks_start(int pid, int write, const uint64_t *dst_bases,
                            uint64_t dst_row_bytes, uint64_t dst_num_rows,
                            const uint64_t *dst_blocks, const uint64_t *src_bases,
                            uint64_t src_row_bytes, uint64_t src_num_rows,
                            const uint64_t *src_blocks, size_t ntensors, size_t nblocks,
                            uint64_t seg, unsigned nthreads, dd_copy_signal *signal,
                            dd_copy_task **task, int *err_no)
{
    if (!start_args_ok(pid, write, &nthreads, signal, task, err_no) ||
        !blocks_ok(dst_bases, dst_row_bytes, dst_num_rows, dst_blocks, src_bases, src_row_bytes,
                   src_num_rows, src_blocks, ntensors, nblocks, seg))
        return DD_EINVAL;
    return vm_blocks(pid, write, dst_bases, dst_row_bytes, dst_blocks, src_bases, src_row_bytes,
                     src_blocks, ntensors, nblocks, seg, nthreads, signal, task, err_no);
}
