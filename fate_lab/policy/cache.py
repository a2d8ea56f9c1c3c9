"""The one expert cache: the per-layer slot state machine that every driver shares.

What this file is: `ExpertCache`, the bookkeeping of which expert of which MoE layer sits in
which device slot, written once and driven three ways -- by the runtime (`runtime.py`, real
transfers on an engine thread or a CUDA stream), by the replay (`replay.py`, transfers that
land at once) and by the timed simulator (`simulate.py`, a simulated link and clock). A
driver implements the small `Mover` protocol below; the cache never touches a tensor, a
thread or a clock. If two drivers disagree on the same trace, that is a bug (tests say so).

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

from fate_lab.policy.cache_state import HOST, LayerState, Mover, _Inflight, _Pool
from fate_lab.policy.lossy import LOWP
from fate_lab.policy.placement import HostPlacement
from fate_lab.policy.replacement import ReplacementPolicy
from fate_lab.policy.stats import PHASES, PhaseStats

__all__ = ["HOST", "ExpertCache", "LayerState", "Mover"]


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
        self.layers: list[LayerState] = []
        base = 0
        for m, c in enumerate(slots_per_layer):
            self.layers.append(LayerState(list(range(base, base + c)), policy(m, c)))
            base += c
        self.demand = _Pool("demand", list(range(base, base + top_k)))
        base += top_k
        self.prefetch_pools = (_Pool("prefetch A", list(range(base, base + prefetch_buffers))),
                               _Pool("prefetch B", list(range(base + prefetch_buffers, base + 2 * prefetch_buffers))))
        self.num_slots = base + 2 * prefetch_buffers
        self.num_staging = top_k + 2 * prefetch_buffers
        self._pool_of: dict[int, _Pool] = {s: p for p in (self.demand, *self.prefetch_pools) for s in p.free}
        self.zombies: list[tuple[int, Any]] = []  # staging slots whose unneeded transfer runs on

    # --- the layer step -----------------------------------------------------------------
    def begin(self, m: int, needed: list[int], counts: dict[int, int] | None = None,
              miss_plan: Callable[[list[int], set[int]], dict[int, int | None]] | None = None) -> list[int]:
        """Layer m starts with the distinct experts `needed` (counts[e]: tokens routed to e, for the host
        placement; default 1): returns the order to compute them in (dropped experts are left out).
        miss_plan(misses, resident) -> {e: stand-in or None (drop)} for a lossy decode step."""
        layer, st = self.layers[m], self.stats[m][self.phase]
        st.calls += 1
        self._reap()
        self._settle(m)
        needed_set = set(needed)
        if layer.prediction is not None:  # recall / precision of the prediction made for this call
            pred = set(layer.prediction)
            st.predictions += 1
            st.predicted += len(pred)
            st.predicted_used += len(pred & needed_set)
            st.true_used += len(needed_set)
        layer.prediction = None
        st.prefetch_useful += len(layer.prefetched & needed_set)
        st.prefetch_wasted += len(layer.prefetched - needed_set)
        layer.prefetched = set()
        self._drop_stale(m, needed_set)

        st.uses += len(needed)
        ready, host, waiting, missing = [], [], [], []
        place = self.placement
        for e in needed:
            if e in layer.inflight:
                waiting.append(e)
                st.late += 1
            elif e in layer.staged or e in layer.valid:
                ready.append(e)
                st.hits += 1
                if e in layer.where:
                    layer.policy.access(e)
            else:
                st.misses += 1
                if place is not None and place.on_host(m, 1 if counts is None else counts[e]):
                    host.append(e)
                else:
                    missing.append(e)
        st.host += len(host)
        layer.host = set(host)
        subst: dict[int, int] = {}
        lowp: list[int] = []
        if miss_plan is not None and missing:
            for e, f in miss_plan(list(missing), layer.resident()).items():
                missing.remove(e)
                if f is None:
                    st.dropped += 1
                elif f == LOWP:
                    lowp.append(e)
                    st.substituted += 1
                else:
                    subst[e] = f
                    st.substituted += 1
        layer.subst, layer.lowp = subst, set(lowp)
        # stand-ins first (their slots are certain now), then resident: their compute hides the transfers
        order = list(subst) + ready + lowp + host + waiting + missing
        layer.pending = set(order) | set(subst.values())
        for e in waiting:  # a needed prefetch still queued becomes urgent: it goes before the misses
            inf = layer.inflight[e]
            if not inf.urgent and self.mover.cancel(inf.handle):
                self._submit(m, e, inf.slot, urgent=True, reason=inf.reason)
        layer.deferred = [e for e in missing if not self._demand(m, e)]
        return order

    def prefetch(self, n: int, predicted: list[int], low_count: Callable[[int], int] | None = None) -> int:
        """Queue predicted experts of layer n (most probable first); returns how many transfers were queued.

        With `link_budget`, at most `link.capacity(n)` transfers; `low_count(k)` of the k queued (the
        least probable) travel for reason "prefill_low" instead of "prefetch" (Fate's INT2 prefill tail).
        """
        layer, st = self.layers[n], self.stats[n][self.phase]
        layer.prediction = list(predicted)
        if self.placement is not None and self.placement.layer_on_host(n):
            return 0  # its experts live on the host: nothing to move
        cap = self.mover.capacity(n) if self.link_budget else None
        protect = frozenset(layer.inflight) | frozenset(predicted)  # a prediction never evicts itself
        moves: list[tuple[int, int]] = []
        for e in predicted:
            if e in layer.inflight or e in layer.valid or e in layer.staged:
                continue
            if cap is not None and len(moves) >= cap:
                break
            slot = self._reserve(n, e, protect, for_prefetch=True)
            if slot is None:
                break  # no slot left for prefetching this layer
            moves.append((e, slot))
        n_low = low_count(len(moves)) if low_count is not None and moves else 0
        for i, (e, slot) in enumerate(moves):
            self._submit(n, e, slot, urgent=False, reason="prefill_low" if i >= len(moves) - n_low else "prefetch")
            layer.prefetched.add(e)
            st.prefetch_issued += 1
        return len(moves)

    def prefetch_ahead(self, m: int, targets: list[tuple[int, list[int]]],
                       low_count: Callable[[int], int] | None = None) -> int:
        """Queue what was predicted during layer m's call, targets [(layer, ids)] nearest first: this cache
        prefetches the next layer only (`prefetch`); `value_cache.ValueCache` plans every target by value."""
        n, predicted = targets[0]
        return self.prefetch(n, predicted, low_count)

    def acquire(self, m: int, e: int) -> int:
        """The slot of expert e of layer m once its bytes are there (waits; reloads a failed transfer)."""
        layer = self.layers[m]
        if e in layer.host:
            return HOST
        if e in layer.lowp:
            return LOWP
        if e in layer.subst:
            f = layer.subst[e]
            return layer.staged.get(f, layer.where.get(f))
        while layer.deferred and self._demand(m, layer.deferred[0]):  # slots freed by computed experts
            layer.deferred.pop(0)
        if layer.deferred and layer.deferred[0] == e:  # e is next and still has no slot: make one free
            layer.deferred.pop(0)
            if not self._demand(m, e, blocking=True):
                raise RuntimeError(f"no slot for expert {e} of MoE layer {m} (cache bug)")
        slot = layer.staged.get(e, layer.where.get(e))
        inf = layer.inflight.get(e)
        if inf is not None:
            ok = self.mover.wait(m, e, inf.handle)
            del layer.inflight[e]  # only now: a wait left by Ctrl-C keeps it in flight for the next call
            if not ok:
                self.stats[m][self.phase].failures += 1
                self.mover.reload(m, e, slot, inf.reason)
        if e in layer.where:
            layer.valid.add(e)
        return slot

    def done(self, m: int, e: int) -> None:
        """Expert e of layer m has computed: its staging slot is given back, or (admit_on_use) it is cached."""
        layer = self.layers[m]
        layer.pending.discard(e)
        if layer.host:
            layer.host.discard(e)
        if e in layer.staged and e not in layer.inflight:
            if self.admit_on_use and self.cache_enabled and layer.cache_slots:
                self._promote(m, e)
            else:
                self._release(layer.staged.pop(e))

    def end(self, m: int) -> None:
        """Layer m's call is over (load-on-demand forgets what it loaded)."""
        layer = self.layers[m]
        layer.pending.clear()
        layer.host.clear()
        layer.subst, layer.lowp = {}, set()
        if not self.cache_enabled:
            layer.valid.clear()

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
        for e, slot in zip(experts, layer.cache_slots, strict=False):
            layer.policy.admit(e)
            layer.where[e] = slot
            layer.valid.add(e)
            out.append((e, slot))
        return out

    # --- internals ----------------------------------------------------------------------
    def _pool_for(self, m: int) -> _Pool:
        return self.prefetch_pools[m % 2]

    def _take_staging(self, m: int, for_prefetch: bool) -> int | None:
        """A free staging slot: prefetches use their layer's pool, on-demand loads the demand pool first."""
        pools = (self._pool_for(m),) if for_prefetch else (self.demand, self._pool_for(m))
        for pool in pools:
            if pool.free:
                return pool.free.pop()
        return None

    def _release(self, slot: int) -> None:
        self._pool_of[slot].free.append(slot)

    def _reserve(self, m: int, e: int, protect: frozenset, for_prefetch: bool) -> int | None:
        """A slot for expert e of layer m from its cache or from staging; None if there is none now."""
        layer = self.layers[m]
        if e in layer.where:  # reserved earlier but its bytes never arrived (dropped or failed)
            layer.policy.access(e)
            return layer.where[e]
        if self.cache_enabled and layer.cache_slots and not (for_prefetch and self.admit_on_use):
            victim = layer.policy.admit(e, protect)
            if victim != e:
                if victim is None:
                    slot = layer.free[0]
                else:
                    slot = layer.where.pop(victim)
                    layer.valid.discard(victim)
                layer.where[e] = slot
                return slot
        slot = self._take_staging(m, for_prefetch)
        if slot is not None:
            layer.staged[e] = slot
        return slot

    def _promote(self, m: int, e: int) -> None:
        """A staged expert that was just used joins layer m's cache; slots swap owners, no bytes move."""
        layer = self.layers[m]
        slot = layer.staged.pop(e)
        victim = layer.policy.admit(e, frozenset(layer.pending) | frozenset(layer.inflight))
        if victim == e:  # nothing may be evicted: it stays uncached
            self._release(slot)
            return
        if victim is None:
            freed = layer.free[0]
        else:
            freed = layer.where.pop(victim)
            layer.valid.discard(victim)
        pool = self._pool_of.pop(slot)
        layer.cache_slots[layer.cache_slots.index(freed)] = slot
        self._pool_of[freed] = pool
        pool.free.append(freed)
        layer.where[e] = slot
        layer.valid.add(e)

    def _submit(self, m: int, e: int, slot: int, urgent: bool, reason: str) -> None:
        h = self.mover.submit(m, e, slot, urgent, reason)
        self.layers[m].inflight[e] = _Inflight(h, slot, urgent, reason)

    def _demand(self, m: int, e: int, blocking: bool = False) -> bool:
        """Queue an urgent load of e; False if no slot is free now (blocking: make one free)."""
        layer = self.layers[m]
        protect = frozenset(layer.pending) | frozenset(layer.inflight)
        slot = self._reserve(m, e, protect, for_prefetch=False)
        if slot is None and blocking:
            self._reap(wait_in=m)
            self._steal_staging(m)
            slot = self._reserve(m, e, protect, for_prefetch=False)
        if slot is None:
            return False
        self._submit(m, e, slot, urgent=True, reason="miss")
        return True

    def _steal_staging(self, m: int) -> None:
        """Free the staging slots other layers' prefetches hold (last resort for an on-demand load)."""
        for n, layer in enumerate(self.layers):
            if n == m:
                continue
            for e in list(layer.staged):
                inf = layer.inflight.pop(e, None)
                if inf is not None and not self.mover.cancel(inf.handle):
                    self.mover.wait(m, e, inf.handle)  # layer m waits for it
                self._release(layer.staged.pop(e))
                if e in layer.prefetched:
                    layer.prefetched.discard(e)
                    self.stats[n][self.phase].prefetch_wasted += 1

    def _settle(self, m: int) -> None:
        """Absorb the finished transfers of layer m without waiting."""
        layer = self.layers[m]
        for e, inf in list(layer.inflight.items()):
            ok = self.mover.poll(inf.handle)
            if ok is None:
                continue
            del layer.inflight[e]
            if ok and e in layer.where:
                layer.valid.add(e)
            elif not ok:  # a failed transfer: counted; a staged one gives its slot back
                self.stats[m][self.phase].failures += 1
                if e in layer.staged:
                    self._release(layer.staged.pop(e))

    def _reap(self, wait_in: int | None = None) -> None:
        """Give back the staging slots of unneeded transfers that have finished (or, from layer
        `wait_in`'s call, wait for them: that wait is layer wait_in's stall)."""
        keep = []
        for slot, h in self.zombies:
            if wait_in is not None and self.mover.poll(h) is None:
                self.mover.wait(wait_in, -1, h)
            (self._release(slot) if self.mover.poll(h) is not None else keep.append((slot, h)))
        self.zombies = keep

    def _drop_stale(self, m: int, needed: set[int]) -> None:
        """Queued prefetches layer m does not need are cancelled; unneeded staged experts leave."""
        layer = self.layers[m]
        for e in [e for e in layer.inflight if e not in needed]:
            inf = layer.inflight[e]
            if self.mover.cancel(inf.handle):
                del layer.inflight[e]
                if e in layer.staged:
                    self._release(layer.staged.pop(e))
            elif e in layer.staged:  # already on the link: its slot comes back when it lands
                del layer.inflight[e]
                self.zombies.append((layer.staged.pop(e), inf.handle))
            # into a cache slot and already on the link: it stays in flight (never evicted) and lands valid
        for e in [e for e in layer.staged if e not in needed]:
            self._release(layer.staged.pop(e))
