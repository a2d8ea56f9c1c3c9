"""Explorers of runs: a real offloaded decode (notebook 05), host compute and speculative windows (07), a lossy
rule's threshold (08).

What it is: `decode_explorer` (each setting decodes for real, the simulator's prediction of the same prompt,
budget and link beside it), `decode_config` (the config its sliders name), `host_explorer`, `window_explorer`
and `threshold_explorer` (which offers only the thresholds whose quality was measured). Every number comes from
`fate_lab.study.tables` or `speculative.window_table`; each returned box keeps what it drew last in
``box.rendered``.
What it is not: a place for tables or metrics.
"""
from __future__ import annotations

import pandas as pd

from fate_lab.core.config import OffloadConfig
from fate_lab.extras import need
from fate_lab.model.trace import Trace
from fate_lab.study import tables, whatif


def decode_config(num_layers: int, num_experts: int, share: float, boundary: int, link: str,
                  layer_s: float | None) -> OffloadConfig:
    """The `fate` preset with a cache of `share` of all experts and the first `boundary` layers favoured, over
    `link` on the run's clock `layer_s` (what the decode explorer's sliders name)."""
    if not 0 < share <= 1:
        raise ValueError(f"cache share {share!r}: give a fraction in (0, 1]")
    return OffloadConfig.preset("fate", slots=int(round(share * num_layers * num_experts)), shallow_layers=boundary,
                                link=link, layer_compute_s=layer_s)


def decode_explorer(model, input_ids, trace: Trace, hardware, shape, layer_s: float, link: str,
                    new_tokens: int = 16, share: float = 0.5):
    """Sliders for L and the cache share; each change decodes `input_ids` for real with the fate preset
    (`tables.measured_and_predicted`) and the timed simulator predicts the same run on `trace` (recorded from
    the same prompt), `hardware` (this machine, calibrated once) and `shape` beside it."""
    W = need("ipywidgets")
    from IPython.display import display

    from fate_lab.study import show
    from fate_lab.study.widgets import layout

    M, E = shape.num_moe_layers, shape.num_experts
    boundary = layout.slider("int", "L (shallow layers first)", value=min(3, M), min=0, max=M)
    share_s = layout.slider("float", f"cache share of {M * E} experts", value=share, min=0.1, max=1.0, step=0.05,
                            readout_format=".2f")
    status = layout.status("")
    out = W.Output()
    box = W.VBox([boundary, share_s, status, out], layout=W.Layout(width="100%"))
    box.rendered = {}

    def _draw(*_):
        cfg = decode_config(M, E, share_s.value, boundary.value, link, layer_s)
        status.value = f"running a real offloaded decode of {new_tokens} tokens ({cfg.slots} expert slots)…"
        boundary.disabled = share_s.disabled = True
        try:
            with out:
                out.clear_output(wait=True)
                df = tables.measured_and_predicted(model, input_ids, trace, cfg, hardware, shape, new_tokens)
                display(show.readable(df, caption=f"fate, L = {boundary.value}, {cfg.slots} of {M * E} expert slots; "
                                                  f"one prompt of {input_ids.shape[1]} tokens, {new_tokens} new "
                                                  f"tokens; {whatif.describe(hardware)}"))
                box.rendered = {"config": cfg, "table": df}
        finally:
            status.value = f"the link and the simulator use one calibration: one decode layer {layer_s * 1e3:.3g} ms"
            boundary.disabled = share_s.disabled = False

    boundary.observe(_draw, names="value")
    share_s.observe(_draw, names="value")
    _draw()
    return box


def host_explorer(trace: Trace, shape, hardware, slots: int):
    """Dropdown (host CPU profile) and slider (its speed, x) -> the simulator's table of `tables.host_table`.

    The returned box's ``rendered`` dict holds the last table drawn, so a test can read it without a browser.
    """
    W = need("ipywidgets")
    from IPython.display import display

    from fate_lab.hardware.hosts import HOST_PROFILES
    from fate_lab.study import show
    from fate_lab.study.widgets import layout

    profile = layout.dropdown("host CPU", sorted(HOST_PROFILES), "desktop_ddr4")
    speed = layout.slider("log", "host speed (x the profile)", value=1.0, base=2, min=-3, max=3, step=0.5,
                          readout_format=".3g")
    out = W.Output()
    box = W.VBox([profile, speed, out], layout=W.Layout(width="100%"))
    box.rendered = {}

    def _draw(*_):
        with out:
            out.clear_output(wait=True)
            df = tables.host_table(trace, shape, hardware, slots, profile.value, speed.value)
            box.rendered = {"profile": profile.value, "speed": speed.value, "table": df}
            display(show.readable(df, caption=f"{HOST_PROFILES[profile.value].describe()} x {speed.value:.3g}; "
                                              f"{slots} cache slots; simulated on {whatif.describe(hardware)}"))

    profile.observe(_draw, names="value")
    speed.observe(_draw, names="value")
    _draw()
    return box


def window_explorer(trace: Trace, config: OffloadConfig, hardware, shape, matches=None,
                    acceptance: float | None = None, draft_token_s: float = 0.0, max_window: int = 8):
    """Slider (speculative window) -> the simulator's plain vs assisted table for that window
    (`speculative.window_table`, from the draft's `matches` along `trace` or a fixed `acceptance`)."""
    W = need("ipywidgets")
    from IPython.display import display

    from fate_lab.study import show, speculative
    from fate_lab.study.widgets import layout

    window = layout.slider("int", "window (draft tokens per verify)", value=min(4, max_window), min=1,
                           max=max_window)
    out = W.Output()
    box = W.VBox([window, out], layout=W.Layout(width="100%"))
    box.rendered = {}

    def _draw(*_):
        with out:
            out.clear_output(wait=True)
            df = speculative.window_table(trace, config, hardware, shape, window.value, matches, acceptance,
                                          draft_token_s)
            box.rendered = {"window": window.value, "table": df}
            display(show.readable(df[["window", "acceptance", "verify_forwards", "moved_per_token", "moved_ratio",
                                      "hit_rate", "decode_tok_s", "tok_s_ratio"]].set_index("window"),
                                  caption=f"simulated, window 0 = plain decoding; {config.name}, {config.slots} "
                                          f"cache slots; {whatif.describe(hardware)}"))

    window.observe(_draw, names="value")
    _draw()
    return box


def measured_thresholds(measured: pd.DataFrame | None, kind: str) -> list[float]:
    """The thresholds of rule `kind` whose quality `measured` (a `quality.sweep_lossy` table) holds, sorted."""
    if measured is None or not (measured["policy"] == kind).any():
        return []
    return sorted(float(t) for t in measured.loc[measured["policy"] == kind, "threshold"].dropna().unique())


def threshold_explorer(trace: Trace, shape, hardware, slots: int, measured: pd.DataFrame):
    """Dropdown (lossy rule) and slider (threshold) -> `tables.threshold_table`. The slider offers only the
    thresholds whose quality was measured (`measured`, a `quality.sweep_lossy` table), so the speed shown always
    stands beside the quality of the same setting. ``rendered`` holds the last table."""
    W = need("ipywidgets")
    from IPython.display import display

    from fate_lab.study import show
    from fate_lab.study.quality import LOSSY_PRESET
    from fate_lab.study.widgets import layout

    kinds = [k for k in LOSSY_PRESET if k != "standin" and measured_thresholds(measured, k)]
    if not kinds:
        raise ValueError("no lossy rule with a measured threshold in `measured`: run quality.sweep_lossy first")
    kind = layout.dropdown("lossy rule", kinds, kinds[0])
    thr = layout.slider("select", "threshold (measured ones)", options=measured_thresholds(measured, kinds[0]))
    out = W.Output()
    box = W.VBox([kind, thr, out], layout=W.Layout(width="100%"))
    box.rendered = {}
    syncing = False

    def _draw(*_):
        if syncing:
            return
        with out:
            out.clear_output(wait=True)
            df = tables.threshold_table(trace, shape, hardware, slots, kind.value, float(thr.value), measured)
            box.rendered = {"kind": kind.value, "threshold": float(thr.value), "table": df}
            display(show.readable(df, caption=f"{kind.value} at threshold {thr.value:g}, {slots} cache slots; "
                                              f"simulated on {whatif.describe(hardware)}; "
                                              "quality measured in the runtime"))

    def _rule(*_):
        nonlocal syncing
        syncing = True
        try:
            thr.options = measured_thresholds(measured, kind.value)
            thr.value = thr.options[0]
        finally:
            syncing = False
        _draw()

    kind.observe(_rule, names="value")
    thr.observe(_draw, names="value")
    _draw()
    return box
