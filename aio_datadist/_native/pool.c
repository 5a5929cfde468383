/* pool.c: thread-safe page allocator handing out offsets in an arena it never touches.
 *
 * The arena is cut into segments kept in an address-ordered doubly linked list (boundary
 * tags), so a freed segment finds its neighbours in O(1) and merges with the free ones at
 * once. Free segments also sit on segregated lists, one per floor(log2(pages)), with a
 * bitmap of the non-empty lists; allocation is best-fit within the request's class, else
 * the smallest of a few candidates from the next non-empty class.
 *
 * Segment records live in one growable array and are named by index; retired records go
 * on a spare stack. A handle is (generation << 32) | index and the record's generation
 * moves on whenever it stops being an allocation, so stale and double frees are detected
 * instead of corrupting the lists.
 */
#define _GNU_SOURCE
#include "datadist.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define NIL UINT32_MAX
#define NCLASSES 64
/* How many records a class scan visits before it settles for a larger class: keeps
 * allocation fast when a class fills with fragments just too small for the request. */
#define SCAN_LIMIT 32
#define MAX_RECORDS (NIL - 1u)

enum { SEG_SPARE = 0, SEG_FREE = 1, SEG_USED = 2 };

typedef struct {
    uint64_t start;  /* first page */
    uint64_t npages;
    uint32_t prev, next;   /* address-order neighbours */
    uint32_t fprev, fnext; /* free-list links; fnext also links the spare stack */
    uint32_t gen;
    uint8_t state;
    uint8_t cls;
} seg_t;

struct dd_pool {
    pthread_mutex_t mu;
    uint64_t base;
    uint64_t npages;
    unsigned shift;
    int closed;
    seg_t *segs;
    uint32_t nrecords; /* records ever handed out: indices below this are valid */
    uint32_t cap;
    uint32_t spare;
    uint32_t heads[NCLASSES];
    uint64_t nonempty; /* bit c set when heads[c] != NIL */
    uint64_t used_pages;
    uint64_t nalloc;
};

static unsigned class_of(uint64_t npages) { return 63u - (unsigned)__builtin_clzll(npages); }

static uint32_t next_gen(uint32_t gen)
{
    /* Generation 0 is never used, so handle 0 is never valid. */
    return gen == UINT32_MAX ? 1u : gen + 1u;
}

static void free_push(dd_pool *p, uint32_t i)
{
    seg_t *s = &p->segs[i];
    unsigned c = class_of(s->npages);
    s->state = SEG_FREE;
    s->cls = (uint8_t)c;
    s->fprev = NIL;
    s->fnext = p->heads[c];
    if (s->fnext != NIL)
        p->segs[s->fnext].fprev = i;
    p->heads[c] = i;
    p->nonempty |= 1ull << c;
}

static void free_unlink(dd_pool *p, uint32_t i)
{
    seg_t *s = &p->segs[i];
    if (s->fprev != NIL)
        p->segs[s->fprev].fnext = s->fnext;
    else
        p->heads[s->cls] = s->fnext;
    if (s->fnext != NIL)
        p->segs[s->fnext].fprev = s->fprev;
    if (p->heads[s->cls] == NIL)
        p->nonempty &= ~(1ull << s->cls);
}

static void record_release(dd_pool *p, uint32_t i)
{
    seg_t *s = &p->segs[i];
    s->state = SEG_SPARE;
    s->gen = next_gen(s->gen);
    s->fnext = p->spare;
    p->spare = i;
}

/* Make sure one spare record exists, so a split cannot fail half way. */
static int reserve_record(dd_pool *p)
{
    if (p->spare != NIL || p->nrecords < p->cap)
        return DD_OK;
    if (p->cap >= MAX_RECORDS)
        return DD_ENOMEM;
    uint32_t cap = p->cap > MAX_RECORDS / 2 ? MAX_RECORDS : p->cap * 2;
    seg_t *segs = realloc(p->segs, (size_t)cap * sizeof *segs);
    if (segs == NULL)
        return DD_ENOMEM;
    p->segs = segs;
    p->cap = cap;
    return DD_OK;
}

static uint32_t record_take(dd_pool *p)
{
    uint32_t i;
    if (p->spare != NIL) {
        i = p->spare;
        p->spare = p->segs[i].fnext;
    } else {
        i = p->nrecords++;
        p->segs[i].gen = 1;
    }
    return i;
}

int dd_pool_create(uint64_t base, uint64_t size, unsigned page_shift, dd_pool **out)
{
    if (out == NULL || page_shift < DD_PAGE_SHIFT_MIN || page_shift > DD_PAGE_SHIFT_MAX)
        return DD_EINVAL;
    *out = NULL;
    uint64_t npages = size >> page_shift;
    if (npages == 0 || (npages << page_shift) - 1u > UINT64_MAX - base)
        return DD_EINVAL;

    dd_pool *p = calloc(1, sizeof *p);
    if (p == NULL)
        return DD_ENOMEM;
    p->cap = 64;
    p->segs = malloc((size_t)p->cap * sizeof *p->segs);
    if (p->segs == NULL || pthread_mutex_init(&p->mu, NULL) != 0) {
        free(p->segs);
        free(p);
        return DD_ENOMEM;
    }
    p->base = base;
    p->npages = npages;
    p->shift = page_shift;
    p->spare = NIL;
    for (unsigned c = 0; c < NCLASSES; c++)
        p->heads[c] = NIL;

    uint32_t i = record_take(p);
    seg_t *s = &p->segs[i];
    s->start = 0;
    s->npages = npages;
    s->prev = s->next = NIL;
    free_push(p, i);
    *out = p;
    return DD_OK;
}

int dd_pool_close(dd_pool *p)
{
    if (p == NULL)
        return DD_EINVAL;
    pthread_mutex_lock(&p->mu);
    if (!p->closed) {
        free(p->segs);
        p->segs = NULL;
        p->closed = 1;
    }
    pthread_mutex_unlock(&p->mu);
    return DD_OK;
}

void dd_pool_destroy(dd_pool *p)
{
    if (p == NULL)
        return;
    dd_pool_close(p);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

/* Best fit among the first SCAN_LIMIT records of class c, or NIL; *more says whether the
 * scan stopped early. */
static uint32_t scan_class(const dd_pool *p, uint32_t from, uint64_t need, int *more)
{
    uint32_t best = NIL;
    uint64_t best_n = UINT64_MAX;
    unsigned seen = 0;
    *more = 0;
    for (uint32_t i = from; i != NIL; i = p->segs[i].fnext) {
        uint64_t n = p->segs[i].npages;
        if (n >= need && n < best_n) {
            best = i;
            best_n = n;
            if (n == need)
                break;
        }
        if (++seen == SCAN_LIMIT && p->segs[i].fnext != NIL) {
            *more = 1;
            break;
        }
    }
    return best;
}

static uint32_t find_fit(const dd_pool *p, uint64_t need)
{
    unsigned c = class_of(need);
    int more = 0;
    uint32_t best = (p->nonempty >> c) & 1u ? scan_class(p, p->heads[c], need, &more) : NIL;
    if (best != NIL)
        return best;

    /* Every segment of a larger class fits; take the smallest of the first few. */
    uint64_t larger = c >= 63 ? 0 : p->nonempty & ~((2ull << c) - 1u);
    if (larger != 0) {
        int ignored;
        return scan_class(p, p->heads[__builtin_ctzll(larger)], need, &ignored);
    }

    /* Nothing larger exists: finish the long class-c scan rather than report a false OOM. */
    for (uint32_t i = p->heads[c]; more && i != NIL; i = p->segs[i].fnext)
        if (p->segs[i].npages >= need)
            return i;
    return NIL;
}

static int alloc_locked(dd_pool *p, uint64_t need, uint64_t *addr, uint64_t *handle)
{
    if (p->closed)
        return DD_ECLOSED;
    if (need > p->npages - p->used_pages)
        return DD_ENOMEM;
    uint32_t i = find_fit(p, need);
    if (i == NIL)
        return DD_ENOMEM;
    if (p->segs[i].npages > need && reserve_record(p) != DD_OK)
        return DD_ENOMEM;

    free_unlink(p, i);
    seg_t *s = &p->segs[i];
    if (s->npages > need) {
        /* Keep the low end, return the tail to the free lists. */
        uint32_t t = record_take(p);
        seg_t *tail = &p->segs[t];
        tail->start = s->start + need;
        tail->npages = s->npages - need;
        tail->prev = i;
        tail->next = s->next;
        if (s->next != NIL)
            p->segs[s->next].prev = t;
        s->next = t;
        s->npages = need;
        free_push(p, t);
    }
    s->state = SEG_USED;
    p->used_pages += need;
    p->nalloc++;
    *addr = p->base + (s->start << p->shift);
    *handle = ((uint64_t)s->gen << 32) | i;
    return DD_OK;
}

int dd_pool_alloc(dd_pool *p, uint64_t nbytes, uint64_t *addr, uint64_t *handle)
{
    if (p == NULL || addr == NULL || handle == NULL || nbytes == 0)
        return DD_EINVAL;
    uint64_t mask = (1ull << p->shift) - 1u;
    uint64_t need = (nbytes >> p->shift) + ((nbytes & mask) != 0);
    pthread_mutex_lock(&p->mu);
    int rc = alloc_locked(p, need, addr, handle);
    pthread_mutex_unlock(&p->mu);
    return rc;
}

static int free_locked(dd_pool *p, uint64_t handle)
{
    uint32_t i = (uint32_t)(handle & 0xffffffffu);
    uint32_t gen = (uint32_t)(handle >> 32);
    if (p->closed)
        return DD_ECLOSED;
    if (i >= p->nrecords || p->segs[i].state != SEG_USED || p->segs[i].gen != gen)
        return DD_EHANDLE;

    seg_t *s = &p->segs[i];
    s->gen = next_gen(s->gen);
    p->used_pages -= s->npages;
    p->nalloc--;

    uint32_t n = s->next;
    if (n != NIL && p->segs[n].state == SEG_FREE) {
        free_unlink(p, n);
        s->npages += p->segs[n].npages;
        s->next = p->segs[n].next;
        if (s->next != NIL)
            p->segs[s->next].prev = i;
        record_release(p, n);
    }
    uint32_t v = s->prev;
    if (v != NIL && p->segs[v].state == SEG_FREE) {
        free_unlink(p, v);
        seg_t *pv = &p->segs[v];
        pv->npages += s->npages;
        pv->next = s->next;
        if (s->next != NIL)
            p->segs[s->next].prev = v;
        record_release(p, i);
        i = v;
    }
    free_push(p, i);
    return DD_OK;
}

int dd_pool_free(dd_pool *p, uint64_t handle)
{
    if (p == NULL)
        return DD_EINVAL;
    pthread_mutex_lock(&p->mu);
    int rc = free_locked(p, handle);
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int dd_pool_get_stats(dd_pool *p, dd_pool_stats *out)
{
    if (p == NULL || out == NULL)
        return DD_EINVAL;
    pthread_mutex_lock(&p->mu);
    int rc = DD_OK;
    if (p->closed) {
        rc = DD_ECLOSED;
    } else {
        uint64_t largest = 0;
        if (p->nonempty != 0) {
            unsigned c = class_of(p->nonempty);
            for (uint32_t i = p->heads[c]; i != NIL; i = p->segs[i].fnext)
                if (p->segs[i].npages > largest)
                    largest = p->segs[i].npages;
        }
        out->capacity = p->npages << p->shift;
        out->used = p->used_pages << p->shift;
        out->free = out->capacity - out->used;
        out->largest_free = largest << p->shift;
        out->allocations = p->nalloc;
        out->page_size = 1ull << p->shift;
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}
