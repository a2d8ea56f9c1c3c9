"""The replay's policy calls by number: ``policy_admit(code, ...)`` runs the admit of the policy numbered `code`.

What this file is: the five compiled calls the replay's loop makes (`policy_init`, `policy_admit`,
`policy_access`, `policy_observe`, `policy_tick`), each a flat chain of ``if code == i`` over every policy of
`registry.POLICIES` in its order, each branch the policy's own function inlined -- what one would write by hand.
The chain is written out from the registry as Python source into a file beside numba's cache (named by a digest of
the registry's order, so a changed registry gets a fresh file and fresh compiled code), then imported: a policy added
to the registry is in the replay with nothing written here. (A source file, not `exec` or numba's `overload`:
numba caches only functions that live in a file, and an inlined overload compiled 6x slower here.)
What it is not: a policy, or the registry.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

from fate_lab.policy.registry import POLICIES

RECORDS = tuple(POLICIES.values())
CODES = {p.name: i for i, p in enumerate(RECORDS)}
CALLS = {  # operation: (its arguments after the code, what it returns for an unknown code)
    "init": ("I, F, S, G, R, E, cap, prm, iprm, uses", "None"),
    "admit": ("I, F, S, G, R, E, e, prot", "-1"),
    "access": ("I, F, S, G, R, E, e", "None"),
    "observe": ("I, F, S, G, R, E, probs, n", "None"),
    "tick": ("I, F, S, G, R, E, t, uses, nextuse", "None"),
}


def source() -> str:
    """The Python source of the five calls, written out from the registry."""
    out = ['"""Written by fate_lab/sim/fast/dispatch.py from the policy registry; not to be edited."""',
           "from numba import njit", "", "from fate_lab.policy.registry import POLICIES", "",
           "RECORDS = tuple(POLICIES.values())"]
    names = ", ".join(p.name for p in RECORDS)
    out.append(f"assert [p.name for p in RECORDS] == {names.split(', ')!r}")
    for i in range(len(RECORDS)):
        out += [f"{op}{i} = RECORDS[{i}].{op}" for op in CALLS]
    for op, (args, unknown) in CALLS.items():
        out += ["", "", "@njit(cache=True, _nrt=False)", f"def policy_{op}(code, {args}):"]
        for i in range(len(RECORDS)):
            out += [f"    if code == {i}:", f"        return {op}{i}({args})"]
        out.append(f"    return {unknown}")
    return "\n".join(out) + "\n"


def _load():
    text = source()
    name = "policy_calls_" + hashlib.sha256(text.encode()).hexdigest()[:16]
    homes = [Path(__file__).parent / "__pycache__",
             Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fate_lab"]
    for home in homes:
        path = home / f"{name}.py"
        try:
            if not (path.is_file() and path.read_text() == text):
                home.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(text)
                os.replace(tmp, path)  # atomic: a parallel process never imports half a file
            break
        except OSError:  # a read-only install: the user's cache folder
            continue
    else:
        raise OSError(f"no writable folder for the replay's compiled policy calls (tried {[str(h) for h in homes]})")
    spec = importlib.util.spec_from_file_location(f"fate_lab.sim.fast.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # numba's cache finds the module of the code it loads by name
    spec.loader.exec_module(module)
    return module


_calls = _load()
policy_init = _calls.policy_init
policy_admit = _calls.policy_admit
policy_access = _calls.policy_access
policy_observe = _calls.policy_observe
policy_tick = _calls.policy_tick
