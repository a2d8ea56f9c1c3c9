"""The one expert cache with prefetch by value and host fill: `ValueCache`, an `ExpertCache` that plans.

What this file is: the cache the opt-in value knobs build (`OffloadConfig.prefetch_value`, `prefetch_depth`,
`prefetch_low`, `host_fill`); with none of them on, drivers build the plain `ExpertCache` and nothing here runs.
Driven by the same three drivers through the same `Mover` protocol (plus `Mover.view`, the link's timing as a
`value.LinkView`; None on an instant link). What it adds, per layer step:
- prefetch by value (decode steps; prefill keeps the plain rule): every layer, the non-urgent prefetches still
  queued for the target layers are cancelled and re-planned with the fresher prediction together with the new
  candidates -- layer m+1 and, with `prefetch_depth=2`, layer m+2 (layer m+2's router on layer m's gate input)
  -- by `value.plan_prefetches` (expected stall saved against the delay imposed on demand loads, the queue
  already waiting, the window until each layer runs); a candidate's probability of use is its rank's learned
  odds (`value.RankOdds`), so what can no longer arrive in time, or is no longer predicted, is cancelled.
  With `prefetch_low` (quantized experts) a prefetch that would land late at INT4 may travel at the miss
  precision (INT2) when that is worth more (reason "prefetch_low");
- admission by worth: a used prefetch enters the layer's cache only in place of an expert used less
  (`value.UseRate`, decayed use counts; `value.worth_admitting`), instead of always evicting the LRU victim;
- host fill (`host_fill`, with host compute): a decode miss computed on the host is also loaded in the
  background into the cache (non-urgent, admitted by worth, at most what the link can finish within one layer
  time; reason "fill", at the prefetch precision), so the cache keeps learning while no step waits for the
  link; a needed load the link has not started yet is cancelled and treated as a miss (the host may take it)
  instead of being waited for.
On an instant link (no `LinkView`) the value planner queues every candidate, nearer layer and better rank first.
What it is not: a mechanism -- it moves no bytes and reads no clock; the times are the link's estimates.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from fate_lab.policy import cache_core as core
from fate_lab.policy import cache_steps as steps
from fate_lab.policy.cache import ExpertCache
from fate_lab.policy.cache_state import items
from fate_lab.policy.value import Candidate, LinkView, RankOdds, UseRate, plan_prefetches, worth_admitting

DEMAND_EMA = 0.1  # weight of the newest decode call in the estimate of P(a layer issues a demand load)


class ValueCache(ExpertCache):
    """`ExpertCache` with prefetch by value, admission by worth and host fill (module docstring)."""

    def __init__(self, *args, value_prefetch: bool = True, host_fill: bool = False, low_offered: bool = False,
                 **kw):
        super().__init__(*args, **kw)
        self.value_prefetch, self.host_fill, self.low_offered = value_prefetch, host_fill, low_offered
        self.odds = RankOdds()
        self.rates = [UseRate() for _ in self.layers]
        self.demand_odds = 1.0  # P(a decode call issues a demand load), learned
        self._ranked: list[list[tuple[int, int, int]]] = [[] for _ in self.layers]  # (expert, distance, rank)
        self._hosted: list[list[int]] = [[] for _ in self.layers]

    # --- the layer step -----------------------------------------------------------------
    def begin(self, m: int, needed: list[int], counts: dict[int, int] | None = None,
              miss_plan: Callable | None = None) -> list[int]:
        """As `ExpertCache.begin`, after learning from the predictions made for this call (and, with host
        fill, turning a needed prefetch the link has not started into a miss the host may take)."""
        layer, needed_set = self.layers[m], set(needed)
        for e, d, r in self._ranked[m]:
            self.odds.record(d, r, e in needed_set)
        self._ranked[m] = []
        self.rates[m].call(list(needed))
        L = layer.L
        if self.host_fill and self.placement is not None:
            for e in needed:
                if L.infl[e] and not L.urg[e] and self.mover.cancel(L.handle[e]):
                    L.infl[e] = 0
                    core.drop(L.inflist, e)
                    if L.staged[e] >= 0:
                        core.unstage(L, self.pools, e)
        order = super().begin(m, needed, counts, miss_plan)
        if self.phase == "decode":
            waited = bool(L.deferred[0]) or any(L.urg[e] for e in items(L.inflist))
            self.demand_odds = (1 - DEMAND_EMA) * self.demand_odds + DEMAND_EMA * float(waited)
        self._hosted[m] = list(layer.host)
        return order

    def prefetch_ahead(self, m: int, targets: list[tuple[int, list[int]]],
                       low_count: Callable[[int], int] | None = None) -> int:
        """Plan the prefetches of the target layers (m+1, and m+2 at depth 2) by value; returns how many were
        queued. Prefill steps and a plain config keep `ExpertCache.prefetch_ahead`."""
        if not self.value_prefetch or self.phase != "decode":
            return super().prefetch_ahead(m, targets, low_count)
        for n, _ in targets:  # re-plan what is still queued for these layers
            self._cancel_queued(n)
        cands: list[Candidate] = []
        for n, ids in targets:
            layer, d = self.layers[n], n - m
            self._ranked[n] += [(e, d, r) for r, e in enumerate(ids)]
            if d == 1:
                layer.prediction = list(ids)
            if self.placement is not None and self.placement.layer_on_host(n):
                continue
            L = layer.L
            for r, e in enumerate(ids):
                if L.infl[e] or L.valid[e] or L.staged[e] >= 0:
                    continue
                cands.append(Candidate(n, e, d, self.odds.p(d, r)))
        view = self.mover.view(m + 1)
        if view is None:  # instant link: everything arrives; nearer layer, better rank first
            plan = [(c.layer, c.expert, False) for c in cands]
        else:
            view = self._adjusted(view)
            plan = [(p.layer, p.expert, p.low) for p in plan_prefetches(cands, view)]
        queued = 0
        for n, e, low in plan:
            layer = self.layers[n]
            L = layer.L
            ids = next(ids for t, ids in targets if t == n)
            if not self.admit_on_use and not self._worth(n, e, frozenset(items(L.inflist)) | frozenset(ids)):
                continue
            for x in (*items(L.inflist), *ids):  # a prediction never evicts itself, nor what is in flight
                L.prot[x] = 1
            slot = core.reserve(L, self.pools, layer.policy, self.E, e, True, self.cache_enabled, self.admit_on_use,
                                True)
            L.prot[:] = 0
            if slot < 0:
                continue  # no slot left for prefetching that layer
            st = self.stats[n][self.phase]
            core.submit(L, st, self.mover, n, e, slot, 0, core.PREFETCH_LOW if low else core.PREFETCH)
            if not L.pref[e]:
                L.pref[e] = 1
                core.push(L.preflist, e)
            st.prefetch_issued += 1
            queued += 1
        return queued

    def end(self, m: int) -> None:
        """As `ExpertCache.end`; with host fill, the decode misses the host computed load in the background."""
        super().end(m)
        hosted, self._hosted[m] = self._hosted[m], []
        if self.host_fill and hosted and self.phase == "decode":
            self._fill(m, hosted)

    # --- internals ----------------------------------------------------------------------
    def _adjusted(self, view: LinkView) -> LinkView:
        """The link's view with this cache's knowledge: a miss costs the host call when that is cheaper, the
        demand-load odds learned, and the low precision only when offered."""
        miss = view.miss_s
        if self.placement is not None and self.placement.mode == "cost":
            miss = min(miss, self.placement.host_s(1))
        return dataclasses.replace(view, miss_s=miss, demand=self.demand_odds,
                                   low_s=view.low_s if self.low_offered else None)

    def _cancel_queued(self, n: int) -> None:
        """Cancel layer n's prefetches the link has not started (they are re-planned; each counts as wasted)."""
        L = self.layers[n].L
        for e in items(L.inflist):
            if L.urg[e] or L.reason[e] == core.FILL or not self.mover.cancel(L.handle[e]):
                continue  # demand loads and background fills are not prefetches to re-plan
            L.infl[e] = 0
            core.drop(L.inflist, e)
            if L.staged[e] >= 0:
                core.unstage(L, self.pools, e)
            if L.pref[e]:
                L.pref[e] = 0
                core.drop(L.preflist, e)
                self.stats[n][self.phase].prefetch_wasted += 1

    def _worth(self, m: int, e: int, protect: frozenset) -> bool:
        """May e enter layer m's full cache? Only in place of an expert used less (a free slot: yes)."""
        pol = self.layers[m].policy
        if len(pol) < pol.capacity:
            return True
        victim = pol.victim(e, protect | {e})
        return victim is not None and worth_admitting(self.rates[m].rate(e), self.rates[m].rate(victim))

    def done(self, m: int, e: int) -> None:
        """As `ExpertCache.done`; a used prefetch joins the cache only in place of an expert used less."""
        layer = self.layers[m]
        L, ok = layer.L, self._promote[m]
        if ok and L.staged[e] >= 0 and not L.infl[e]:
            ok = self._worth(m, e, frozenset(x for x in items(L.touched) if L.pend[x] and x != e)
                             | frozenset(items(L.inflist)))
        steps.done(L, self.pools, layer.policy, self.E, e, ok)

    def _fill(self, m: int, experts: list[int]) -> None:
        """Load host-computed experts of layer m into its cache, most used first, within one layer of link time."""
        layer = self.layers[m]
        L = layer.L
        view = self.mover.view(m)
        if view is None or not (self.cache_enabled and L.sc[core.NSLOTS]):
            return
        st = self.stats[m][self.phase]
        clock = view.backlog_s
        for e in sorted(experts, key=lambda x: (-self.rates[m].rate(x), x)):
            if clock + view.prefetch_s > view.layer_s:
                break
            if L.infl[e]:
                continue
            if L.where[e] >= 0:  # its slot is reserved but its bytes never came (a cancelled load): fill it
                slot = L.where[e]
            else:
                if not self._worth(m, e, frozenset(items(L.inflist)) | layer.pending):
                    continue
                slot = core.reserve(L, self.pools, layer.policy, self.E, e, False, self.cache_enabled,
                                    self.admit_on_use, False)
                if slot < 0:
                    continue
                if L.staged[e] >= 0:  # no cache slot came free: do not hold a staging slot for it
                    core.unstage(L, self.pools, e)
                    continue
            core.submit(L, st, self.mover, m, e, slot, 0, core.FILL)
            st.filled += 1
            clock += view.prefetch_s
