/* wire.c: the one C reader and writer of wire.h's frame header and access fixed part.
 *
 * Fields are copied at their wire.h offsets with memcpy: the native layer builds for
 * little-endian hosts only, so a field's bytes are its value.
 */
#include "wire.h"

#include <string.h>

/* The layouts have no gaps and end where their sizes say. */
#define NEXT(a, b) ((a##_OFF) + (a##_SIZE) == (b##_OFF))
_Static_assert(NEXT(DD_HDR_MAGIC, DD_HDR_VERSION) && NEXT(DD_HDR_VERSION, DD_HDR_KIND) &&
                   NEXT(DD_HDR_KIND, DD_HDR_REQUEST_ID) &&
                   NEXT(DD_HDR_REQUEST_ID, DD_HDR_STATUS) &&
                   NEXT(DD_HDR_STATUS, DD_HDR_BODY_LEN) && NEXT(DD_HDR_BODY_LEN, DD_HDR_FLAGS) &&
                   NEXT(DD_HDR_FLAGS, DD_HDR_PAYLOAD_LEN) && DD_HDR_MAGIC_OFF == 0 &&
                   DD_HDR_PAYLOAD_LEN_OFF + DD_HDR_PAYLOAD_LEN_SIZE == DD_HDR_SIZE,
               "frame header layout");
_Static_assert(NEXT(DD_ACCESS_TARGET, DD_ACCESS_FLAGS) && NEXT(DD_ACCESS_FLAGS, DD_ACCESS_IDENT) &&
                   NEXT(DD_ACCESS_IDENT, DD_ACCESS_MODEL_ID) &&
                   NEXT(DD_ACCESS_MODEL_ID, DD_ACCESS_ROW) &&
                   NEXT(DD_ACCESS_ROW, DD_ACCESS_TENSOR_START) &&
                   NEXT(DD_ACCESS_TENSOR_START, DD_ACCESS_TENSOR_COUNT) &&
                   NEXT(DD_ACCESS_TENSOR_COUNT, DD_ACCESS_OFFSET) &&
                   NEXT(DD_ACCESS_OFFSET, DD_ACCESS_SEG_BYTES) &&
                   NEXT(DD_ACCESS_SEG_BYTES, DD_ACCESS_TAIL_BYTES) &&
                   NEXT(DD_ACCESS_TAIL_BYTES, DD_ACCESS_NBLOCKS) &&
                   NEXT(DD_ACCESS_NBLOCKS, DD_ACCESS_NROWS) && DD_ACCESS_TARGET_OFF == 0 &&
                   DD_ACCESS_NROWS_OFF + DD_ACCESS_NROWS_SIZE == DD_ACCESS_FIXED_SIZE,
               "access layout");
#undef NEXT

/* Copy field F between the struct member m and its bytes in the wire buffer. */
#define GET(p, s, F, m)                                                                       \
    do {                                                                                      \
        _Static_assert(sizeof(s)->m == F##_SIZE, #F " size");                                 \
        memcpy(&(s)->m, (p) + F##_OFF, F##_SIZE);                                             \
    } while (0)
#define PUT(p, s, F, m)                                                                       \
    do {                                                                                      \
        _Static_assert(sizeof(s)->m == F##_SIZE, #F " size");                                 \
        memcpy((p) + F##_OFF, &(s)->m, F##_SIZE);                                             \
    } while (0)

void dd_frame_header_read(const uint8_t *p, dd_frame_header *h)
{
    GET(p, h, DD_HDR_MAGIC, magic);
    GET(p, h, DD_HDR_VERSION, version);
    GET(p, h, DD_HDR_KIND, kind);
    GET(p, h, DD_HDR_REQUEST_ID, request_id);
    GET(p, h, DD_HDR_STATUS, status);
    GET(p, h, DD_HDR_BODY_LEN, body_len);
    GET(p, h, DD_HDR_FLAGS, flags);
    GET(p, h, DD_HDR_PAYLOAD_LEN, payload_len);
}

void dd_frame_header_write(uint8_t *p, const dd_frame_header *h)
{
    PUT(p, h, DD_HDR_MAGIC, magic);
    PUT(p, h, DD_HDR_VERSION, version);
    PUT(p, h, DD_HDR_KIND, kind);
    PUT(p, h, DD_HDR_REQUEST_ID, request_id);
    PUT(p, h, DD_HDR_STATUS, status);
    PUT(p, h, DD_HDR_BODY_LEN, body_len);
    PUT(p, h, DD_HDR_FLAGS, flags);
    PUT(p, h, DD_HDR_PAYLOAD_LEN, payload_len);
}

void dd_access_head_read(const uint8_t *p, dd_access_head *a)
{
    GET(p, a, DD_ACCESS_TARGET, target);
    GET(p, a, DD_ACCESS_FLAGS, flags);
    GET(p, a, DD_ACCESS_IDENT, ident);
    GET(p, a, DD_ACCESS_MODEL_ID, model_id);
    GET(p, a, DD_ACCESS_ROW, row);
    GET(p, a, DD_ACCESS_TENSOR_START, tensor_start);
    GET(p, a, DD_ACCESS_TENSOR_COUNT, tensor_count);
    GET(p, a, DD_ACCESS_OFFSET, offset);
    GET(p, a, DD_ACCESS_SEG_BYTES, seg_bytes);
    GET(p, a, DD_ACCESS_TAIL_BYTES, tail_bytes);
    GET(p, a, DD_ACCESS_NBLOCKS, nblocks);
    GET(p, a, DD_ACCESS_NROWS, nrows);
}
