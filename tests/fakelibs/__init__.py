"""Small C libraries built by the tests: stand-ins for device runtimes absent from CI.

:func:`build` compiles one C file of this folder into a shared library (once per content,
cached under the system temp dir) and returns its path; tests then point a runtime at it
through the runtime's library-path variable.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def build(source: str, soname: str, defines: Sequence[str] = ()) -> Path:
    """Compile ``fakelibs/<source>`` into ``<soname>``; skips the test when no C compiler.

    ``defines`` are preprocessor definitions (``"NAME"`` or ``"NAME=value"``) selecting a
    variant of the library; each variant is cached apart.
    """
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake runtime library")
    src = HERE / source
    flags = [f"-D{d}" for d in defines]
    digest = hashlib.sha256(src.read_bytes() + "\0".join(flags).encode()).hexdigest()[:16]
    out_dir = Path(tempfile.gettempdir()) / f"aio-dd-fakelib-{digest}"
    out = out_dir / soname
    if not out.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".{soname}.{os.getpid()}"
        subprocess.run(
            [
                cc,
                "-shared",
                "-fPIC",
                "-O1",
                "-std=c11",
                "-pthread",
                *flags,
                "-o",
                str(tmp),
                str(src),
            ],
            check=True,
            capture_output=True,
        )
        tmp.replace(out)
    return out
