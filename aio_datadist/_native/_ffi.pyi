"""Stub for the cffi extension; only ``api`` touches these, so the ``Any`` stays fenced there."""

from typing import Any

ffi: Any
lib: Any
