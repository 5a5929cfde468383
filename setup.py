"""Build hook: setuptools compiles the cffi extension described in build_ffi.py.

The extension uses only the stable ABI (``Py_LIMITED_API``), so the wheel is tagged
``cp311-abi3``: one wheel serves every CPython from 3.11 on.
"""

from setuptools import setup

setup(
    cffi_modules=["build_ffi.py:ffibuilder"],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
