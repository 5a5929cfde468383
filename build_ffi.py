"""cffi build script for ``aio_datadist._native._ffi`` (API mode, out-of-line).

The cdef is the region between the ``cdef-begin`` and ``cdef-end`` markers of each header in
``HEADERS`` (``datadist.h``, the wire format's ``wire.h``, then the device-runtime headers), so
the headers stay the single description of the C surface. Device runtimes are reached through
``dlopen`` at run time: nothing here needs CUDA or CANN to build.

setuptools runs this through ``cffi_modules`` in setup.py; ``python build_ffi.py`` builds
the extension in place for development. Nothing here runs at import time of the package.

``AIO_DATADIST_CFLAGS`` (environment, split like a shell word list) adds flags to both the
compile and the link, e.g. ``-fsanitize=address,undefined`` for ``tools/asan.sh``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sysconfig
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from cffi import FFI  # type: ignore[import-untyped,unused-ignore]

ROOT = Path(__file__).resolve().parent
NATIVE = Path("aio_datadist") / "_native"
#: The C surface: the core header, the wire format, then one header per device runtime
#: (dlopen-based).
HEADERS = ["datadist.h", "wire.h", "cuda_rt.h", "acl_rt.h"]
#: Every C source of the native layer; names starting with "_" are generated.
SOURCES = sorted(p.name for p in (ROOT / NATIVE).glob("*.c") if not p.name.startswith("_"))


def read_cdef(header: Path) -> str:
    """Return the declarations between the cdef markers of ``header``."""
    text = header.read_text(encoding="utf-8")
    begin = text.index("/* cdef-begin */") + len("/* cdef-begin */")
    end = text.index("/* cdef-end */")
    return text[begin:end]


#: Extra compile and link flags from the environment (sanitizers, debug builds).
EXTRA_FLAGS = shlex.split(os.environ.get("AIO_DATADIST_CFLAGS", ""))


def require_c_compiler() -> None:
    """Stop the build with a clear message when no C compiler can be found."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    program = shlex.split(cc)[0] if cc.strip() else "cc"
    if shutil.which(program) is None:
        raise SystemExit(
            f"aio_datadist builds its native layer from C and needs a C compiler, but "
            f"{program!r} was not found. Install one (Debian/Ubuntu: apt install gcc; "
            f"Fedora/RHEL: dnf install gcc; Alpine: apk add build-base) or set CC."
        )


require_c_compiler()
ffibuilder = FFI()
_present = [h for h in HEADERS if (ROOT / NATIVE / h).exists()]
ffibuilder.cdef("\n".join(read_cdef(ROOT / NATIVE / h) for h in _present))
ffibuilder.set_source(
    "aio_datadist._native._ffi",
    "\n".join(f'#include "{h}"' for h in _present),
    # Relative paths: distutils would put objects for absolute ones beside the sources.
    sources=[str(NATIVE / name) for name in SOURCES],
    include_dirs=[str(NATIVE)],
    extra_compile_args=[
        "-O3",
        "-std=c11",
        "-pthread",
        "-fvisibility=hidden",
        "-Wall",
        "-Wextra",
        *EXTRA_FLAGS,
    ],
    extra_link_args=["-pthread", *EXTRA_FLAGS],
    libraries=["pthread", "dl"],
)

if __name__ == "__main__":
    os.chdir(ROOT)
    # In-place development build; compile() puts objects beside the sources, drop them.
    built = Path(ffibuilder.compile(tmpdir=".", verbose=True))
    for obj in NATIVE.glob("*.o"):
        obj.unlink()
    # Use the name setuptools gives the (limited-API) module, so the two builds replace
    # each other instead of a stale one shadowing the other.
    if ".abi3.so" in EXTENSION_SUFFIXES:
        built.replace(NATIVE / "_ffi.abi3.so")
