/* hccl.c: libhccl through dlopen: whether it is present, and communicator set-up and teardown.
 *
 * Only the calls a rank-table `link` needs to build a communication domain are bound here;
 * HCCL needs an initialised ACL device on the calling thread, which the caller arranges.
 */
#define _GNU_SOURCE
#include "acl_rt.h"
#include "datadist.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_LIBRARY "libhccl.so"
#define PATH_MAX_BYTES 4096

typedef struct {
    dd_HcclGetRootInfo_fn get_root_info;
    dd_HcclCommInitRootInfo_fn comm_init_root_info;
    dd_HcclCommInitClusterInfo_fn comm_init_cluster_info; /* optional */
    dd_HcclCommDestroy_fn comm_destroy;
    /* one-sided: all present or all NULL */
    dd_HcclRegisterGlobalMem_fn register_mem;
    dd_HcclDeregisterGlobalMem_fn deregister_mem;
    dd_HcclCommBindMem_fn bind_mem;
    dd_HcclCommUnbindMem_fn unbind_mem;
    dd_HcclCommPrepare_fn prepare;
    dd_HcclBatchOp_fn batch_put;
    dd_HcclBatchOp_fn batch_get;
} hccl_table;

#define ONE_SIDED_COUNT 7
static const char *const one_sided_names[ONE_SIDED_COUNT] = {
    "HcclRegisterGlobalMem", "HcclDeregisterGlobalMem", "HcclCommBindMem", "HcclCommUnbindMem",
    "HcclCommPrepare",       "HcclBatchPut",            "HcclBatchGet"};

static struct {
    pthread_mutex_t lock;
    void *handle;
    char path[PATH_MAX_BYTES];
    hccl_table fn;
} g = {.lock = PTHREAD_MUTEX_INITIALIZER};

static _Thread_local int32_t t_code;

static int classify(HcclResult r) {
    t_code = (int32_t)r;
    switch ((int)r) {
    case HCCL_SUCCESS:
        return DD_OK;
    case HCCL_E_PARA:
    case HCCL_E_PTR:
        return DD_EINVAL;
    case HCCL_E_MEMORY:
        return DD_ENOMEM;
    default:
        return DD_ACL_EFAIL;
    }
}

static void *sym(void *h, const char *name) { return dlsym(h, name); }

int dd_hccl_load(const char *path, char *err, size_t cap) {
    char scratch[8];
    if (!err || !cap) {
        err = scratch;
        cap = sizeof scratch;
    }
    err[0] = '\0';
    if (!path || !*path)
        path = DEFAULT_LIBRARY;
    if (strlen(path) >= PATH_MAX_BYTES) {
        snprintf(err, cap, "library path too long");
        return DD_EINVAL;
    }
    pthread_mutex_lock(&g.lock);
    int rc = DD_OK;
    if (g.handle && strcmp(g.path, path) == 0)
        goto out;
    dlerror();
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *why = dlerror();
        snprintf(err, cap, "%s", why ? why : "dlopen failed");
        rc = DD_ACL_ENOLIB;
        goto out;
    }
    static const char *const required[] = {"HcclGetRootInfo", "HcclCommInitRootInfo",
                                           "HcclCommDestroy"};
    void *found[3];
    for (size_t i = 0; i < 3; i++) {
        found[i] = sym(h, required[i]);
        if (!found[i]) {
            snprintf(err, cap, "%s has no symbol %s", path, required[i]);
            dlclose(h);
            rc = DD_ACL_ENOLIB;
            goto out;
        }
    }
    hccl_table t;
    memcpy(&t.get_root_info, &found[0], sizeof found[0]);
    memcpy(&t.comm_init_root_info, &found[1], sizeof found[1]);
    memcpy(&t.comm_destroy, &found[2], sizeof found[2]);
    void *cluster = sym(h, "HcclCommInitClusterInfo");
    memcpy(&t.comm_init_cluster_info, &cluster, sizeof cluster);
    void *one_sided[ONE_SIDED_COUNT];
    int all = 1;
    for (size_t i = 0; i < ONE_SIDED_COUNT; i++) {
        one_sided[i] = sym(h, one_sided_names[i]);
        all = all && one_sided[i] != NULL;
    }
    if (!all)
        memset(one_sided, 0, sizeof one_sided);
    memcpy(&t.register_mem, &one_sided[0], sizeof one_sided[0]);
    memcpy(&t.deregister_mem, &one_sided[1], sizeof one_sided[1]);
    memcpy(&t.bind_mem, &one_sided[2], sizeof one_sided[2]);
    memcpy(&t.unbind_mem, &one_sided[3], sizeof one_sided[3]);
    memcpy(&t.prepare, &one_sided[4], sizeof one_sided[4]);
    memcpy(&t.batch_put, &one_sided[5], sizeof one_sided[5]);
    memcpy(&t.batch_get, &one_sided[6], sizeof one_sided[6]);
    if (h == g.handle)
        dlclose(h);
    g.handle = h;
    g.fn = t;
    snprintf(g.path, sizeof g.path, "%s", path);
out:
    pthread_mutex_unlock(&g.lock);
    return rc;
}

/* The table, or NULL when nothing is loaded; the process lock is held only to read it. */
static int table(hccl_table *out) {
    pthread_mutex_lock(&g.lock);
    int ok = g.handle != NULL;
    if (ok)
        *out = g.fn;
    pthread_mutex_unlock(&g.lock);
    return ok;
}

int dd_hccl_has_cluster_info(void) {
    hccl_table t;
    return table(&t) && t.comm_init_cluster_info != NULL;
}

int dd_hccl_get_root_info(uint8_t *root_info) {
    hccl_table t;
    t_code = 0;
    if (!root_info)
        return DD_EINVAL;
    if (!table(&t))
        return DD_ACL_ENOLIB;
    HcclRootInfo info;
    memset(&info, 0, sizeof info);
    int rc = classify(t.get_root_info(&info));
    if (rc == DD_OK)
        memcpy(root_info, info.internal, sizeof info.internal);
    return rc;
}

int dd_hccl_comm_init_root_info(uint32_t n_ranks, const uint8_t *root_info, uint32_t rank,
                                uint64_t *comm) {
    hccl_table t;
    t_code = 0;
    if (!root_info || !comm || n_ranks == 0 || rank >= n_ranks)
        return DD_EINVAL;
    if (!table(&t))
        return DD_ACL_ENOLIB;
    HcclRootInfo info;
    memcpy(info.internal, root_info, sizeof info.internal);
    HcclComm c = NULL;
    int rc = classify(t.comm_init_root_info(n_ranks, &info, rank, &c));
    if (rc == DD_OK)
        *comm = (uint64_t)(uintptr_t)c;
    return rc;
}

int dd_hccl_comm_init_cluster_info(const char *rank_table_path, uint32_t rank, uint64_t *comm) {
    hccl_table t;
    t_code = 0;
    if (!rank_table_path || !comm)
        return DD_EINVAL;
    if (!table(&t) || !t.comm_init_cluster_info)
        return DD_ACL_ENOLIB;
    HcclComm c = NULL;
    int rc = classify(t.comm_init_cluster_info(rank_table_path, rank, &c));
    if (rc == DD_OK)
        *comm = (uint64_t)(uintptr_t)c;
    return rc;
}

int dd_hccl_comm_destroy(uint64_t comm) {
    hccl_table t;
    t_code = 0;
    if (!comm)
        return DD_EINVAL;
    if (!table(&t))
        return DD_ACL_ENOLIB;
    return classify(t.comm_destroy((HcclComm)(uintptr_t)comm));
}

int dd_hccl_has_one_sided(void) {
    hccl_table t;
    return table(&t) && t.batch_get != NULL;
}

/* The table with its one-sided calls, or 0 (nothing loaded, or no one-sided calls). */
static int one_sided(hccl_table *t) { return table(t) && t->batch_get != NULL; }

int dd_hccl_bind_mem(uint64_t comm, int on_device, uint64_t addr, uint64_t nbytes,
                     uint64_t *handle) {
    hccl_table t;
    t_code = 0;
    if (!comm || !addr || !nbytes || !handle || addr + nbytes < addr)
        return DD_EINVAL;
    if (!one_sided(&t))
        return DD_ACL_ENOLIB;
    CommMem mem = {on_device ? HCCL_MEM_TYPE_DEVICE : HCCL_MEM_TYPE_HOST,
                   (void *)(uintptr_t)addr, nbytes};
    void *h = NULL;
    int rc = classify(t.register_mem(&mem, &h));
    if (rc != DD_OK)
        return rc;
    rc = classify(t.bind_mem((HcclComm)(uintptr_t)comm, h));
    if (rc != DD_OK) {
        int32_t code = t_code;
        (void)t.deregister_mem(h);
        t_code = code; /* the bind's code, not the clean-up's */
        return rc;
    }
    *handle = (uint64_t)(uintptr_t)h;
    return DD_OK;
}

int dd_hccl_unbind_mem(uint64_t comm, uint64_t handle) {
    hccl_table t;
    t_code = 0;
    if (!comm || !handle)
        return DD_EINVAL;
    if (!one_sided(&t))
        return DD_ACL_ENOLIB;
    void *h = (void *)(uintptr_t)handle;
    int rc = classify(t.unbind_mem((HcclComm)(uintptr_t)comm, h));
    int32_t code = t_code;
    int rc2 = classify(t.deregister_mem(h));
    if (rc != DD_OK) {
        t_code = code;
        return rc;
    }
    return rc2;
}

int dd_hccl_prepare(uint64_t comm, int32_t timeout_s) {
    hccl_table t;
    t_code = 0;
    if (!comm || timeout_s < 0)
        return DD_EINVAL;
    if (!one_sided(&t))
        return DD_ACL_ENOLIB;
    HcclPrepareConfig config;
    memset(&config, 0, sizeof config);
    config.topoType = HCCL_TOPO_FULLMESH;
    return classify(t.prepare((HcclComm)(uintptr_t)comm, &config, timeout_s));
}

typedef struct {
    dd_HcclBatchOp_fn op;
    HcclComm comm;
    uint32_t remote_rank;
    HcclOneSideOpDesc *desc;
    uint32_t n;
} batch_args;

static int issue_batch(aclrtStream stream, void *arg) {
    batch_args *a = arg;
    return classify(a->op(a->comm, a->remote_rank, a->desc, a->n, stream));
}

int dd_hccl_batch(dd_acl_rt *rt, uint64_t comm, uint32_t remote_rank, const uint64_t *rows,
                  size_t n, int get) {
    hccl_table t;
    t_code = 0;
    if (!rt || !comm || !rows || n == 0 || n > UINT32_MAX)
        return DD_EINVAL;
    for (size_t i = 0; i < n; i++) {
        uint64_t local = rows[3 * i], remote = rows[3 * i + 1], len = rows[3 * i + 2];
        if (!local || !remote || !len || local + len < local || remote + len < remote)
            return DD_EINVAL;
    }
    if (!one_sided(&t))
        return DD_ACL_ENOLIB;
    HcclOneSideOpDesc *desc = calloc(n, sizeof *desc);
    if (!desc)
        return DD_ENOMEM;
    for (size_t i = 0; i < n; i++) {
        desc[i].localAddr = (void *)(uintptr_t)rows[3 * i];
        desc[i].remoteAddr = (void *)(uintptr_t)rows[3 * i + 1];
        desc[i].count = rows[3 * i + 2];
        desc[i].dataType = HCCL_DATA_TYPE_INT8;
    }
    batch_args a = {get ? t.batch_get : t.batch_put, (HcclComm)(uintptr_t)comm, remote_rank,
                    desc, (uint32_t)n};
    int32_t code = 0;
    int rc = dd_acl_on_stream(rt, issue_batch, &a);
    code = t_code;
    free(desc);
    t_code = code;
    return rc;
}

int32_t dd_hccl_last_error(void) { return t_code; }
