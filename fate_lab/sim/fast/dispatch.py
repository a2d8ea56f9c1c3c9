"""The replay's loop per policy: `loop_for(name)` is `driver.py` compiled for the policy of that name.

What this file is: `loop_for`, which writes out the text of `driver.py` with its one ``POLICY = POLICIES["lru"]``
line naming another registered policy, into a file beside numba's cache (named by the policy and a digest of the
text, so a changed loop or policy gets a fresh file and fresh compiled code), imports it, and keeps the module. A
policy added to the registry is in the replay with nothing written here. (A file, not ``exec``, a closure or a
function passed as an argument: numba caches only functions that live in a file, and its cache keys a closure or a
function argument by its address, so those would compile again in every process.)
What it is not: the loop (`driver.py`), a policy, or the registry.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import threading
from pathlib import Path
from types import ModuleType

from fate_lab.policy.registry import POLICIES
from fate_lab.sim.fast import driver

_LINE = 'POLICY = POLICIES["lru"]'  # the line of driver.py that names its policy
_loaded: dict[str, ModuleType] = {}
_lock = threading.Lock()


def source(name: str) -> str:
    """The text of driver.py with its policy line naming `name` (a registered policy), and a digest of the policy
    sources in a last comment."""
    if name not in POLICIES:
        raise ValueError(f"unknown replacement policy {name!r}; choose one of {sorted(POLICIES)}")
    text = Path(driver.__file__).read_text()
    if text.count(_LINE) != 1:
        raise RuntimeError(f"{driver.__file__} must hold the line {_LINE!r} exactly once")
    from fate_lab.policy.kernels import _sources_digest

    # the digest of the policy files and their callers: an edited policy gets a new file name, so numba's cache,
    # which keys a loop on this file alone, never serves a loop compiled around the policy's old functions
    return (text.replace(_LINE, f"POLICY = POLICIES[{name!r}]")
            + f"# written for the policy sources {_sources_digest()[:16]}\n")


def loop_for(name: str) -> ModuleType:
    """The module of the replay loop compiled for the policy `name` (driver.py itself for LRU)."""
    if name == "lru":
        return driver
    with _lock:
        if name not in _loaded:
            _loaded[name] = _load(name, source(name))
        return _loaded[name]


def _load(name: str, text: str) -> ModuleType:
    mod = f"replay_{name}_" + hashlib.sha256(text.encode()).hexdigest()[:16]
    homes = [Path(driver.__file__).parent / "__pycache__",
             Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fate_lab"]
    for home in homes:
        path = home / f"{mod}.py"
        try:
            for old in home.glob(f"replay_{name}_*.py"):  # the loops of an earlier driver.py or policy file
                if old != path and re.fullmatch(rf"replay_{name}_[0-9a-f]{{16}}\.py", old.name):
                    old.unlink(missing_ok=True)
            if not (path.is_file() and path.read_text() == text):
                home.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(text)
                os.replace(tmp, path)  # atomic: a parallel process never imports half a file
            break
        except OSError:  # a read-only install: the user's cache folder
            continue
    else:
        raise OSError(f"no writable folder for the replay loop of {name!r} (tried {[str(h) for h in homes]})")
    spec = importlib.util.spec_from_file_location(f"fate_lab.sim.fast.{mod}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # numba's cache finds the module of the code it loads by name
    spec.loader.exec_module(module)
    return module
