"""The lint of pyproject.toml's [tool.ruff] holds over the whole repository: `ruff check` finds nothing.

ruff comes with the test extra (pinned in constraints.txt, since each release may add findings); a missing ruff is
a failure that says how to install it, not a skip.
"""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    try:
        from ruff.__main__ import find_ruff_bin
    except ImportError:
        pytest.fail("ruff is not installed: it comes with the test extra (make setup, or pip install -e '.[test]')")
    r = subprocess.run([find_ruff_bin(), "check", "--no-cache", "--output-format", "concise", str(ROOT)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ruff check found:\n{r.stdout[-6000:]}{r.stderr[-2000:]}"
