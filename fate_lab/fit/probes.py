"""Fitting the learned cross-layer probes: training data, the sklearn fits, thresholds, the comparison.

What this file is: the probes' training data (`train_prompts`, `training_trace`: a routing trace of
TRAINING-split text), the fit with scikit-learn (`fit_probes`: one-vs-rest logistic regression or a
one-hidden-layer MLP per layer), the thresholds tuned on a calibration trace so that recall equals the
75th-percentile rule's recall there (`tune_thresholds`), and `compare_with_percentile`, the comparison
against `Percentile(75)` on held-out text, host time included. The command line is
`python -m fate_lab fit-probes --model DIR` (`fate_lab/cli.py`).

Which probe (benchmarks/results/learned_predictor_2026-12-03.md, embedded tiny_moe, held-out text):
at the percentile rule's recall, and on the same 45k training tokens, one-vs-rest L2 logistic
regression (`hidden=0`: 224 exact Newton fits, one linear map) predicts ~0.65x (prefill) / ~0.51x
(decode) of the rule's set size; a one-hidden-layer ReLU MLP with logistic outputs (sklearn
`MLPClassifier`, one multi-label fit per layer, also 4x faster to fit) ~0.60x / ~0.47x at width 192;
more prefill text (the fit default, 291k tokens) brings the shipped probes to ~0.56x / ~0.49x.
Width 192 keeps the float16 file at 759 KiB (256: 1012 KiB for under a point of set size). A host call
costs about 1.5x the router product + percentile's (33 vs 22 us per layer in that file, measured beside
the test suite). The same threshold rule on the router's own softmax scores needs MORE experts than the
percentile rule: the gain is the probes', not the rule's.
What it is not: the probes as data and the predictor (`fate_lab/policy/probes.py`).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import replace

import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from fate_lab.model.trace import DECODE, PREFILL, Trace
from fate_lab.model.trace import cross_layer_scores as trace_cross_layer_scores
from fate_lab.policy.prediction_metrics import evaluate_rule
from fate_lab.policy.predictors import CrossLayerGate
from fate_lab.policy.probes import HIDDEN, MATCH_MODES, PHASE_NAMES, LearnedGate, ProbeSet, Threshold
from fate_lab.policy.rules import Percentile, next_layer_scores

_SATURATED_LOGIT = 30.0  # bias of a probe whose expert was never (or always) routed to in training

__all__ = ["HIDDEN", "MATCH_MODES", "compare_with_percentile", "fit_probes", "percentile_recall",
           "threshold_for_recall", "train_prompts", "training_trace", "tune_thresholds"]


def train_prompts(n: int, max_chars: int = 400, seed: int = 0) -> list[str]:
    """``n`` prompts cut from TRAINING-split documents (seeded; never a held-out document).

    Drawn like ``heldout_prompts`` draws the held-out ones: the corpus sources take turns, so each
    source's style is represented (the Bible is 26 long documents, the dictionaries thousands of
    short ones: a uniform draw over documents would all but miss it). Each prompt is a window of
    about ``max_chars`` from a random document of that source: its start, or, in a document longer
    than four windows, a random line start, cut back to a word boundary.
    """
    from fate_lab.model.corpus import load_corpus

    by_source: dict[str, list[str]] = {}
    for d in load_corpus(split="train"):
        by_source.setdefault(d["source"], []).append(d["text"])
    if n > 0 and not by_source:
        raise ValueError("the training split of the corpus is empty")
    rng = random.Random(seed)
    sources = sorted(by_source)
    prompts: list[str] = []
    seen: set[str] = set()
    for _ in range(100 * n):  # draws; a repeated window is drawn again
        if len(prompts) == n:
            break
        texts = by_source[sources[len(prompts) % len(sources)]]
        text = texts[rng.randrange(len(texts))]
        start = 0
        if len(text) > 4 * max_chars:
            start = text.find("\n", rng.randrange(len(text) - 2 * max_chars)) + 1  # 0 when no line start is left
        cut = text[start : start + max_chars].lstrip()
        cut = cut[: cut.rfind(" ")] if " " in cut else cut
        if cut and cut not in seen:
            seen.add(cut)
            prompts.append(cut)
    if len(prompts) < n:
        raise ValueError(f"could draw only {len(prompts)} distinct training prompts of the {n} asked for")
    return prompts


def training_trace(model, tokenizer, prompts: int = 320, decode_tokens: int = 48, prefill_prompts: int = 2560,
                   max_chars: int = 400, seed: int = 0, progress: bool = True) -> Trace:
    """The probes' training data: a routing trace of training-split text (``train_prompts``).

    ``prompts`` prompts are prefilled and greedily decoded for ``decode_tokens`` steps (the decode
    tokens a runtime sees); ``prefill_prompts`` further prompts (the next draws) are only prefilled:
    a forward of a whole prompt costs about what one decode step does, so they add prefill tokens
    cheaply. Gate inputs are kept in float16, as ``Trace.save`` stores them.
    """
    from fate_lab.model.record import record_trace

    texts = train_prompts(prompts + prefill_prompts, max_chars, seed)
    parts = [record_trace(model, tokenizer, t, decode_tokens=d, progress=progress)
             for t, d in ((texts[:prompts], decode_tokens), (texts[prompts:], 0)) if t]
    for t in parts:
        t.gate_inputs = t.gate_inputs.half()  # (N, L, H) half the memory; the cached traces are float16 too
    if len(parts) == 1:
        return parts[0]
    a, b = parts
    rows = {n: torch.cat([getattr(a, n), getattr(b, n)]) for n in
            ("experts", "token_ids", "phase", "position", "weights", "logits", "gate_inputs")}
    meta = dict(a.meta, prompts=a.meta["prompts"] + b.meta["prompts"],
                generated=a.meta["generated"] + b.meta["generated"], prefill_only_prompts=len(b.meta["prompts"]))
    return replace(a, **rows, prompt_id=torch.cat([a.prompt_id, b.prompt_id + prompts]), meta=meta)


def _targets(experts: Tensor, num_experts: int) -> Tensor:
    """``[N, L, k]`` ids -> ``[N, L-1, E]`` bool: the experts of layer l+1, the label of probe l."""
    nxt = experts[:, 1:].long()  # (N, L-1, k)
    return torch.zeros(*nxt.shape[:2], num_experts, dtype=torch.bool).scatter_(-1, nxt, True)


def _check_trace(trace: Trace, what: str) -> None:
    if trace.gate_inputs is None:
        raise ValueError(f"the {what} trace has no gate inputs (a routing-only trace?); record one with record_trace")
    if trace.num_layers < 2:
        raise ValueError(f"the {what} trace has {trace.num_layers} MoE layer(s); cross-layer probes need at least 2")


def fit_probes(trace: Trace, hidden: int = HIDDEN, alpha: float = 1e-2, C: float = 1.0, seed: int = 0,
               dtype: torch.dtype = torch.float32, progress: bool = True) -> ProbeSet:
    """Fit one probe per MoE layer l (x_l -> experts of l+1) on ``trace``; thresholds left to ``tune_thresholds``.

    ``hidden=0``: one-vs-rest L2 logistic regression (sklearn ``LogisticRegression``, Newton solver,
    inverse strength ``C``), one fit per expert. ``hidden>0``: one ReLU hidden layer of that width
    with logistic outputs, all experts at once (sklearn ``MLPClassifier``, L2 ``alpha``, Adam,
    early stopping on a seeded 10% split). Inputs are standardised; the scaling is folded into the
    first layer. ``dtype`` is the storage dtype of the result (float16 halves the file).
    """
    import numpy as np
    import sklearn

    _check_trace(trace, "training")
    if hidden < 0:
        raise ValueError(f"hidden must be >= 0 (0: linear probes), got {hidden}")
    N, L, H = trace.gate_inputs.shape
    E = trace.num_experts
    labels = _targets(trace.experts, E).numpy()  # (N, L-1, E)
    out = {"weight": [], "bias": [], "hidden_weight": [], "hidden_bias": []}
    bar = tqdm(total=(L - 1) * (E if hidden == 0 else 1), desc="fit probes", unit="fit", disable=not progress)
    for l in range(L - 1):
        x = trace.gate_inputs[:, l].double().numpy()  # (N, H)
        mu, sd = x.mean(0), x.std(0) + 1e-6
        z = (x - mu) / sd  # (N, H) standardised
        if hidden == 0:
            w, b = _fit_logistic(z, labels[:, l], C, bar)  # (E, H), (E,)
            w = w / sd  # fold the standardisation: w.z + b = (w/sd).x + (b - (w/sd).mu)
            out["weight"].append(torch.from_numpy(w))
            out["bias"].append(torch.from_numpy(b - w @ mu))
        else:
            w1, b1, w2, b2 = _fit_mlp(z.astype(np.float32), labels[:, l], hidden, alpha, seed)
            w1 = w1.astype(np.float64) / sd[:, None]  # (H, D) folded as above
            out["hidden_weight"].append(torch.from_numpy(w1.T))
            out["hidden_bias"].append(torch.from_numpy(b1 - mu @ w1))
            out["weight"].append(torch.from_numpy(w2.T.astype(np.float64)))
            out["bias"].append(torch.from_numpy(b2.astype(np.float64)))
            bar.update(1)
    bar.close()
    meta = {"probe": "logistic_regression_ovr" if hidden == 0 else "mlp_relu_logistic", "hidden": hidden,
            "alpha": alpha if hidden else None, "C": C if hidden == 0 else None, "seed": seed,
            "training_tokens": N, "training_prefill_tokens": int((trace.phase == PREFILL).sum()),
            "training_decode_tokens": int((trace.phase == DECODE).sum()), "sklearn": sklearn.__version__,
            "storage_dtype": str(dtype).removeprefix("torch.")}
    stacked = {k: torch.stack(v).to(dtype) for k, v in out.items() if v}
    return ProbeSet(**stacked, meta=meta)


def _fit_logistic(z, y, C: float, bar) -> tuple:
    """One-vs-rest logistic regression on standardised ``z [N, H]``, labels ``y [N, E]`` -> (w [E, H], b [E])."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression

    E = y.shape[1]
    w, b = np.zeros((E, z.shape[1])), np.zeros(E)
    for e in range(E):
        if y[:, e].all() or not y[:, e].any():  # never (or always) routed to in training: a constant probe
            b[e] = _SATURATED_LOGIT if y[:, e].all() else -_SATURATED_LOGIT
        else:
            clf = LogisticRegression(C=C, solver="newton-cholesky", max_iter=100).fit(z, y[:, e])
            w[e], b[e] = clf.coef_[0], clf.intercept_[0]
        bar.update(1)
    return w, b


def _fit_mlp(z, y, hidden: int, alpha: float, seed: int) -> tuple:
    """A one-hidden-layer multi-label MLP on ``z [N, H]``, ``y [N, E]`` -> (w1 [H, D], b1 [D], w2 [D, E], b2 [E])."""
    import numpy as np
    from sklearn.neural_network import MLPClassifier

    E = y.shape[1]
    always = y.all(0)  # sklearn's multi-label output needs both classes present per column
    never = ~y.any(0)
    clf = MLPClassifier(hidden_layer_sizes=(hidden,), activation="relu", alpha=alpha, batch_size=256,
                        max_iter=200, early_stopping=True, n_iter_no_change=5, random_state=seed)
    clf.fit(z, y.astype(np.int64))
    w1, b1 = clf.coefs_[0], clf.intercepts_[0]
    w2, b2 = clf.coefs_[1].copy(), clf.intercepts_[1].copy()
    if w2.shape[1] != E:
        raise RuntimeError(f"the MLP has {w2.shape[1]} outputs for {E} experts")
    w2[:, always | never] = 0.0
    b2[always] = _SATURATED_LOGIT
    b2[never] = -_SATURATED_LOGIT
    return w1, b1, w2, b2


# ----------------------------------------------------------------------------- thresholds at equal recall


def threshold_for_recall(scores: Tensor, true: Tensor, target: float) -> float:
    """The largest p with ``Threshold(p)``'s recall >= ``target`` on ``scores``/``true`` (both ``[..., E]``).

    Exact: a true expert is found at threshold p iff its score is >= p or it is the row's best (the
    fallback), so the recall at p counts the true experts' "reach" values >= p.
    """
    if scores.shape != true.shape or true.dtype != torch.bool:
        raise ValueError(f"scores and true must be [..., E] of one shape, true a bool mask; got "
                         f"{tuple(scores.shape)} and {tuple(true.shape)} {true.dtype}")
    s = scores.reshape(-1, scores.shape[-1]).float()  # (R, E)
    t = true.reshape(-1, true.shape[-1])  # (R, E)
    best = torch.zeros_like(t).scatter_(-1, s.argmax(-1, keepdim=True), True)  # (R, E) the fallback's pick
    reach = torch.where(best, torch.full_like(s, math.inf), s)[t]  # (hits,) highest p at which each is found
    total = int(t.sum())
    if total == 0:
        return 1.0
    need = max(1, math.ceil(target * total - 1e-9))
    if need > total:
        raise ValueError(f"target recall {target} is above 1")
    p = float(torch.sort(reach, descending=True).values[need - 1])
    return min(p, 1.0)  # inf: the fallback alone reaches it; p=1.0 selects at least as much


def percentile_recall(trace: Trace, q: float = 75.0) -> dict:
    """Recall of Fate's ``Percentile(q)`` on ``trace``: ``{phase: {"overall": r, "per_layer": [L-1]}}``."""
    res = evaluate_rule(trace_cross_layer_scores(trace), trace.experts, Percentile(q), trace.phase)
    return {ph: None if res[ph] is None or not res[ph]["tokens"] else
            {"overall": res[ph]["recall"], "per_layer": [r["recall"] for r in res[ph]["per_layer"]]}
            for ph in PHASE_NAMES}


def tune_thresholds(probes: ProbeSet, trace: Trace, q: float = 75.0, match: str = "overall") -> ProbeSet:
    """``probes`` with thresholds at which each phase's recall on ``trace`` equals ``Percentile(q)``'s there.

    ``match="overall"``: one threshold per phase for all layers, matched to the phase's overall
    recall (the set sizes go where the probes are least sure: the best size for that recall when
    the probabilities are calibrated). ``match="layer"``: one per layer, matched layer by layer.
    Recall on ``trace`` is then >= the target (the smallest sets that reach it). Use a trace the
    probes were not fitted on and that is not the one you evaluate on (e.g. the calib split).
    """
    _check_trace(trace, "tuning")
    if match not in MATCH_MODES:
        raise ValueError(f"match must be one of {MATCH_MODES}, not {match!r}")
    probes.check(trace.num_layers, trace.num_experts, trace.gate_inputs.shape[-1])
    scores = probes.trace_scores(trace.gate_inputs)  # (N, L-1, E)
    true = _targets(trace.experts, probes.num_experts)  # (N, L-1, E)
    targets = percentile_recall(trace, q)
    thr = torch.zeros(2, probes.num_layers - 1)
    for i, ph in enumerate(PHASE_NAMES):
        rows = trace.phase == (PREFILL if ph == "prefill" else DECODE)
        if targets[ph] is None:  # no tokens of this phase: borrow the other phase's thresholds below
            thr[i] = math.nan
            continue
        if match == "overall":
            thr[i] = threshold_for_recall(scores[rows], true[rows], targets[ph]["overall"])
        else:
            for l in range(probes.num_layers - 1):
                thr[i, l] = threshold_for_recall(scores[rows, l], true[rows, l], targets[ph]["per_layer"][l])
    if thr.isnan().all():
        raise ValueError("the tuning trace has no tokens")
    thr = torch.where(thr.isnan(), thr.flip(0), thr)
    meta = dict(probes.meta, tuning={"rule": f"Threshold matched to Percentile({q}) recall", "match": match,
                                     "tokens": trace.num_tokens, "target_recall": targets})
    return replace(probes, thresholds=thr, meta=meta)


# ----------------------------------------------------------------------------- comparison


def _host_us(fn, reps: int) -> float:
    """Microseconds per call of ``fn``: the best of 5 blocks of ``reps`` calls (robust to a busy CPU)."""
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def _row(phase: str, layer, pct: dict, shipped: dict, eq: dict) -> dict:
    return {"phase": phase, "layer": layer,
            "pct_recall": pct["recall"], "pct_precision": pct["precision"], "pct_set_size": pct["mean_set_size"],
            "probe_recall": shipped["recall"], "probe_precision": shipped["precision"],
            "probe_set_size": shipped["mean_set_size"],
            "eq_recall": eq["recall"], "eq_precision": eq["precision"], "eq_set_size": eq["mean_set_size"],
            "size_ratio": eq["mean_set_size"] / pct["mean_set_size"]}


def _evaluate_thresholds(scores: Tensor, experts: Tensor, thr: Tensor) -> list[dict]:
    """Metrics of per-layer thresholds ``thr [L-1]`` on one phase's rows, per layer."""
    return [evaluate_rule(scores[:, l : l + 1], experts[:, l : l + 2], Threshold(float(thr[l])))["all"]
            for l in range(scores.shape[1])]


def compare_with_percentile(probes: ProbeSet, eval_trace: Trace, q: float = 75.0, match: str | None = None,
                            reps: int = 2000) -> pd.DataFrame:
    """The probes against Fate's ``Percentile(q)`` on a held-out trace, per phase, per layer and overall.

    Columns: ``pct_*`` the percentile rule on the router product; ``probe_*`` the probes with their
    shipped thresholds (tuned on another trace); ``eq_*`` the probes at equal recall (thresholds
    matched on ``eval_trace`` itself, ``match`` as in ``tune_thresholds``; default: the shipped
    mode): a point on the probes' recall/size curve, not a deployable setting; ``size_ratio`` =
    eq_set_size / pct_set_size (the target: <= 0.6). Host time per layer on one decode token, in
    microseconds, scoring alone (``*_score_us``) and scoring + selection (``*_predict_us``): probe vs
    router product + percentile. Overall rows (layer "all") are means over (token, layer) pairs.
    """
    _check_trace(eval_trace, "evaluation")
    if eval_trace.router_weights is None:
        raise ValueError("the evaluation trace has no router weights; record it with record_trace")
    probes.check(eval_trace.num_layers, eval_trace.num_experts, eval_trace.gate_inputs.shape[-1])
    match = match or probes.meta.get("tuning", {}).get("match", "overall")
    if probes.thresholds is None:
        raise ValueError("these probes have no tuned thresholds; call tune_thresholds(probes, calib_trace) first")
    eq_probes = tune_thresholds(probes, eval_trace, q, match)
    pct_scores = trace_cross_layer_scores(eval_trace)  # (N, L-1, E)
    scores = probes.trace_scores(eval_trace.gate_inputs)  # (N, L-1, E)
    P = probes.num_layers - 1
    rw = eval_trace.router_weights.float()
    scoring = eval_trace.meta.get("scoring", "softmax")
    decode_rows = (eval_trace.phase == DECODE).nonzero().flatten()
    t1 = int(decode_rows[0]) if len(decode_rows) else 0  # one decode token
    x1 = eval_trace.gate_inputs[t1].float()  # (L, H)
    rows = []
    for i, ph in enumerate(PHASE_NAMES):
        sel = eval_trace.phase == (PREFILL if ph == "prefill" else DECODE)
        if not sel.any():
            continue
        ex = eval_trace.experts[sel]
        pct = evaluate_rule(pct_scores[sel], ex, Percentile(q))["all"]
        shipped = _evaluate_thresholds(scores[sel], ex, probes.thresholds[i])
        eq = _evaluate_thresholds(scores[sel], ex, eq_probes.thresholds[i])
        for l in range(P):
            rows.append(_row(ph, l + 1, pct["per_layer"][l], shipped[l], eq[l]))
        mean = lambda ms, key: sum(m[key] for m in ms) / P  # noqa: E731 same tokens in every layer
        keys = ("recall", "precision", "mean_set_size")
        rows.append(_row(ph, "all", {k: pct[k] for k in keys}, {k: mean(shipped, k) for k in keys},
                         {k: mean(eq, k) for k in keys}))
    table = pd.DataFrame(rows)
    learned, fate, timing = LearnedGate(probes), CrossLayerGate(Percentile(q)), {}
    learned.set_phase("decode")
    for l in range(P):  # what a driver pays per layer and decode token: scores, then predict (as policy/step.py)
        w, x, cur = rw[l + 1], x1[l : l + 1], eval_trace.experts[t1, l]  # (E, H), (1, H), (k,)
        timing[l + 1] = {
            "probe_score_us": _host_us(lambda l=l, x=x: learned.scores(l, x), reps),
            "gate_score_us": _host_us(lambda w=w, x=x: next_layer_scores(w, x, scoring), reps),
            "probe_predict_us": _host_us(lambda l=l, x=x, cur=cur: learned.predict(l, learned.scores(l, x)[0], cur),
                                        reps),
            "gate_predict_us": _host_us(
                lambda l=l, w=w, x=x, cur=cur: fate.predict(l, next_layer_scores(w, x, scoring)[0], cur), reps),
        }
    for col in ("probe_score_us", "gate_score_us", "probe_predict_us", "gate_predict_us"):
        per_layer = {l: t[col] for l, t in timing.items()}
        table[col] = [per_layer[r] if r != "all" else sum(per_layer.values()) / P for r in table["layer"]]
    return table
