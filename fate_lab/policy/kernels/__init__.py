"""The replacement policies, one file each, written once as compiled functions over arrays (numba).

Each file fills one `record.Policy` (name, compiled functions, keywords, what it reads) and `policy/registry.py`
lists it in one line. The runtime and the simulator call the functions from Python (`policy/compiled.py`); the fast
replay calls them from the cache's steps, compiled once per policy (`sim/fast/driver.py`, `sim/fast/dispatch.py`).
Shared pieces (linked lists, a heap, the key-ordered resident set, SplitMix64) are in `blocks.py`; `record.py` says
the form.

Numba's on-disk cache (``cache=True``) keys each compiled function on its own file only, so an edit to `blocks.py`
would leave a stale policy function (which inlines it) in ``__pycache__``, and an edit to a policy file a stale
replay loop (a compiled caller keeps a copy of what it calls). On import, this package compares a digest of those
sources with the one stored beside the cache and clears the cached kernels of all of them when they differ (an
installed package gets fresh files, and so a fresh cache, on every upgrade anyway).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

_HERE = Path(__file__).parent
_PACKAGE = _HERE.parents[1]  # fate_lab/
_SOURCES = (_HERE, _PACKAGE / "policy", _PACKAGE / "sim" / "fast")  # policies, their callers, the replay


def _sources_digest() -> str:
    h = hashlib.sha256()
    for d in _SOURCES:
        for f in sorted(d.glob("*.py")):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def _clear_stale_cache() -> None:
    """Remove the numba cache files of these sources if any of them changed since the cache was written."""
    stamp = _HERE / "__pycache__" / "kernels.sha256"
    digest = _sources_digest()
    if stamp.is_file() and stamp.read_text() == digest:
        return
    try:
        for d in (*_SOURCES, _SOURCES[-1] / "__pycache__"):  # the last: the per-policy loops (dispatch.py)
            cache = d / "__pycache__"
            cache.mkdir(exist_ok=True)
            for f in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
                f.unlink(missing_ok=True)
        stamp.write_text(digest)
    except OSError:  # a read-only install: numba caches in its user-wide folder, keyed on fresh files
        pass


_clear_stale_cache()
