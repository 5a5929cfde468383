/* pump.c: the one reader of a link's socket, and the table of the requests awaiting answers.
 *
 * Every frame that arrives on a link is read by its pump, which runs in the link's reader
 * thread with the GIL released (dd_pump_run). A request of this side is entered in the
 * pump's table before it is sent (dd_pump_enter): its id, the frame kind that answers it,
 * the rows its payload lands in and its deadline. The pump then completes it without
 * Python: a PULL_DATA payload goes straight into the rows, a PUSH_ACK completes a push.
 * Everything else (the peer's requests, an ERROR, an answer the table does not hold or
 * that does not match it, BYE...) is handed back to the reader thread's Python, which
 * reads the rest of that frame itself and calls dd_pump_run again: the socket passes
 * between them by call and return, never by a lock.
 *
 * A completed request is taken by its waiter. A blocking caller waits in dd_pump_wait: it
 * claims the request, busy-polls the completion count for a while, then sleeps on it
 * (futex); the pump wakes it and it takes the outcome itself. A request nobody claimed is
 * listed as done, and dd_pump_run returns DD_PUMP_DONE so the reader thread takes the list
 * (dd_pump_take_done) and completes their futures. A slot stays taken until its outcome is
 * taken, so whoever gives up on a request (dd_pump_forget: its deadline, the link closing)
 * learns whether the pump still holds it.
 *
 * While answers are due the pump busy-polls the socket after each frame for spin_ns
 * before it sleeps; a request entered while it sleeps kicks it awake (an eventfd), so its
 * wake-up overlaps the round trip instead of following it.
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
#include <sys/eventfd.h>
#include <sys/socket.h>
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
    int kick_fd;          /* eventfd: a request entered while the pump sleeps (made once
                             the pump first sleeps with answers due; -1 until then) */
    int64_t stall_ns;
    pthread_mutex_t lock; /* the slots, the done list, closed */
    slot_t *chunks[CHUNKS];
    uint64_t due;         /* slots WAITING or MOVING */
    uint64_t *done;       /* ids of unclaimed completions, for dd_pump_take_done */
    size_t ndone, cap_done;
    int closed;
    _Atomic uint32_t seq; /* completions so far: the futex word of waiters */
    _Atomic int sleepers; /* waiters asleep on seq */
    _Atomic int asleep;   /* the pump sleeps in poll */
    _Atomic uint64_t entered; /* requests entered so far */
    uint64_t owed;        /* payload bytes of an abandoned answer still to discard */
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
    if (s->state == WAITING || s->state == MOVING)
        p->due--;
    s->state = FREE;
    s->rows = NULL;
    s->claimed = s->listed = 0;
}

/* Complete slot s with outcome (lock held): its claiming waiter takes it, else it goes on
 * the done list (DD_ENOMEM when the list cannot grow: the slot is then freed and its id
 * lost, which the caller reports as a broken link). */
static int complete(dd_pump *p, slot_t *s, int32_t outcome, uint64_t moved)
{
    p->due--;
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
    p->kick_fd = -1;
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
    if (p->kick_fd >= 0)
        close(p->kick_fd);
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
    p->due++;
    atomic_fetch_add(&p->entered, 1);
    if (p->kick_fd >= 0 && atomic_load(&p->asleep)) {
        uint64_t one = 1;
        ssize_t w = write(p->kick_fd, &one, sizeof one);
        (void)w; /* a full counter already kicks */
    }
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
    memmove(p->done, p->done + i, (p->ndone - i) * sizeof *p->done);
    p->ndone -= i;
    pthread_mutex_unlock(&p->lock);
    *taken = n;
    return DD_OK;
}

static int64_t futex_wait(_Atomic uint32_t *word, uint32_t seen, int64_t until_ns)
{
    int64_t left = until_ns - dd_monotonic_ns();
    if (left <= 0)
        return 0;
    struct timespec ts = {.tv_sec = left / 1000000000, .tv_nsec = left % 1000000000};
    return syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, &ts, NULL, 0);
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
    if (s->state == DONE) {
        take(p, s, out);
        pthread_mutex_unlock(&p->lock);
        return DD_OK;
    }
    s->claimed = 1;
    pthread_mutex_unlock(&p->lock);
    int64_t spin_end = dd_monotonic_ns() + spin_ns;
    for (;;) {
        uint32_t seen = atomic_load_explicit(&p->seq, memory_order_acquire);
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
        if (now >= until_ns) { /* give it back: the pump lists it once done */
            s->claimed = 0;
            pthread_mutex_unlock(&p->lock);
            return DD_ETIMEDOUT;
        }
        pthread_mutex_unlock(&p->lock);
        if (now < spin_end) {
            while (atomic_load_explicit(&p->seq, memory_order_acquire) == seen &&
                   dd_monotonic_ns() < spin_end)
                dd_cpu_relax();
            continue;
        }
        atomic_fetch_add_explicit(&p->sleepers, 1, memory_order_acq_rel);
        futex_wait(&p->seq, seen, until_ns);
        atomic_fetch_sub_explicit(&p->sleepers, 1, memory_order_acq_rel);
    }
}

int dd_pump_close(dd_pump *p)
{
    pthread_mutex_lock(&p->lock);
    p->closed = 1;
    if (p->kick_fd >= 0) { /* (the reader closes it: nothing polls it any more) */
        close(p->kick_fd);
        p->kick_fd = -1;
    }
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
    pthread_mutex_unlock(&p->lock);
    return rc;
}

/* Discard what is owed of an abandoned payload. */
static int drain(dd_pump *p)
{
    if (p->scratch == NULL && (p->scratch = malloc(SCRATCH)) == NULL)
        return DD_ENOMEM;
    while (p->owed > 0) {
        uint64_t step = p->owed < SCRATCH ? p->owed : SCRATCH, got = 0;
        const uint64_t row[2] = {(uint64_t)(uintptr_t)p->scratch, step};
        int rc = dd_net_recv_rows(p->fd, row, 1, 0, dd_monotonic_ns() + p->stall_ns, 0, &got);
        p->owed -= got;
        if (rc == DD_ETIMEDOUT && got > 0)
            continue; /* slow, not stalled */
        if (rc != DD_OK)
            return rc == DD_ETIMEDOUT ? DD_PUMP_STALLED : rc;
    }
    return DD_OK;
}

/* Receive slot s's payload (s is MOVING; no lock held): DD_OK, DD_PUMP_LATE (its deadline
 * passed: the rest is owed), or why the link cannot go on. */
static int receive(dd_pump *p, slot_t *s, int64_t spin_end, uint64_t *moved)
{
    *moved = 0;
    for (;;) {
        int64_t now = dd_monotonic_ns(), until = now + p->stall_ns;
        if (s->deadline_ns > 0 && s->deadline_ns < until)
            until = s->deadline_ns;
        uint64_t got = 0;
        int64_t spin_until = spin_end < until ? spin_end : until;
        int rc = dd_net_recv_rows(p->fd, s->rows, s->nrows, *moved, until, spin_until, &got);
        *moved += got;
        if (rc != DD_ETIMEDOUT)
            return rc;
        if (s->deadline_ns > 0 && dd_monotonic_ns() >= s->deadline_ns) {
            p->owed = s->nbytes - *moved;
            return DD_PUMP_LATE;
        }
        if (got == 0)
            return DD_PUMP_STALLED;
    }
}

/* Take an answer the table holds, whose header h was just read; NOT_OURS when it is not one. */
static int answer(dd_pump *p, const dd_frame_header *h, int64_t spin_end)
{
    pthread_mutex_lock(&p->lock);
    slot_t *s = find(p, h->request_id);
    if (s == NULL || s->state != WAITING || s->kind != h->kind || h->status != 0 ||
        h->body_len != 0 || h->flags != 0 || h->payload_len != s->nbytes) {
        pthread_mutex_unlock(&p->lock);
        return NOT_OURS; /* Python reads it: a refusal, a mismatch, an id nobody waits for */
    }
    if (h->kind == DD_FRAME_PUSH_ACK || s->nbytes == 0) {
        int rc = complete(p, s, DD_PUMP_OK, 0);
        pthread_mutex_unlock(&p->lock);
        return rc;
    }
    s->state = MOVING;
    pthread_mutex_unlock(&p->lock);
    uint64_t moved = 0;
    int rc = receive(p, s, spin_end, &moved);
    pthread_mutex_lock(&p->lock);
    int outcome = rc == DD_OK ? DD_PUMP_OK : rc == DD_PUMP_LATE ? DD_PUMP_LATE : DD_PUMP_BROKEN;
    int done = complete(p, s, outcome, moved);
    pthread_mutex_unlock(&p->lock);
    if (rc == DD_OK || rc == DD_PUMP_LATE)
        return done;
    return rc;
}

static int is_peer_request(unsigned kind)
{
    return kind == DD_FRAME_PULL || kind == DD_FRAME_PUSH || kind == DD_FRAME_PING;
}

/* Sleep until the socket is readable, a request is entered (*kicked), or idle_until passes:
 * DD_OK, DD_ETIMEDOUT, or DD_ESYS. A request entered since *entered_seen kicks at once. */
static int sleep_readable(dd_pump *p, int64_t idle_until, uint64_t *entered_seen, int *kicked)
{
    *kicked = 0;
    pthread_mutex_lock(&p->lock);
    if (p->kick_fd < 0 && p->due > 0) /* none: the answer's arrival wakes the pump */
        p->kick_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    int kick_fd = p->kick_fd;
    pthread_mutex_unlock(&p->lock);
    atomic_store(&p->asleep, 1);
    uint64_t entered = atomic_load(&p->entered);
    int rc = DD_OK;
    while (entered == *entered_seen) {
        int ms = -1;
        if (idle_until > 0) {
            int64_t left = idle_until - dd_monotonic_ns();
            if (left <= 0) {
                rc = DD_ETIMEDOUT;
                break;
            }
            int64_t lms = (left + 999999) / 1000000;
            ms = lms > INT_MAX ? INT_MAX : (int)lms;
        }
        struct pollfd f[2] = {{.fd = p->fd, .events = POLLIN}, {.fd = kick_fd, .events = POLLIN}};
        int r = poll(f, kick_fd >= 0 ? 2 : 1, ms);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            rc = DD_ESYS;
            break;
        }
        if (r == 0)
            continue; /* the clock at the top decides */
        if (kick_fd >= 0 && (f[1].revents & POLLIN)) {
            uint64_t n;
            ssize_t got = read(kick_fd, &n, sizeof n);
            (void)got;
        }
        if (f[0].revents & POLLNVAL) {
            errno = EBADF;
            rc = DD_ESYS;
        }
        break;
    }
    atomic_store(&p->asleep, 0);
    entered = atomic_load(&p->entered);
    if (entered != *entered_seen) {
        *entered_seen = entered;
        *kicked = 1;
    }
    return rc;
}

int dd_pump_run(dd_pump *p, int64_t spin_ns, int spin_first, int64_t idle_ns, uint8_t *header)
{
    int64_t now = dd_monotonic_ns();
    int64_t spin_end = spin_first ? now + spin_ns : 0;
    int64_t idle_until = idle_ns > 0 ? now + idle_ns : 0;
    int64_t short_since = 0; /* a header too short to tell its kind, seen since then */
    int64_t nap_ns = PEEK_SLEEP_NS;
    uint64_t entered_seen = atomic_load(&p->entered);
    for (;;) {
        int r = dd_net_ready_now(p->fd);
        if (r < 0)
            return DD_ESYS;
        pthread_mutex_lock(&p->lock);
        size_t ndone = p->ndone;
        uint64_t due = p->due;
        pthread_mutex_unlock(&p->lock);
        /* Outcomes go to their futures before the pump waits on anything: bytes still to
         * come, a payload owed, or a batch of answers grown long. */
        if (ndone > 0 && (r == 0 || p->owed > 0 || ndone >= 64))
            return DD_PUMP_DONE;
        if (p->owed > 0) {
            int rc = drain(p);
            if (rc != DD_OK)
                return rc;
            continue;
        }
        if (r == 0) {
            now = dd_monotonic_ns();
            if (now < spin_end) {
                dd_cpu_relax();
                continue;
            }
            if (due > 0 && atomic_load(&p->entered) != entered_seen) {
                entered_seen = atomic_load(&p->entered); /* a new request: its answer is due */
                spin_end = now + spin_ns;
                continue;
            }
            int kicked = 0;
            int rc = sleep_readable(p, idle_until, &entered_seen, &kicked);
            if (rc != DD_OK)
                return rc;
            if (kicked)
                spin_end = dd_monotonic_ns() + spin_ns;
            continue;
        }
        uint8_t h[DD_HDR_SIZE];
        ssize_t n = recv(p->fd, h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0)
            return DD_ECLOSED_PEER;
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
                continue;
            return errno == ECONNRESET ? DD_ECLOSED_PEER : DD_ESYS;
        }
        if ((size_t)n < DD_HDR_KIND_OFF + DD_HDR_KIND_SIZE) {
            /* Too little to tell whose frame it is: the rest follows within microseconds,
             * unless the peer stalled. */
            now = dd_monotonic_ns();
            if (short_since == 0)
                short_since = now;
            else if (now - short_since >= p->stall_ns)
                return DD_PUMP_STALLED;
            struct timespec ts = {0, nap_ns};
            nanosleep(&ts, NULL);
            nap_ns = nap_ns * 2 < PEEK_SLEEP_MAX_NS ? nap_ns * 2 : PEEK_SLEEP_MAX_NS;
            continue;
        }
        short_since = 0;
        nap_ns = PEEK_SLEEP_NS;
        unsigned kind = (unsigned)h[DD_HDR_KIND_OFF] | ((unsigned)h[DD_HDR_KIND_OFF + 1] << 8);
        if (ndone > 0 && kind != DD_FRAME_PULL_DATA && kind != DD_FRAME_PUSH_ACK)
            return DD_PUMP_DONE; /* outcomes first: the frame may depend on them (limits) */
        if (is_peer_request(kind))
            return DD_PUMP_PEER; /* left on the socket, for the native server or Python */
        const uint64_t row[2] = {(uint64_t)(uintptr_t)h, sizeof h};
        uint64_t got = 0;
        int rc = dd_net_recv_rows(p->fd, row, 1, 0, dd_monotonic_ns() + p->stall_ns, 0, &got);
        if (rc != DD_OK)
            return rc == DD_ETIMEDOUT ? DD_PUMP_STALLED : rc;
        dd_frame_header f;
        dd_frame_header_read(h, &f);
        if (f.magic == DD_WIRE_MAGIC && f.version == DD_WIRE_VERSION &&
            (kind == DD_FRAME_PULL_DATA || kind == DD_FRAME_PUSH_ACK)) {
            int64_t window = dd_monotonic_ns() + spin_ns;
            rc = answer(p, &f, window);
            if (rc == DD_OK) {
                pthread_mutex_lock(&p->lock);
                due = p->due;
                pthread_mutex_unlock(&p->lock);
                spin_end = due > 0 ? window : 0; /* more answers due: they may follow at once */
                continue;
            }
            if (rc != NOT_OURS)
                return rc;
        }
        memcpy(header, h, sizeof h);
        return DD_PUMP_FRAME;
    }
}
