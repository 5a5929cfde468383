/* net.c: scatter-gather socket I/O straight from and into registered memory.
 *
 * A transfer is a table of (addr, len) rows read as one stream of bytes. The rows are
 * turned into a window of at most IOV_MAX iovecs that one sendmsg/recvmsg call consumes;
 * a partial call advances the window mid-entry, and the window is topped up from the
 * remaining rows before it runs low, so a table of any length costs time linear in its
 * rows no matter how the kernel splits the bytes.
 *
 * Blocking and non-blocking descriptors are handled alike without touching the
 * descriptor's mode (which other threads or Python's socket object may rely on): every
 * call passes MSG_DONTWAIT, and only when the kernel answers EAGAIN do we wait in poll()
 * until the descriptor is ready or the deadline passes. So the deadline is honoured even
 * on a blocking socket, and a transfer the kernel can finish at once never pays for a
 * poll. Being socket calls, these work on sockets only (a pipe gives ENOTSOCK).
 *
 * Errors: DD_ETIMEDOUT when we would have to wait past the deadline, DD_ECLOSED_PEER on
 * EOF, ECONNRESET or EPIPE, DD_ESYS for any other failed system call with errno left as
 * that call set it (cffi hands errno to Python as ffi.errno). *done always receives the
 * bytes moved before the return, so a caller can tell how far a failed transfer got.
 */
#define _GNU_SOURCE
#include "datadist.h"
#include "wire.h"

#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* Upper bound of the iovec window; the effective one is min(this, sysconf(_SC_IOV_MAX)).
 * 1024 is Linux's UIO_MAXIOV, and 16 KiB of iovecs on the stack is harmless. */
#define WINDOW_MAX 1024
/* Bytes offered to one call. The kernel moves at most ~2 GiB per call anyway, and the sum
 * of iov_len must fit in ssize_t, so rows longer than this are offered in pieces. */
#define CALL_BYTES_MAX (1ull << 30)
/* Pause instructions between two polls of a busy-polling wait (about a microsecond). */
#ifndef SPIN_PAUSES
#define SPIN_PAUSES 32
#endif

static atomic_int g_window; /* 0 until first use */

static int window_size(void)
{
    int w = atomic_load_explicit(&g_window, memory_order_relaxed);
    if (w == 0) {
        long lim = sysconf(_SC_IOV_MAX);
        /* -1 means "no limit" (or unknown): POSIX guarantees at least 16, Linux has 1024. */
        w = lim <= 0 || lim > WINDOW_MAX ? WINDOW_MAX : (int)lim;
        atomic_store_explicit(&g_window, w, memory_order_relaxed);
    }
    return w;
}

int64_t dd_monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

typedef struct {
    const uint64_t *rows; /* n rows of (addr, len) */
    size_t n;
    size_t row;      /* next byte not yet in the window: row ... */
    uint64_t off;    /* ... and offset within it */
    int cap;         /* window capacity in entries */
    int head, tail;  /* live entries are v[head, tail) */
    uint64_t bytes;  /* bytes in the live entries */
    struct iovec v[WINDOW_MAX];
} window_t;

/* Move the live entries to the front and append rows until the window is full. */
static void refill(window_t *w)
{
    if (w->head > 0) {
        memmove(w->v, w->v + w->head, (size_t)(w->tail - w->head) * sizeof w->v[0]);
        w->tail -= w->head;
        w->head = 0;
    }
    while (w->tail < w->cap && w->row < w->n && w->bytes < CALL_BYTES_MAX) {
        uint64_t addr = w->rows[2 * w->row], len = w->rows[2 * w->row + 1];
        if (w->off >= len) { /* zero-length rows never reach the kernel */
            w->row++;
            w->off = 0;
            continue;
        }
        uint64_t take = len - w->off, room = CALL_BYTES_MAX - w->bytes;
        if (take > room)
            take = room;
        w->v[w->tail].iov_base = (void *)(uintptr_t)(addr + w->off);
        w->v[w->tail].iov_len = (size_t)take;
        w->tail++;
        w->bytes += take;
        w->off += take;
        if (w->off == len) {
            w->row++;
            w->off = 0;
        }
    }
}

/* Drop k bytes from the front of the window, splitting an entry when k ends inside it. */
static void consume(window_t *w, uint64_t k)
{
    w->bytes -= k;
    while (k > 0) {
        struct iovec *e = &w->v[w->head];
        if (k >= e->iov_len) {
            k -= e->iov_len;
            w->head++;
        } else {
            e->iov_base = (char *)e->iov_base + k;
            e->iov_len -= (size_t)k;
            k = 0;
        }
    }
}

/* Wait until fd is ready for `events` or the deadline passes. */
static int wait_ready(int fd, short events, int64_t deadline_ns)
{
    for (;;) {
        int ms = -1;
        if (deadline_ns > 0) {
            int64_t left = deadline_ns - dd_monotonic_ns();
            if (left <= 0)
                return DD_ETIMEDOUT;
            /* Round up: waking a hair early would only spin through another poll. */
            int64_t lms = (left + 999999) / 1000000;
            ms = lms > INT_MAX ? INT_MAX : (int)lms;
        }
        struct pollfd p = {.fd = fd, .events = events, .revents = 0};
        int r = poll(&p, 1, ms);
        if (r > 0) {
            if (p.revents & POLLNVAL) {
                errno = EBADF;
                return DD_ESYS;
            }
            /* POLLERR/POLLHUP: the next send/recv reports what happened. */
            return DD_OK;
        }
        if (r < 0 && errno != EINTR)
            return DD_ESYS;
        /* Timed out or interrupted: the clock at the top decides whether to go on. */
    }
}

/* Check everything before any I/O, so a bad table moves no byte. */
static int validate(int fd, const uint64_t *iov, size_t n)
{
    if (fd < 0 || (n > 0 && iov == NULL))
        return DD_EINVAL;
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t addr = iov[2 * i], len = iov[2 * i + 1];
        if (len == 0)
            continue;
        if (addr == 0 || addr + len < addr || total + len < total)
            return DD_EINVAL;
        total += len;
    }
    return DD_OK;
}

static int spin_ready(int fd, short events, int64_t spin_end);
static int ready_now(int fd, short events);

/* Move the rows through fd by the deadline. While the clock is before spin_end, a socket
 * that has nothing (or no room) is busy-polled instead of slept on. */
static int transfer(int fd, const uint64_t *iov, size_t n, int64_t deadline_ns, uint64_t *done,
                    int sending, int64_t spin_end, uint64_t skip)
{
    uint64_t moved = 0;
    if (done != NULL)
        *done = 0;
    int rc = validate(fd, iov, n);
    if (rc != DD_OK)
        return rc;

    window_t w;
    w.rows = iov;
    w.n = n;
    w.row = 0;
    w.off = 0;
    while (skip > 0 && w.row < n) { /* start skip bytes in (the rest of a frame) */
        uint64_t len = iov[2 * w.row + 1];
        if (skip < len) {
            w.off = skip;
            break;
        }
        skip -= len;
        w.row++;
    }
    w.cap = window_size();
    w.head = w.tail = 0;
    w.bytes = 0;

    for (;;) {
        /* Top up once the window is half spent, so each call offers plenty of work. */
        int live = w.tail - w.head;
        if (w.row < w.n && (live <= w.cap / 2 || w.bytes <= CALL_BYTES_MAX / 2))
            refill(&w);
        if (w.head == w.tail) {
            rc = DD_OK;
            break;
        }
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = w.v + w.head;
        m.msg_iovlen = (size_t)(w.tail - w.head);
        ssize_t r = sending ? sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT)
                            : recvmsg(fd, &m, MSG_DONTWAIT);
        if (r > 0) {
            moved += (uint64_t)r;
            consume(&w, (uint64_t)r);
            continue;
        }
        if (r == 0) {
            if (!sending) { /* orderly shutdown before every byte arrived */
                rc = DD_ECLOSED_PEER;
                break;
            }
            /* A stream socket never sends 0 of a non-empty request; treat it as "full". */
            errno = EAGAIN;
        }
        int e = errno;
        if (e == EINTR)
            continue;
        if (e == EAGAIN || e == EWOULDBLOCK) {
            short events = sending ? POLLOUT : POLLIN;
            int spun = spin_end > 0 ? spin_ready(fd, events, spin_end) : 0;
            if (spun > 0)
                continue;
            rc = spun < 0 ? DD_ESYS : wait_ready(fd, events, deadline_ns);
            if (rc != DD_OK)
                break;
            continue;
        }
        if (e == EPIPE || e == ECONNRESET) {
            rc = DD_ECLOSED_PEER;
            break;
        }
        errno = e;
        rc = DD_ESYS;
        break;
    }
    /* Keep errno as the failing call left it: nothing below may touch it. */
    if (done != NULL)
        *done = moved;
    return rc;
}

int dd_sock_sendv(int fd, const uint64_t *iov, size_t n, int64_t deadline_ns, uint64_t *done)
{
    return transfer(fd, iov, n, deadline_ns, done, 1, 0, 0);
}

int dd_sock_recvv(int fd, const uint64_t *iov, size_t n, int64_t deadline_ns, uint64_t *done)
{
    return transfer(fd, iov, n, deadline_ns, done, 0, 0, 0);
}

int dd_net_recv_rows(int fd, const uint64_t *iov, size_t n, uint64_t skip, int64_t deadline_ns,
                     int64_t spin_end, uint64_t *done)
{
    return transfer(fd, iov, n, deadline_ns, done, 0, spin_end, skip);
}

int dd_net_ready_now(int fd)
{
    return ready_now(fd, POLLIN);
}

int dd_sock_send(int fd, uint64_t addr, uint64_t len, int64_t deadline_ns, uint64_t *done)
{
    const uint64_t row[2] = {addr, len};
    return transfer(fd, row, 1, deadline_ns, done, 1, 0, 0);
}

int dd_sock_recv(int fd, uint64_t addr, uint64_t len, int64_t deadline_ns, uint64_t *done)
{
    const uint64_t row[2] = {addr, len};
    return transfer(fd, row, 1, deadline_ns, done, 0, 0, 0);
}

/* A short pause between polls, leaving the core's other hardware thread its share. */
void dd_cpu_relax(void)
{
    for (int i = 0; i < SPIN_PAUSES; i++) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ __volatile__("yield");
#else
        __asm__ __volatile__("" ::: "memory");
#endif
    }
}

/* One poll() that never sleeps: 1 ready (or error/hangup pending), 0 not, -1 failed. poll()
 * reads the socket's state without taking its lock, so polling in a loop never holds up the
 * kernel delivering bytes to the socket, as recv(MSG_PEEK) in a loop would. */
static int ready_now(int fd, short events)
{
    for (;;) {
        struct pollfd p = {.fd = fd, .events = events, .revents = 0};
        int r = poll(&p, 1, 0);
        if (r > 0) {
            if (p.revents & POLLNVAL) {
                errno = EBADF;
                return -1;
            }
            return 1;
        }
        if (r == 0)
            return 0;
        if (errno != EINTR)
            return -1;
    }
}

/* Busy-poll fd until it is ready for `events` (1), the clock reaches spin_end (0) or the
 * poll fails (-1). */
static int spin_ready(int fd, short events, int64_t spin_end)
{
    for (;;) {
        int r = ready_now(fd, events);
        if (r != 0)
            return r;
        if (dd_monotonic_ns() >= spin_end)
            return 0;
        dd_cpu_relax();
    }
}

int dd_sock_wait_readable(int fd, int64_t spin_ns, int64_t deadline_ns)
{
    if (fd < 0 || spin_ns < 0)
        return DD_EINVAL;
    int64_t now = dd_monotonic_ns();
    int64_t spin_end = now + spin_ns;
    if (deadline_ns > 0 && deadline_ns < spin_end)
        spin_end = deadline_ns;
    /* Busy polling: a thread that expects bytes within microseconds skips the sleep and
     * the wake-up, which cost more than the wait itself on a virtual CPU. */
    int r = spin_ready(fd, POLLIN, spin_end);
    if (r != 0)
        return r > 0 ? DD_OK : DD_ESYS;
    if (deadline_ns > 0 && dd_monotonic_ns() >= deadline_ns)
        return DD_ETIMEDOUT;
    return wait_ready(fd, POLLIN, deadline_ns);
}

int dd_sock_tune(int fd, int nodelay, int sndbuf, int rcvbuf)
{
    if (fd < 0 || sndbuf < 0 || rcvbuf < 0)
        return DD_EINVAL;
    if (nodelay >= 0) {
        int on = nodelay > 0;
        /* Unix-domain and other non-TCP sockets refuse TCP options; that is not an error
         * for a caller who tunes whatever socket a transport handed it. */
        if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on) != 0 &&
            errno != ENOPROTOOPT && errno != EOPNOTSUPP)
            return DD_ESYS;
    }
    if (sndbuf > 0 && setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf) != 0)
        return DD_ESYS;
    if (rcvbuf > 0 && setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf) != 0)
        return DD_ESYS;
    return DD_OK;
}
