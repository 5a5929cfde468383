/* hostmem.c: page-aligned anonymous host memory for caches and staging buffers.
 *
 * mmap gives what a KV cache wants without touching a byte here: page alignment, zeroed
 * pages, and physical memory committed only where the first write lands, so a large
 * cache costs nothing until it is used. Big mappings ask for transparent huge pages,
 * which cut TLB misses when whole caches are copied; the kernel may ignore the advice.
 */
#define _GNU_SOURCE
#include "datadist.h"

#include <sys/mman.h>
#include <unistd.h>

/* Mappings at least this big get MADV_HUGEPAGE. */
#define HUGEPAGE_MIN (4ull << 20)

uint64_t dd_host_page_size(void)
{
    long page = sysconf(_SC_PAGESIZE);
    return page > 0 ? (uint64_t)page : 4096u;
}

static int round_to_pages(uint64_t nbytes, size_t *out)
{
    uint64_t page = dd_host_page_size();
    if (nbytes == 0 || nbytes > SIZE_MAX - page)
        return DD_EINVAL;
    *out = (size_t)((nbytes + page - 1) & ~(page - 1));
    return DD_OK;
}

int dd_host_alloc(uint64_t nbytes, uint64_t *addr)
{
    size_t len;
    if (addr == NULL || round_to_pages(nbytes, &len) != DD_OK)
        return DD_EINVAL;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED)
        return DD_ENOMEM;
#ifdef MADV_HUGEPAGE
    if (len >= HUGEPAGE_MIN)
        (void)madvise(p, len, MADV_HUGEPAGE);
#endif
    *addr = (uint64_t)(uintptr_t)p;
    return DD_OK;
}

int dd_host_free(uint64_t addr, uint64_t nbytes)
{
    size_t len;
    if (addr == 0 || addr % dd_host_page_size() != 0 || round_to_pages(nbytes, &len) != DD_OK)
        return DD_EINVAL;
    return munmap((void *)(uintptr_t)addr, len) == 0 ? DD_OK : DD_ESYS;
}
