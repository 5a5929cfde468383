/* serve.c: small pulls and pushes of blocks, answered from the link's reader thread in C.
 *
 * A serve table lists the blocks caches an engine lets peers read and write that live in
 * host-addressable memory: per cache its blocks-key ident and, per tensor, the address of
 * its first block. The engine keeps it current from its cache registry.
 *
 * dd_serve_requests() looks at the frames waiting on a link's socket without consuming them
 * (MSG_PEEK). A frame that is a whole, well-formed PULL or PUSH of blocks of a listed
 * cache, whose every row lies inside that cache and adds up to the size the requester
 * expects, is taken and answered at once: a pull with the PULL_DATA header and the rows of
 * cache memory in one sendmsg, a push (only once all of its payload has arrived: the rest
 * of one in flight is busy-polled for briefly, never slept for) by one recvmsg straight
 * into the rows and a PUSH_ACK. The first frame that
 * is anything else, or not yet whole, stops the loop and is left on the socket for the
 * transport's general reader, which also answers every refusal: this path never answers
 * an error, so a refusal reads the same whichever path met it.
 *
 * The frame header and access layouts are wire.h's, which the Python path reads too; the
 * tests check both paths agree.
 *
 * Memory in use is pinned: dd_serve_table_set() waits until no transfer uses a cache it
 * drops, so a cache unregistered meanwhile keeps its memory until its bytes moved. An
 * answer the kernel takes only in part hands its rest to the caller, with the pin held for
 * a pull (DD_SERVE_PARTIAL); dd_serve_unpin() releases it once the rest went.
 */
#define _GNU_SOURCE
#include "datadist.h"
#include "wire.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

/* Largest frame looked at: header, a PULL's byte count, the access's fixed part and up to
 * PEEK_BLOCKS block ids. */
#define PEEK_BLOCKS 496
#define PEEK_MAX                                                                              \
    (DD_HDR_SIZE + DD_PULL_NBYTES_SIZE + DD_ACCESS_FIXED_SIZE + DD_ACCESS_BLOCK_SIZE * PEEK_BLOCKS)
/* Largest push whose payload still arriving is busy-polled for. */
#define PUSH_SPIN_MAX (256u << 10)
/* Payload rows of one answer: one sendmsg carries them with the header (IOV_MAX 1024). */
#define ROWS_MAX 1023

static uint64_t rd64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v; /* the native layer builds for little-endian hosts only (x86-64, aarch64) */
}

/* ---- the table ---- */

typedef struct entry {
    uint64_t ident, ntensors, row_bytes, num_rows;
    uint64_t *addrs;
    uint64_t pins;
    struct entry *next_retired;
} entry_t;

struct dd_serve_table {
    pthread_mutex_t mu;
    pthread_cond_t unpinned;
    entry_t **live;
    size_t n;
    entry_t *retired; /* dropped from the table, freed once no send pins them */
    atomic_uint_fast64_t served;
    atomic_uint_fast64_t partial;
};

static void entry_free(entry_t *e)
{
    free(e->addrs);
    free(e);
}

int dd_serve_table_new(dd_serve_table **out)
{
    if (out == NULL)
        return DD_EINVAL;
    *out = NULL;
    dd_serve_table *t = calloc(1, sizeof *t);
    if (t == NULL)
        return DD_ENOMEM;
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0) {
        free(t);
        return DD_ESYS;
    }
    int ok = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) == 0 &&
             pthread_cond_init(&t->unpinned, &ca) == 0;
    pthread_condattr_destroy(&ca);
    if (!ok) {
        free(t);
        return DD_ESYS;
    }
    if (pthread_mutex_init(&t->mu, NULL) != 0) {
        pthread_cond_destroy(&t->unpinned);
        free(t);
        return DD_ESYS;
    }
    atomic_init(&t->served, 0);
    atomic_init(&t->partial, 0);
    *out = t;
    return DD_OK;
}

/* Free the retired entries no send pins any more (mutex held); 1 when some stay pinned. */
static int sweep(dd_serve_table *t)
{
    int pinned = 0;
    entry_t **link = &t->retired;
    while (*link != NULL) {
        entry_t *e = *link;
        if (e->pins == 0) {
            *link = e->next_retired;
            entry_free(e);
        } else {
            pinned = 1;
            link = &e->next_retired;
        }
    }
    return pinned;
}

void dd_serve_table_free(dd_serve_table *t)
{
    if (t == NULL)
        return;
    /* The owner guarantees no reader thread uses the table any more. */
    for (size_t i = 0; i < t->n; i++)
        entry_free(t->live[i]);
    free(t->live);
    while (t->retired != NULL) {
        entry_t *e = t->retired;
        t->retired = e->next_retired;
        entry_free(e);
    }
    pthread_cond_destroy(&t->unpinned);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

static int same(const entry_t *e, const uint64_t *row, const uint64_t *addrs)
{
    return e->ident == row[0] && e->ntensors == row[1] && e->row_bytes == row[2] &&
           e->num_rows == row[3] && memcmp(e->addrs, addrs, row[1] * sizeof *addrs) == 0;
}

int dd_serve_table_set(dd_serve_table *t, const uint64_t *rows, size_t n, const uint64_t *addrs,
                       size_t naddrs, int64_t deadline_ns)
{
    if (t == NULL || (n > 0 && (rows == NULL || addrs == NULL)))
        return DD_EINVAL;
    size_t need = 0;
    for (size_t i = 0; i < n; i++) {
        const uint64_t *r = rows + 4 * i;
        if (r[1] == 0 || r[1] > naddrs - need || r[2] == 0 || r[3] == 0)
            return DD_EINVAL;
        for (size_t k = 0; k < r[1]; k++) { /* no block may wrap around the address space */
            uint64_t a = addrs[need + k];
            if (a == 0 || r[3] > UINT64_MAX / r[2] || a + r[2] * r[3] < a)
                return DD_EINVAL;
        }
        need += r[1];
    }
    if (need != naddrs)
        return DD_EINVAL;

    entry_t **fresh = n ? calloc(n, sizeof *fresh) : NULL;
    if (n > 0 && fresh == NULL)
        return DD_ENOMEM;
    pthread_mutex_lock(&t->mu);
    /* Keep the entries that did not change (a send may pin them); build the rest. */
    const uint64_t *a = addrs;
    int rc = DD_OK;
    for (size_t i = 0; i < n && rc == DD_OK; i++) {
        const uint64_t *r = rows + 4 * i;
        for (size_t j = 0; j < t->n; j++) {
            if (t->live[j] != NULL && same(t->live[j], r, a)) {
                fresh[i] = t->live[j];
                t->live[j] = NULL;
                break;
            }
        }
        if (fresh[i] == NULL) {
            entry_t *e = calloc(1, sizeof *e);
            uint64_t *copy = malloc(r[1] * sizeof *copy);
            if (e == NULL || copy == NULL) {
                free(e);
                free(copy);
                rc = DD_ENOMEM;
                break;
            }
            memcpy(copy, a, r[1] * sizeof *copy);
            e->ident = r[0];
            e->ntensors = r[1];
            e->row_bytes = r[2];
            e->num_rows = r[3];
            e->addrs = copy;
            fresh[i] = e;
        }
        a += r[1];
    }
    if (rc != DD_OK) { /* put the kept entries back, free the new ones: nothing changed */
        for (size_t i = 0; i < n; i++) {
            entry_t *e = fresh[i];
            if (e == NULL)
                continue;
            int kept = 0;
            for (size_t j = 0; j < t->n && !kept; j++) {
                if (t->live[j] == NULL && (kept = 1))
                    t->live[j] = e;
            }
            if (!kept)
                entry_free(e);
        }
        pthread_mutex_unlock(&t->mu);
        free(fresh);
        return rc;
    }
    for (size_t j = 0; j < t->n; j++) {
        entry_t *e = t->live[j];
        if (e != NULL) {
            e->next_retired = t->retired;
            t->retired = e;
        }
    }
    free(t->live);
    t->live = fresh;
    t->n = n;
    /* Dropped caches may be freed by their owner once this returns: wait out their sends. */
    while (sweep(t)) {
        if (deadline_ns > 0) {
            if (dd_monotonic_ns() >= deadline_ns) {
                rc = DD_ETIMEDOUT;
                break;
            }
            struct timespec ts = {.tv_sec = deadline_ns / 1000000000,
                                  .tv_nsec = deadline_ns % 1000000000};
            pthread_cond_timedwait(&t->unpinned, &t->mu, &ts);
        } else {
            pthread_cond_wait(&t->unpinned, &t->mu);
        }
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

void dd_serve_unpin(dd_serve_table *t, void *pin)
{
    if (t == NULL || pin == NULL)
        return;
    entry_t *e = pin;
    pthread_mutex_lock(&t->mu);
    if (e->pins > 0 && --e->pins == 0)
        pthread_cond_broadcast(&t->unpinned);
    pthread_mutex_unlock(&t->mu);
}

int dd_serve_table_stats(dd_serve_table *t, dd_serve_stats *out)
{
    if (t == NULL || out == NULL)
        return DD_EINVAL;
    pthread_mutex_lock(&t->mu);
    out->caches = t->n;
    out->pinned = 0;
    for (size_t i = 0; i < t->n; i++)
        out->pinned += t->live[i]->pins;
    for (entry_t *e = t->retired; e != NULL; e = e->next_retired)
        out->pinned += e->pins;
    pthread_mutex_unlock(&t->mu);
    out->served = atomic_load(&t->served);
    out->partial = atomic_load(&t->partial);
    return DD_OK;
}

/* ---- serving ---- */

/* The listed entry for ident, pinned; NULL when none. */
static entry_t *pin(dd_serve_table *t, uint64_t ident)
{
    entry_t *found = NULL;
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->n; i++) {
        if (t->live[i]->ident == ident) {
            found = t->live[i];
            found->pins++;
            break;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return found;
}

/* The rows of an access over e, into rows (pairs); their count, or 0 when the access is not
 * one this path serves (Python then refuses or serves it). The bounds are dd_blocks_check's,
 * the one check of a blocks access that the Python path applies too. */
static size_t access_rows(const entry_t *e, const dd_access_head *a, const unsigned char *ids,
                          uint64_t nbytes, uint64_t *rows, size_t cap)
{
    uint64_t blocks[PEEK_BLOCKS]; /* aligned: the ids sit at any offset of the frame */
    uint32_t nblocks = a->nblocks, count = a->tensor_count;
    uint64_t seg = a->seg_bytes, last = a->tail_bytes ? a->tail_bytes : seg, bad;
    if (nblocks > PEEK_BLOCKS)
        return 0;
    memcpy(blocks, ids, DD_ACCESS_BLOCK_SIZE * (size_t)nblocks);
    if (dd_blocks_rows(rows, cap, e->addrs, e->ntensors, e->row_bytes, e->num_rows,
                       a->tensor_start, count, blocks, nblocks, seg, last, &bad) != DD_OK)
        return 0;
    /* The size the requester expects; bounded above: count * nblocks <= cap rows of at most
     * a block each. */
    if (count * ((uint64_t)(nblocks - 1) * seg + last) != nbytes)
        return 0;
    return (size_t)count * nblocks;
}

/* Drop the first step bytes of the iovecs v[0, *n); the first one left (and *n updated). */
static struct iovec *advance(struct iovec *v, size_t *n, size_t step)
{
    while (*n > 0 && step >= v->iov_len) {
        step -= v->iov_len;
        v++;
        (*n)--;
    }
    if (step > 0) {
        v->iov_base = (char *)v->iov_base + step;
        v->iov_len -= step;
    }
    return v;
}

/* Move exactly the bytes of the iovecs v[0, n), which must already be readable in full
 * (seen with MSG_PEEK or FIONREAD): never waits. */
static int take(int fd, struct iovec *v, size_t n)
{
    while (n > 0) {
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = v;
        m.msg_iovlen = n;
        ssize_t r = recvmsg(fd, &m, MSG_DONTWAIT);
        if (r == 0)
            return DD_ECLOSED_PEER;
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                errno = EPROTO; /* the kernel said these bytes were there */
                return DD_ESYS;
            }
            return errno == ECONNRESET ? DD_ECLOSED_PEER : DD_ESYS;
        }
        v = advance(v, &n, (size_t)r);
    }
    return DD_OK;
}

/* Send the iovecs v[0, n) without waiting; *sent receives the bytes the kernel took, and
 * DD_ETIMEDOUT says it took no more for now. */
static int give(int fd, struct iovec *v, size_t n, uint64_t *sent)
{
    *sent = 0;
    while (n > 0) {
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = v;
        m.msg_iovlen = n;
        ssize_t r = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return DD_ETIMEDOUT;
            return errno == EPIPE || errno == ECONNRESET ? DD_ECLOSED_PEER : DD_ESYS;
        }
        *sent += (uint64_t)r;
        v = advance(v, &n, (size_t)r);
    }
    return DD_OK;
}

static void put_header(unsigned char *hdr, uint16_t kind, uint64_t rid, uint64_t payload)
{
    dd_frame_header h = {.magic = DD_WIRE_MAGIC,
                         .version = DD_WIRE_VERSION,
                         .kind = kind,
                         .request_id = rid,
                         .payload_len = payload};
    dd_frame_header_write(hdr, &h);
}

/* iovecs over the payload rows, after slot 0 (kept for a header). */
static void rows_to_iov(struct iovec *v, const uint64_t *rows, size_t k)
{
    for (size_t i = 0; i < k; i++) {
        v[i + 1].iov_base = (void *)(uintptr_t)rows[2 * i];
        v[i + 1].iov_len = (size_t)rows[2 * i + 1];
    }
}

/* Bytes waiting on fd, or 0 when unknown. */
static uint64_t readable_bytes(int fd)
{
    int n = 0;
    return ioctl(fd, FIONREAD, &n) == 0 && n > 0 ? (uint64_t)n : 0;
}

/* Whether n bytes wait on fd, busy-polling up to spin_ns for them. */
static int arrived(int fd, uint64_t n, int64_t spin_ns)
{
    if (readable_bytes(fd) >= n)
        return 1;
    int64_t end = dd_monotonic_ns() + spin_ns;
    while (dd_monotonic_ns() < end) {
        dd_cpu_relax();
        if (readable_bytes(fd) >= n)
            return 1;
    }
    return 0;
}

int dd_serve_requests(dd_serve_table *t, int fd, uint64_t max_bytes, int64_t spin_ns,
                      uint64_t *rows, size_t cap, dd_serve_out *out)
{
    if (out == NULL)
        return DD_EINVAL;
    memset(out, 0, sizeof *out);
    if (t == NULL || fd < 0 || rows == NULL || cap == 0 || spin_ns < 0)
        return DD_EINVAL;
    if (cap > ROWS_MAX)
        cap = ROWS_MAX;
    unsigned char buf[PEEK_MAX];
    struct iovec v[ROWS_MAX + 1];
    for (;;) {
        ssize_t r = recv(fd, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return DD_OK; /* nothing waiting */
        out->pending = 1; /* from here on, every stop leaves something for the reader */
        if (r < DD_HDR_SIZE)
            return DD_OK; /* an error, EOF or a partial header: the reader reports it */
        dd_frame_header h;
        dd_frame_header_read(buf, &h);
        uint32_t body_len = h.body_len;
        uint64_t payload = h.payload_len;
        int push = h.kind == DD_FRAME_PUSH;
        /* A pull's body starts with its byte count. */
        size_t fixed = push ? 0 : DD_PULL_NBYTES_SIZE;
        if (h.magic != DD_WIRE_MAGIC || h.version != DD_WIRE_VERSION ||
            (h.kind != DD_FRAME_PULL && !push) || h.status != 0 || h.flags != 0 ||
            body_len < fixed + DD_ACCESS_FIXED_SIZE || body_len > (size_t)r - DD_HDR_SIZE)
            return DD_OK;
        uint64_t nbytes = push ? payload : rd64(buf + DD_HDR_SIZE + DD_PULL_NBYTES_OFF);
        uint64_t frame = DD_HDR_SIZE + (uint64_t)body_len;
        if ((!push && payload != 0) || nbytes == 0 || nbytes > max_bytes)
            return DD_OK;
        /* A push is taken only once all of it has arrived: the rest of a small one in
         * flight is busy-polled for up to spin_ns (it follows within microseconds), never
         * slept for; a large one may not fit the socket's buffer at all. */
        if (push && !arrived(fd, frame + nbytes, nbytes <= PUSH_SPIN_MAX ? spin_ns : 0))
            return DD_OK;
        const unsigned char *acc = buf + DD_HDR_SIZE + fixed;
        dd_access_head a;
        dd_access_head_read(acc, &a);
        if (a.target != DD_TARGET_BLOCKS_KEY || a.flags != 0 || a.nrows != 0 || a.nblocks == 0 ||
            body_len != fixed + DD_ACCESS_FIXED_SIZE + DD_ACCESS_BLOCK_SIZE * (uint64_t)a.nblocks)
            return DD_OK;
        entry_t *e = pin(t, a.ident);
        if (e == NULL)
            return DD_OK;
        size_t k = access_rows(e, &a, acc + DD_ACCESS_FIXED_SIZE, nbytes, rows, cap);
        if (k == 0) {
            dd_serve_unpin(t, e);
            return DD_OK;
        }
        uint64_t rid = h.request_id;
        out->pending = 0;
        out->request_id = rid;
        /* Take the request: its frame, and a push's payload straight into the cache. */
        v[0].iov_base = buf;
        v[0].iov_len = (size_t)frame;
        size_t n = 1;
        if (push) {
            rows_to_iov(v, rows, k);
            n += k;
        }
        int rc = take(fd, v, n);
        if (push)
            dd_serve_unpin(t, e); /* the bytes are in place: nothing reads the cache now */
        if (rc != DD_OK) {
            if (!push)
                dd_serve_unpin(t, e);
            return rc;
        }
        /* Answer: PULL_DATA with the rows, or PUSH_ACK. */
        unsigned char hdr[DD_HDR_SIZE];
        uint16_t answer = push ? DD_FRAME_PUSH_ACK : DD_FRAME_PULL_DATA;
        put_header(hdr, answer, rid, push ? 0 : nbytes);
        v[0].iov_base = hdr;
        v[0].iov_len = DD_HDR_SIZE;
        n = 1;
        if (!push) {
            rows_to_iov(v, rows, k);
            n += k;
        }
        uint64_t sent = 0;
        rc = give(fd, v, n, &sent);
        if (rc == DD_OK) {
            if (!push)
                dd_serve_unpin(t, e);
            atomic_fetch_add(&t->served, 1);
            out->served++;
            continue;
        }
        out->sent = sent;
        if (rc == DD_ETIMEDOUT) {
            atomic_fetch_add(&t->partial, 1);
            out->kind = answer;
            out->nbytes = push ? 0 : nbytes;
            out->nrows = push ? 0 : k;
            out->pin = push ? NULL : e;
            return DD_SERVE_PARTIAL;
        }
        if (!push)
            dd_serve_unpin(t, e);
        return rc;
    }
}
