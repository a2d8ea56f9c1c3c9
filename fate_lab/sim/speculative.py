"""Speculative decoding on the simulated clock: verify steps from a greedy trace, and a roofline pick of the window.

What this file is:
  - ``verify_steps(trace, window, matches=... | acceptance=...)``: the forwards greedy assisted
    generation (HF, constant window w) runs on each prompt of a recorded trace: the prefill of the
    prompt together with the first w proposals, then verify steps of ``1 + c`` tokens (the last
    accepted token and c = min(w, tokens left - 1) proposals), each producing ``accepted + 1`` tokens;
  - ``simulate_speculative(...)``: those forwards through ``simulate.Simulator`` (the runtime's own
    cache, layer step and predictor on a simulated link), with the draft's time between forwards;
  - ``union_sizes`` and ``pick_window``: a roofline over windows -- per verify step, the link time
    of the experts the step's tokens need (their union per layer, minus the cache's hits) against
    the compute time, and ``1 + expected accepted`` tokens per step -> predicted tokens/s;
    ``break_even_acceptance`` reads off the acceptance a window needs to match plain decoding.

Approximations, said plainly:
  - A greedy trace holds the routing of the tokens the target produced, not of the draft tokens a
    verify step rejects. A rejected proposal at position p is given the routing of trace row p
    (the token the target produced there): same position and context, a different token. So a
    verify step over positions s..s+c is exactly trace rows s..s+c; its accepted rows are exact,
    its rejected rows are stand-ins.
  - ``matches`` (per trace row: the draft's greedy next token equals the target's) gives the
    exact accept lengths of greedy assisted generation: a proposal i is accepted when proposals
    1..i all match. Without a draft, ``acceptance`` p assumes each proposal is accepted with
    probability p independently of the others, and the steps take the *expected* accept length
    (carried over as a fraction from step to step, so the totals follow the expectation exactly).
  - The draft costs ``draft_token_s`` seconds per proposed token, on the compute thread between
    target forwards (the link keeps moving queued transfers meanwhile).
  - The roofline assumes transfers overlap compute perfectly, uses one hit rate for every union
    (that of plain decode, measured or simulated), and the trace's mean union sizes.
What it is not: no model runs here (the draft's matches come from ``study.speculative.draft_matches``),
and nothing moves; the real measurement is ``study.speculative.speculative_decode``.
Letters: T tokens per forward, M MoE layers, K experts per token, w window (proposals per step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.setups import Hardware
from fate_lab.model.trace import PREFILL, Trace
from fate_lab.policy.stats import RunStats
from fate_lab.sim.simulate import Simulator, check_trace


@dataclass(frozen=True)
class VerifyStep:
    """One target forward of assisted generation over trace rows [start, end)."""

    start: int
    end: int
    phase: str  # "prefill" (the prompt and the first proposals) or "decode" (a verify step)
    proposed: int  # draft tokens checked by this forward
    accepted: int  # of them accepted

    @property
    def produced(self) -> int:
        """Tokens this forward adds to the sequence: the accepted ones plus the target's own."""
        return self.accepted + 1


def expected_accepted(p: float, window: int) -> float:
    """Expected accepted proposals of a window when each is accepted with probability p: sum_i p^i."""
    return sum(p ** i for i in range(1, window + 1))


def per_token_acceptance(rate: float, window: int) -> float:
    """The per-proposal probability p whose accepted/proposed ratio at this window is `rate` (inverts the above)."""
    if window < 1:
        raise ValueError(f"window must be >= 1 to have an acceptance rate, got {window}")
    if not 0 <= rate <= 1:
        raise ValueError(f"acceptance rate must lie in [0, 1], got {rate}")
    lo, hi = 0.0, 1.0
    for _ in range(60):  # accepted/proposed rises monotonically with p
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_accepted(mid, window) / window < rate else (lo, mid)
    return (lo + hi) / 2


def accept_runs(matches: torch.Tensor) -> torch.Tensor:
    """Run length of consecutive True from each position: matches bool [N] -> int64 [N]."""
    m = matches.to(torch.bool).tolist()
    run = [0] * (len(m) + 1)
    for i in range(len(m) - 1, -1, -1):
        run[i] = run[i + 1] + 1 if m[i] else 0
    return torch.tensor(run[:-1], dtype=torch.int64)


def prompt_rows(trace: Trace) -> list[tuple[int, int, int]]:
    """(first row, prefill rows P, total rows) of each prompt, in trace order."""
    pid, phase = trace.prompt_id.tolist(), trace.phase.tolist()
    out, i = [], 0
    while i < len(pid):
        j = i
        while j < len(pid) and pid[j] == pid[i]:
            j += 1
        P = sum(1 for r in range(i, j) if phase[r] == PREFILL)
        if P == 0 or any(phase[r] == PREFILL for r in range(i + P, j)):
            raise ValueError(f"prompt {pid[i]} of the trace does not start with its prefill rows")
        out.append((i, P, j - i))
        i = j
    return out


def verify_steps(trace: Trace, window: int, matches: torch.Tensor | None = None,
                 acceptance: float | None = None) -> list[VerifyStep]:
    """The target forwards of greedy assisted generation with `window` proposals per step, per prompt.

    Give ``matches`` (bool [N]: the draft's greedy next token after row r equals the trace's row
    r+1 in the same prompt) for exact accept lengths, or ``acceptance`` p (per proposal,
    independent) for expected ones. A prompt with P prefill and D decode rows generates D + 1
    tokens, as HF's ``generate(max_new_tokens=D + 1)`` would. Window 0 is plain decoding.
    """
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if window > 0 and (matches is None) == (acceptance is None):
        raise ValueError("give exactly one of matches (bool per trace row, from the draft) or acceptance "
                         "(a per-proposal probability in [0, 1])")
    if acceptance is not None and not 0 <= acceptance <= 1:
        raise ValueError(f"acceptance must lie in [0, 1], got {acceptance}")
    runs = None
    if matches is not None:
        if matches.shape != (trace.num_tokens,):
            raise ValueError(f"matches must be bool [{trace.num_tokens}] (one per trace row), "
                             f"got {tuple(matches.shape)}")
        runs = accept_runs(matches).tolist()
    steps: list[VerifyStep] = []
    for first, P, rows in prompt_rows(trace):
        N = rows - P + 1  # new tokens: one per decode row, plus the one the last row produces
        L, carry = P, 0.0  # sequence length so far; fractional accepted tokens carried over
        while L < P + N:
            c = min(window, P + N - L - 1)  # proposals (HF: at most max_length - cur_len - 1)
            if c == 0:
                a = 0
            elif runs is not None:
                a = min(c, runs[first + L - 1])  # proposals 1..a equal the target's tokens at L..L+a-1
            else:
                carry += expected_accepted(acceptance, c)
                a = min(c, int(carry + 1e-9))
                carry -= a
            start = first if L == P else first + L - 1  # the first forward also holds the prompt
            steps.append(VerifyStep(start, first + L + c, "prefill" if L == P else "decode", c, a))
            L += a + 1
    return steps


@dataclass
class SpecSimResult:
    """What `simulate_speculative` returns: the runtime's stats type plus the speculative counts."""

    stats: RunStats
    window: int
    steps: list[VerifyStep]
    ttft_s: float  # mean time of a prompt's first forward (prompt + first proposals), draft included
    decode_s: float  # verify forwards plus the draft's time between them
    decode_tokens: int  # tokens produced by the decode-phase forwards
    proposed: int
    accepted: int

    @property
    def decode_tok_s(self) -> float:
        """Decode tokens per second."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def acceptance(self) -> float:
        """Accepted / proposed draft tokens (NaN for plain decoding)."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def moved_per_token(self) -> float:
        """Expert transfers of the decode phase per decode token."""
        moved = sum(v for (phase, _, _), v in self.stats.moved.items() if phase == "decode")
        return moved / self.decode_tokens if self.decode_tokens else float("nan")

    def summary(self) -> dict:
        """One plain row: window, forwards, acceptance, moved per token, hit rate, predicted speeds."""
        d = self.stats.summary()["decode"]
        return {"window": self.window, "decode_tokens": self.decode_tokens,
                "verify_forwards": sum(s.phase == "decode" for s in self.steps), "proposed": self.proposed,
                "accepted": self.accepted, "acceptance": self.acceptance, "moved_per_token": self.moved_per_token,
                "hit_rate": d["hit_rate"], "stall_s": d["stall_s"], "ttft_s": self.ttft_s,
                "decode_s": self.decode_s, "decode_tok_s": self.decode_tok_s}


def simulate_speculative(trace: Trace, config: OffloadConfig, hardware: Hardware, shape: ModelShape, window: int,
                         matches: torch.Tensor | None = None, acceptance: float | None = None,
                         draft_token_s: float = 0.0, miss_curves=None) -> SpecSimResult:
    """Run `config` over the trace's assisted-generation forwards (`verify_steps`) on `hardware`."""
    router = check_trace(trace, config, shape)
    steps = verify_steps(trace, window, matches, acceptance)
    sim = Simulator(config, hardware, shape, router=router, miss_curves=miss_curves)
    gi = trace.gate_inputs.float() if router is not None else None  # (N, M, H)
    first_s, decode_s, decode_tokens = [], 0.0, 0
    for s in steps:
        draft = s.proposed * draft_token_s  # the draft proposes before the target verifies
        sim.advance(draft)
        dt = sim.forward(trace.experts[s.start:s.end], None if gi is None else gi[s.start:s.end], phase=s.phase)
        if s.phase == "prefill":
            first_s.append(dt + draft)
        else:
            decode_s += dt + draft
            decode_tokens += s.produced
    return SpecSimResult(sim.stats, window, steps, sum(first_s) / len(first_s) if first_s else float("nan"),
                         decode_s, decode_tokens, sum(s.proposed for s in steps), sum(s.accepted for s in steps))


def union_sizes(trace: Trace, max_tokens: int) -> list[float]:
    """Mean distinct experts per MoE layer needed by T consecutive decode tokens, for T = 0..max_tokens."""
    E = trace.num_experts
    sums, counts = [0.0] * (max_tokens + 1), [0] * (max_tokens + 1)
    for first, P, rows in prompt_rows(trace):
        dec = trace.experts[first + P:first + rows].long()  # (D, M, K)
        D, M, _ = dec.shape
        if D == 0:
            continue
        hot = torch.zeros(D, M, E).scatter_(2, dec, 1.0)  # (D, M, E) expert used by token d in layer m
        csum = torch.cat([torch.zeros(1, M, E), hot.cumsum(0)])  # (D+1, M, E)
        for T in range(1, min(max_tokens, D) + 1):
            win = csum[T:] - csum[:-T]  # (D-T+1, M, E) uses within each window of T tokens
            distinct = (win > 0).sum(-1).float()  # (D-T+1, M)
            sums[T] += distinct.sum().item()
            counts[T] += distinct.numel()
    out = [s / c if c else float("nan") for s, c in zip(sums, counts, strict=False)]
    out[0] = 0.0
    return out


def pick_window(union: list[float], shape: ModelShape, hardware: Hardware, acceptance: float, hit_rate: float,
                windows: range | list[int] = range(0, 9), draft_token_s: float = 0.0) -> tuple[int, list[dict]]:
    """(best window, one roofline row per window): step time = max(link, compute) + draft, tokens = 1 + E[accepted].

    `union[T]` is the mean distinct experts per layer of T tokens (`union_sizes`), `acceptance`
    the per-proposal probability p (`per_token_acceptance` turns a measured rate into it), and
    `hit_rate` the share of needed experts found resident (plain decode's).
    """
    if not 0 <= hit_rate <= 1 or not 0 <= acceptance <= 1:
        raise ValueError(f"hit_rate and acceptance must lie in [0, 1], got {hit_rate} and {acceptance}")
    hardware = hardware.for_model(shape.nbytes(None))
    comp, M, K = hardware.compute, shape.num_moe_layers, shape.top_k
    t_x = hardware.transfer_s(shape.nbytes(None))
    rows = []
    for w in windows:
        T = w + 1
        if T >= len(union) or union[T] != union[T]:  # NaN: the trace has no run of T decode tokens
            raise ValueError(f"window {w} needs union sizes up to {T} tokens; union_sizes gave {len(union) - 1}")
        U = union[T]
        link_s = M * U * (1 - hit_rate) * t_x
        compute_s = (shape.num_layers - M) * comp.dense(T) + M * (
            comp.dense(T) + comp.call(T) + U * comp.expert(max(1, round(T * K / U)), T) + comp.predict(T))
        draft_s = w * draft_token_s
        tokens = 1 + expected_accepted(acceptance, w)
        step_s = max(link_s, compute_s) + draft_s
        rows.append({"window": w, "union_per_layer": U, "link_ms": 1e3 * link_s, "compute_ms": 1e3 * compute_s,
                     "draft_ms": 1e3 * draft_s, "bound": "link" if link_s >= compute_s else "compute",
                     "tokens_per_step": tokens, "moved_per_token": M * U * (1 - hit_rate) / tokens,
                     "tok_s": tokens / step_s if step_s > 0 else float("inf")})
    best = max(rows, key=lambda r: r["tok_s"])["window"]
    return best, rows


def break_even_acceptance(roofline: list[dict], window: int) -> float:
    """Per-proposal acceptance p at which `window` matches window 0's roofline tok/s (NaN: not even at p = 1).

    `roofline` are `pick_window`'s rows (they must hold windows 0 and `window`); its step times do not
    depend on p, so the window breaks even when 1 + E[accepted](p) = step time(w) / step time(0).
    """
    rows = {r["window"]: r for r in roofline}
    if 0 not in rows or window not in rows:
        raise ValueError(f"the roofline rows must hold windows 0 and {window}; they hold {sorted(rows)}")
    need = rows[window]["tokens_per_step"] / rows[window]["tok_s"] * rows[0]["tok_s"]  # step(w) / step(0)
    if need > 1 + window:
        return float("nan")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 1 + expected_accepted(mid, window) < need else (lo, mid)
    return (lo + hi) / 2
