"""The type checker passes: ``python -m mypy`` with the project's ``[tool.mypy]`` settings
(pyproject.toml: strict on the modules listed there), as a subprocess with a bounded time, so
the README's test command and CI run it unchanged."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(600)


def test_mypy_strict_passes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MYPY")}
    r = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, f"mypy found errors:\n{r.stdout[-8000:]}\n{r.stderr[-2000:]}"
    assert "Success" in r.stdout
