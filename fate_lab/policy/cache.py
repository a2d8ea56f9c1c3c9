"""The one expert cache: the per-layer slot state machine that every driver shares.

What this file is: `ExpertCache`, the bookkeeping of which expert of which MoE layer sits in
which device slot, driven three ways -- by the runtime (`runtime.py`, real transfers on an
engine thread or a CUDA stream), by the replay (`replay.py`, transfers that land at once) and by
the timed simulator (`simulate.py`, a simulated link and clock). A driver implements the small
`Mover` protocol (`cache_state.py`); the cache never touches a tensor, a thread or a clock.
The rules themselves are `cache_core.py`'s functions, which this class runs as Python; the fast
replay runs the same functions compiled (`sim/fast/`), so there is one state machine. What stays
here: the mover's Python objects, the stats objects, the host placement and lossy plan (Python
callables turned into flags before a step), stealing other layers' staging slots, the slot audit.

Slots are plain ints. Layout (`ExpertCache.num_slots` in all):
  [cache slots of layer 0 | layer 1 | ... | top_k demand slots | prefetch pool A | pool B]
Each MoE layer owns `slots_per_layer[m]` cache slots managed by its replacement policy.
Experts that are not cached sit in *staging* slots: `top_k` demand slots for on-demand loads,
and two prefetch pools of `prefetch_buffers` slots each, one for the even and one for the odd
layers (a prefetch for layer m+1 is issued while layer m still computes from its own staged
experts, so two pools never fight; with transfers that land at once each layer is then
independent of the others, which the replay's per-layer sweeps rely on).
Promotion (`admit_on_use=True`): a prefetched expert waits in its staging slot and enters the
cache only when it is used; the slot itself changes owner (the staging slot joins the layer's
cache, the victim's slot joins the pool), so no bytes move.

One layer step (the order every driver follows; `step.run_layer` is that code):
  order = cache.begin(m, needed)        # settle, drop stale prefetches, classify, queue misses
  cache.prefetch(m + 1, predicted)      # what the predictor says layer m+1 needs
  for e in order: slot = cache.acquire(m, e); <compute e from slot>; cache.done(m, e)
  cache.end(m)
Order of a layer's experts: resident first (hits, then prefetches still in flight, then
misses), each group in the order of `needed` (popularity in prefill). That is the order the
runtime computes in, so it is also the order the replay's replacement policy sees.
Counters go to the `PhaseStats` of (layer, phase) given at construction; the driver counts
bytes and stall time, the cache counts hits, misses, late prefetches and prefetch outcomes.
Host compute (`placement`, a `placement.HostPlacement`): a needed expert that is not resident may
compute where it lives instead of being loaded; it takes no slot and moves no bytes, `acquire`
returns `HOST` for it, and it computes right after the resident experts (its host time hides the
transfers of the misses that are loaded). It still counts as a miss (it was not on the device),
and in `host`.
Lossy decode steps (`miss_plan`, from `lossy.MissPolicy`): a miss may be dropped (not computed, no
transfer; the driver renormalises) or stood in for by a resident expert f of the same layer (`acquire`
returns f's slot). Stand-ins compute first, before any slot is released; both count as misses and in
`dropped` / `substituted`.
"""
from __future__ import annotations

from typing import Any, Callable

from fate_lab.policy import cache_core as core
from fate_lab.policy import cache_steps as steps
from fate_lab.policy.cache_core import HASPRED, HOST, MISSING, NEED_STEAL, NO_PLAN, NUSED, Pools
from fate_lab.policy.cache_state import LayerState, Mover, Pool, items
from fate_lab.policy.compiled import DEFAULT_IDS
from fate_lab.policy.placement import HostPlacement
from fate_lab.policy.replacement import ReplacementPolicy
from fate_lab.policy.stats import PHASES, PhaseStats

__all__ = ["HOST", "ExpertCache", "LayerState", "Mover"]
_POOLS = ("demand", "prefetch A", "prefetch B")


class ExpertCache:
    """Per-layer expert slots under replacement policies, staging pools and in-flight transfers."""

    def __init__(self, slots_per_layer: list[int], policy: Callable[[int, int], ReplacementPolicy], top_k: int,
                 prefetch_buffers: int, mover: Mover, stats: list[dict[str, PhaseStats]] | None = None,
                 cache: bool = True, admit_on_use: bool = False, link_budget: bool = False,
                 placement: HostPlacement | None = None):
        """policy(m, capacity) builds layer m's replacement policy; stats[m][phase] receives the counters;
        placement: which non-resident experts compute on the host (None: every one is loaded)."""
        if top_k <= 0 or prefetch_buffers < 0:
            raise ValueError(f"need top_k > 0 and prefetch_buffers >= 0, got {top_k}, {prefetch_buffers}")
        self.mover, self.top_k = mover, top_k
        self.cache_enabled, self.admit_on_use, self.link_budget = cache, admit_on_use, link_budget
        self.placement = placement
        self.stats = stats if stats is not None else [{p: PhaseStats() for p in PHASES} for _ in slots_per_layer]
        self.phase = "prefill"
        policies = [policy(m, c) for m, c in enumerate(slots_per_layer)]
        self.E = max([getattr(p, "E", DEFAULT_IDS) for p in policies], default=1)  # the id bound of the state
        self.layers: list[LayerState] = []
        base = 0
        for m, (c, pol) in enumerate(zip(slots_per_layer, policies, strict=True)):
            self.layers.append(LayerState(list(range(base, base + c)), pol, self.E, m % 2))
            base += c
        sizes = (top_k, prefetch_buffers, prefetch_buffers)
        pfree, pool_of = [], [-1] * (base + sum(sizes))
        for p, size in enumerate(sizes):
            pfree.append(list(range(base, base + size)))
            pool_of[base:base + size] = [p] * size
            base += size
        self.num_slots = base
        self.num_staging = sum(sizes)
        z = self.num_staging + 1
        self.pools = Pools(pfree=pfree, pn=list(sizes), pool_of=pool_of, zslots=[0] * z, zhand=[None] * z)
        # a used staged expert joins the cache (admit on use): fixed per layer, so decided once
        self._promote = [admit_on_use and cache and c > 0 for c in slots_per_layer]

    # --- views ----------------------------------------------------------------------------
    @property
    def demand(self) -> Pool:
        """The on-demand staging pool (a view)."""
        return self._pool(0)

    @property
    def prefetch_pools(self) -> tuple[Pool, Pool]:
        """The prefetch staging pools of the even and the odd layers (views)."""
        return self._pool(1), self._pool(2)

    @property
    def zombies(self) -> list[tuple[int, Any]]:
        """Staging slots whose unneeded transfer runs on, with the transfer's handle."""
        n = self.pools.zslots[0]
        return list(zip(self.pools.zslots[1:n + 1], self.pools.zhand[1:n + 1], strict=True))

    def _pool(self, p: int) -> Pool:
        return Pool(_POOLS[p], self.pools.pfree[p][:self.pools.pn[p]])

    # --- the layer step -----------------------------------------------------------------
    def begin(self, m: int, needed: list[int], counts: dict[int, int] | None = None,
              miss_plan: Callable[[list[int], set[int]], dict[int, int | None]] | None = None) -> list[int]:
        """Layer m starts with the distinct experts `needed` (counts[e]: tokens routed to e, for the host
        placement; default 1): returns the order to compute them in (dropped experts are left out).
        miss_plan(misses, resident) -> {e: stand-in or None (drop)} for a lossy decode step."""
        layer = self.layers[m]
        L, st, n = layer.L, self.stats[m][self.phase], len(needed)
        place = self.placement
        onhost = None if place is None else [place.on_host(m, 1 if counts is None else counts[e]) for e in needed]
        cls = [0] * n
        steps.begin_a(L, self.pools, st, layer.policy, self.E, self.mover, needed, n, onhost, cls)
        plan = None
        if miss_plan is not None and MISSING in cls:
            missing = [needed[i] for i in range(n) if cls[i] == MISSING]
            answer = miss_plan(missing, layer.resident())
            if answer:
                plan = [NO_PLAN] * n
                for i, e in enumerate(needed):
                    if cls[i] == MISSING and e in answer:
                        plan[i] = -1 if answer[e] is None else answer[e]
        order = [0] * n
        k = steps.begin_b(L, self.pools, st, layer.policy, self.E, self.mover, m, needed, n, cls, plan, order,
                         self.cache_enabled)
        return order if k == n else order[:k]

    def prefetch(self, n: int, predicted: list[int], low_count: Callable[[int], int] | None = None) -> int:
        """Queue predicted experts of layer n (most probable first); returns how many transfers were queued.

        With `link_budget`, at most `link.capacity(n)` transfers; `low_count(k)` of the k queued (the
        least probable) travel for reason "prefill_low" instead of "prefetch" (Fate's INT2 prefill tail).
        """
        L = self.layers[n].L
        L.pred[:] = [len(predicted), *predicted]  # the prediction kept for this layer's next call (recall)
        L.sc[HASPRED] = 1
        if self.placement is not None and self.placement.layer_on_host(n):
            return 0  # its experts live on the host: nothing to move
        cap = self.mover.capacity(n) if self.link_budget else None
        moves = [0] * len(predicted)
        k = steps.prefetch(L, self.pools, self.layers[n].policy, self.E, predicted, -1 if cap is None else cap,
                           self.cache_enabled, self.admit_on_use, moves)
        if k:
            n_low = low_count(k) if low_count is not None else 0
            steps.prefetch_submit(L, self.stats[n][self.phase], self.mover, n, moves, k, n_low)
        return k

    def prefetch_ahead(self, m: int, targets: list[tuple[int, list[int]]],
                       low_count: Callable[[int], int] | None = None) -> int:
        """Queue what was predicted during layer m's call, targets [(layer, ids)] nearest first: this cache
        prefetches the next layer only (`prefetch`); `value_cache.ValueCache` plans every target by value."""
        n, predicted = targets[0]
        return self.prefetch(n, predicted, low_count)

    def acquire(self, m: int, e: int) -> int:
        """The slot of expert e of layer m once its bytes are there (waits; reloads a failed transfer)."""
        layer = self.layers[m]
        st = self.stats[m][self.phase]
        slot = steps.acquire(layer.L, self.pools, st, layer.policy, self.E, self.mover, m, e, self.cache_enabled, 0)
        if slot == NEED_STEAL:  # no slot in this layer's reach: take the staging slots other layers' prefetches hold
            self._steal_staging(m)
            slot = steps.acquire(layer.L, self.pools, st, layer.policy, self.E, self.mover, m, e, self.cache_enabled,
                                 1)
        return slot

    def done(self, m: int, e: int) -> None:
        """Expert e of layer m has computed: its staging slot is given back, or (admit_on_use) it is cached."""
        layer = self.layers[m]
        steps.done(layer.L, self.pools, layer.policy, self.E, e, self._promote[m])

    def end(self, m: int) -> None:
        """Layer m's call is over (load-on-demand forgets what it loaded)."""
        L = self.layers[m].L
        steps.end(L)
        if not self.cache_enabled and L.sc[NUSED]:  # (without a cache only `preload` makes anything valid)
            L.valid[:] = [0] * len(L.valid)

    # --- accounting ---------------------------------------------------------------------
    def check_slots(self) -> None:
        """Raise RuntimeError if a slot is lost or owned twice (every slot is a layer's cache slot, a free
        staging slot, a staged expert's, or a finished transfer's waiting to be reaped)."""
        owners: dict[int, list[str]] = {}
        for m, layer in enumerate(self.layers):
            for slot in layer.cache_slots:
                owners.setdefault(slot, []).append(f"layer {m} cache")
            for e, slot in layer.staged.items():
                owners.setdefault(slot, []).append(f"layer {m} staged expert {e}")
        for pool in (self.demand, *self.prefetch_pools):
            for slot in pool.free:
                owners.setdefault(slot, []).append(f"{pool.name} free")
        for slot, _ in self.zombies:
            owners.setdefault(slot, []).append("an unneeded transfer still landing")
        lost = [s for s in range(self.num_slots) if s not in owners]
        twice = {s: o for s, o in owners.items() if len(o) > 1}
        if lost or twice:
            raise RuntimeError(f"cache slot accounting is broken: lost {lost}, owned twice {twice}")

    # --- filling: the all-resident upper bound ----------------------------------------
    def preload(self, m: int, experts: list[int]) -> list[tuple[int, int]]:
        """Mark experts of layer m cached (the caller loads them): returns (expert, slot) pairs."""
        layer, out = self.layers[m], []
        L = layer.L
        for e in experts:
            if L.sc[NUSED] >= len(L.cslots):
                break
            slot = L.cslots[L.sc[NUSED]]
            layer.policy.admit(e)
            L.where[e], L.valid[e] = slot, 1
            L.sc[NUSED] += 1
            out.append((e, slot))
        return out

    # --- internals ----------------------------------------------------------------------
    def _steal_staging(self, m: int) -> None:
        """Free the staging slots other layers' prefetches hold (last resort for an on-demand load)."""
        for n, layer in enumerate(self.layers):
            if n == m:
                continue
            L = layer.L
            for e in items(L.stlist):
                if L.infl[e]:
                    h = L.handle[e]
                    L.infl[e] = 0
                    core.drop(L.inflist, e)
                    if not self.mover.cancel(h):
                        self.mover.wait(m, e, h)  # layer m waits for it
                core.unstage(L, self.pools, e)
                if L.pref[e]:
                    L.pref[e] = 0
                    core.drop(L.preflist, e)
                    self.stats[n][self.phase].prefetch_wasted += 1
