"""Calibrating a `ComputeProfile` of this machine from the runtime itself.

What this file is: `calibrate_compute`, which runs the real runtime (every expert resident over
an instant link, then the `fate` preset over an emulated link) with its timeline on, and reads
off what the timed simulator needs: per-layer dense time, per-expert compute, the experts call's
bookkeeping, the host-side prediction, what the CPU emulation costs (cold experts, cache
pollution by the link's copies, the worker's sleep overshoot, the waiting thread's wake-up), and the dequantize
a packed slot pays before each compute (the runtime's own, timed on one of the model's experts at INT4).
What it is not: the simulator (`simulate.py`), which only reads the profile.
"""
from __future__ import annotations

import time

import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.hardware.compute import ComputeProfile
from fate_lab.hardware.links import LinkProfile

RESIDENT_RUNS = 3  # measured all-resident generates
PREDICTOR_RUNS = 1  # generates per predictor measured apart (a median over its many prediction events)


def med(xs: list[float]) -> float:
    """The median (the upper one of an even count); 0 for none."""
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def _resident_figures(st, M: int, L: int, T: int, K: int) -> tuple[float, ...]:
    """(dense_s, dense_tok, expert_s, expert_tok, call_s, predict_s, predict_tok) of one all-resident generate:
    decode figures are medians over its decode steps, prefill's per-token slopes come from its prompt."""
    tl = st.timeline
    pre_end = st.forward_s["prefill"][0]  # one prefill forward
    p = st.total("prefill")
    comp = [ev[4] - ev[3] for ev in tl if ev[0] == "compute"]  # chronological: the prefill's come first
    pred = [ev[4] - ev[3] for ev in tl if ev[0] == "predict"]
    n_pre = p.uses
    expert_s = med(comp[n_pre:])
    predict_s = med(pred[M - 1:])
    expert_tok = max(0.0, (sum(comp[:n_pre]) - n_pre * expert_s) / max(1, M * T * K - n_pre))
    pre_pred = pred[:M - 1]
    predict_tok = max(0.0, (sum(pre_pred) / max(1, len(pre_pred)) - predict_s) / max(1, T - 1))
    d = st.total("decode")
    n_dec = len(st.forward_s["decode"])
    call_total = d.compute_s / max(1, n_dec)  # experts-call wall time per decode forward, all layers
    in_calls = (sum(comp[n_pre:]) + sum(pred[M - 1:])) / max(1, n_dec)
    call_s = max(0.0, (call_total - in_calls) / M)
    fwd = med(st.forward_s["decode"])
    dense_s = max(0.0, (fwd - call_total) / L)
    dense_tok = max(0.0, (pre_end - p.compute_s - L * dense_s) / max(1, L * (T - 1)))
    return dense_s, dense_tok, expert_s, expert_tok, call_s, predict_s, predict_tok


SHORT_PREFILL = 16  # tokens of the calibration's short prefill (a quarter of the prompt if that is shorter)


def _prefill_figures(st, M: int, L: int, T: int, K: int) -> tuple[float, float, float, float, float]:
    """(dense seconds per layer, seconds per expert computed, tokens per expert computed, the experts call's own
    seconds per layer, seconds per prediction) of the one prefill of an all-resident generate of a T-token prompt."""
    p = st.total("prefill")
    comp = [ev[4] - ev[3] for ev in st.timeline if ev[0] == "compute"][:p.uses]
    pred = [ev[4] - ev[3] for ev in st.timeline if ev[0] == "predict"][:M - 1]
    n = max(1, len(comp))
    return ((st.forward_s["prefill"][0] - p.compute_s) / L, sum(comp) / n, M * T * K / n,
            (p.compute_s - sum(comp) - sum(pred)) / M, sum(pred) / max(1, len(pred)))


def _prefill_lines(short: list[float], long: list[float], T1: int, T2: int) -> tuple[dict, tuple[float, ...]]:
    """The prefill pieces' lines through a short (T1 tokens) and a long (T2) prefill's `_prefill_figures`: the
    profile's prefill intercepts (at 1 token) and the slopes (dense, expert, prediction per additional token)."""
    def line(y1: float, y2: float, x1: float, x2: float) -> tuple[float, float]:
        slope = max(0.0, (y2 - y1) / (x2 - x1)) if x2 > x1 else 0.0
        return max(0.0, y1 - slope * (x1 - 1)), slope

    dense0, dense_tok = line(short[0], long[0], T1, T2)
    expert0, expert_tok = line(short[1], long[1], short[2], long[2])
    call0, call_tok = line(short[3], long[3], T1, T2)
    predict0, predict_tok = line(short[4], long[4], T1, T2)
    return ({"dense_prefill_s": dense0, "expert_prefill_s": expert0, "call_prefill_s": call0,
             "call_per_token_s": call_tok, "predict_prefill_s": predict0}, (dense_tok, expert_tok, predict_tok))


def link_overshoot(moves: list[tuple[float, float]], nbytes: int, link: LinkProfile,
                   among: list[int] | None = None) -> float:
    """Seconds per transfer of nbytes beyond what the simulator's link (`sim.simulate.SimMover`) charges it, from the
    (start, end) of the moves a run timed: the inverse of SimMover's own rule, averaged over `among` (default: all).

    Depth 1: a transfer holds the link alone for latency + bytes / bandwidth + overshoot, so its overshoot is its
    time less those. Deeper queues (the disk): SimMover overlaps the latencies of transfers in flight but passes their
    bytes and overshoot over one wire in turn, so a transfer ends at max(start + latency, the previous transfer's
    end) + bytes / bandwidth + overshoot; each move's overshoot is read off that rule, with the previous end from
    the timed moves in the order they ended. At depth 1 each move's overshoot is its own, and the median keeps a
    stray slow one out; deeper, the mean: over a busy spell the overshoots sum to its length less one latency and
    its bytes' time, so the mean is what makes SimMover take as long as the run took (two reads that ran side by
    side in the time of one give one its whole time and the other none, so no single move speaks for the rest).
    """
    pick = range(len(moves)) if among is None else among
    if not pick:
        return 0.0
    wire = nbytes / link.bandwidth
    before, last = {}, float("-inf")  # each move: the end of the move that ended just before it (depth > 1)
    for i in sorted(range(len(moves)), key=lambda i: moves[i][1]):
        before[i], last = (last if link.queue_depth > 1 else float("-inf")), moves[i][1]
    over = [moves[i][1] - max(moves[i][0] + link.latency, before[i]) - wire for i in pick]
    return max(0.0, med(over) if link.queue_depth == 1 else sum(over) / len(over))


# predictors whose host work is not the cross-layer gate's, each timed in a run of its own preset (every expert
# resident, instant link): the activation path's counts and the activation matrix's search run in Python per call
PREDICTORS_APART = {"activation_path": "activation_path", "activation_matrix": "eap"}


def _call_rest(st, skip: int = 0) -> tuple[float, int]:
    """(seconds of the experts calls that no expert's compute took, prediction events) of a run's stats; `skip`:
    leave out the first `skip` compute events (a prefill's, for a decode figure)."""
    comp = [ev[4] - ev[3] for ev in st.timeline if ev[0] == "compute"]
    return sum(comp[skip:]), sum(1 for ev in st.timeline if ev[0] == "predict")


def _per_prediction(rest: float, preds: int, M: int, call_s: float, steps: int = 1) -> float:
    """Seconds per prediction of a predictor whose `steps` forwards of M MoE layers spent `rest` seconds in their
    experts calls beyond their experts' compute, with `preds` prediction events, when the gate preset's bookkeeping
    is `call_s` per layer: the inverse of the simulator's charge (M x call_s per forward, one prediction per event)."""
    return max(0.0, (rest - steps * M * call_s) / preds) if preds else 0.0


def _predictor_figures(model, prompt_ids: torch.Tensor, preset: str, new_tokens: int, quant: str | None,
                       call, T1: int) -> tuple[float, float, float | None]:
    """(predict_s, predict_per_token_s, predict_prefill_s) of `preset`'s predictor: all the host work it adds to
    the experts calls beyond the gate preset's bookkeeping (`call(T)`, seconds per layer), per prediction. That is
    its calls' time less their experts' compute, less M x call(T), over its prediction events: the inverse of what
    the simulator charges (M calls and one prediction per event). Read off a generate (decode, per step) and two
    prefill-only generates of T and T1 tokens (the prefill line), so work outside the prediction events (the
    activation matrix's bookkeeping per call) is counted too."""
    from fate_lab.offloading.runtime import offload

    runs = []
    with offload(model, OffloadConfig.preset(preset, all_resident=True, link="instant", quant=quant)) as rt:
        model.generate(prompt_ids[:, :8], max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
        M, T = rt.adapter.num_moe_layers, prompt_ids.shape[1]

        def prefill(n: int) -> tuple[float, int, int]:
            rt.reset_stats()
            model.generate(prompt_ids[:, :n], max_new_tokens=1, min_new_tokens=1, do_sample=False)
            p = rt.stats.total("prefill")
            comp, preds = _call_rest(rt.stats)
            return p.compute_s - comp, preds, p.uses

        def per_prediction(rest: float, preds: int, T: int, steps: int = 1) -> float:
            return _per_prediction(rest, preds, M, call(T), steps)

        for _ in range(PREDICTOR_RUNS):
            long_rest, long_preds, uses = prefill(T)
            short = per_prediction(*prefill(T1)[:2], T1) if T1 < T else None
            rt.reset_stats()
            model.generate(prompt_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            d, steps = rt.stats.total("decode"), len(rt.stats.forward_s["decode"])
            comp, preds = _call_rest(rt.stats, skip=uses)
            decode = per_prediction(d.compute_s - comp, preds - long_preds, 1, steps)
            long = per_prediction(long_rest, long_preds, T)
            slope = max(0.0, (long - short) / (T - T1)) if short is not None else max(0.0, (long - decode) / (T - 1))
            runs.append((decode, slope, None if short is None else max(0.0, short - slope * (T1 - 1))))
    prefill_s = [r[2] for r in runs if r[2] is not None]
    return med([r[0] for r in runs]), med([r[1] for r in runs]), med(prefill_s) if prefill_s else None


def _dequant_s(w) -> float:
    """The runtime's dequantize of expert w at INT4, in the largest of INT4's group sizes (64, 32, ..., 8) that
    divides its projections' last dims, as a quantized preset would have to pick; 0 if none does (no packed slot
    can hold it, so nothing is ever dequantized)."""
    from fate_lab.offloading.slots import dequantize_s
    from fate_lab.quant import QuantSpec
    from fate_lab.quant.experts import pack_expert

    for g in (64, 32, 16, 8):
        if w.gate_up.shape[-1] % g == 0 and w.down.shape[-1] % g == 0:
            return dequantize_s(pack_expert(w, QuantSpec(4, g)))
    return 0.0


def calibrate_compute(model, prompt_ids: torch.Tensor, new_tokens: int = 24, quant: str | None = None,
                      name: str = "this machine", link: str | None = None,
                      layer_compute_s: float | None = None, link_profile: LinkProfile | None = None,
                      quick: bool = False) -> ComputeProfile:
    """A `ComputeProfile` measured from the runtime itself: every expert resident, instant link, timeline on.

    Decode figures are medians over the decode steps. A prefill runs other code (rows gathered per expert, masks, the
    KV cache begun), so its pieces get lines of their own, through the prompt's prefill and a short one of its first
    `SHORT_PREFILL` tokens (each a median over `RESIDENT_RUNS`).
    With `link` (an emulated link name), a second run loads experts on demand over it and measures what
    the link's copies cost the compute thread on a CPU (`expert_cold_s`, `landed_s`, `busy_factor`,
    `transfer_host_s`); the resident figures (medians over `RESIDENT_RUNS` generates) stay those of the first
    run, so a run that moves nothing (all experts resident) is predicted at the resident speed. `link_profile`: the
    link the simulator will be given (default: the runtime's), against which each transfer's overshoot is measured.
    Give a prompt as long as the longest prefills to be predicted: the lines are fits between the two lengths.
    quick: one round of the disk's contention trials instead of `fit.contention.ROUNDS` (FAST mode: a rougher
    profile, about 25 s sooner on the embedded models).
    """
    from fate_lab.model.adapters import adapt
    from fate_lab.offloading.runtime import offload

    dequant = _dequant_s(adapt(model).expert(0, 0))
    cfg = OffloadConfig.preset("fate", all_resident=True, link="instant", quant=quant)
    runs = []
    with offload(model, cfg) as rt:
        packed = rt.core.spec(0, "cache") is not None  # every resident slot packed: its computes dequantized
        model.generate(prompt_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)  # warm-up
        M, L, T = rt.adapter.num_moe_layers, len(getattr(model, "model", model).layers), prompt_ids.shape[1]
        T1 = max(2, min(SHORT_PREFILL, T // 4))  # the short prefill, where a line through two lengths is wanted
        longs, shorts = [], []
        for _ in range(RESIDENT_RUNS):  # each figure is the median over these runs: a busy spell hits one
            rt.reset_stats()
            model.generate(prompt_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            runs.append(_resident_figures(rt.stats, M, L, T, rt.top_k))
            longs.append(_prefill_figures(rt.stats, M, L, T, rt.top_k))
            if T1 < T:
                rt.reset_stats()
                model.generate(prompt_ids[:, :T1], max_new_tokens=1, min_new_tokens=1, do_sample=False)
                shorts.append(_prefill_figures(rt.stats, M, L, T1, rt.top_k))
    dense_s, dense_tok, expert_s, expert_tok, call_s, predict_s, predict_tok = (
        med([r[i] for r in runs]) for i in range(7))
    prefill = {}
    if shorts:  # the prefill pieces' lines through the two lengths, in place of the lines through the decode figures
        prefill, (dense_tok, expert_tok, predict_tok) = _prefill_lines(
            [med([r[i] for r in shorts]) for i in range(5)], [med([r[i] for r in longs]) for i in range(5)], T1, T)
    def gate_call(n: int) -> float:  # the gate preset's bookkeeping per layer in a step of n tokens
        if n == 1:
            return call_s
        return prefill.get("call_prefill_s", call_s) + prefill.get("call_per_token_s", 0.0) * (n - 1)

    predictors = tuple((pred, *_predictor_figures(model, prompt_ids, preset, new_tokens, quant, gate_call, T1))
                       for pred, preset in PREDICTORS_APART.items())
    if packed:  # the measured expert time holds the dequantize, which the simulator charges apart (dequant_s)
        expert_s = max(0.0, expert_s - dequant)
        if "expert_prefill_s" in prefill:
            prefill["expert_prefill_s"] = max(0.0, prefill["expert_prefill_s"] - dequant)
    cold = landed = extra = wake = queued = 0.0
    demand_extra = None
    busy = 1.0
    if link is not None:  # the same machine while an emulated link copies on the other core
        disk = {"store": "ssd", "checkpoint": model.name_or_path} if link == "disk" else {}  # real reads
        cfg = OffloadConfig.preset("fate", link=link, layer_compute_s=layer_compute_s, quant=quant,
                                   slots=M * rt.num_experts // 4, **disk)
        with offload(model, cfg) as rt2:
            model.generate(prompt_ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
            rt2.reset_stats()
            model.generate(prompt_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            st2, tl2 = rt2.stats, rt2.stats.timeline
        skip = st2.total("prefill").uses  # the prefill's compute events come first
        fresh, warm_c, cold_c, pred2, pre_comp, seen = set(), [], [], [], [], 0
        for kind, m, e, a0, a1 in tl2:
            if kind in ("demand", "prefetch", "sync_load"):
                fresh.add((m, e))
            elif kind == "compute":
                seen += 1
                if seen > skip:
                    (cold_c if (m, e) in fresh else warm_c).append(a1 - a0)
                else:
                    pre_comp.append(a1 - a0)
                fresh.discard((m, e))
            elif kind == "predict":
                pred2.append(a1 - a0)
        lp = link_profile if link_profile is not None else rt2.link
        moves = [(kind, a0, a1) for kind, m, e, a0, a1 in tl2 if kind in ("demand", "prefetch")]
        spans = [(a0, a1) for _, a0, a1 in moves]
        extra, demand_extra = link_overshoot(spans, rt2.expert_bytes, lp), None
        urgent = [i for i, (kind, _, _) in enumerate(moves) if kind == "demand"]
        if lp.queue_depth > 1 and 0 < len(urgent) < len(moves):
            # a disk read's own CPU work (conversion, digest, copy) has the cores to itself while the compute
            # thread waits on it (a demand load) and shares them with compute otherwise (a prefetch): measured apart
            demand_extra = link_overshoot(spans, rt2.expert_bytes, lp, among=urgent)
            extra = link_overshoot(spans, rt2.expert_bytes, lp, among=sorted(set(range(len(moves))) - set(urgent)))
        landed_at: dict = {}
        wakes = []
        for kind, m, e, _a0, a1 in tl2:
            if kind in ("demand", "prefetch"):
                landed_at[m, e] = a1
            elif kind == "stall" and (m, e) in landed_at and landed_at[m, e] <= a1:
                wakes.append(a1 - landed_at[m, e])
        wake = med(wakes)
        # the prefill's calls beyond their pieces: the compute thread's own work for its many transfers (charged per
        # transfer below, once the readers' slow-down of the calls is known, for the disk link)
        p2 = st2.total("prefill")
        pre_moves = p2.bytes_moved / rt.expert_bytes
        pre_rest = p2.compute_s - sum(pre_comp) - p2.stall_s - sum(pred2[:M - 1])
        d2, n2 = st2.total("decode"), len(st2.forward_s["decode"])
        moved = d2.bytes_moved / rt.expert_bytes / n2  # transfers per decode token
        busy_expert = med(warm_c)  # a warm expert's compute while the link copies
        base = expert_s + (dequant if packed else 0.0)  # a warm expert's own time, its dequantize included
        busy = max(1.0, busy_expert / base) if busy_expert and base else 1.0
        cold = max(0.0, med(cold_c) - busy_expert) if busy_expert else 0.0
        in_calls2 = (sum(warm_c) + sum(cold_c) + sum(pred2[M - 1:]) + d2.stall_s) / n2
        # what the calls spent beyond their pieces, less the resident run's bookkeeping slowed by the busy link:
        # the compute thread's own time per transfer it queued
        per = moved if moved > 0 else float("inf")  # no transfer: nothing to charge them with
        queued = max(0.0, d2.compute_s / n2 - in_calls2 - M * call_s * busy) / per
        dense_part = (sum(st2.forward_s["decode"]) - d2.compute_s) / n2  # per token, outside experts calls
        landed = max(0.0, (dense_part - L * dense_s) / per)
    disk: dict = {}
    if link == "disk":  # the readers' host work and their contention with compute, each measured on its own
        from fate_lab.fit.contention import ROUNDS, measure_contention

        lp = link_profile if link_profile is not None else rt2.link
        con = measure_contention(model, prompt_ids, depth=lp.queue_depth, rounds=1 if quick else ROUNDS)
        disk = {"read_host_s": con.host_line(lp.latency, lp.bandwidth, busy=False),
                "read_host_busy_s": con.host_line(lp.latency, lp.bandwidth, busy=True), "reader_slowdown": con.slowdown,
                "reader_overlap": con.overlap,
                "reader_slowdown_dense": con.slowdown_dense, "reader_slowdown_prefill": con.slowdown_prefill,
                "reader_slowdown_prefill_dense": con.slowdown_prefill_dense}
        # the prefill's predictions beside the readers, as the cold prefill above timed them (its readers ran
        # throughout): a few whole-tensor ops, slowed less than the calls' many small pieces (0.6-2.9 against 2.1
        # ms charged at the calls' figure on tiny_moe, 2026-12-06); the other predictors' prefills are charged alike
        alone = prefill.get("predict_prefill_s", predict_s) + predict_tok * (T - 1)  # the gate's prediction, alone
        if pred2[:M - 1] and alone > 0:
            disk["reader_slowdown_predict_prefill"] = (max(1.0, med(pred2[:M - 1]) / alone),)
        extra, demand_extra, busy, landed = 0.0, None, 1.0, 0.0  # what the disk model replaces
        # the compute thread's own work per read (queueing it, reserving and freeing its slot, waking on it), from
        # the cold prefill above, where the readers were busy throughout: what its calls took beyond their experts,
        # stall, predictions and (slowed) bookkeeping, per read, less that slow-down (the simulator slows it again by
        # the readers busy at each submit, as it does the calls' other pieces)
        slow = (con.slowdown_prefill or con.slowdown)[-1]
        queued = max(0.0, pre_rest - M * gate_call(T) * slow) / pre_moves / slow if pre_moves else 0.0
    return ComputeProfile(name, dense_s, dense_tok, expert_s, expert_tok, call_s, predict_s, predict_tok,
                          expert_cold_s=cold, landed_s=landed, link_extra_s=max(0.0, extra), wake_s=wake,
                          demand_extra_s=demand_extra, **disk, **prefill, predictors=predictors,
                          busy_factor=busy, transfer_host_s=queued, dequant_s=dequant,
                          source=f"calibrated {time.strftime('%Y-%m-%d %H:%M')} from the runtime (all resident, "
                          f"instant link, {new_tokens} tokens, quant={quant}"
                          + (f"; cold experts, the busy link's slow-down and per-transfer time over {link}" if link
                             else "") + ("; the disk readers' host work and contention measured apart "
                                         "(fit/contention.py)" if disk else "") + ")")
