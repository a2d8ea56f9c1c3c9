"""The decomposition: a regime's speed-up over load-on-demand, split into what each component contributes.

What it is: `decompose(trace, shape, ...)` -> a DataFrame, one row per (regime, component), from the timed
simulator. A regime is (transfer/compute ratio r, share of experts cached, precision); r sets a link on which
one expert's transfer takes r decode-layer computes of the compute profile (the model's experts at full
precision; quantized experts keep the fp16 expert's clock, `core.driver.scaling_bytes`). Each component is one
step of Fate's own ladder, and its factor is the speed ratio of the step over the previous one, so the factors of
a regime multiply to its total speed-up (log-additive: a stacked or waterfall bar):

    load_on_demand -> cache (uniform LRU) -> allocation (Fate's shallow-favoring) -> replacement (ARC)
      -> prediction (`fate`: cross-layer gate, 75th percentile, link-sized x4, admitted on use)
      -> quantization (`fate_quant`, the INT4/INT2 regime) | host compute (`host_compute`, full precision)

Prediction is split four ways with simulator-only counterfactuals that read the trace ahead (never a
deployable predictor): `oracle` (the true experts of the next layer: perfect recall and precision, same
mechanics) and `filtered` (fate's predicted sets with the wrong experts taken out: fate's recall, perfect
precision). With S the decode speed and stall(x) a run's stall per decode token:

    ceiling   = S_free / S_replacement   where S_free = 1 / (1/S_oracle - stall(oracle)): all stall removed
    lateness  = S_oracle / S_free        what even a perfect predictor still waits for at this link
    recall    = S_filtered / S_oracle    the experts fate does not predict
    precision = S_fate / S_filtered      the link time and slots fate spends on experts never used

`decompose_runtime` measures the same ladder (without the counterfactuals: the runtime cannot read ahead) on
this machine's runtime and puts the simulator's prediction for the same points beside it.
`plot_decomposition(df, ...)` draws the stacked log2 bars; `by_regime(df)` is the short table (prediction's parts
in one factor, both precisions in one row). `versus_eap(trace, shape, ...)` simulates, in the same regimes, fate
against the EAP baselines docs/fate_vs_eap.md compares (token-level `activation_path`, MoE-Infinity's request
matrix `eap`, online and profiled, and `eap` with fate's INT4/INT2), and `eap_margins` sums up its ratios.
What it is not: a claim about other models -- the factors are the embedded models' routing on the compute
profile given.
"""
from __future__ import annotations

import dataclasses
import math

import pandas as pd
import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.core.driver import scaling_bytes
from fate_lab.core.shape import ModelShape
from fate_lab.extras import need
from fate_lab.hardware.compute import ComputeProfile
from fate_lab.hardware.links import LinkProfile
from fate_lab.hardware.profiles import COMPUTE_PROFILES
from fate_lab.hardware.setups import Hardware
from fate_lab.model.trace import Trace
from fate_lab.policy.predictors import Oracle, Predictor
from fate_lab.quant import QuantPolicy

RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0)
SHARES = (0.1, 0.25, 0.5)
PRECISIONS = ("fp", "int4/int2")
PREDICTION_PARTS = ("prediction: ceiling", "prediction: lateness", "prediction: recall", "prediction: precision")
COMPONENTS = ("cache", "allocation", "replacement") + PREDICTION_PARTS + ("quantization", "host compute")
PREVIOUS = {"cache": "load_on_demand", "allocation": "cache", "replacement": "allocation", "prediction": "replacement",
            "quantization": "prediction", "host compute": "prediction"}  # the step each ladder step is measured against


def ladder(shape: ModelShape) -> dict[str, OffloadConfig]:
    """The steps of the decomposition as configs (cache size set per regime)."""
    lru = OffloadConfig.preset("lru")
    shallow = lru.replace(name="lru+shallow", allocation="shallow")
    arc = shallow.replace(name="arc+shallow", replacement="arc")
    fate = OffloadConfig.preset("fate")
    return {"load_on_demand": OffloadConfig.preset("load_on_demand"), "cache": lru, "allocation": shallow,
            "replacement": arc, "prediction": fate, "quantization": OffloadConfig.preset("fate_quant"),
            "host compute": OffloadConfig.preset("host_compute")}


class Filtered(Predictor):
    """Another predictor's sets with the experts the next layer does not use taken out: its recall, no waste.

    Reads the trace ahead (the simulator only), with `predictors.Oracle`'s token cursor: it advances by the rows
    observed at the last layer."""

    def __init__(self, inner: Predictor, experts: torch.Tensor):
        self.inner, self.name = inner, f"filtered[{inner.name}]"
        self._truth = Oracle(experts)

    def reset(self) -> None:
        self.inner.reset()

    def set_phase(self, phase: str) -> None:
        self.inner.set_phase(phase)

    def scores(self, layer, gate_input, router):
        return self.inner.scores(layer, gate_input, router)

    def predict(self, layer, next_scores, cur_experts) -> list[int]:
        used = set(self._truth.predict(layer, None, cur_experts))
        return [e for e in self.inner.predict(layer, next_scores, cur_experts) if e in used]

    def observe(self, layer, experts) -> None:
        self.inner.observe(layer, experts)
        self._truth.observe(layer, experts)


def ratio_hardware(shape: ModelShape, compute: ComputeProfile, ratio: float, quant: str | None = None) -> Hardware:
    """A link on which one expert (as `scaling_bytes` counts it) takes `ratio` decode-layer computes of `compute`."""
    layer_s = compute.decode_layer_s(shape.top_k)
    nbytes = scaling_bytes(shape, None if quant is None else QuantPolicy.preset(quant))
    return Hardware(compute, LinkProfile(f"r={ratio:g}", nbytes / (ratio * layer_s), 0.0))


def _stall_per_token(stats) -> float:
    d = stats.total("decode")
    return d.stall_s / max(1, len(stats.forward_s["decode"]))


def regime_steps(trace: Trace, shape: ModelShape, hw: Hardware, hw_quant: Hardware, slots: int) -> dict:
    """Decode tok/s (and the prediction run's counters) of every ladder step and counterfactual in one regime."""
    from fate_lab.core.parts import build_predictor
    from fate_lab.sim.simulate import simulate

    steps = ladder(shape)
    out, stats = {}, {}
    for name, cfg in steps.items():
        st = simulate(trace, cfg.replace(slots=slots), hw_quant if cfg.quant else hw, shape)
        out[name], stats[name] = st.decode_tok_s, st
    fate = steps["prediction"].replace(slots=slots)
    for name, pred in (("oracle", Oracle(trace.experts)),
                       ("filtered", Filtered(build_predictor(fate, shape), trace.experts))):
        st = simulate(trace, fate, hw, shape, predictor=pred)
        out[name], stats[name] = st.decode_tok_s, st
    out["free"] = 1.0 / max(1e-12, 1.0 / out["oracle"] - _stall_per_token(stats["oracle"]))
    return {"speed": out, "stats": stats}


def factors(speed: dict, precision: str) -> dict[str, float]:
    """Each component's factor from a regime's speeds (module docstring); they multiply to the total."""
    f = {"cache": speed["cache"] / speed["load_on_demand"], "allocation": speed["allocation"] / speed["cache"],
         "replacement": speed["replacement"] / speed["allocation"],
         "prediction: ceiling": speed["free"] / speed["replacement"],
         "prediction: lateness": speed["oracle"] / speed["free"],
         "prediction: recall": speed["filtered"] / speed["oracle"],
         "prediction: precision": speed["prediction"] / speed["filtered"]}
    last = "quantization" if precision != "fp" else "host compute"
    f[last] = speed[last] / speed["prediction"]
    return f


def decompose(trace: Trace, shape: ModelShape, model: str = "", compute: ComputeProfile | None = None,
              ratios=RATIOS, shares=SHARES, precisions=PRECISIONS, progress: bool = True) -> pd.DataFrame:
    """One row per (regime, component): factor, log2 factor, and the regime's total speed-up over load-on-demand,
    with the prediction run's recall, precision, set size, late prefetches and stall per decode token."""
    from tqdm.auto import tqdm

    compute = compute or COMPUTE_PROFILES["qwen15_moe_rtx3090"]
    rows = []
    jobs = [(r, s) for r in ratios for s in shares]
    for r, share in tqdm(jobs, desc="decompose", unit="regime", disable=not progress):
        slots = int(shape.num_moe_layers * shape.num_experts * share)
        res = regime_steps(trace, shape, ratio_hardware(shape, compute, r), ratio_hardware(shape, compute, r, "fate"),
                           slots)
        sp, d = res["speed"], res["stats"]["prediction"].total("decode")
        n = max(1, len(res["stats"]["prediction"].forward_s["decode"]))
        for precision in precisions:
            f = factors(sp, precision)
            total = math.prod(f.values())
            for comp, x in f.items():
                rows.append({"model": model, "ratio": r, "cached": share, "precision": precision, "component": comp,
                             "factor": x, "log2 factor": math.log2(x), "total speed-up": total,
                             "load_on_demand tok/s": sp["load_on_demand"],
                             "final tok/s": sp["quantization" if precision != "fp" else "host compute"],
                             "oracle tok/s": sp["oracle"], "fate recall": d.recall, "fate precision": d.precision,
                             "fate set size": d.set_size, "fate late per token": d.late / n,
                             "fate stall ms/token": 1e3 * d.stall_s / n})
    return pd.DataFrame(rows)


def wide(df: pd.DataFrame) -> pd.DataFrame:
    """One row per regime, one column per component's factor, plus the total (the benchmark's table)."""
    keys = ["model", "precision", "cached", "ratio"]
    w = df.pivot_table(index=keys, columns="component", values="factor", aggfunc="first")
    w = w[[c for c in COMPONENTS if c in w.columns]]
    w["total speed-up"] = df.groupby(keys)["total speed-up"].first()
    return w.reset_index()


def by_regime(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, cached, ratio): the ladder's factors with prediction's four parts multiplied into one
    "prediction" factor, host compute (from the fp rows) and quantization (from the int4/int2 rows), and the total
    speed-up at each precision present ("total (fp)", "total (int4/int2)"); the factors before the last step are
    the same at both precisions, so cache x allocation x replacement x prediction x host compute = total (fp)."""
    keys = ["model", "cached", "ratio"]
    w = wide(df)
    w["prediction"] = w[[c for c in PREDICTION_PARTS if c in w.columns]].prod(axis=1)
    out = w.drop_duplicates(keys).set_index(keys)[["cache", "allocation", "replacement", "prediction"]]
    for precision, part in w.groupby("precision", sort=False):
        part = part.set_index(keys)
        last = "host compute" if precision == "fp" else "quantization"
        out[last], out[f"total ({precision})"] = part[last], part["total speed-up"]
    return out.reset_index()


def eap_configs(shape: ModelShape, calibration: Trace | None = None) -> dict[str, OffloadConfig]:
    """fate, fate_quant and the EAP baselines of docs/fate_vs_eap.md (cache size set per regime): `activation_path`
    (token-level, online), `eap` (request matrix, online), "eap (profiled)" (its collection the calibration
    trace's requests, when one is given) and `eap_quant` (`eap` with fate's INT4/INT2)."""
    from fate_lab.policy.predictors import activation_matrices

    eap = OffloadConfig.preset("eap")
    out = {"fate": OffloadConfig.preset("fate"), "fate_quant": OffloadConfig.preset("fate_quant"),
           "activation_path": OffloadConfig.preset("activation_path"), "eap": eap}
    if calibration is not None:
        seed = activation_matrices(calibration.experts, calibration.prompt_id, shape.num_experts).tolist()
        out["eap (profiled)"] = eap.replace(name="eap (profiled)", activation_collection=tuple(
            tuple(tuple(float(x) for x in row) for row in m) for m in seed))
    out["eap_quant"] = eap.replace(name="eap_quant", quant="fate")
    return out


def versus_eap(trace: Trace, shape: ModelShape, model: str = "", compute: ComputeProfile | None = None,
               ratios=RATIOS, shares=SHARES, calibration: Trace | None = None) -> pd.DataFrame:
    """One row per regime (ratio, cached): simulated decode tok/s of every `eap_configs` config on the regime's
    `ratio_hardware` (quantized configs on the quantized link), and "fate / best EAP" (fate over the fastest
    full-precision EAP baseline: the same precision), "fate_quant / eap" (fate's INT4/INT2 against a
    full-precision EAP, the reading under which the paper's 2.2x is reproduced) and "fate_quant / eap_quant" (the
    same quantization on both)."""
    from fate_lab.sim.simulate import simulate

    compute = compute or COMPUTE_PROFILES["qwen15_moe_rtx3090"]
    cfgs = eap_configs(shape, calibration)
    rows = []
    for r in ratios:
        hw, hwq = ratio_hardware(shape, compute, r), ratio_hardware(shape, compute, r, "fate")
        for share in shares:
            slots = int(shape.num_moe_layers * shape.num_experts * share)
            v = {n: simulate(trace, c.replace(slots=slots), hwq if c.quant else hw, shape).decode_tok_s
                 for n, c in cfgs.items()}
            best = max(x for n, x in v.items() if n not in ("fate", "fate_quant", "eap_quant"))
            rows.append({"model": model, "ratio": r, "cached": share, **{f"{n} tok/s": x for n, x in v.items()},
                         "fate / best EAP": v["fate"] / best, "fate_quant / eap": v["fate_quant"] / v["eap"],
                         "fate_quant / eap_quant": v["fate_quant"] / v["eap_quant"]})
    return pd.DataFrame(rows)


def eap_margins(vs: pd.DataFrame) -> pd.DataFrame:
    """`versus_eap`'s ratios summed up, one row per comparison: the smallest and largest over the regimes, where the
    largest is, and how many regimes; "fate_quant / eap" also over the slow-link, small-cache regimes alone (r >= 1,
    <= 25% cached: where docs/fate_vs_eap.md finds the paper's margin; NaN when the grid has none)."""
    slow = vs[(vs["ratio"] >= 1) & (vs["cached"] <= 0.25)]
    rows = []
    for label, col, part in (("fate / best EAP (same precision)", "fate / best EAP", vs),
                             ("fate_quant / eap (INT4/INT2 against full precision)", "fate_quant / eap", vs),
                             ("fate_quant / eap, r >= 1 and <= 25% cached", "fate_quant / eap", slow),
                             ("fate_quant / eap_quant (the same INT4/INT2 on both)", "fate_quant / eap_quant", vs)):
        at = part.loc[part[col].idxmax()] if len(part) else None
        rows.append({"comparison": label, "smallest": part[col].min() if len(part) else float("nan"),
                     "largest": part[col].max() if len(part) else float("nan"),
                     "largest at": "—" if at is None else f"r={at['ratio']:g}, {at['cached']:.0%} cached",
                     "regimes": len(part)})
    return pd.DataFrame(rows).set_index("comparison")


def plot_decomposition(df: pd.DataFrame, model: str | None = None, precision: str = "fp"):
    """Stacked log2 factors per regime (one panel per cache share, ratios along x), the total as a black dot."""
    plt = need("matplotlib.pyplot")

    sub = df[(df["precision"] == precision) & ((df["model"] == model) if model is not None else True)]
    shares = sorted(sub["cached"].unique())
    comps = [c for c in COMPONENTS if c in set(sub["component"])]
    colors = dict(zip(COMPONENTS, plt.get_cmap("tab10").colors, strict=False))
    fig, axes = plt.subplots(1, len(shares), figsize=(4.2 * len(shares), 4), sharey=True, squeeze=False)
    for ax, share in zip(axes[0], shares, strict=True):
        part = sub[sub["cached"] == share]
        ratios = sorted(part["ratio"].unique())
        x = range(len(ratios))
        up, down = [0.0] * len(ratios), [0.0] * len(ratios)
        for comp in comps:
            vals = [float(part[(part["ratio"] == r) & (part["component"] == comp)]["log2 factor"].sum())
                    for r in ratios]
            base = [u if v >= 0 else dn for v, u, dn in zip(vals, up, down, strict=True)]
            ax.bar(x, vals, bottom=base, color=colors[comp], label=comp, width=0.7)
            up = [u + max(v, 0) for u, v in zip(up, vals, strict=True)]
            down = [dn + min(v, 0) for dn, v in zip(down, vals, strict=True)]
        totals = [math.log2(float(part[part["ratio"] == r]["total speed-up"].iloc[0])) for r in ratios]
        ax.plot(list(x), totals, "ko", label="total")
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_xticks(list(x), [f"{r:g}" for r in ratios])
        ax.set_xlabel("transfer / compute ratio r")
        ax.set_title(f"{share:.0%} of experts cached")
    axes[0][0].set_ylabel("log2 speed-up over load-on-demand")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.suptitle(f"What each component contributes ({model or 'all models'}, {precision})")
    fig.tight_layout()
    return fig


def decompose_runtime(model, tokenizer, points, prompts: int = 2, new_tokens: int = 32, repeats: int = 3,
                      trace: Trace | None = None) -> pd.DataFrame:
    """The ladder measured in the runtime at `points` [(scaled link, share)] (median of `repeats`, torch on one
    thread), beside the simulator's prediction on this machine's calibrated compute profile."""
    import statistics

    from fate_lab.fit.calibrate import calibrate_compute
    from fate_lab.hardware.setups import run_hardware
    from fate_lab.model.adapters import adapt
    from fate_lab.model.corpus import heldout_prompts
    from fate_lab.model.record import record_trace
    from fate_lab.offloading.runtime import calibrate_layer_time, offload
    from fate_lab.sim.simulate import simulate

    torch.set_num_threads(1)
    shape = ModelShape.from_adapter(adapt(model))
    ids = [tokenizer(t)["input_ids"][:24] for t in heldout_prompts(prompts)]
    trace = trace or record_trace(model, tokenizer, ids, decode_tokens=new_tokens - 1, progress=False)
    layer_s = calibrate_layer_time(model, steps=24)
    rows = []
    for link, share in points:
        slots = int(shape.num_moe_layers * shape.num_experts * share)
        compute = {q: calibrate_compute(model, torch.tensor([ids[0]]), link=link, layer_compute_s=layer_s, quant=q)
                   for q in (None, "fate")}
        for step, cfg in ladder(shape).items():
            cfg = cfg.replace(slots=slots, link=link, layer_compute_s=layer_s)
            rates = []
            with offload(model, cfg) as rt:
                _run(model, ids[:1], 4)
                for _ in range(repeats):
                    rt.reset_stats()
                    _run(model, ids, new_tokens)
                    dec = rt.stats.forward_s["decode"]
                    rates.append(len(dec) / sum(dec))
            med = statistics.median(rates)
            hw = dataclasses.replace(run_hardware(link, layer_s), compute=compute[cfg.quant])
            sim = simulate(trace, cfg, hw, shape).decode_tok_s  # quantized: on the plain model's routing
            rows.append({"link": link, "cached": share, "step": step, "runtime tok/s": med,
                         "spread": (max(rates) - min(rates)) / med, "simulated tok/s": sim})
    df = pd.DataFrame(rows)
    for col in ("runtime tok/s", "simulated tok/s"):
        keys = list(zip(df["link"], df["cached"], df["step"], strict=True))
        speed = dict(zip(keys, df[col], strict=True))
        df[col.replace("tok/s", "factor")] = [speed[li, sh, st] / speed[li, sh, PREVIOUS[st]] if st in PREVIOUS
                                              else float("nan") for li, sh, st in keys]
    return df


@torch.no_grad()
def _run(model, prompts, new_tokens: int) -> None:
    """Prefill + greedy decode of each prompt (what the trace records)."""
    for p in prompts:
        out = model(input_ids=torch.tensor([p]), use_cache=True)
        for _ in range(new_tokens - 1):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=out.cache, use_cache=True)
