/* fake_hccl.c: a stand-in libhccl.so for the tests: communicator set-up without a network.
 *
 * HcclGetRootInfo writes a recognisable root info; HcclCommInitRootInfo accepts only one
 * made here and a rank below nRanks; HcclCommInitClusterInfo needs a readable rank-table
 * file; HcclCommDestroy accepts each communicator once. FAKE_HCCL_LOG names a file that
 * receives one line per call.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { SUCCESS = 0, E_PARA = 1, E_PTR = 2, E_NOT_FOUND = 6, E_OPEN_FILE_FAILURE = 10 };
enum { ROOT_INFO_BYTES = 4108, MAX_COMMS = 64 };

typedef struct {
    char internal[ROOT_INFO_BYTES];
} HcclRootInfo;

static const char MAGIC[] = "fake-hccl-root";
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static void *comms[MAX_COMMS];

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

static int new_comm(uint32_t rank, void **comm) {
    for (int i = 0; i < MAX_COMMS; i++) {
        if (!comms[i]) {
            comms[i] = malloc(sizeof(uint32_t));
            if (!comms[i])
                return E_PARA;
            *(uint32_t *)comms[i] = rank;
            *comm = comms[i];
            return SUCCESS;
        }
    }
    return E_PARA;
}

int HcclGetRootInfo(HcclRootInfo *root_info) {
    int rc = root_info ? SUCCESS : E_PTR;
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
    int rc = !root_info || !comm ? E_PTR : SUCCESS;
    if (!rc && (memcmp(root_info->internal, MAGIC, sizeof MAGIC) != 0 ||
                (unsigned char)root_info->internal[ROOT_INFO_BYTES - 1] != 0x5a))
        rc = E_PARA;
    if (!rc && rank >= n_ranks)
        rc = E_PARA;
    if (!rc)
        rc = new_comm(rank, comm);
    note("HcclCommInitRootInfo nRanks=%u rank=%u -> %d", n_ranks, rank, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

int HcclCommInitClusterInfo(const char *cluster_info, uint32_t rank, void **comm) {
    pthread_mutex_lock(&mu);
    int rc = !cluster_info || !comm ? E_PTR : SUCCESS;
    if (!rc) {
        FILE *f = fopen(cluster_info, "r");
        if (!f)
            rc = E_OPEN_FILE_FAILURE;
        else
            fclose(f);
    }
    if (!rc)
        rc = new_comm(rank, comm);
    note("HcclCommInitClusterInfo rank=%u -> %d", rank, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

int HcclCommDestroy(void *comm) {
    pthread_mutex_lock(&mu);
    int rc = E_NOT_FOUND;
    for (int i = 0; i < MAX_COMMS && rc; i++) {
        if (comm && comms[i] == comm) {
            free(comms[i]);
            comms[i] = NULL;
            rc = SUCCESS;
        }
    }
    note("HcclCommDestroy -> %d", rc);
    pthread_mutex_unlock(&mu);
    return rc;
}
