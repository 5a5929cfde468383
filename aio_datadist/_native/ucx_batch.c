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
 * off the batch's count, so whether the batch is done is one load.
 */
#include <stdbool.h>
#include <stdlib.h>

#include "datadist.h"

typedef uint64_t (*rma_fn)(uint64_t ep, uint64_t buffer, size_t count, uint64_t remote_addr,
                           uint64_t rkey, uint64_t param);
typedef void (*free_fn)(uint64_t request);
typedef unsigned (*progress_fn)(uint64_t worker);

/* UCS_PTR_IS_ERR: the status pointers of errors are the last 100 addresses. */
#define UCS_ERR_WORDS ((uint64_t)-100)

static bool calls_ok(const dd_ucx_calls *c)
{
    return c != NULL && c->get_nbx && c->put_nbx && c->request_free && c->worker_progress;
}

dd_ucx_count *dd_ucx_count_new(const dd_ucx_calls *c)
{
    if (!calls_ok(c))
        return NULL;
    dd_ucx_count *count = calloc(1, sizeof(*count));
    if (count != NULL)
        count->request_free = c->request_free;
    return count;
}

int dd_ucx_count_free(dd_ucx_count *count)
{
    if (count == NULL)
        return DD_EINVAL;
    if (__atomic_load_n(&count->pending, __ATOMIC_ACQUIRE) != 0)
        return DD_EAGAIN;
    free(count);
    return DD_OK;
}

int64_t dd_ucx_count_left(const dd_ucx_count *count, int *status)
{
    if (count == NULL || status == NULL)
        return DD_EINVAL;
    int64_t left = __atomic_load_n(&count->pending, __ATOMIC_ACQUIRE);
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
    /* last: once the count reads 0, the status is set and the count is no longer touched */
    __atomic_fetch_sub(&count->pending, 1, __ATOMIC_RELEASE);
}

int64_t dd_ucx_rma(const dd_ucx_calls *c, uint64_t ep, int write, const uint64_t *ops,
                   const uint64_t *rkeys, size_t n, uint64_t param, dd_ucx_count *count,
                   int *status)
{
    if (!calls_ok(c) || !ep || (n && (ops == NULL || rkeys == NULL)) || count == NULL ||
        status == NULL)
        return DD_EINVAL;
    rma_fn rma = (rma_fn)(uintptr_t)(write ? c->put_nbx : c->get_nbx);
    /* Count every row first, so that the count cannot read 0 while rows are still being
     * started (a completion may run in another thread meanwhile); then take off the rows
     * that left no request behind. */
    __atomic_fetch_add(&count->pending, (int64_t)n, __ATOMIC_RELAXED);
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
    __atomic_fetch_sub(&count->pending, (int64_t)(n - started), __ATOMIC_RELEASE);
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
