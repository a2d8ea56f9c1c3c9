"""The compiled kernels of the fast replay (numba): data structures, policy state machines, the driver.

Numba's on-disk cache (``cache=True``) keys each compiled function on its own file only, so an edit
to `structs.py` would leave a stale `driver.run_layer` (which inlines it) in ``__pycache__``. On import,
this package therefore compares a digest of its sources with the one stored beside the cache and
clears this package's cached kernels when they differ (an installed package gets fresh files, and so
a fresh cache, on every upgrade anyway).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

_HERE = Path(__file__).parent
_CACHE = _HERE / "__pycache__"


def _sources_digest() -> str:
    h = hashlib.sha256()
    for f in sorted(_HERE.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def _clear_stale_cache() -> None:
    """Remove this package's numba cache files if the kernels' sources changed since they were written."""
    stamp = _CACHE / "kernels.sha256"
    digest = _sources_digest()
    if stamp.is_file() and stamp.read_text() == digest:
        return
    try:
        _CACHE.mkdir(exist_ok=True)
        for f in [*_CACHE.glob("*.nbi"), *_CACHE.glob("*.nbc")]:
            f.unlink(missing_ok=True)
        stamp.write_text(digest)
    except OSError:  # a read-only install: numba caches in its user-wide folder, keyed on fresh files
        pass


_clear_stale_cache()
