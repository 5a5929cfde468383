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
#include <string.h>

#define DEFAULT_LIBRARY "libhccl.so"
#define PATH_MAX_BYTES 4096

typedef struct {
    dd_HcclGetRootInfo_fn get_root_info;
    dd_HcclCommInitRootInfo_fn comm_init_root_info;
    dd_HcclCommInitClusterInfo_fn comm_init_cluster_info; /* optional */
    dd_HcclCommDestroy_fn comm_destroy;
} hccl_table;

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

int32_t dd_hccl_last_error(void) { return t_code; }
