#!/usr/bin/env bash
# Build the native extension with AddressSanitizer and UndefinedBehaviorSanitizer into a
# scratch copy of the repository, run the tests that drive native code against it, and fail
# on any sanitizer report. The normal in-place build is never touched.
#
#   tools/asan.sh [pytest args...]        (from the repository root; PYTHON picks the
#                                          interpreter, default: python3)
#
# Python loads the extension with dlopen, so the ASan runtime must be in the process before
# anything else: it is preloaded (LD_PRELOAD=$(gcc -print-file-name=libasan.so)).
# detect_leaks=0: CPython deliberately never frees much of what it allocates (interned
# objects, module state, arenas kept for reuse) and exits without tearing it all down, so
# LeakSanitizer would report thousands of "leaks" that are not ours; the pool tests check
# our own frees. Reports go to files (log_path), so those from child processes the tests
# start count too.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/aio-datadist-asan.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

cd "$ROOT"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$WORK"
# Generated sources and the in-place build stay behind; the copy builds its own.
rm -f "$WORK"/aio_datadist/_native/_ffi.c "$WORK"/aio_datadist/_native/_ffi*.so

cd "$WORK"
AIO_DATADIST_CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined \
-fno-omit-frame-pointer -O1 -g" "$PYTHON" build_ffi.py >"$WORK/build.log" 2>&1 \
    || { cat "$WORK/build.log"; exit 1; }

mkdir -p "$WORK/reports"
export LD_PRELOAD=$(gcc -print-file-name=libasan.so)
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$WORK/reports/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$WORK/reports/ubsan"
# Run from the copy: "python -m pytest" puts it first on sys.path, ahead of any install.
"$PYTHON" -c 'import aio_datadist._native._ffi as m, sys; sys.exit(0 if m.__file__.startswith(sys.argv[1]) else f"not the sanitized build: {m.__file__}")' "$WORK"
status=0
"$PYTHON" -m pytest -q -p no:cacheprovider \
    tests/test_native_pool.py tests/test_native_copy.py tests/test_native_net.py \
    tests/test_native_serve.py tests/test_transfers.py \
    tests/test_samehost.py tests/test_background.py tests/test_wire.py tests/test_transport_tcp.py \
    tests/test_bounds.py tests/test_fuzz.py tests/test_runtime_cuda.py \
    tests/test_runtime_acl.py tests/test_staging.py tests/test_device_transfers.py \
    tests/test_hccl_presence.py tests/test_hccl_domains.py \
    tests/test_cross_process.py tests/test_ucx_binding.py tests/test_ucx_route.py \
    tests/test_ucx_transfer.py tests/test_pool_commit.py tests/test_pending_requests.py \
    --deselect tests/test_runtime_cuda.py::test_ptx_header_is_current \
    --deselect tests/test_ucx_binding.py::test_an_access_outside_the_peers_memory_fails_the_link \
    "$@" || status=$?
# (the first runs nvcc, which does not survive the preloaded sanitizer runtime; the second
# has UCX in the peer read a wild address on purpose, which the sanitizer reports there)

if compgen -G "$WORK/reports/*" >/dev/null; then
    cat "$WORK"/reports/*
    echo "asan.sh: sanitizer reports above" >&2
    exit 1
fi
[ "$status" -eq 0 ] || { echo "asan.sh: tests failed under the sanitizers" >&2; exit "$status"; }
echo "asan.sh: no sanitizer reports; native tests passed"
