/* ucx_batch.c: batches of UCP RMA requests, started in one call, their completions counted.
 *
 * The UCX route issues one ucp_get_nbx/ucp_put_nbx per contiguous piece of a transfer; done
 * from Python, that costs a call through cffi and an object per request. These functions
 * start a batch in one call, and count its requests' completions.
 *
 * Nothing here is linked against UCX (the package builds without it): the caller passes the
 * addresses of the four UCP functions it loaded (dd_ucx_calls), and handles (endpoint, remote
 * keys, worker, request parameters, requests) travel as uint64_t words. The prototypes below
 * are those of ucp/api/ucp.h with every pointer a word; ucs_status_t is one signed byte.
 *
 * A batch (dd_ucx_rma) is not checked request by request: each request's completion takes it
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

int dd_ucx_count_free(dd_ucx_count *count)
{
    if (count == NULL)
        return DD_EINVAL;
    if (__atomic_load_n(&count->pending, __ATOMIC_SEQ_CST) != 0 ||
        __atomic_load_n(&count->busy, __ATOMIC_SEQ_CST) != 0)
        return DD_EAGAIN;
    free(count);
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

int64_t dd_ucx_rma(const dd_ucx_calls *c, uint64_t ep, int write, int flush,
                   const uint64_t *ops, const uint64_t *rkeys, size_t n, uint64_t param,
                   dd_ucx_count *count, int *status)
{
    if (!calls_ok(c) || !ep || (n && (ops == NULL || rkeys == NULL)) || count == NULL ||
        status == NULL)
        return DD_EINVAL;
    rma_fn rma = (rma_fn)(uintptr_t)(write ? c->put_nbx : c->get_nbx);
    /* Count every request first (the rows, and the flush), so that the count cannot read 0
     * while they are still being started (a completion may run in another thread
     * meanwhile); then take off the ones that left no request behind. */
    size_t planned = n + (flush ? 1 : 0);
    __atomic_fetch_add(&count->pending, (int64_t)planned, __ATOMIC_RELAXED);
    size_t started = 0, i = 0;
    int64_t result = (int64_t)n;
    *status = 0;
    for (; i < n; i++) {
        const uint64_t *op = ops + 3 * i;
        uint64_t ptr = rma(ep, op[0], (size_t)op[2], op[1], rkeys[i], param);
        if (ptr == 0)
            continue; /* done at once: no completion will run */
        if (ptr >= UCS_ERR_WORDS) {
            *status = (int)(int64_t)ptr;
            result = (int64_t)i;
            break;
        }
        started++;
    }
    if (flush && result == (int64_t)n) {
        uint64_t ptr = ((flush_fn)(uintptr_t)c->ep_flush_nbx)(ep, param);
        if (ptr >= UCS_ERR_WORDS)
            *status = (int)(int64_t)ptr;
        else if (ptr != 0)
            started++;
    }
    __atomic_fetch_sub(&count->pending, (int64_t)(planned - started), __ATOMIC_RELEASE);
    return result;
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
