"""The record of a replacement policy: its name, its compiled functions, its keywords and what it reads.

What this file is: `Policy`, the one record each policy file fills and `policy/registry.py` lists; `kernel`, the
decorator of a policy's compiled functions; the state a policy keeps (`State`), and the no-op functions a policy
that does not observe the router or read the future gets. What it is not: a policy, or the registry.

A policy is a few plain functions over arrays, compiled by numba and run unchanged by the runtime and the simulator
(one call each, from Python, through `compiled.CompiledPolicy`) and by the fast replay (called from the cache's steps
compiled with the replay's token loop for the policy, `fate_lab/sim/fast/driver.py`). Every function takes the state
first, ``I, F, S, G, R`` (see `State`), and ``E``, the id bound: ids are ``0..E-1`` and ``E..E+7`` are free for
list sentinels.

    init(I, F, S, G, R, E, cap, prm, iprm, uses)   the empty cache of `cap` slots (``uses``: the future, [N, k],
                                                   for a policy that reads it; else a [0, 1] array)
    admit(I, F, S, G, R, E, e, prot) -> int        insert the non-resident e: -1 (nothing evicted), the evicted id,
                                                   or e itself (nothing may be evicted: e is not cached); prot[x]
                                                   != 0 marks the ids that must stay. With fewer than cap ids
                                                   resident it evicts nothing and reads no prot (the cache's
                                                   `cache_core.admit` and `CompiledPolicy` then mark none; tests
                                                   check every registered policy)
    access(I, F, S, G, R, E, e)                    a further use of the resident e
    observe(I, F, S, G, R, E, probs, n)            the router's probabilities of the E experts, averaged over a
                                                   call's n tokens, before the call's uses (``needs_scores``)
    tick(I, F, S, G, R, E, t, uses, nextuse)       token t starts (``reads_future``; nextuse[t, j] is the next token
                                                   that uses uses[t, j], N if none)

``setup(capacity, **keywords) -> (prm, iprm)`` runs in Python: it checks the keywords and turns them into the float
and int parameters ``init`` reads (at most 8 of each; iprm[7] is reserved for the heap threshold).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from numba import njit

N_PARAMS = 8  # floats and ints a policy's setup may give its init (the last int is the heap threshold)
HEAP_ABOVE = 128  # key-ordered residents: a heap above this many slots, else a scanned array (same victims)
I_ROWS, F_ROWS, S_LEN, R_LEN = 12, 4, 32, 2
G_LEN = 8 + 4096  # G[0:8] scalars, then a table (LRFU's powers of its decay)


def kernel(fn):
    """A policy's compiled function: cached on disk, allocation-free (no reference counting), called by the cache's
    steps compiled for its policy in the fast replay (`sim/fast/driver.py`)."""
    return njit(cache=True, _nrt=False)(fn)


@kernel
def no_observe(I, F, S, G, R, E, probs, n):
    """A policy that does not read the router's probabilities."""


@kernel
def no_tick(I, F, S, G, R, E, t, uses, nextuse):
    """A policy that does not read the future."""


def no_keywords(capacity: int, **kw) -> tuple[list[float], list[int]]:
    """The setup of a policy without keywords."""
    if kw:
        raise TypeError(f"this policy takes no keywords, got {sorted(kw)}")
    return [], []


def ratio(name: str, value: float) -> float:
    """A share in [0, 1), checked (a setup's helper)."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return float(value)


@dataclass(frozen=True)
class Policy:
    """One replacement policy: everything the runtime, the simulator, the replay and the configs know about it."""

    name: str
    init: Callable
    admit: Callable
    access: Callable
    setup: Callable[..., tuple[list[float], list[int]]] = no_keywords
    keywords: tuple[str, ...] = ()  # what setup accepts, by name
    observe: Callable = no_observe
    tick: Callable = no_tick
    needs_scores: bool = False  # observe() gets the router's probabilities (the drivers compute them)
    reads_future: bool = False  # init gets the layer's future uses and tick() runs before every token
    kind: str = "field"  # "classic" (what the studies compare by default), "field", "moe" or "bound"
    summary: str = ""  # one line for listings
    refs: tuple[str, ...] = field(default=())  # the paper or code it follows

    def __post_init__(self):
        if self.needs_scores and self.observe is no_observe:
            raise ValueError(f"policy {self.name!r} needs scores but has no observe()")
        if self.reads_future and self.tick is no_tick:
            raise ValueError(f"policy {self.name!r} reads the future but has no tick()")

    def params(self, capacity: int, kw: dict, heap_above: int = HEAP_ABOVE) -> tuple[np.ndarray, np.ndarray]:
        """(prm float64 [8], iprm int64 [8]) for init: setup's, padded, the heap threshold last. Checks keywords."""
        unknown = set(kw) - set(self.keywords)
        if unknown:
            known = ", ".join(self.keywords) or "none"
            raise TypeError(f"policy {self.name!r} has no keyword {sorted(unknown)}; its keywords: {known}")
        prm, iprm = self.setup(int(capacity), **kw)
        if len(prm) > N_PARAMS or len(iprm) > N_PARAMS - 1:
            raise ValueError(f"policy {self.name!r}: setup gave more than {N_PARAMS} parameters")
        f = np.zeros(N_PARAMS, np.float64)
        f[:len(prm)] = prm
        i = np.zeros(N_PARAMS, np.int64)
        i[:len(iprm)] = iprm
        i[N_PARAMS - 1] = heap_above
        return f, i


class State:
    """The arrays one layer's policy keeps: I int64 [12, E + 8], F float64 [4, E + 8], S int64 [32] (S[0] is by
    convention the resident count and S[1] the capacity), G float64 [8 + 4096], R uint64 [2] (a random state)."""

    __slots__ = ("I", "F", "S", "G", "R")

    def __init__(self, E: int):
        W = E + 8
        self.I = np.zeros((I_ROWS, W), np.int64)
        self.F = np.zeros((F_ROWS, W), np.float64)
        self.S = np.zeros(S_LEN, np.int64)
        self.G = np.zeros(G_LEN, np.float64)
        self.R = np.zeros(R_LEN, np.uint64)

    def copy(self) -> "State":
        """An independent copy (a peek at what an admit would do)."""
        c = State.__new__(State)
        c.I, c.F, c.S, c.G, c.R = self.I.copy(), self.F.copy(), self.S.copy(), self.G.copy(), self.R.copy()
        return c
