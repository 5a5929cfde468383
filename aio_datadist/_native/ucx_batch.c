/* ucx_batch.c: batches of UCP RMA requests, started in one call, their completions counted.
 *
 * The UCX route issues one ucp_get_nbx/ucp_put_nbx per contiguous piece of a transfer; done
 * from Python, that costs a call through cffi and an object per request, and checking each
 * op against the peer's registrations and cutting the transfer for the lanes cost numpy
 * calls by the dozen. dd_ucx_transfer does all of it in one call: finds each op's remote key
 * (which also bounds-checks it), cuts the bytes into one run per part, merges neighbours and
 * starts every part, the lanes' first.
 *
 * Nothing here is linked against UCX (the package builds without it): the caller passes the
 * addresses of the UCP functions it loaded (dd_ucx_calls), and handles (endpoint, remote
 * keys, worker, request parameters, requests) travel as uint64_t words. The prototypes below
 * are those of ucp/api/ucp.h with every pointer a word; ucs_status_t is one signed byte.
 *
 * A part's batch is not checked request by request: each request's completion takes it
 * off the batch's count, so whether the batch is done is one load. A batch that another
 * thread progresses (on a lane's worker) names a worker to signal when its count reaches 0,
 * so that whoever waits for it, asleep on that worker's event fd, wakes.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "datadist.h"

typedef uint64_t (*rma_fn)(uint64_t ep, uint64_t buffer, size_t count, uint64_t remote_addr,
                           uint64_t rkey, uint64_t param);
typedef void (*free_fn)(uint64_t request);
typedef unsigned (*progress_fn)(uint64_t worker);
typedef int8_t (*signal_fn)(uint64_t worker);
typedef uint64_t (*flush_fn)(uint64_t ep, uint64_t param);
typedef int8_t (*arm_fn)(uint64_t worker);

#define UCS_ERR_BUSY (-15)

/* UCS_PTR_IS_ERR: the status pointers of errors are the last 100 addresses. */
#define UCS_ERR_WORDS ((uint64_t)-100)

static bool calls_ok(const dd_ucx_calls *c)
{
    return c != NULL && c->get_nbx && c->put_nbx && c->request_free && c->worker_progress &&
           c->worker_signal && c->ep_flush_nbx && c->worker_arm;
}

dd_ucx_count *dd_ucx_count_new(const dd_ucx_calls *c)
{
    if (!calls_ok(c))
        return NULL;
    dd_ucx_count *count = calloc(1, sizeof(*count));
    if (count != NULL) {
        count->request_free = c->request_free;
        count->signal = c->worker_signal;
    }
    return count;
}

int dd_ucx_count_notify(dd_ucx_count *count, uint64_t worker)
{
    if (count == NULL)
        return DD_EINVAL;
    __atomic_store_n(&count->notify, worker, __ATOMIC_SEQ_CST);
    return DD_OK;
}

/* DD_OK when no request of count is in flight and no completion still touches it. */
static int count_idle(const dd_ucx_count *count)
{
    if (count == NULL)
        return DD_EINVAL;
    if (__atomic_load_n(&count->pending, __ATOMIC_SEQ_CST) != 0 ||
        __atomic_load_n(&count->busy, __ATOMIC_SEQ_CST) != 0)
        return DD_EAGAIN;
    return DD_OK;
}

int dd_ucx_count_free(dd_ucx_count *count)
{
    int rc = count_idle(count);
    if (rc == DD_OK)
        free(count);
    return rc;
}

int dd_ucx_count_reset(dd_ucx_count *count)
{
    int rc = count_idle(count);
    if (rc != DD_OK)
        return rc;
    __atomic_store_n(&count->status, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&count->notify, 0, __ATOMIC_SEQ_CST);
    return DD_OK;
}

int64_t dd_ucx_count_left(const dd_ucx_count *count, int *status)
{
    if (count == NULL || status == NULL)
        return DD_EINVAL;
    int64_t left = __atomic_load_n(&count->pending, __ATOMIC_SEQ_CST);
    *status = __atomic_load_n(&count->status, __ATOMIC_RELAXED);
    return left;
}

void dd_ucx_counted(void *request, int8_t status, void *user_data)
{
    dd_ucx_count *count = user_data;
    if (status != 0) {
        int32_t none = 0;
        __atomic_compare_exchange_n(&count->status, &none, (int32_t)status, false,
                                    __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    }
    ((free_fn)(uintptr_t)count->request_free)((uint64_t)(uintptr_t)request);
    /* busy from before the count may read 0 until the last touch: it is not freed meanwhile */
    __atomic_fetch_add(&count->busy, 1, __ATOMIC_SEQ_CST);
    if (__atomic_fetch_sub(&count->pending, 1, __ATOMIC_SEQ_CST) == 1) {
        /* the last: a waiter that set notify before its look at the count saw it above 0 */
        uint64_t notify = __atomic_load_n(&count->notify, __ATOMIC_SEQ_CST);
        if (notify)
            ((signal_fn)(uintptr_t)count->signal)(notify);
    }
    __atomic_fetch_sub(&count->busy, 1, __ATOMIC_SEQ_CST);
}

/* How many earlier registrations a lookup tries when the nearest one below a span does not
 * hold it (registrations may overlap, as two registrations of one buffer do). */
#define FIND_BACKTRACK 16
/* Parts are cut at multiples of this many bytes of the transfer (pages of the usual size). */
#define CUT_ALIGN 4096ull
/* Up to this many ops the keys they go through are noted on the stack. */
#define STACK_OPS 512

/* The key row of keys (rows of 2 words: addr, end; sorted by addr) that holds [addr, +len)
 * whole, or -1. */
static int64_t find_key(const uint64_t *keys, size_t nkeys, uint64_t addr, uint64_t len)
{
    uint64_t end;
    if (__builtin_add_overflow(addr, len, &end))
        return -1;
    size_t lo = 0, hi = nkeys; /* the first row starting above addr */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (keys[2 * mid] <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (size_t k = lo, tried = 0; k > 0 && tried <= FIND_BACKTRACK; k--, tried++) {
        if (end <= keys[2 * (k - 1) + 1])
            return (int64_t)(k - 1);
    }
    return -1;
}

int64_t dd_ucx_find(const uint64_t *keys, size_t nkeys, const uint64_t *spans, size_t stride,
                    size_t n, int32_t *found)
{
    if ((n && (spans == NULL || found == NULL || stride < 2)) || (nkeys && keys == NULL) ||
        nkeys > INT32_MAX)
        return DD_EINVAL;
    for (size_t i = 0; i < n; i++) {
        int64_t k = find_key(keys, nkeys, spans[stride * i], spans[stride * i + 1]);
        if (k < 0)
            return (int64_t)i;
        found[i] = (int32_t)k;
    }
    return (int64_t)n;
}

/* Wake the lane's thread for a part started on its worker. */
static void lane_post(dd_ucx_lane *lane);

/* Start the requests of one part: the bytes [from, to) of the transfer, op by op from op
 * `first` (`skip` bytes into it), neighbours that continue each other on both sides
 * through one key merged. 0 or the ucs_status_t UCX refused a request with. */
static int part_start(const dd_ucx_calls *c, rma_fn rma, int flush, const uint64_t *ops,
                      size_t n, const int32_t *which, size_t first, uint64_t skip,
                      uint64_t bytes, dd_ucx_part *part)
{
    /* Count every request it may start first (an op each, and the flush), so that the count
     * cannot read 0 while they are still being started (a completion may run in another
     * thread meanwhile); then take off the ones that left no request behind. */
    size_t planned = flush ? 1 : 0;
    {
        uint64_t left = bytes + skip;
        for (size_t i = first; i < n && left; i++, planned++)
            left -= ops[3 * i + 2] < left ? ops[3 * i + 2] : left;
    }
    __atomic_fetch_add(&part->count->pending, (int64_t)planned, __ATOMIC_RELAXED);
    part->started = 1;
    size_t started = 0;
    int status = 0;
    uint64_t local = 0, remote = 0, len = 0; /* the piece being merged */
    int32_t key = -1;
    for (size_t i = first; i < n && (bytes || len); i++) {
        const uint64_t *op = ops + 3 * i;
        uint64_t take = op[2] - skip;
        if (take > bytes)
            take = bytes;
        uint64_t l = op[0] + skip, r = op[1] + skip;
        skip = 0;
        bytes -= take;
        if (len && which[i] == key && local + len == l && remote + len == r) {
            len += take; /* no overflow: both sides' ends were checked */
        } else {
            if (len) {
                uint64_t ptr = rma(part->ep, local, (size_t)len, remote, part->rkeys[key],
                                   part->param);
                if (ptr >= UCS_ERR_WORDS) {
                    status = (int)(int64_t)ptr;
                    break;
                }
                started += ptr != 0; /* 0: done at once, no completion will run */
            }
            local = l, remote = r, len = take, key = which[i];
        }
        if (!bytes && len) {
            uint64_t ptr = rma(part->ep, local, (size_t)len, remote, part->rkeys[key],
                               part->param);
            len = 0;
            if (ptr >= UCS_ERR_WORDS) {
                status = (int)(int64_t)ptr;
                break;
            }
            started += ptr != 0;
        }
    }
    if (flush && !status) {
        uint64_t ptr = ((flush_fn)(uintptr_t)c->ep_flush_nbx)(part->ep, part->param);
        if (ptr >= UCS_ERR_WORDS)
            status = (int)(int64_t)ptr;
        else
            started += ptr != 0;
    }
    __atomic_fetch_sub(&part->count->pending, (int64_t)(planned - started), __ATOMIC_RELEASE);
    part->status = status;
    if (part->lane != NULL)
        lane_post(part->lane);
    return status;
}

/* Progress worker until count reads 0 (true), budget_ns passed, or, with idle_ends, a
 * round finds nothing to do (false). */
static bool progress_count(const dd_ucx_calls *c, uint64_t worker, const dd_ucx_count *count,
                           int64_t budget_ns, bool idle_ends)
{
    progress_fn progress = (progress_fn)(uintptr_t)c->worker_progress;
    int64_t until = dd_monotonic_ns() + budget_ns;
    while (__atomic_load_n(&count->pending, __ATOMIC_ACQUIRE) != 0) {
        if ((!progress(worker) && idle_ends) || dd_monotonic_ns() >= until)
            return false;
    }
    return true;
}

int64_t dd_ucx_transfer(const dd_ucx_calls *c, int write, int flush, const uint64_t *ops,
                        size_t n, const dd_blocks_pair *pair, const uint64_t *keys,
                        size_t nkeys, dd_ucx_part *parts, size_t nparts, int64_t *bad,
                        uint64_t worker, int64_t progress_ns)
{
    if (bad != NULL)
        *bad = -1;
    if (!calls_ok(c) || (ops == NULL && pair == NULL && n != 0) ||
        (nkeys && keys == NULL) || parts == NULL || nparts == 0 || bad == NULL ||
        nkeys > INT32_MAX || (progress_ns > 0 && !worker))
        return DD_EINVAL;
    for (size_t p = 0; p < nparts; p++) {
        parts[p].status = 0;
        parts[p].started = 0;
        parts[p].done = 0;
        parts[p].failed = 0;
        if (!parts[p].ep || !parts[p].param || parts[p].count == NULL ||
            (nkeys && parts[p].rkeys == NULL))
            return DD_EINVAL;
    }
    uint64_t stack_ops[3 * STACK_OPS];
    uint64_t *made = NULL; /* the pair's ops, when they do not fit on the stack */
    if (ops == NULL && pair != NULL) {
        if (pair->ntensors && pair->nblocks > SIZE_MAX / 3 / pair->ntensors) {
            *bad = -2;
            return DD_EINVAL;
        }
        n = pair->ntensors * pair->nblocks;
        made = n <= STACK_OPS ? stack_ops : malloc(3 * n * sizeof *made);
        if (made == NULL)
            return DD_ENOMEM;
        if (dd_blocks_ops(made, pair->local_bases, pair->local_block_bytes,
                          pair->local_num_blocks, pair->local_blocks, pair->remote_bases,
                          pair->remote_block_bytes, pair->remote_num_blocks,
                          pair->remote_blocks, pair->ntensors, pair->nblocks,
                          pair->seg) != DD_OK) {
            if (made != stack_ops)
                free(made);
            *bad = -2;
            return DD_EINVAL;
        }
        ops = made;
    }
    /* Every op checked, and its key found, before anything starts. */
    int32_t stack_which[STACK_OPS];
    int32_t *which = n <= STACK_OPS ? stack_which : malloc(n * sizeof *which);
    if (which == NULL) {
        if (made != NULL && made != stack_ops)
            free(made);
        return DD_ENOMEM;
    }
    uint64_t total = 0;
    int64_t result = (int64_t)n;
    for (size_t i = 0; i < n; i++) {
        const uint64_t *op = ops + 3 * i;
        uint64_t end;
        if (!op[2] || !op[0] || __builtin_add_overflow(op[0], op[2], &end) ||
            __builtin_add_overflow(total, op[2], &total)) {
            *bad = (int64_t)i;
            result = DD_EINVAL;
            goto out;
        }
        int64_t k = find_key(keys, nkeys, op[1], op[2]);
        if (k < 0) {
            result = (int64_t)i;
            goto out;
        }
        which[i] = (int32_t)k;
    }
    /* The parts: runs of about equal bytes, cut at multiples of CUT_ALIGN. */
    size_t runs = 0;
    uint64_t cut_at[DD_UCX_MAX_PARTS + 1];
    size_t first_op[DD_UCX_MAX_PARTS + 1];
    uint64_t skip_of[DD_UCX_MAX_PARTS + 1];
    if (nparts > DD_UCX_MAX_PARTS)
        nparts = DD_UCX_MAX_PARTS;
    cut_at[runs++] = 0;
    if (total >= 2 * CUT_ALIGN) {
        for (size_t k = 1; k < nparts; k++) {
            uint64_t cut = (uint64_t)((unsigned __int128)total * k / nparts) / CUT_ALIGN * CUT_ALIGN;
            if (cut > cut_at[runs - 1] && cut < total)
                cut_at[runs++] = cut;
        }
    }
    cut_at[runs] = total;
    {
        /* where each run starts: its first op and the bytes of that op before it */
        size_t i = 0;
        uint64_t at = 0; /* bytes of the transfer before op i */
        for (size_t r = 0; r < runs; r++) {
            while (i < n && at + ops[3 * i + 2] <= cut_at[r])
                at += ops[3 * i + 2], i++;
            first_op[r] = i;
            skip_of[r] = cut_at[r] - at;
        }
    }
    rma_fn rma = (rma_fn)(uintptr_t)(write ? c->put_nbx : c->get_nbx);
    /* the lanes' parts first: their threads wake while this one starts its own */
    for (size_t k = 1; k <= runs; k++) {
        size_t r = k % runs;
        if (part_start(c, rma, flush, ops, n, which, first_op[r], skip_of[r],
                       cut_at[r + 1] - cut_at[r], &parts[r]))
            break; /* refused: the parts not started yet never start */
    }
    if (progress_ns > 0) {
        progress_count(c, worker, parts[0].count, progress_ns, true);
        for (size_t p = 0; p < nparts; p++) {
            dd_ucx_count *count = parts[p].count;
            if (!parts[p].started || count_idle(count) != DD_OK)
                continue;
            parts[p].failed = __atomic_load_n(&count->status, __ATOMIC_RELAXED);
            parts[p].done = dd_ucx_count_reset(count) == DD_OK;
        }
    }
out:
    if (which != stack_which)
        free(which);
    if (made != NULL && made != stack_ops)
        free(made);
    return result;
}

int dd_ucx_spin(const dd_ucx_calls *c, uint64_t worker, const dd_ucx_count *count,
                int64_t spin_ns)
{
    if (!calls_ok(c) || !worker || count == NULL)
        return DD_EINVAL;
    return progress_count(c, worker, count, spin_ns, false) ? 1 : 0;
}

int dd_ucx_drain(const dd_ucx_calls *c, uint64_t worker, int64_t budget_ns)
{
    if (!calls_ok(c) || !worker)
        return DD_EINVAL;
    progress_fn progress = (progress_fn)(uintptr_t)c->worker_progress;
    if (!progress(worker))
        return 0;
    int64_t until = budget_ns > 0 ? dd_monotonic_ns() + budget_ns : 0;
    while (progress(worker)) {
        if (until && dd_monotonic_ns() >= until)
            return 2;
    }
    return 1;
}

/* ---- a lane: a thread that progresses one worker ---- */

struct dd_ucx_lane {
    dd_ucx_calls c;
    uint64_t worker;
    int efd;
    int stop;
    pthread_t thread;
};

/* Wake the lane's thread for a part started on its worker. */
static void lane_post(dd_ucx_lane *lane)
{
    ((signal_fn)(uintptr_t)lane->c.worker_signal)(lane->worker);
}

/* Sleep before the next wait after idle wake-ups in a row that found nothing to do. */
static void idle_pause(int idle)
{
    if (idle < 4)
        return;
    int64_t ns = 50000;
    for (int i = 4; i < idle && ns < 1000000; i++)
        ns *= 2;
    if (ns > 1000000)
        ns = 1000000;
    struct timespec ts = {0, (long)ns};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Read what was written to fd (an eventfd); whether the call must return (turn->look). */
static bool woken(int fd, dd_ucx_turn *turn)
{
    uint64_t value;
    while (read(fd, &value, sizeof value) < 0 && errno == EINTR) {
    }
    return __atomic_exchange_n(&turn->look, 0, __ATOMIC_ACQ_REL) != 0;
}

/* Nanoseconds until deadline_ns (-1: none); 0 when it passed. */
static int64_t wait_left_ns(int64_t deadline_ns, bool *passed)
{
    *passed = false;
    if (deadline_ns <= 0)
        return -1;
    int64_t left = deadline_ns - dd_monotonic_ns();
    if (left <= 0)
        *passed = true;
    return left > 0 ? left : 0;
}

/* Milliseconds until deadline_ns for poll, rounded up (-1: none); 0 when it passed. */
static int poll_ms(int64_t deadline_ns, bool *passed)
{
    int64_t left = wait_left_ns(deadline_ns, passed);
    return left < 0 ? -1 : (int)((left + 999999) / 1000000);
}

/* Poll one fd for POLLIN for wait_ns (-1: no limit). */
static int poll_ns(struct pollfd *fd, int64_t wait_ns)
{
    if (wait_ns < 0)
        return ppoll(fd, 1, NULL, NULL);
    struct timespec ts = {(time_t)(wait_ns / 1000000000), (long)(wait_ns % 1000000000)};
    return ppoll(fd, 1, &ts, NULL);
}

int dd_ucx_serve(const dd_ucx_calls *c, uint64_t worker, int efd, int wake_fd,
                 int64_t deadline_ns, int until_work, int *idle, dd_ucx_turn *turn,
                 int64_t spin_ns)
{
    if (!calls_ok(c) || !worker || efd < 0 || wake_fd < 0 || idle == NULL || turn == NULL)
        return DD_EINVAL;
    progress_fn progress = (progress_fn)(uintptr_t)c->worker_progress;
    arm_fn arm = (arm_fn)(uintptr_t)c->worker_arm;
    bool passed;
    /* the first stand-down after work looks at the waiters again by itself after spin_ns */
    bool timed = spin_ns > 0;
    for (;;) {
        if (__atomic_load_n(&turn->waiters, __ATOMIC_ACQUIRE) > 0) {
            /* stand down: a waiter progresses; parked is published before the last look */
            int32_t mode = timed ? DD_UCX_PARKED_TIMED : DD_UCX_PARKED;
            __atomic_store_n(&turn->parked, mode, __ATOMIC_SEQ_CST);
            int n = 0;
            struct pollfd fd = {wake_fd, POLLIN, 0};
            if (__atomic_load_n(&turn->waiters, __ATOMIC_SEQ_CST) > 0) {
                int64_t wait_ns = wait_left_ns(deadline_ns, &passed);
                if (timed && (wait_ns < 0 || wait_ns > spin_ns))
                    wait_ns = spin_ns;
                n = passed ? 0 : poll_ns(&fd, wait_ns);
            }
            __atomic_store_n(&turn->parked, 0, __ATOMIC_SEQ_CST);
            if (n < 0 && errno != EINTR)
                return DD_ESYS;
            if (n > 0 && woken(wake_fd, turn))
                return 0;
            if (n == 0)
                timed = false; /* the waiter stayed: from now, its leaving writes wake_fd */
            poll_ms(deadline_ns, &passed);
            if (passed)
                return 0;
            continue;
        }
        timed = spin_ns > 0;
        if (progress(worker)) {
            while (progress(worker)) {
            }
            *idle = 0;
            if (until_work)
                return 1;
            /* the peer's next request usually follows soon: poll for it a while first */
            int64_t until = spin_ns > 0 ? dd_monotonic_ns() + spin_ns : 0;
            while (until && __atomic_load_n(&turn->waiters, __ATOMIC_ACQUIRE) == 0) {
                if (progress(worker))
                    break;
                if (dd_monotonic_ns() >= until)
                    until = 0;
            }
            continue;
        }
        int timeout_ms = poll_ms(deadline_ns, &passed);
        if (passed)
            return 0;
        int8_t status = arm(worker);
        if (status == UCS_ERR_BUSY) { /* events pending: progress again */
            idle_pause(++*idle);
            continue;
        }
        if (status != 0) {
            errno = EIO;
            return DD_ESYS;
        }
        idle_pause(*idle);
        struct pollfd fds[2] = {{efd, POLLIN, 0}, {wake_fd, POLLIN, 0}};
        int n = poll(fds, 2, timeout_ms);
        if (n < 0 && errno != EINTR)
            return DD_ESYS;
        if (n > 0 && fds[1].revents) {
            if (woken(wake_fd, turn))
                return 0;
            continue; /* a waiter left: look at the waiters again */
        }
        ++*idle;
    }
}

int dd_ucx_turn_waiters(dd_ucx_turn *turn, int32_t waiters)
{
    if (turn == NULL || waiters < 0)
        return DD_EINVAL;
    __atomic_store_n(&turn->waiters, waiters, __ATOMIC_SEQ_CST);
    return __atomic_load_n(&turn->parked, __ATOMIC_SEQ_CST);
}

static void *lane_run(void *arg)
{
    dd_ucx_lane *lane = arg;
    progress_fn progress = (progress_fn)(uintptr_t)lane->c.worker_progress;
    arm_fn arm = (arm_fn)(uintptr_t)lane->c.worker_arm;
    int idle = 0;
    while (!__atomic_load_n(&lane->stop, __ATOMIC_ACQUIRE)) {
        if (progress(lane->worker)) {
            while (progress(lane->worker)) {
            }
            idle = 0;
            continue;
        }
        if (arm(lane->worker) == UCS_ERR_BUSY) { /* events pending: progress again */
            idle_pause(++idle);
            continue;
        }
        if (__atomic_load_n(&lane->stop, __ATOMIC_ACQUIRE))
            break;
        idle_pause(idle);
        struct pollfd fd = {lane->efd, POLLIN, 0};
        poll(&fd, 1, -1);
        idle++;
    }
    return NULL;
}

dd_ucx_lane *dd_ucx_lane_start(const dd_ucx_calls *c, uint64_t worker, int efd)
{
    if (!calls_ok(c) || !worker || efd < 0) {
        errno = EINVAL;
        return NULL;
    }
    dd_ucx_lane *lane = calloc(1, sizeof(*lane));
    if (lane == NULL)
        return NULL;
    lane->c = *c;
    lane->worker = worker;
    lane->efd = efd;
    int rc = pthread_create(&lane->thread, NULL, lane_run, lane);
    if (rc != 0) {
        free(lane);
        errno = rc;
        return NULL;
    }
    pthread_setname_np(lane->thread, "aio-dd-ucx-lane");
    return lane;
}

int dd_ucx_lane_stop(dd_ucx_lane *lane)
{
    if (lane == NULL)
        return DD_EINVAL;
    __atomic_store_n(&lane->stop, 1, __ATOMIC_RELEASE);
    ((signal_fn)(uintptr_t)lane->c.worker_signal)(lane->worker);
    pthread_join(lane->thread, NULL);
    free(lane);
    return DD_OK;
}
