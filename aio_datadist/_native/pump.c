/* pump.c: the one parser of a link's frames, the table of the requests awaiting answers,
 * and the role that says who reads the socket now.
 *
 * A request of this side is entered in the pump's table before it is sent (dd_pump_enter):
 * its id, the frame kind that answers it, the rows its payload lands in and its deadline.
 * Whoever reads completes it without Python: a PULL_DATA payload goes straight into the
 * rows, a PUSH_ACK completes a push. Everything else (the peer's requests, an ERROR, an
 * answer the table does not hold or that does not match it, BYE...) goes to the link's
 * reader thread, whose Python reads the rest of that frame.
 *
 * Three kinds of driver read, one at a time (the role, taken and let go at frame
 * boundaries, or mid-frame with the stream's state kept here for the next driver):
 *  - a blocking waiter, while its spin lasts (dd_pump_wait): its answer costs no thread
 *    hand-over when it comes within the spin; then it sleeps on the completion count
 *    (futex) and the reader thread reads for it;
 *  - an event loop, from its selector (dd_pump_poll): it never waits; a payload still
 *    arriving stays the pump's current frame;
 *  - the reader thread (dd_pump_run), when nobody else does: it stays off the socket while
 *    others drove within the last 5 ms (asleep on the role's word, looking each tick, so a
 *    frame nobody takes waits at most a tick), and takes every frame for Python.
 * A driver that meets a frame for Python parks its header here (or leaves a request of the
 * peer's unread on the socket, for the native server's peek) and wakes the reader thread;
 * no other driver reads until the reader thread took it.
 *
 * A completed request is taken by its waiter if one claimed it; otherwise it is listed as
 * done, for whoever drives to complete its future (dd_pump_take_done). A slot stays taken
 * until its outcome is taken, so whoever gives up on a request (dd_pump_forget: its
 * deadline, the link closing) learns whether the pump still holds it.
 */
#define _GNU_SOURCE
#include "datadist.h"
#include "wire.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define CHUNK 1024
#define CHUNKS 64
#define SLOTS (CHUNK * CHUNKS) /* requests in flight a table holds; more go through Python */
#define SCRATCH (64u << 10)    /* drained payloads land here */
#define PEEK_SLEEP_NS 20000    /* a header too short to tell its kind: first nap, doubling */
#define PEEK_SLEEP_MAX_NS 10000000 /* ... up to this */
#define NOT_OURS 100           /* answer(): a frame for Python */

enum { FREE = 0, WAITING, MOVING, DONE };

typedef struct {
    uint64_t rid;
    const uint64_t *rows;
    size_t nrows;
    uint64_t nbytes;
    int64_t deadline_ns;
    uint64_t moved;
    uint32_t kind;    /* the frame kind that answers it */
    uint8_t state;    /* FREE, WAITING, MOVING, DONE */
    uint8_t claimed;  /* a waiter takes the outcome itself */
    uint8_t listed;   /* on the done list */
    int32_t outcome;  /* DD_PUMP_OK, DD_PUMP_LATE, DD_PUMP_BROKEN */
} slot_t;

struct dd_pump {
    int fd;
    int64_t stall_ns;
    pthread_mutex_t lock; /* the slots, the done list, closed */
    slot_t *chunks[CHUNKS];
    uint64_t *done;       /* ids of unclaimed completions, for dd_pump_take_done */
    size_t ndone, cap_done;
    int closed;
    _Atomic uint32_t seq; /* completions so far: the futex word of waiters */
    _Atomic int sleepers; /* waiters asleep on seq */
    /* The socket's reader: one driver at a time (the role), and where the stream is. */
    _Atomic int driver;           /* 1 while someone reads */
    _Atomic int shut;             /* closed: the role is taken for good */
    _Atomic uint32_t role_seq;    /* bumped as the role is let go: the parked reader's word */
    _Atomic int reader_asleep;    /* the reader thread sleeps in poll: wake it through wake_fd */
    int wake_fd;                  /* eventfd (-1 once closed, under lock) */
    _Atomic int64_t others_until; /* others drive until then: the reader stays off */
    int reader_holds;             /* the reader thread holds the role (Python reads a frame) */
    _Atomic int handoff;          /* p->hdr holds a frame for the reader thread */
    uint8_t hdr[DD_HDR_SIZE];     /* the header being read, or handed off */
    size_t hdr_have;              /* its bytes taken so far (0: at a frame's start) */
    slot_t *cur;                  /* the answer whose payload is arriving */
    uint64_t cur_moved;
    uint64_t owed;                /* payload bytes of an abandoned answer still to discard */
    unsigned char *scratch;
};

static slot_t *slot_at(dd_pump *p, uint64_t rid)
{
    size_t i = (size_t)(rid & (SLOTS - 1));
    slot_t *c = p->chunks[i / CHUNK];
    return c == NULL ? NULL : &c[i % CHUNK];
}

/* The slot holding request rid (lock held), or NULL. */
static slot_t *find(dd_pump *p, uint64_t rid)
{
    slot_t *s = slot_at(p, rid);
    return (s != NULL && s->state != FREE && s->rid == rid) ? s : NULL;
}

static void wake_waiters(dd_pump *p)
{
    atomic_fetch_add_explicit(&p->seq, 1, memory_order_release);
    if (atomic_load_explicit(&p->sleepers, memory_order_acquire) > 0)
        syscall(SYS_futex, &p->seq, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static void release(dd_pump *p, slot_t *s)
{
    s->state = FREE;
    s->rows = NULL;
    s->claimed = s->listed = 0;
}

/* Complete slot s with outcome (lock held): its claiming waiter takes it, else it goes on
 * the done list (DD_ENOMEM when the list cannot grow: the slot is then freed and its id
 * lost, which the caller reports as a broken link). */
static int complete(dd_pump *p, slot_t *s, int32_t outcome, uint64_t moved)
{
    s->state = DONE;
    s->outcome = outcome;
    s->moved = moved;
    int rc = DD_OK;
    if (!s->claimed) {
        if (p->ndone == p->cap_done) {
            size_t cap = p->cap_done ? 2 * p->cap_done : 64;
            uint64_t *grown = realloc(p->done, cap * sizeof *grown);
            if (grown == NULL) {
                s->state = FREE;
                rc = DD_ENOMEM;
                goto woken;
            }
            p->done = grown;
            p->cap_done = cap;
        }
        p->done[p->ndone++] = s->rid;
        s->listed = 1;
    }
woken:
    wake_waiters(p);
    return rc;
}

int dd_pump_new(int fd, int64_t stall_ns, dd_pump **out)
{
    if (out == NULL || fd < 0 || stall_ns <= 0)
        return DD_EINVAL;
    dd_pump *p = calloc(1, sizeof *p);
    if (p == NULL)
        return DD_ENOMEM;
    p->fd = fd;
    p->stall_ns = stall_ns;
    p->wake_fd = -1; /* made by the reader thread as it starts: a link never started has none */
    if (pthread_mutex_init(&p->lock, NULL) != 0) {
        free(p);
        return DD_ENOMEM;
    }
    *out = p;
    return DD_OK;
}

void dd_pump_free(dd_pump *p)
{
    if (p == NULL)
        return;
    for (int i = 0; i < CHUNKS; i++)
        free(p->chunks[i]);
    free(p->done);
    free(p->scratch);
    if (p->wake_fd >= 0)
        close(p->wake_fd);
    pthread_mutex_destroy(&p->lock);
    free(p);
}

int dd_pump_enter(dd_pump *p, uint64_t rid, unsigned kind, const uint64_t *rows, size_t nrows,
                  uint64_t nbytes, int64_t deadline_ns)
{
    if (p == NULL || rid == 0 || (kind != DD_FRAME_PULL_DATA && kind != DD_FRAME_PUSH_ACK) ||
        (nrows > 0 && rows == NULL))
        return DD_EINVAL;
    uint64_t total = 0;
    for (size_t i = 0; i < nrows; i++) {
        uint64_t addr = rows[2 * i], len = rows[2 * i + 1];
        if (len > 0 && (addr == 0 || addr + len < addr || total + len < total))
            return DD_EINVAL;
        total += len;
    }
    if (total != nbytes)
        return DD_EINVAL;
    pthread_mutex_lock(&p->lock);
    int rc = DD_OK;
    size_t i = (size_t)(rid & (SLOTS - 1));
    if (p->closed) {
        rc = DD_ECLOSED;
        goto out;
    }
    if (p->chunks[i / CHUNK] == NULL) {
        p->chunks[i / CHUNK] = calloc(CHUNK, sizeof(slot_t));
        if (p->chunks[i / CHUNK] == NULL) {
            rc = DD_EAGAIN;
            goto out;
        }
    }
    slot_t *s = &p->chunks[i / CHUNK][i % CHUNK];
    if (s->state != FREE) { /* an older request still holds the slot */
        rc = DD_EAGAIN;
        goto out;
    }
    s->rid = rid;
    s->kind = kind;
    s->rows = rows;
    s->nrows = nrows;
    s->nbytes = nbytes;
    s->deadline_ns = deadline_ns;
    s->moved = 0;
    s->outcome = DD_PUMP_OK;
    s->claimed = s->listed = 0;
    s->state = WAITING;
out:
    pthread_mutex_unlock(&p->lock);
    return rc;
}

int dd_pump_forget(dd_pump *p, uint64_t rid)
{
    pthread_mutex_lock(&p->lock);
    slot_t *s = find(p, rid);
    int rc = DD_OK;
    if (s != NULL) {
        if (s->state == WAITING) {
            release(p, s);
            wake_waiters(p); /* a claiming waiter finds it gone */
        } else {
            rc = DD_EAGAIN; /* moving, or an outcome not yet taken */
        }
    }
    pthread_mutex_unlock(&p->lock);
    return rc;
}

/* Take the outcome of done slot s (lock held) and free it. */
static void take(dd_pump *p, slot_t *s, dd_pump_outcome *out)
{
    out->request_id = s->rid;
    out->outcome = s->outcome;
    out->moved = s->moved;
    release(p, s);
}

int dd_pump_take_done(dd_pump *p, dd_pump_outcome *out, size_t cap, size_t *taken)
{
    size_t n = 0, i = 0;
    pthread_mutex_lock(&p->lock);
    for (; i < p->ndone && n < cap; i++) {
        slot_t *s = find(p, p->done[i]);
        if (s != NULL && s->state == DONE && s->listed)
            take(p, s, &out[n++]);
    }
    if (i) /* (done may be NULL while nothing was ever done) */
        memmove(p->done, p->done + i, (p->ndone - i) * sizeof *p->done);
    p->ndone -= i;
    pthread_mutex_unlock(&p->lock);
    *taken = n;
    return DD_OK;
}

/* ---- driving: who reads the socket ---- */

enum {
    READER = 0, /* the link's reader thread: may block; frames for Python come back to it */
    WAITER = 1, /* a blocking waiter, while its spin lasts */
    LOOP = 2    /* an event loop: never waits */
};

/* advance() results besides DD_PUMP_FRAME / DD_PUMP_PEER / DD_PUMP_STALLED and errors. */
enum {
    ADV_IDLE = 100,   /* nothing to read now, at a frame's start */
    ADV_OWN = 101,    /* the waiter's request completed */
    ADV_BOUND = 102,  /* the driver's time ran out mid-frame: the state stays for the next */
    ADV_HANDOFF = 103 /* the next frame is the reader thread's (parked, or left unread) */
};

#define TICK_NS 1000000           /* a parked reader looks this often ... */
#define TICK_MAX_NS 100000000     /* ... backing off to this while nothing comes */
#define OTHERS_NS 5000000         /* after another driver read, the reader stays off this long */

static int acquire(dd_pump *p, int reader)
{
    int free_ = 0;
    if (!atomic_compare_exchange_strong(&p->driver, &free_, 1))
        return 0;
    /* The stream is the reader thread's until it took a frame handed to it; once the pump
     * closed, nobody reads (its descriptor is about to go, and its number may be reused). */
    if ((!reader && p->handoff) || atomic_load(&p->shut)) {
        atomic_store(&p->driver, 0);
        return 0;
    }
    return 1;
}

/* Let the socket go; wake a parked reader thread when it must read now. */
static void wake_reader(dd_pump *p)
{
    if (!atomic_load(&p->reader_asleep))
        return;
    pthread_mutex_lock(&p->lock);
    if (p->wake_fd >= 0) {
        uint64_t one = 1;
        ssize_t w = write(p->wake_fd, &one, sizeof one);
        (void)w; /* a full counter wakes it already */
    }
    pthread_mutex_unlock(&p->lock);
}

static void let_go(dd_pump *p, int wake)
{
    atomic_store(&p->driver, 0);
    atomic_fetch_add(&p->role_seq, 1);
    if (wake)
        wake_reader(p);
}

static int64_t futex_wait(_Atomic uint32_t *word, uint32_t seen, int64_t until_ns)
{
    int64_t left = until_ns - dd_monotonic_ns();
    if (left <= 0)
        return 0;
    struct timespec ts = {.tv_sec = left / 1000000000, .tv_nsec = left % 1000000000};
    return syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, &ts, NULL, 0);
}

static int is_peer_request(unsigned kind)
{
    return kind == DD_FRAME_PULL || kind == DD_FRAME_PUSH || kind == DD_FRAME_PING;
}

/* How long a driver in `mode` may wait for bytes mid-frame: the reader until the stall
 * time, a waiter until its bound, a loop not at all (a deadline in the past). */
static int64_t mid_frame_until(dd_pump *p, int mode, int64_t bound)
{
    if (mode == LOOP)
        return 1;
    if (mode == WAITER)
        return bound;
    return dd_monotonic_ns() + p->stall_ns;
}

/* Discard what is owed of an abandoned payload: DD_OK, ADV_BOUND, or a failure. */
static int drain(dd_pump *p, int mode, int64_t bound)
{
    if (p->scratch == NULL && (p->scratch = malloc(SCRATCH)) == NULL)
        return DD_ENOMEM;
    while (p->owed > 0) {
        uint64_t step = p->owed < SCRATCH ? p->owed : SCRATCH, got = 0;
        const uint64_t row[2] = {(uint64_t)(uintptr_t)p->scratch, step};
        int64_t until = mid_frame_until(p, mode, bound);
        int rc = dd_net_recv_rows(p->fd, row, 1, 0, until, mode == WAITER ? until : 0, &got);
        p->owed -= got;
        if (rc == DD_ETIMEDOUT) {
            if (mode != READER)
                return ADV_BOUND;
            if (got > 0)
                continue; /* slow, not stalled */
            return DD_PUMP_STALLED;
        }
        if (rc != DD_OK)
            return rc;
    }
    return DD_OK;
}

/* Go on receiving the payload in progress: DD_OK (complete), ADV_BOUND, DD_PUMP_LATE (its
 * deadline passed: the rest is owed), or a failure of the socket. */
static int receive_more(dd_pump *p, int mode, int64_t bound)
{
    slot_t *s = p->cur;
    for (;;) {
        int64_t until = mid_frame_until(p, mode, bound);
        if (s->deadline_ns > 0 && s->deadline_ns < until && mode == READER)
            until = s->deadline_ns;
        uint64_t got = 0;
        int rc = dd_net_recv_rows(p->fd, s->rows, s->nrows, p->cur_moved, until,
                                  mode == WAITER ? until : 0, &got);
        p->cur_moved += got;
        if (rc != DD_ETIMEDOUT)
            return rc;
        if (s->deadline_ns > 0 && dd_monotonic_ns() >= s->deadline_ns) {
            p->owed = s->nbytes - p->cur_moved;
            return DD_PUMP_LATE;
        }
        if (mode != READER)
            return ADV_BOUND;
        if (got == 0)
            return DD_PUMP_STALLED;
    }
}

/* Finish the payload in progress with rc (receive_more's). */
static int finish_cur(dd_pump *p, int rc)
{
    slot_t *s = p->cur;
    int outcome = rc == DD_OK ? DD_PUMP_OK : rc == DD_PUMP_LATE ? DD_PUMP_LATE : DD_PUMP_BROKEN;
    pthread_mutex_lock(&p->lock);
    int done = complete(p, s, outcome, p->cur_moved);
    pthread_mutex_unlock(&p->lock);
    p->cur = NULL;
    p->cur_moved = 0;
    if (rc == DD_OK || rc == DD_PUMP_LATE)
        return done;
    return rc;
}

/* Whether request own (0: none) is done (lock taken). */
static int own_done(dd_pump *p, uint64_t own)
{
    if (own == 0)
        return 0;
    pthread_mutex_lock(&p->lock);
    slot_t *s = find(p, own);
    int done = s == NULL || s->state == DONE;
    pthread_mutex_unlock(&p->lock);
    return done;
}

/* The header in p->hdr is whole: take the answer it starts if the table holds it
 * (DD_OK: completed, or its payload now in progress); NOT_OURS otherwise. */
static int begin_answer(dd_pump *p)
{
    dd_frame_header f;
    dd_frame_header_read(p->hdr, &f);
    if (f.magic != DD_WIRE_MAGIC || f.version != DD_WIRE_VERSION ||
        (f.kind != DD_FRAME_PULL_DATA && f.kind != DD_FRAME_PUSH_ACK))
        return NOT_OURS;
    pthread_mutex_lock(&p->lock);
    slot_t *s = find(p, f.request_id);
    if (s == NULL || s->state != WAITING || s->kind != f.kind || f.status != 0 ||
        f.body_len != 0 || f.flags != 0 || f.payload_len != s->nbytes) {
        pthread_mutex_unlock(&p->lock);
        return NOT_OURS; /* Python reads it: a refusal, a mismatch, an id nobody waits for */
    }
    int rc = DD_OK;
    if (f.kind == DD_FRAME_PUSH_ACK || s->nbytes == 0) {
        rc = complete(p, s, DD_PUMP_OK, 0);
    } else {
        s->state = MOVING;
        p->cur = s;
        p->cur_moved = 0;
    }
    pthread_mutex_unlock(&p->lock);
    return rc;
}

/* Read what the socket holds, with the driver role, in `mode`: complete the answers the
 * table holds, and stop at what is not this driver's to read (see ADV_* and DD_PUMP_*).
 * The reader thread gets a frame for Python's header in `header` (DD_PUMP_FRAME); another
 * driver parks it in p->hdr for the reader thread (ADV_HANDOFF). */
static int advance(dd_pump *p, int mode, int64_t bound, uint64_t own, uint8_t *header)
{
    int64_t nap_ns = PEEK_SLEEP_NS, short_since = 0;
    for (;;) {
        if (p->owed > 0) {
            int rc = drain(p, mode, bound);
            if (rc != DD_OK)
                return rc;
        }
        if (p->cur != NULL) {
            int rc = receive_more(p, mode, bound);
            if (rc == ADV_BOUND)
                return rc;
            rc = finish_cur(p, rc);
            if (rc != DD_OK)
                return rc;
        }
        if (own_done(p, own))
            return ADV_OWN;
        if (p->hdr_have == 0) {
            int r = dd_net_ready_now(p->fd);
            if (r < 0)
                return DD_ESYS;
            if (r == 0)
                return ADV_IDLE;
            uint8_t h[DD_HDR_SIZE];
            ssize_t n = recv(p->fd, h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
            if (n == 0)
                return DD_ECLOSED_PEER;
            if (n < 0) {
                if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
                    continue;
                return errno == ECONNRESET ? DD_ECLOSED_PEER : DD_ESYS;
            }
            if ((size_t)n >= DD_HDR_KIND_OFF + DD_HDR_KIND_SIZE) {
                unsigned kind =
                    (unsigned)h[DD_HDR_KIND_OFF] | ((unsigned)h[DD_HDR_KIND_OFF + 1] << 8);
                if (is_peer_request(kind)) /* left on the socket, for the serve table */
                    return mode == READER ? DD_PUMP_PEER : ADV_HANDOFF;
            } else if (mode != LOOP) {
                /* Too little to tell whose frame it is: the rest follows within
                 * microseconds, unless the peer stalled. */
                int64_t now = dd_monotonic_ns();
                if (mode == WAITER && now >= bound)
                    return ADV_BOUND;
                if (short_since == 0)
                    short_since = now;
                else if (now - short_since >= p->stall_ns)
                    return DD_PUMP_STALLED;
                if (mode == WAITER) {
                    dd_cpu_relax();
                } else {
                    struct timespec ts = {0, nap_ns};
                    nanosleep(&ts, NULL);
                    nap_ns = nap_ns * 2 < PEEK_SLEEP_MAX_NS ? nap_ns * 2 : PEEK_SLEEP_MAX_NS;
                }
                continue;
            }
        }
        /* Take the header's bytes: as far as they came (the next driver goes on). */
        uint64_t got = 0;
        const uint64_t row[2] = {(uint64_t)(uintptr_t)(p->hdr + p->hdr_have),
                                 DD_HDR_SIZE - p->hdr_have};
        int64_t until = mid_frame_until(p, mode, bound);
        int rc = dd_net_recv_rows(p->fd, row, 1, 0, until, mode == WAITER ? until : 0, &got);
        p->hdr_have += (size_t)got;
        if (rc == DD_ETIMEDOUT) {
            if (mode != READER)
                return p->hdr_have > 0 && mode == LOOP ? ADV_IDLE : ADV_BOUND;
            if (got == 0)
                return DD_PUMP_STALLED;
            continue;
        }
        if (rc != DD_OK)
            return rc;
        p->hdr_have = 0; /* whole: p->hdr holds it */
        short_since = 0;
        rc = begin_answer(p);
        if (rc == DD_OK)
            continue;
        if (rc != NOT_OURS)
            return rc;
        if (mode == READER) {
            memcpy(header, p->hdr, DD_HDR_SIZE);
            return DD_PUMP_FRAME;
        }
        p->handoff = 1;
        return ADV_HANDOFF;
    }
}

int dd_pump_wait(dd_pump *p, uint64_t rid, int64_t spin_ns, int64_t until_ns,
                 dd_pump_outcome *out)
{
    pthread_mutex_lock(&p->lock);
    slot_t *s = find(p, rid);
    if (s == NULL) {
        pthread_mutex_unlock(&p->lock);
        return DD_EINVAL;
    }
    s->claimed = 1;
    pthread_mutex_unlock(&p->lock);
    int64_t spin_end = dd_monotonic_ns() + spin_ns;
    if (spin_end > until_ns)
        spin_end = until_ns;
    int told = 0; /* the reader thread was told to read for this wait */
    for (;;) {
        uint32_t seen = atomic_load(&p->seq);
        pthread_mutex_lock(&p->lock);
        s = find(p, rid);
        if (s == NULL) {
            pthread_mutex_unlock(&p->lock);
            return DD_EINVAL;
        }
        if (s->state == DONE) {
            take(p, s, out);
            pthread_mutex_unlock(&p->lock);
            return DD_OK;
        }
        int64_t now = dd_monotonic_ns();
        if (now >= until_ns) { /* give it back: the reader lists it once done */
            s->claimed = 0;
            pthread_mutex_unlock(&p->lock);
            return DD_ETIMEDOUT;
        }
        pthread_mutex_unlock(&p->lock);
        if (now < spin_end) {
            if (acquire(p, 0)) {
                atomic_store(&p->others_until, now + OTHERS_NS);
                int rc = advance(p, WAITER, spin_end, rid, NULL);
                /* A frame for the reader thread, or a failure it reports: it reads now. */
                int wake = rc == ADV_HANDOFF || rc < 0 || rc == DD_PUMP_STALLED;
                let_go(p, wake);
            } else {
                dd_cpu_relax();
            }
            continue;
        }
        if (!told) { /* nobody may be reading: the reader thread goes back to the socket */
            told = 1;
            atomic_store(&p->others_until, 0);
            atomic_fetch_add(&p->role_seq, 1);
            wake_reader(p);
        }
        atomic_fetch_add(&p->sleepers, 1);
        futex_wait(&p->seq, seen, until_ns);
        atomic_fetch_sub(&p->sleepers, 1);
    }
}

void dd_pump_expect(dd_pump *p)
{
    atomic_store(&p->others_until, dd_monotonic_ns() + OTHERS_NS);
}

int dd_pump_poll(dd_pump *p)
{
    if (!acquire(p, 0)) /* closed: the loop stops watching (its descriptor hangs up) */
        return atomic_load(&p->shut) ? DD_PUMP_FRAME : DD_EAGAIN;
    atomic_store(&p->others_until, dd_monotonic_ns() + OTHERS_NS);
    int rc = advance(p, LOOP, 1, 0, NULL);
    int handoff = rc == ADV_HANDOFF || rc < 0 || rc == DD_PUMP_STALLED;
    let_go(p, handoff);
    return handoff ? DD_PUMP_FRAME : DD_OK;
}

int dd_pump_close(dd_pump *p)
{
    /* Take the role for good: a driver reading now finishes its bounded turn first (a
     * waiter's spin, a loop's look), and none starts after. */
    atomic_store(&p->shut, 1);
    if (!p->reader_holds) {
        int free_ = 0;
        while (!atomic_compare_exchange_weak(&p->driver, &free_, 1)) {
            free_ = 0;
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
        }
        p->reader_holds = 1;
    }
    pthread_mutex_lock(&p->lock);
    p->closed = 1;
    int rc = DD_OK;
    for (int c = 0; c < CHUNKS; c++) {
        if (p->chunks[c] == NULL)
            continue;
        for (int i = 0; i < CHUNK; i++) {
            slot_t *s = &p->chunks[c][i];
            if (s->state == WAITING || s->state == MOVING)
                if (complete(p, s, DD_PUMP_BROKEN, s->moved) != DD_OK)
                    rc = DD_ENOMEM;
        }
    }
    p->cur = NULL;
    if (p->wake_fd >= 0) { /* (the reader closes it: it polls it no more) */
        close(p->wake_fd);
        p->wake_fd = -1;
    }
    pthread_mutex_unlock(&p->lock);
    return rc;
}

/* The reader thread sleeps until the socket is readable (socket: 1) or it is woken (a
 * driver handed it a frame, or a waiter stopped reading), or until `until`. With socket 0
 * it stays off the socket (others drive): it sleeps on its wake-up only. DD_OK,
 * DD_ETIMEDOUT (until passed), DD_ESYS. */
static int reader_sleep(dd_pump *p, int socket, int64_t until)
{
    int ms = -1;
    if (until > 0) {
        int64_t left = until - dd_monotonic_ns();
        if (left <= 0)
            return DD_ETIMEDOUT;
        int64_t lms = (left + 999999) / 1000000;
        ms = lms > INT_MAX ? INT_MAX : (int)lms;
    }
    if (ms < 0 || ms > 100)
        ms = 100; /* (a wake-up missed by a hair costs at most this) */
    struct pollfd f[2] = {{.fd = p->wake_fd, .events = POLLIN}, {.fd = p->fd, .events = POLLIN}};
    atomic_store(&p->reader_asleep, 1);
    if (atomic_load(&p->handoff)) { /* handed over as it fell asleep */
        atomic_store(&p->reader_asleep, 0);
        return DD_OK;
    }
    int r = poll(f, socket ? 2 : 1, ms);
    atomic_store(&p->reader_asleep, 0);
    if (r < 0 && errno != EINTR)
        return DD_ESYS;
    if (r > 0 && (f[0].revents & POLLIN)) {
        uint64_t n;
        ssize_t got = read(p->wake_fd, &n, sizeof n);
        (void)got;
    }
    if (r > 0 && socket && (f[1].revents & POLLNVAL)) {
        errno = EBADF;
        return DD_ESYS;
    }
    return r == 0 ? DD_ETIMEDOUT : DD_OK;
}

/* The reader thread stays off the socket while others drive, looking each tick: it reads
 * again when woken, when the others stopped, or when a frame waited a whole tick with
 * nobody coming to it. Returns once it should try the socket. */
static void park(dd_pump *p, int64_t idle_until)
{
    int64_t tick = TICK_NS;
    for (;;) {
        int64_t now = dd_monotonic_ns();
        if (now >= atomic_load(&p->others_until) || (idle_until > 0 && now >= idle_until))
            return;
        uint32_t seen = atomic_load(&p->role_seq);
        int rc = reader_sleep(p, 0, now + tick);
        if (rc != DD_ETIMEDOUT)
            return; /* woken: a frame is its, or a waiter stopped reading */
        if (atomic_load(&p->role_seq) != seen) {
            tick = TICK_NS;
            continue; /* someone drove: stay off */
        }
        /* A whole tick with nobody at the socket: a frame waiting now is the reader's. */
        if (dd_net_ready_now(p->fd) != 0)
            return;
        tick = tick * 2 < TICK_MAX_NS ? tick * 2 : TICK_MAX_NS;
    }
}

int dd_pump_run(dd_pump *p, int64_t spin_ns, int spin_first, int64_t idle_ns, uint8_t *header)
{
    int64_t now = dd_monotonic_ns();
    int64_t spin_end = spin_first ? now + spin_ns : 0;
    int64_t idle_until = idle_ns > 0 ? now + idle_ns : 0;
    if (p->wake_fd < 0) {
        pthread_mutex_lock(&p->lock);
        if (!p->closed)
            p->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        int made = p->wake_fd >= 0;
        pthread_mutex_unlock(&p->lock);
        if (!made)
            return DD_ESYS;
    }
    for (;;) {
        if (!p->reader_holds) {
            if (!acquire(p, 1)) {
                park(p, idle_until);
                if (idle_until > 0 && dd_monotonic_ns() >= idle_until)
                    return DD_ETIMEDOUT;
                continue;
            }
            p->reader_holds = 1;
            if (p->handoff) { /* a frame another driver parked */
                p->handoff = 0;
                memcpy(header, p->hdr, DD_HDR_SIZE);
                return DD_PUMP_FRAME;
            }
        }
        pthread_mutex_lock(&p->lock);
        size_t ndone = p->ndone;
        pthread_mutex_unlock(&p->lock);
        int rc;
        if (ndone > 0 && p->cur == NULL && p->owed == 0 && p->hdr_have == 0 &&
            (ndone >= 64 || dd_net_ready_now(p->fd) == 0)) {
            rc = ADV_IDLE; /* outcomes first, at a frame's start */
        } else {
            rc = advance(p, READER, 0, 0, header);
        }
        if (rc == DD_PUMP_FRAME || rc == DD_PUMP_PEER) {
            pthread_mutex_lock(&p->lock);
            ndone = p->ndone;
            pthread_mutex_unlock(&p->lock);
            if (rc == DD_PUMP_PEER && ndone > 0) {
                p->reader_holds = 0;
                let_go(p, 0);
                return DD_PUMP_DONE; /* outcomes first: the frame may depend on them */
            }
            return rc; /* the reader thread keeps the socket for the rest of the frame */
        }
        if (rc != ADV_IDLE) { /* the link cannot go on */
            p->reader_holds = 0;
            let_go(p, 0);
            return rc;
        }
        pthread_mutex_lock(&p->lock);
        ndone = p->ndone;
        pthread_mutex_unlock(&p->lock);
        if (ndone > 0) {
            p->reader_holds = 0;
            let_go(p, 0);
            return DD_PUMP_DONE;
        }
        now = dd_monotonic_ns();
        if (now < spin_end) { /* after the peer's requests: the next follows at once */
            dd_cpu_relax();
            continue;
        }
        p->reader_holds = 0;
        let_go(p, 0);
        if (now < atomic_load(&p->others_until)) {
            park(p, idle_until);
        } else {
            rc = reader_sleep(p, 1, idle_until);
            if (rc == DD_ESYS)
                return rc;
            if (idle_until > 0 && dd_monotonic_ns() >= idle_until)
                return DD_ETIMEDOUT;
        }
    }
}
