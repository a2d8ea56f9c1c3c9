"""Seaborn figures of the suite, each one call from a notebook; every axis is labelled with units.

What it is: plotting of numbers that other modules computed (tables, traces, replay results).
What it is not: a place that computes metrics; a figure never derives a number of its own.
"""
from __future__ import annotations

import pandas as pd
import torch

from fate_lab.extras import need

plt = need("matplotlib.pyplot")
sns = need("seaborn")
sns.set_theme(context="notebook", style="whitegrid")

# Legend text for the column names the analysis tables use (anything else: underscores become spaces)
LABELS = {"cosine": "same token, adjacent layers", "cosine_other_token": "different tokens (baseline)",
          "hit_rate": "hit rate", "hit_rate_prefill": "prefill", "hit_rate_decode": "decode",
          "recall": "recall", "precision": "precision", "mean_set_size": "mean set size"}


def pretty(name: str) -> str:
    """A reader's label for a column or category name."""
    return LABELS.get(name, str(name).replace("_", " "))


def _pretty_legend(ax) -> None:
    """The legend with readers' labels, moved outside the axes (right of them) so that it covers no data."""
    leg = ax.get_legend()
    if leg is not None:
        title = leg.get_title().get_text() if leg.get_title() is not None else ""
        handles, labels = ax.get_legend_handles_labels()
        legend_outside(ax, handles, [pretty(t) for t in labels], pretty(title) if title else None)


def legend_outside(ax, handles=None, labels=None, title: str | None = None) -> None:
    """A legend right of the axes, outside the data."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, title=title, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                  title_fontsize=8, frameon=False)


def memory_bars(breakdown: pd.DataFrame):
    """Side-by-side bars of dense vs routed-expert bytes per model (GiB, log scale: the models span
    four orders of magnitude, and stacked segments on a log axis would have meaningless lengths)."""
    df = breakdown[["dense_bytes", "expert_bytes"]] / 2**30
    ax = df.plot.barh(stacked=False, figsize=(8, 0.8 * len(df) + 1.5), logx=True,
                      color=sns.color_palette("deep")[:2])
    ax.set_xlabel("weight memory (GiB, log scale)")
    ax.set_ylabel("")
    legend_outside(ax, ax.get_legend_handles_labels()[0], ["dense (always on device)", "routed experts (offloadable)"])
    ax.set_title("Where an MoE model's bytes are")
    plt.tight_layout()
    return ax


def routing_raster(experts: torch.Tensor, num_experts: int, layers: list[int], title: str = ""):
    """Which experts each token used (dots), token by token, for a few layers."""
    fig, axes = plt.subplots(1, len(layers), figsize=(4.5 * len(layers), 3.6), squeeze=False)
    for ax, l in zip(axes[0], layers, strict=True):
        T, k = experts.shape[0], experts.shape[2]
        ax.scatter(torch.arange(T).repeat_interleave(k), experts[:, l].flatten(), s=6, marker="s")
        ax.set_xlabel("decode step (token)")
        ax.set_ylabel("expert id")
        ax.set_ylim(-0.5, num_experts - 0.5)
        ax.set_title(f"MoE layer {l}")
    fig.suptitle(title or "Routed experts per token")
    fig.tight_layout()
    return fig


def per_layer_lines(df: pd.DataFrame, y: str, hue: str | None = None, ylabel: str = "", title: str = "",
                    x: str = "layer", ylim: tuple | None = None):
    """A metric per layer, one line per ``hue`` value."""
    fig, ax = plt.subplots(figsize=(8, 3.8))
    sns.lineplot(data=df, x=x, y=y, hue=hue, marker="o", ax=ax)
    ax.set_xlabel("MoE layer" if x == "layer" else x)
    ax.set_ylabel(ylabel or pretty(y))
    if ylim:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    _pretty_legend(ax)
    fig.tight_layout()
    return fig


def heatmap(matrix, xlabel: str, ylabel: str, title: str, cbar: str, fmt: str = ".2f", annot: bool = True,
            xticklabels="auto", yticklabels="auto", cmap: str = "viridis", vmin=None, vmax=None):
    """A labelled heatmap (matrix: 2-D tensor, array or DataFrame)."""
    data = matrix.numpy() if isinstance(matrix, torch.Tensor) else matrix
    fig, ax = plt.subplots(figsize=(7, 5.5))
    sns.heatmap(data, annot=annot, fmt=fmt, cmap=cmap, ax=ax, cbar_kws={"label": cbar}, vmin=vmin, vmax=vmax,
                xticklabels=xticklabels, yticklabels=yticklabels, annot_kws={"size": 7})
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def grouped_bars(df: pd.DataFrame, x: str, y: str, hue: str, ylabel: str, title: str, ylim: tuple | None = None):
    """Bars of ``y`` per ``x``, grouped by ``hue``."""
    fig, ax = plt.subplots(figsize=(9, 3.8))
    sns.barplot(data=df, x=x, y=y, hue=hue, ax=ax)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("MoE layer" if x == "layer" else pretty(x))
    if ylim:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    _pretty_legend(ax)
    fig.tight_layout()
    return fig


def timeline(events: pd.DataFrame, title: str = "Compute vs transfers"):
    """A Gantt chart of runtime events: columns kind, lane, t_start, t_end (seconds)."""
    lanes = list(dict.fromkeys(events["lane"]))
    colors = dict(zip(sorted(events["kind"].unique()), sns.color_palette("deep"), strict=False))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(lanes) + 2.5))
    for _, ev in events.iterrows():
        ax.barh(lanes.index(ev["lane"]), (ev["t_end"] - ev["t_start"]) * 1e3, left=ev["t_start"] * 1e3,
                color=colors[ev["kind"]], edgecolor="none", height=0.7)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("time (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    legend_outside(ax, handles, list(colors), "event")
    ax.set_title(title, loc="left", wrap=True)
    fig.tight_layout()
    return fig


def speedup_vs_ratio(curve: pd.DataFrame, points: pd.DataFrame, over: str = "lru", of: str = "fate"):
    """`of`'s decode speed-up over `over` against the link's transfer/compute ratio: the simulator's
    curve (`whatif.ratio_curve`) and the runtime's measured points (columns ratio, config, decode tok/s)."""
    def speedup(df: pd.DataFrame) -> pd.DataFrame:
        wide = df.pivot_table(index="ratio", columns="config", values="decode tok/s")
        return (wide[of] / wide[over]).rename("speedup").reset_index()

    fig, ax = plt.subplots(figsize=(6.5, 4))
    sim = speedup(curve)
    ax.plot(sim["ratio"], sim["speedup"], marker="o", label="simulator (this CPU's profile)")
    run = speedup(points)
    ax.scatter(run["ratio"], run["speedup"], s=80, color="black", zorder=3, label="runtime (measured)")
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("one expert's transfer time / one layer's compute time (log scale)")
    ax.set_ylabel(f"decode speed-up of {of} over {over}")
    ax.set_title(f"Where prediction pays: {of} vs {over} over link speeds")
    legend_outside(ax)
    fig.tight_layout()
    return ax


def quality_speed(df: pd.DataFrame, x: str = "decode tok/s", y: str = "perplexity change",
                  size: str = "MiB / decode token", label: str = "preset"):
    """Quality against speed, one point per preset, its area the bytes it moves per decode token."""
    if label not in df.columns:  # the label is the table's index
        df = df.rename_axis(label).reset_index()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    area = 600 * df[size] / max(float(df[size].max()), 1e-12) + 30
    ax.scatter(df[x], 100 * df[y], s=area, alpha=0.6, color=sns.color_palette("deep")[0], edgecolor="black")
    for _, r in df.iterrows():
        ax.annotate(f"{r[label]}\n{r[size]:.2f} MiB/token", (r[x], 100 * r[y]), textcoords="offset points",
                    xytext=(8, 6), fontsize=8)
    ax.axhline(0.0, color="grey", lw=1, ls="--")
    ax.set_xlabel(pretty(x))
    ax.set_ylabel("perplexity change vs full precision (%)")
    ax.set_title("Quality, speed and bytes moved (area: MiB per decode token)")
    ax.margins(x=0.25, y=0.3)
    fig.tight_layout()
    return ax


def pareto(df: pd.DataFrame, x: str = "decode tok/s", y: str = "perplexity change"):
    """Quality against speed: one line per lossy rule as its threshold moves, the baselines as points
    (a `quality.sweep_lossy` table: columns policy, threshold, x, y)."""
    fig, ax = plt.subplots(figsize=(7, 4.4))
    colors = iter(sns.color_palette("deep"))
    for policy, g in df.groupby("policy", sort=False):
        c = next(colors)
        if g["threshold"].notna().any():
            g = g.sort_values("threshold")
            ax.plot(g[x], 100 * g[y], marker="o", color=c, label=f"{policy} (threshold {g['threshold'].min():g}"
                    f"-{g['threshold'].max():g})")
            for _, r in g.iterrows():
                ax.annotate(f"{r['threshold']:g}", (r[x], 100 * r[y]), textcoords="offset points", xytext=(4, 4),
                            fontsize=7, color=c)
        else:
            ax.scatter(g[x], 100 * g[y], s=90, marker="D", color=c, edgecolor="black", label=pretty(str(policy)),
                       zorder=3)
    ax.axhline(0.0, color="grey", lw=1, ls="--")
    ax.set_xlabel(pretty(x))
    ax.set_ylabel("perplexity change vs the plain model (%)")
    ax.set_title("Quality for speed: lower right is better")
    legend_outside(ax)
    fig.tight_layout()
    return ax


def measured_vs_simulated(df: pd.DataFrame, measured: str = "decode tok/s", simulated: str = "simulated tok/s"):
    """One bar pair per config: decode tok/s measured in the runtime and predicted by the simulator."""
    long = df[[measured, simulated]].rename(columns={measured: "runtime (measured)",
                                                     simulated: "simulator (predicted)"})
    long = long.rename_axis("config").reset_index().melt(id_vars="config", var_name="source", value_name="tok/s")
    fig, ax = plt.subplots(figsize=(8, 3.8))
    sns.barplot(long, x="config", y="tok/s", hue="source", ax=ax)
    ax.set_ylabel("decode tokens/s")
    ax.set_xlabel("")
    ax.set_title("Every idea side by side: measured and predicted")
    ax.tick_params(axis="x", rotation=25)
    _pretty_legend(ax)
    fig.tight_layout()
    return ax


def memory_plan(memory: pd.DataFrame, budget_gib: float, title: str = ""):
    """One stacked bar per preset of where the budget goes (GiB): dense weights, KV cache, buffers, cached experts
    (`plan.DeploymentPlan.memory` rows), with the budget as a line."""
    parts = ["dense (GiB)", "KV cache (GiB)", "buffers (GiB)", "experts cached (GiB)"]
    df = memory.set_index("config")[parts]
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(df) + 1.6))
    left = pd.Series(0.0, index=df.index)
    for part, color in zip(parts, sns.color_palette("deep"), strict=False):
        ax.barh(df.index, df[part], left=left, color=color, label=part.replace(" (GiB)", ""))
        left += df[part]
    ax.axvline(budget_gib, color="black", ls="--", lw=1, label=f"budget {budget_gib:.3g} GiB")
    ax.invert_yaxis()
    ax.set_xlabel("device memory (GiB)")
    ax.set_title(title or "Where the budget goes, per preset", loc="left")
    legend_outside(ax)
    fig.tight_layout()
    return fig


def preset_speed(rows: pd.DataFrame, title: str = ""):
    """Predicted decode tok/s and TTFT per preset, side by side (`plan.DeploymentPlan.rows`)."""
    df = rows.set_index("config")
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 0.42 * len(df) + 1.8), sharey=True)
    colors = [sns.color_palette("deep")[0 if dep else 2] for dep in df.get("depends on routing", [True] * len(df))]
    axes[0].barh(df.index, df["decode tok/s"], color=colors)
    axes[0].set_xlabel("decode tokens/s (predicted)")
    axes[1].barh(df.index, df["TTFT (ms)"], color=colors)
    axes[1].set_xlabel("time to first token (ms, predicted)")
    axes[0].invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=sns.color_palette("deep")[i]) for i in (0, 2)]
    legend_outside(axes[1], handles, ["depends on routing", "bytes and FLOPs only"])
    fig.suptitle(title or "Predicted speed per preset", x=0.01, ha="left")
    fig.tight_layout()
    return fig


def n_cpu_moe_sweep(sweep: pd.DataFrame, title: str = "", mark: int | None = None):
    """Decode tok/s against llama.cpp's --n-cpu-moe, one line per weight format (`fit.n_cpu_moe_sweep` rows; a
    placement that does not fit has no point); `mark`: a dashed line at one N."""
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    sns.lineplot(data=sweep.dropna(subset=["decode tok/s"]), x="--n-cpu-moe", y="decode tok/s", hue="format",
                 marker="o", ax=ax)
    if mark is not None:
        ax.axvline(mark, color="0.4", linestyle="--", linewidth=1)
    ax.set_xlabel("--n-cpu-moe (routed experts of the first N layers on the CPU)")
    ax.set_ylabel("decode tokens/s (predicted)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "Decode speed against --n-cpu-moe", loc="left")
    legend_outside(ax, title="weights")
    fig.tight_layout()
    return fig


def budget_sweep(sweep: pd.DataFrame, title: str = ""):
    """Decode tok/s against the memory budget, one line per preset (`plan.budget_sweep` rows)."""
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    sns.lineplot(data=sweep, x="budget (GiB)", y="decode tok/s", hue="config", marker="o", ax=ax)
    ax.set_xlabel("device memory budget (GiB)")
    ax.set_ylabel("decode tokens/s (predicted)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "Decode speed against the budget", loc="left")
    legend_outside(ax, title="preset")
    fig.tight_layout()
    return fig
