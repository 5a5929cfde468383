/* fake_hccl.c: a stand-in libhccl.so for the tests: communicators and one-sided transfers
 * without a network, between communicators of the same process.
 *
 * HcclGetRootInfo writes a recognisable root info; HcclCommInitRootInfo accepts only one
 * made here and a rank below nRanks; HcclCommInitClusterInfo needs a readable rank-table
 * file; HcclCommDestroy accepts each communicator once (and drops its memory bindings).
 *
 * A communicator belongs to a domain named by a key: 0 for root-info communicators, a
 * 64-bit FNV-1a hash of the rank table's content for cluster-info ones, so two
 * communicators made from two files of equal content are ranks of one domain.
 * HcclRegisterGlobalMem / HcclDeregisterGlobalMem make and drop memory handles (type 0:
 * device memory of the fake ACL, type 1: host memory); HcclCommBindMem / HcclCommUnbindMem
 * attach them to a communicator; HcclCommPrepare (full mesh only) readies it;
 * HcclBatchPut / HcclBatchGet copy bytes between memory bound to the calling communicator
 * and memory bound to the prepared communicator of the same domain with the remote rank.
 * Every descriptor is checked before any byte moves. Device memory is moved only through
 * fake_acl_read / fake_acl_write of the fake ACL named by AIO_DATADIST_ASCENDCL (already
 * loaded); without it, device memory is treated as host memory.
 *
 * Environment, read at every call:
 *   FAKE_HCCL_LOG   file that receives one line per call: "Name args -> rc"
 *   FAKE_HCCL_FAIL  "Name[,Name...]": the named calls fail with HCCL_E_INTERNAL, doing nothing
 * Test helper (not HCCL): fake_hccl_live("comms" | "mems" | "bindings") counts live objects.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
    SUCCESS = 0,
    E_PARA = 1,
    E_PTR = 2,
    E_INTERNAL = 4,
    E_NOT_FOUND = 6,
    E_OPEN_FILE_FAILURE = 10
};
enum { ROOT_INFO_BYTES = 4108, MAX_COMMS = 64 };
enum { MEM_DEVICE = 0, MEM_HOST = 1 };
enum { DATA_TYPE_INT8 = 0 };

typedef struct {
    char internal[ROOT_INFO_BYTES];
} HcclRootInfo;

typedef struct {
    int32_t type;
    void *addr;
    uint64_t size;
} CommMem;

typedef struct {
    void *localAddr;
    void *remoteAddr;
    uint64_t count;
    int32_t dataType;
} HcclOneSideOpDesc;

typedef struct {
    int32_t topoType;
    uint64_t rsvd0, rsvd1, rsvd2;
} HcclPrepareConfig;

typedef struct {
    int32_t type;
    uintptr_t addr;
    uint64_t size;
} mem_record;

typedef struct {
    uint32_t rank;
    uint64_t key;
    int prepared;
    mem_record **bound;
    size_t nbound, cap;
} comm_record;

static const char MAGIC[] = "fake-hccl-root";
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static comm_record *comms[MAX_COMMS];
static mem_record **mems;
static size_t nmems, mems_cap;

static void note(const char *fmt, ...) {
    const char *path = getenv("FAKE_HCCL_LOG");
    if (!path || !*path)
        return;
    FILE *f = fopen(path, "a");
    if (!f)
        return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
    fclose(f);
}

/* E_INTERNAL when FAKE_HCCL_FAIL names this function, else SUCCESS. */
static int injected(const char *name) {
    const char *spec = getenv("FAKE_HCCL_FAIL");
    size_t len = strlen(name);
    while (spec && *spec) {
        if (strncmp(spec, name, len) == 0 && (spec[len] == '\0' || spec[len] == ','))
            return E_INTERNAL;
        spec = strchr(spec, ',');
        if (spec)
            spec++;
    }
    return SUCCESS;
}

static comm_record *comm_of(const void *comm) {
    for (int i = 0; comm && i < MAX_COMMS; i++)
        if (comms[i] == comm)
            return comms[i];
    return NULL;
}

/* Index of a registered handle in mems, or nmems. */
static size_t mem_index(const void *handle) {
    size_t i = 0;
    while (i < nmems && mems[i] != handle)
        i++;
    return i;
}

/* Index of a handle among the comm's bindings, or c->nbound. */
static size_t bound_index(const comm_record *c, const mem_record *m) {
    size_t i = 0;
    while (i < c->nbound && c->bound[i] != m)
        i++;
    return i;
}

static int bound_anywhere(const mem_record *m) {
    for (int i = 0; i < MAX_COMMS; i++)
        if (comms[i] && bound_index(comms[i], m) < comms[i]->nbound)
            return 1;
    return 0;
}

static int new_comm(uint32_t rank, uint64_t key, void **comm) {
    for (int i = 0; i < MAX_COMMS; i++) {
        if (!comms[i]) {
            comms[i] = calloc(1, sizeof *comms[i]);
            if (!comms[i])
                return E_PARA;
            comms[i]->rank = rank;
            comms[i]->key = key;
            *comm = comms[i];
            return SUCCESS;
        }
    }
    return E_PARA;
}

/* FNV-1a of the file's whole content into *key; E_OPEN_FILE_FAILURE if unreadable. */
static int table_key(const char *path, uint64_t *key) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return E_OPEN_FILE_FAILURE;
    uint64_t h = 1469598103934665603ULL;
    unsigned char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        for (size_t i = 0; i < n; i++)
            h = (h ^ buf[i]) * 1099511628211ULL;
    int bad = ferror(f);
    fclose(f);
    if (bad)
        return E_OPEN_FILE_FAILURE;
    *key = h ? h : 1; /* 0 names the root-info domain */
    return SUCCESS;
}

int HcclGetRootInfo(HcclRootInfo *root_info) {
    int rc = injected("HcclGetRootInfo");
    if (!rc && !root_info)
        rc = E_PTR;
    if (!rc) {
        memset(root_info, 0, sizeof *root_info);
        memcpy(root_info->internal, MAGIC, sizeof MAGIC);
        root_info->internal[ROOT_INFO_BYTES - 1] = 0x5a;
    }
    note("HcclGetRootInfo -> %d", rc);
    return rc;
}

int HcclCommInitRootInfo(uint32_t n_ranks, const HcclRootInfo *root_info, uint32_t rank,
                         void **comm) {
    pthread_mutex_lock(&mu);
    int rc = injected("HcclCommInitRootInfo");
    if (!rc && (!root_info || !comm))
        rc = E_PTR;
    if (!rc && (memcmp(root_info->internal, MAGIC, sizeof MAGIC) != 0 ||
                (unsigned char)root_info->internal[ROOT_INFO_BYTES - 1] != 0x5a))
        rc = E_PARA;
    if (!rc && rank >= n_ranks)
        rc = E_PARA;
    if (!rc)
        rc = new_comm(rank, 0, comm);
    note("HcclCommInitRootInfo nRanks=%u rank=%u -> %d", n_ranks, rank, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

int HcclCommInitClusterInfo(const char *cluster_info, uint32_t rank, void **comm) {
    pthread_mutex_lock(&mu);
    int rc = injected("HcclCommInitClusterInfo");
    uint64_t key = 0;
    if (!rc && (!cluster_info || !comm))
        rc = E_PTR;
    if (!rc)
        rc = table_key(cluster_info, &key);
    if (!rc)
        rc = new_comm(rank, key, comm);
    note("HcclCommInitClusterInfo rank=%u -> %d", rank, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

int HcclCommDestroy(void *comm) {
    pthread_mutex_lock(&mu);
    int rc = injected("HcclCommDestroy");
    size_t unbound = 0;
    int i = 0;
    while (i < MAX_COMMS && (!comm || comms[i] != comm))
        i++;
    if (!rc && i == MAX_COMMS)
        rc = E_NOT_FOUND;
    if (!rc) {
        unbound = comms[i]->nbound;
        free(comms[i]->bound);
        free(comms[i]);
        comms[i] = NULL;
    }
    note("HcclCommDestroy unbound=%zu -> %d", unbound, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

int HcclRegisterGlobalMem(CommMem *mem, void **memHandle) {
    pthread_mutex_lock(&mu);
    int rc = injected("HcclRegisterGlobalMem");
    if (!rc && (!mem || !memHandle))
        rc = E_PTR;
    if (!rc && (!mem->addr || mem->size == 0 || (mem->type != MEM_DEVICE && mem->type != MEM_HOST)))
        rc = E_PARA;
    if (!rc && nmems == mems_cap) {
        size_t cap = mems_cap ? 2 * mems_cap : 16;
        mem_record **grown = realloc(mems, cap * sizeof *grown);
        if (!grown)
            rc = E_INTERNAL;
        else {
            mems = grown;
            mems_cap = cap;
        }
    }
    mem_record *m = NULL;
    if (!rc && !(m = malloc(sizeof *m)))
        rc = E_INTERNAL;
    if (!rc) {
        *m = (mem_record){mem->type, (uintptr_t)mem->addr, mem->size};
        mems[nmems++] = m;
        *memHandle = m;
    }
    note("HcclRegisterGlobalMem type=%d size=%llu -> %d", mem ? (int)mem->type : -1,
         mem ? (unsigned long long)mem->size : 0ULL, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

int HcclDeregisterGlobalMem(void *memHandle) {
    pthread_mutex_lock(&mu);
    int rc = injected("HcclDeregisterGlobalMem");
    size_t i = mem_index(memHandle);
    if (!rc && (!memHandle || i == nmems))
        rc = E_NOT_FOUND;
    if (!rc && bound_anywhere(mems[i]))
        rc = E_PARA;
    if (!rc) {
        free(mems[i]);
        mems[i] = mems[--nmems];
    }
    note("HcclDeregisterGlobalMem -> %d", rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

int HcclCommBindMem(void *comm, void *memHandle) {
    pthread_mutex_lock(&mu);
    int rc = injected("HcclCommBindMem");
    comm_record *c = comm_of(comm);
    size_t i = mem_index(memHandle);
    if (!rc && (!c || !memHandle || i == nmems))
        rc = E_NOT_FOUND;
    if (!rc && bound_index(c, mems[i]) < c->nbound)
        rc = E_PARA;
    if (!rc && c->nbound == c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 8;
        mem_record **grown = realloc(c->bound, cap * sizeof *grown);
        if (!grown)
            rc = E_INTERNAL;
        else {
            c->bound = grown;
            c->cap = cap;
        }
    }
    if (!rc)
        c->bound[c->nbound++] = mems[i];
    note("HcclCommBindMem -> %d", rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

int HcclCommUnbindMem(void *comm, void *memHandle) {
    pthread_mutex_lock(&mu);
    int rc = injected("HcclCommUnbindMem");
    comm_record *c = comm_of(comm);
    size_t i = mem_index(memHandle), b = 0;
    if (!rc && (!c || !memHandle || i == nmems))
        rc = E_NOT_FOUND;
    if (!rc && (b = bound_index(c, mems[i])) == c->nbound)
        rc = E_NOT_FOUND;
    if (!rc)
        c->bound[b] = c->bound[--c->nbound];
    note("HcclCommUnbindMem -> %d", rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

int HcclCommPrepare(void *comm, HcclPrepareConfig *prepareConfig, int32_t timeout) {
    pthread_mutex_lock(&mu);
    int rc = injected("HcclCommPrepare");
    comm_record *c = comm_of(comm);
    if (!rc && !c)
        rc = E_NOT_FOUND;
    if (!rc && !prepareConfig)
        rc = E_PTR;
    if (!rc && prepareConfig->topoType != 0)
        rc = E_PARA;
    if (!rc)
        c->prepared = 1;
    note("HcclCommPrepare topoType=%d timeout=%d -> %d",
         prepareConfig ? (int)prepareConfig->topoType : -1, (int)timeout, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

/* The memory bound to c that holds [addr, addr + n) whole, or NULL. */
static const mem_record *holder(const comm_record *c, const void *addr, uint64_t n) {
    uintptr_t a = (uintptr_t)addr;
    for (size_t i = 0; i < c->nbound; i++) {
        const mem_record *m = c->bound[i];
        if (a >= m->addr && n <= m->size && a - m->addr <= m->size - n)
            return m;
    }
    return NULL;
}

typedef int (*acl_read_fn)(uint64_t, void *, size_t);
typedef int (*acl_write_fn)(uint64_t, const void *, size_t);

typedef struct {
    void *lib;
    acl_read_fn read;
    acl_write_fn write;
} acl_access;

/* The fake ACL's device accessors, if AIO_DATADIST_ASCENDCL names a loaded library that
 * has them; otherwise read and write stay NULL and device memory is host memory. */
static acl_access open_acl(void) {
    acl_access a = {NULL, NULL, NULL};
    const char *path = getenv("AIO_DATADIST_ASCENDCL");
    if (!path || !*path)
        return a;
    a.lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!a.lib)
        return a;
    void *r = dlsym(a.lib, "fake_acl_read"), *w = dlsym(a.lib, "fake_acl_write");
    memcpy(&a.read, &r, sizeof a.read); /* object to function pointer, as POSIX allows */
    memcpy(&a.write, &w, sizeof a.write);
    if (!a.read || !a.write)
        a.read = NULL, a.write = NULL;
    return a;
}

static void close_acl(acl_access *a) {
    if (a->lib)
        dlclose(a->lib);
    *a = (acl_access){NULL, NULL, NULL};
}

/* Move n bytes from src (memory of type src_type) to dst (of type dst_type). */
static int move_bytes(const acl_access *acl, void *dst, int dst_type, const void *src,
                      int src_type, uint64_t n) {
    int dst_dev = dst_type == MEM_DEVICE && acl->write;
    int src_dev = src_type == MEM_DEVICE && acl->read;
    if (!dst_dev && !src_dev) {
        memmove(dst, src, (size_t)n);
        return SUCCESS;
    }
    if (dst_dev && !src_dev)
        return acl->write((uint64_t)(uintptr_t)dst, src, (size_t)n) ? E_INTERNAL : SUCCESS;
    if (!dst_dev && src_dev)
        return acl->read((uint64_t)(uintptr_t)src, dst, (size_t)n) ? E_INTERNAL : SUCCESS;
    void *bounce = malloc((size_t)n);
    if (!bounce)
        return E_INTERNAL;
    int rc = acl->read((uint64_t)(uintptr_t)src, bounce, (size_t)n) ||
                     acl->write((uint64_t)(uintptr_t)dst, bounce, (size_t)n)
                 ? E_INTERNAL
                 : SUCCESS;
    free(bounce);
    return rc;
}

/* HcclBatchPut (put != 0: local to remote) and HcclBatchGet (remote to local). */
static int batch(const char *name, int put, void *comm, uint32_t remote_rank,
                 HcclOneSideOpDesc *desc, uint32_t n, void *stream) {
    pthread_mutex_lock(&mu);
    int rc = injected(name);
    unsigned long long moved = 0;
    comm_record *c = comm_of(comm), *peer = NULL;
    if (!rc && !c)
        rc = E_NOT_FOUND;
    if (!rc && (!desc || !stream))
        rc = E_PTR;
    if (!rc && n == 0)
        rc = E_PARA;
    if (!rc && !c->prepared)
        rc = E_INTERNAL;
    for (int i = 0; !rc && !peer && i < MAX_COMMS; i++)
        if (comms[i] && comms[i] != c && comms[i]->key == c->key &&
            comms[i]->rank == remote_rank && comms[i]->prepared)
            peer = comms[i];
    if (!rc && (!peer || remote_rank == c->rank))
        rc = E_NOT_FOUND;
    for (uint32_t i = 0; !rc && i < n; i++)
        if (desc[i].dataType != DATA_TYPE_INT8 || desc[i].count == 0 ||
            !holder(c, desc[i].localAddr, desc[i].count) ||
            !holder(peer, desc[i].remoteAddr, desc[i].count))
            rc = E_PARA;
    if (!rc) {
        acl_access acl = open_acl();
        for (uint32_t i = 0; !rc && i < n; i++) {
            int local = holder(c, desc[i].localAddr, desc[i].count)->type;
            int remote = holder(peer, desc[i].remoteAddr, desc[i].count)->type;
            if (put)
                rc = move_bytes(&acl, desc[i].remoteAddr, remote, desc[i].localAddr, local,
                                desc[i].count);
            else
                rc = move_bytes(&acl, desc[i].localAddr, local, desc[i].remoteAddr, remote,
                                desc[i].count);
            if (!rc)
                moved += desc[i].count;
        }
        close_acl(&acl);
    }
    note("%s rank=%u n=%u bytes=%llu -> %d", name, remote_rank, n, moved, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

int HcclBatchPut(void *comm, uint32_t remoteRank, HcclOneSideOpDesc *desc, uint32_t descNum,
                 void *stream) {
    return batch("HcclBatchPut", 1, comm, remoteRank, desc, descNum, stream);
}

int HcclBatchGet(void *comm, uint32_t remoteRank, HcclOneSideOpDesc *desc, uint32_t descNum,
                 void *stream) {
    return batch("HcclBatchGet", 0, comm, remoteRank, desc, descNum, stream);
}

/* ---- test helper, not part of HCCL ---- */

/* what: "comms" (live communicators), "mems" (registered handles), "bindings" (handles
 * bound, summed over communicators); -1 for another word. */
long fake_hccl_live(const char *what) {
    pthread_mutex_lock(&mu);
    long n = -1;
    if (what && strcmp(what, "comms") == 0) {
        n = 0;
        for (int i = 0; i < MAX_COMMS; i++)
            n += comms[i] != NULL;
    } else if (what && strcmp(what, "mems") == 0) {
        n = (long)nmems;
    } else if (what && strcmp(what, "bindings") == 0) {
        n = 0;
        for (int i = 0; i < MAX_COMMS; i++)
            n += comms[i] ? (long)comms[i]->nbound : 0;
    }
    pthread_mutex_unlock(&mu);
    return n;
}
