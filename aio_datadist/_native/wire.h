/* wire.h: the wire format of a link, defined once for C and Python.
 *
 * Every number of the format lives here: the frame header's layout, the frame kinds, the
 * PULL body's prefix, the access body's fixed layout, its flags and targets, and the
 * limits. build_ffi.py feeds the cdef region to cffi, aio_datadist/_native/wire.py hands
 * the values to the transport and the engine, and net.c and serve.c include this header,
 * so no side keeps a copy. The region holds enums (and one macro, for a limit wider than
 * an int) that cffi reads as they are.
 *
 * Every field is little-endian; the native layer builds for little-endian hosts only.
 */
#ifndef AIO_DATADIST_WIRE_H
#define AIO_DATADIST_WIRE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* cdef-begin */

/* A frame: a DD_HDR_SIZE-byte header, body_len bytes of control body, then payload_len
 * bytes of bulk payload (KV bytes, moved straight from or into registered memory). */
enum {
    DD_WIRE_MAGIC = 0x44444941, /* "AIDD", read as a u32 */
    DD_WIRE_VERSION = 1,
    /* Header fields: offset and size in bytes. */
    DD_HDR_MAGIC_OFF = 0,         DD_HDR_MAGIC_SIZE = 4,
    DD_HDR_VERSION_OFF = 4,       DD_HDR_VERSION_SIZE = 2,
    DD_HDR_KIND_OFF = 6,          DD_HDR_KIND_SIZE = 2,        /* DD_FRAME_* */
    DD_HDR_REQUEST_ID_OFF = 8,    DD_HDR_REQUEST_ID_SIZE = 8,  /* pairs answer and request; 0: none */
    DD_HDR_STATUS_OFF = 16,       DD_HDR_STATUS_SIZE = 8,      /* int64 status of an answer; 0 in requests */
    DD_HDR_BODY_LEN_OFF = 24,     DD_HDR_BODY_LEN_SIZE = 4,    /* <= DD_WIRE_MAX_BODY */
    DD_HDR_FLAGS_OFF = 28,        DD_HDR_FLAGS_SIZE = 4,       /* per-kind bits; no kind defines one yet */
    DD_HDR_PAYLOAD_LEN_OFF = 32,  DD_HDR_PAYLOAD_LEN_SIZE = 8, /* <= DD_WIRE_MAX_PAYLOAD */
    DD_HDR_SIZE = 40
};

/* What a frame carries (the header's kind). */
enum {
    DD_FRAME_HELLO = 1,
    DD_FRAME_HELLO_ACK = 2,
    DD_FRAME_BYE = 3,
    DD_FRAME_BYE_ACK = 4,
    DD_FRAME_PING = 5,
    DD_FRAME_PONG = 6,
    DD_FRAME_AUTH = 7,
    DD_FRAME_PULL = 16,
    DD_FRAME_PULL_DATA = 17,
    DD_FRAME_PULL_DONE = 18,
    DD_FRAME_PUSH = 19,
    DD_FRAME_PUSH_ACK = 20,
    DD_FRAME_ERROR = 31
};

/* Limits every decoder enforces. */
enum {
    DD_WIRE_MAX_BODY = 1 << 24,       /* control body bytes */
    DD_WIRE_MAX_HELLO_BODY = 1 << 16, /* HELLO / HELLO_ACK body bytes */
    DD_WIRE_MAX_ERROR_TEXT = 4096     /* ERROR message bytes a sender puts on the wire */
};
/* Payload bytes of one frame (1 TiB); each request bounds it further. A macro: an enum
 * constant must fit an int. */
#define DD_WIRE_MAX_PAYLOAD 0x10000000000ULL

/* Record types of the HELLO extension blob (u16 type, u16 length, the bytes); readers skip
 * types they do not know. */
enum {
    /* 1: retired (an unverified process id and board descriptor); skipped like any unknown */
    DD_HELLO_EXT_AUTH_NONCE = 2,    /* the client's nonce: it starts authentication */
    DD_HELLO_EXT_COMM_NAME = 3,     /* the communication domain a client links for */
    DD_HELLO_EXT_HOST_PRESENCE = 4, /* same host: the host's identity, where to prove it */
    DD_HELLO_EXT_UCX = 5            /* the sender offers the UCX route: one byte, DD_UCX_VERSION */
};

/* A PULL body: the u64 payload bytes the requester expects, then the access. A PUSH body is
 * the access alone. */
enum {
    DD_PULL_NBYTES_OFF = 0, DD_PULL_NBYTES_SIZE = 8
};

/* An access body names the serving side's memory: this fixed part, then nblocks u64 block
 * ids, nrows (addr, len) u64 pairs, and with DD_ACCESS_DELIVER a u32 count and that many
 * (addr, len) pairs of the requester's own rows. */
enum {
    DD_ACCESS_TARGET_OFF = 0,        DD_ACCESS_TARGET_SIZE = 1,       /* DD_TARGET_* */
    DD_ACCESS_FLAGS_OFF = 1,         DD_ACCESS_FLAGS_SIZE = 1,        /* DD_ACCESS_DROP_KEY | ... */
    DD_ACCESS_IDENT_OFF = 2,         DD_ACCESS_IDENT_SIZE = 8,
    DD_ACCESS_MODEL_ID_OFF = 10,     DD_ACCESS_MODEL_ID_SIZE = 8,
    DD_ACCESS_ROW_OFF = 18,          DD_ACCESS_ROW_SIZE = 8,
    DD_ACCESS_TENSOR_START_OFF = 26, DD_ACCESS_TENSOR_START_SIZE = 4,
    DD_ACCESS_TENSOR_COUNT_OFF = 30, DD_ACCESS_TENSOR_COUNT_SIZE = 4,
    DD_ACCESS_OFFSET_OFF = 34,       DD_ACCESS_OFFSET_SIZE = 8,
    DD_ACCESS_SEG_BYTES_OFF = 42,    DD_ACCESS_SEG_BYTES_SIZE = 8,
    DD_ACCESS_TAIL_BYTES_OFF = 50,   DD_ACCESS_TAIL_BYTES_SIZE = 8,
    DD_ACCESS_NBLOCKS_OFF = 58,      DD_ACCESS_NBLOCKS_SIZE = 4,
    DD_ACCESS_NROWS_OFF = 62,        DD_ACCESS_NROWS_SIZE = 4,
    DD_ACCESS_FIXED_SIZE = 66,
    DD_ACCESS_BLOCK_SIZE = 8,     /* one block id */
    DD_ACCESS_PAIR_SIZE = 16,     /* one (addr, len) row */
    DD_ACCESS_NDELIVER_SIZE = 4,  /* the count of delivery rows */
    DD_ACCESS_MAX_ROWS = 1 << 20  /* most blocks, rows or delivery rows one access names */
};

/* Flag bits of an access. */
enum {
    DD_ACCESS_DROP_KEY = 1, /* drop the named key once the requester confirmed every byte */
    DD_ACCESS_DELIVER = 2   /* the serving side moves the bytes to or from the requester's rows */
};

/* How an access names the serving side's cache (its target). */
enum {
    DD_TARGET_REQ_KEY = 1,     /* CacheKey by req_id: ident = req_id */
    DD_TARGET_PREFIX_KEY = 2,  /* CacheKey by prefix_id: ident = prefix_id */
    DD_TARGET_CACHE_INDEX = 3, /* CacheKeyByIdAndIndex: ident = cache_id, row = batch_index */
    DD_TARGET_BLOCKS_KEY = 4,  /* BlocksCacheKey: ident = model_id */
    DD_TARGET_ADDRESSES = 5,   /* raw addresses of registered or allocated memory */
    /* The UCX route's control plane (pushes, served by the engine, never by native code): */
    DD_TARGET_UCX_TABLE = 6,   /* the payload is the sender's UCX table: ident = its sequence */
    DD_TARGET_UCX_ACK = 7      /* no payload: the sender applied the receiver's table ident and
                                * no transfer it started under an older table is in flight */
};

/* A UCX table (the payload of a DD_TARGET_UCX_TABLE push): what its sender offers over UCX.
 * u32 version (DD_UCX_VERSION), u64 sequence (grows with every change), then counted fields
 * (u32 length or count first): the sender's UCX worker address (at most
 * DD_UCX_MAX_ADDRESS bytes), its host identity (empty, or DD_UCX_HOST_SIZE bytes: boot id
 * and pid-namespace inode), its registrations (a count, then for each: u64 address, u64
 * length, u32 memory type (DD_UCX_MEMORY_*), the packed remote key of at most
 * DD_UCX_MAX_RKEY bytes), and the caches it publishes (one blob in the region board's table
 * layout, ``_engine/regions.py``). A table is at most DD_UCX_MAX_TABLE bytes and names at
 * most DD_UCX_MAX_KEYS registrations. */
enum {
    DD_UCX_VERSION = 1,
    DD_UCX_HOST_SIZE = 24,
    DD_UCX_MAX_ADDRESS = 1 << 16,
    DD_UCX_MAX_RKEY = 1 << 14,
    DD_UCX_MAX_KEYS = 1 << 16,
    DD_UCX_MAX_TABLE = 1 << 24,
    DD_UCX_MEMORY_HOST = 0,
    DD_UCX_MEMORY_CUDA = 1
};

/* A decoded frame header, and an access body's fixed part: the fields as they are, unchecked. */
typedef struct {
    uint32_t magic;
    uint16_t version;
    uint16_t kind;
    uint64_t request_id;
    int64_t status;
    uint32_t body_len;
    uint32_t flags;
    uint64_t payload_len;
} dd_frame_header;

typedef struct {
    uint8_t target;
    uint8_t flags;
    uint64_t ident;
    uint64_t model_id;
    uint64_t row;
    uint32_t tensor_start;
    uint32_t tensor_count;
    uint64_t offset;
    uint64_t seg_bytes;
    uint64_t tail_bytes;
    uint32_t nblocks;
    uint32_t nrows;
} dd_access_head;

/* The DD_HDR_SIZE bytes at p, into *h. */
void dd_frame_header_read(const uint8_t *p, dd_frame_header *h);
/* *h as DD_HDR_SIZE bytes at p. */
void dd_frame_header_write(uint8_t *p, const dd_frame_header *h);
/* The DD_ACCESS_FIXED_SIZE bytes at p, into *a. */
void dd_access_head_read(const uint8_t *p, dd_access_head *a);

/* cdef-end */

#ifdef __cplusplus
}
#endif

#endif /* AIO_DATADIST_WIRE_H */
