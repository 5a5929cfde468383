/* hostmem.c: page-aligned host memory for caches and staging buffers.
 *
 * mmap gives what a KV cache wants without touching a byte here: page alignment, zeroed
 * pages, and physical memory committed only where the first write lands, so a large pool
 * costs nothing until it is used. Pools commit the pages of a cache when they hand it out
 * (dd_host_populate), in one call, so transfers never take page faults, as on a device.
 * Big mappings ask for transparent huge pages, which cut TLB misses when whole caches are
 * copied; the kernel may ignore the advice.
 *
 * Shared memory (dd_host_alloc_shared) is the same, backed by a memory file (memfd) sealed
 * at its size, so that a proven same-host peer can map it too (dd_host_map_peer): the
 * peer takes the file from this process by descriptor number (pidfd_getfd, which the
 * kernel allows exactly where it allows process_vm_readv) and checks it is the file this
 * process published before mapping it. A sealed file cannot shrink under a mapping, so a
 * mapper never meets SIGBUS; it unmaps with dd_host_free.
 */
#define _GNU_SOURCE
#include "datadist.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#define MFD_ALLOW_SEALING 0x0002U
#endif
#ifndef F_ADD_SEALS
#define F_ADD_SEALS 1033
#define F_GET_SEALS 1034
#define F_SEAL_SEAL 0x0001
#define F_SEAL_SHRINK 0x0002
#define F_SEAL_GROW 0x0004
#endif
/* The seals of a shared arena: its size is fixed for good. */
#define ARENA_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

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

/* Mappings start at a multiple of the largest power of two up to this that fits in them, so
 * a pool's pages (and huge pages, where the kernel gives them) start aligned whatever the
 * kernel would have picked. */
#define ALIGN_MAX (2ull << 20)

/* Map len bytes (fd -1: anonymous private memory; else fd's file, shared), aligned as
 * ALIGN_MAX says: reserve room for the alignment, map over its aligned part, return the
 * rest. MAP_FAILED on failure (errno set). */
static void *map_aligned(size_t len, int fd)
{
    size_t align = (size_t)dd_host_page_size();
    while (align < ALIGN_MAX && align * 2 <= len)
        align *= 2;
    int flags = fd < 0 ? MAP_PRIVATE | MAP_ANONYMOUS : MAP_SHARED;
    if (len > SIZE_MAX - align)
        return MAP_FAILED;
    char *room = mmap(NULL, len + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
    if (room == MAP_FAILED)
        return MAP_FAILED;
    char *start = (char *)(((uintptr_t)room + align - 1) & ~((uintptr_t)align - 1));
    void *p = mmap(start, len, PROT_READ | PROT_WRITE, flags | MAP_FIXED | MAP_NORESERVE, fd, 0);
    if (p == MAP_FAILED) {
        int saved = errno;
        munmap(room, len + align);
        errno = saved;
        return MAP_FAILED;
    }
    if (start > room)
        munmap(room, (size_t)(start - room));
    size_t tail = (size_t)(room + len + align - (start + len));
    if (tail > 0)
        munmap(start + len, tail);
    return p;
}

static void advise(void *p, size_t len)
{
#ifdef MADV_HUGEPAGE
    if (len >= HUGEPAGE_MIN)
        (void)madvise(p, len, MADV_HUGEPAGE);
#else
    (void)p;
    (void)len;
#endif
}

int dd_host_alloc(uint64_t nbytes, uint64_t *addr)
{
    size_t len;
    if (addr == NULL || round_to_pages(nbytes, &len) != DD_OK)
        return DD_EINVAL;
    void *p = map_aligned(len, -1);
    if (p == MAP_FAILED)
        return DD_ENOMEM;
    advise(p, len);
    *addr = (uint64_t)(uintptr_t)p;
    return DD_OK;
}

int dd_host_alloc_shared(uint64_t nbytes, uint64_t *addr, int *fd)
{
    size_t len;
    if (addr == NULL || fd == NULL || round_to_pages(nbytes, &len) != DD_OK)
        return DD_EINVAL;
    int f = (int)syscall(SYS_memfd_create, "aio-datadist-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (f < 0)
        return DD_ESYS;
    if (ftruncate(f, (off_t)len) != 0 || fcntl(f, F_ADD_SEALS, ARENA_SEALS) != 0) {
        int saved = errno;
        close(f);
        errno = saved;
        return errno == ENOMEM || errno == ENOSPC ? DD_ENOMEM : DD_ESYS;
    }
    void *p = map_aligned(len, f);
    if (p == MAP_FAILED) {
        close(f);
        return DD_ENOMEM;
    }
    advise(p, len);
    *addr = (uint64_t)(uintptr_t)p;
    *fd = f;
    return DD_OK;
}

int dd_host_map_peer(int pid, int fd_no, uint64_t ino, uint64_t nbytes, uint64_t *addr)
{
    size_t len;
    if (pid <= 0 || fd_no < 0 || addr == NULL || round_to_pages(nbytes, &len) != DD_OK)
        return DD_EINVAL;
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (pidfd < 0)
        return DD_ESYS;
    int f = (int)syscall(SYS_pidfd_getfd, pidfd, fd_no, 0);
    int saved = errno;
    close(pidfd);
    if (f < 0) {
        errno = saved;
        return DD_ESYS;
    }
    /* Only the file the peer published: a regular file of that inode and exactly that size,
     * sealed against shrinking (a descriptor number reused meanwhile names another file). */
    struct stat st;
    int rc = DD_OK;
    if (fstat(f, &st) != 0) {
        rc = DD_ESYS;
    } else if (!S_ISREG(st.st_mode) || (uint64_t)st.st_ino != ino || (uint64_t)st.st_size != len ||
               (fcntl(f, F_GET_SEALS) & F_SEAL_SHRINK) == 0) {
        errno = EBADF;
        rc = DD_ESYS;
    } else {
        void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, f, 0);
        if (p == MAP_FAILED)
            rc = DD_ESYS;
        else
            *addr = (uint64_t)(uintptr_t)p;
    }
    saved = errno;
    close(f);
    errno = saved;
    return rc;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

int dd_host_populate(uint64_t addr, uint64_t nbytes)
{
    size_t len;
    uint64_t page = dd_host_page_size();
    if (addr == 0 || addr % page != 0 || round_to_pages(nbytes, &len) != DD_OK ||
        addr > UINTPTR_MAX - len)
        return DD_EINVAL;
    if (madvise((void *)(uintptr_t)addr, len, MADV_POPULATE_WRITE) == 0)
        return DD_OK;
    if (errno == ENOMEM || errno == EFAULT) /* EFAULT: an access would raise SIGBUS */
        return DD_ENOMEM;
    if (errno != EINVAL)
        return DD_ESYS;
    /* A kernel without MADV_POPULATE_WRITE: fault each page in by writing a byte back. */
    volatile unsigned char *p = (volatile unsigned char *)(uintptr_t)addr;
    for (size_t off = 0; off < len; off += (size_t)page)
        p[off] = p[off];
    return DD_OK;
}

int dd_host_free(uint64_t addr, uint64_t nbytes)
{
    size_t len;
    if (addr == 0 || addr % dd_host_page_size() != 0 || round_to_pages(nbytes, &len) != DD_OK)
        return DD_EINVAL;
    return munmap((void *)(uintptr_t)addr, len) == 0 ? DD_OK : DD_ESYS;
}
