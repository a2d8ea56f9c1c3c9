"""The replay per policy: `loop_for(name)` is the one cache's steps and the replay's loop compiled for one policy.

What this file is: `source`, which puts one file together -- `policy/cache_core.py` with its interpreted ``mode``
block replaced by `driver.py`'s compiled one (its one ``POLICY = POLICIES["lru"]`` line naming the policy), then
the body of `policy/cache_steps.py`, then the body of `driver.py` -- and `loop_for`, which writes that text into a
file beside numba's cache (named by the policy and a digest of the text, so a changed cache, loop or policy gets a
fresh file and fresh compiled code), imports it, and keeps the module. So the replay runs the cache's own code,
and a policy added to the registry is in the replay with nothing written here. (A file, not ``exec``, a closure or a
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

from fate_lab.policy import cache_core, cache_steps
from fate_lab.policy.registry import POLICIES
from fate_lab.sim.fast import driver

_LINE = 'POLICY = POLICIES["lru"]'  # the line of driver.py that names its policy
_MODE, _END, _BODY = "# >>> mode", "# <<< mode\n", "# >>> body"
_loaded: dict[str, ModuleType] = {}
_lock = threading.Lock()


def _cut(path: str, start: str, end: str | None = None) -> tuple[str, str, str]:
    """The text of the file at path as (before the line starting `start`, from it to the end of line `end` or of
    the file, after that)."""
    text = Path(path).read_text()
    if text.count(start) != 1 or (end is not None and text.count(end) != 1):
        raise RuntimeError(f"{path} must hold the lines {start!r} and {end!r} once each")
    i = text.index(start)
    j = text.index(end) + len(end) if end is not None else len(text)
    return text[:i], text[i:j], text[j:]


def source(name: str) -> str:
    """The file of the cache's steps and the replay loop compiled for the registered policy `name`, with a digest
    of the policy sources in a last comment."""
    if name not in POLICIES:
        raise ValueError(f"unknown replacement policy {name!r}; choose one of {sorted(POLICIES)}")
    before, _, after = _cut(cache_core.__file__, _MODE, _END)
    _, mode, _ = _cut(driver.__file__, _MODE, _END)
    if mode.count(_LINE) != 1:
        raise RuntimeError(f"{driver.__file__} must hold the line {_LINE!r} exactly once")
    steps = _cut(cache_steps.__file__, _BODY)[1]
    loop = _cut(driver.__file__, _BODY)[1]
    from fate_lab.policy.kernels import _sources_digest

    # the digest of the policy files and their callers: an edited policy gets a new file name, so numba's cache,
    # which keys a loop on this file alone, never serves a loop compiled around the policy's old functions
    return (before + mode.replace(_LINE, f"POLICY = POLICIES[{name!r}]") + after + "\n\n" + steps + "\n\n" + loop
            + f"# written for the policy sources {_sources_digest()[:16]}\n")


def loop_for(name: str) -> ModuleType:
    """The module of the cache's steps and the replay loop compiled for the policy `name`."""
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
