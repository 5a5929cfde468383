"""Build hook: setuptools compiles the cffi extension described in build_ffi.py."""

from setuptools import setup

setup(cffi_modules=["build_ffi.py:ffibuilder"])
