"""The documentation site builds with every warning an error (broken links and anchors,
docstrings the API reference cannot render, snippets whose files are gone)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("mkdocs", reason="the docs extra is not installed")
pytest.importorskip("mkdocstrings", reason="the docs extra is not installed")


def test_the_docs_build_strict(tmp_path: Path) -> None:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(ROOT))
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    for page in (
        "index",
        "getting-started",
        "async-guide",
        "migrating",
        "transports",
        "security",
        "reference",
        "design",
        "benchmarks",
        "reliability",
    ):
        path = tmp_path / ("index.html" if page == "index" else f"{page}/index.html")
        assert path.is_file(), page
    reference = (tmp_path / "reference" / "index.html").read_text()
    for name in ("AsyncLLMDataDist", "pull_blocks", "CacheTask", "LLMException"):
        assert name in reference
