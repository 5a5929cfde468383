"""cffi build script for ``aio_datadist._native._ffi`` (API mode, out-of-line).

The cdef is the region of ``aio_datadist/_native/datadist.h`` between the ``cdef-begin``
and ``cdef-end`` markers, so the header stays the single description of the C surface.
setuptools runs this through ``cffi_modules`` in setup.py; ``python build_ffi.py`` builds
the extension in place for development. Nothing here runs at import time of the package.
"""

from __future__ import annotations

import os
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from cffi import FFI  # type: ignore[import-untyped,unused-ignore]

ROOT = Path(__file__).resolve().parent
NATIVE = Path("aio_datadist") / "_native"
SOURCES = ["pool.c", "copy.c", "hostmem.c", "net.c"]


def read_cdef(header: Path) -> str:
    """Return the declarations between the cdef markers of ``header``."""
    text = header.read_text(encoding="utf-8")
    begin = text.index("/* cdef-begin */") + len("/* cdef-begin */")
    end = text.index("/* cdef-end */")
    return text[begin:end]


ffibuilder = FFI()
ffibuilder.cdef(read_cdef(ROOT / NATIVE / "datadist.h"))
ffibuilder.set_source(
    "aio_datadist._native._ffi",
    '#include "datadist.h"',
    # Relative paths: distutils would put objects for absolute ones beside the sources.
    sources=[str(NATIVE / name) for name in SOURCES],
    include_dirs=[str(NATIVE)],
    extra_compile_args=["-O3", "-std=c11", "-pthread", "-fvisibility=hidden", "-Wall", "-Wextra"],
    extra_link_args=["-pthread"],
    libraries=["pthread"],
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
