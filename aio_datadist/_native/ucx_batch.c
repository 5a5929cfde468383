/* ucx_batch.c: batches of UCP RMA requests, started, reaped and progressed in one call each.
 *
 * The UCX route issues one ucp_get_nbx/ucp_put_nbx per contiguous piece of a transfer and
 * checks every request until it completes; done from Python, that costs a call through cffi
 * and an object per request. These functions run the same loops in C, one call per batch.
 *
 * Nothing here is linked against UCX (the package builds without it): the caller passes the
 * addresses of the five UCP functions it loaded (dd_ucx_calls), and handles (endpoint, remote
 * keys, worker, request parameters, requests) travel as uint64_t words. The prototypes below
 * are those of ucp/api/ucp.h with every pointer a word; ucs_status_t is one signed byte.
 */
#include <stdbool.h>

#include "datadist.h"

typedef uint64_t (*rma_fn)(uint64_t ep, uint64_t buffer, size_t count, uint64_t remote_addr,
                           uint64_t rkey, uint64_t param);
typedef int8_t (*check_fn)(uint64_t request);
typedef void (*free_fn)(uint64_t request);
typedef unsigned (*progress_fn)(uint64_t worker);

/* UCS_PTR_IS_ERR: the status pointers of errors are the last 100 addresses. */
#define UCS_ERR_WORDS ((uint64_t)-100)
#define UCS_INPROGRESS 1

static bool calls_ok(const dd_ucx_calls *c)
{
    return c != NULL && c->get_nbx && c->put_nbx && c->check_status && c->request_free &&
           c->worker_progress;
}

int64_t dd_ucx_rma(const dd_ucx_calls *c, uint64_t ep, int write, const uint64_t *ops,
                   const uint64_t *rkeys, size_t n, uint64_t param, uint64_t *reqs,
                   size_t *nreqs, int *status)
{
    if (!calls_ok(c) || !ep || (n && (ops == NULL || rkeys == NULL || reqs == NULL)) ||
        nreqs == NULL || status == NULL)
        return DD_EINVAL;
    rma_fn rma = (rma_fn)(uintptr_t)(write ? c->put_nbx : c->get_nbx);
    size_t k = 0;
    *status = 0;
    for (size_t i = 0; i < n; i++) {
        const uint64_t *op = ops + 3 * i;
        uint64_t ptr = rma(ep, op[0], (size_t)op[2], op[1], rkeys[i], param);
        if (ptr == 0)
            continue; /* done at once */
        if (ptr >= UCS_ERR_WORDS) {
            *status = (int)(int64_t)ptr;
            *nreqs = k;
            return (int64_t)i;
        }
        reqs[k++] = ptr;
    }
    *nreqs = k;
    return (int64_t)n;
}

int64_t dd_ucx_reap(const dd_ucx_calls *c, uint64_t *reqs, size_t n, int *status)
{
    if (!calls_ok(c) || (n && reqs == NULL) || status == NULL)
        return DD_EINVAL;
    check_fn check = (check_fn)(uintptr_t)c->check_status;
    free_fn release = (free_fn)(uintptr_t)c->request_free;
    size_t left = 0;
    for (size_t i = 0; i < n; i++) {
        int8_t s = check(reqs[i]);
        if (s == UCS_INPROGRESS) {
            reqs[left++] = reqs[i];
            continue;
        }
        release(reqs[i]);
        if (s != 0 && *status == 0)
            *status = s;
    }
    return (int64_t)left;
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
