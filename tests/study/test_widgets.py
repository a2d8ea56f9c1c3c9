"""The table functions behind the notebook widgets, and the widgets wired to them, on a hand-built trace (no
browser)."""
import pytest
import torch

from fate_lab.model.trace import DECODE, PREFILL, Trace
from fate_lab.policy.rules import CountBudget, TopK
from fate_lab.study import tables, widgets


@pytest.fixture
def hand_trace():
    # E=4 experts, H=4, L=2 layers, k=1. Layer 1's router is 10 x identity, so the cross-layer
    # prediction for layer 1 is the argmax of the token's layer-0 gate input.
    gate = torch.zeros(4, 2, 4)
    for t, e in enumerate([0, 1, 2, 3]):
        gate[t, 0, e] = 1.0  # token t's layer-0 gate input points at expert t
    W = torch.stack([torch.eye(4), 10 * torch.eye(4)])  # (L, E, H)
    experts = torch.tensor([[[0], [0]], [[1], [2]], [[2], [2]], [[3], [3]]])  # token 1 is mispredicted
    return Trace(experts=experts, token_ids=torch.arange(4), phase=torch.tensor([PREFILL, DECODE, DECODE, DECODE]),
                 prompt_id=torch.zeros(4, dtype=torch.long), position=torch.arange(4), gate_inputs=gate,
                 router_weights=W, meta={"num_experts": 4, "scoring": "softmax"})


def test_prefetch_table_topk_recall_by_hand(hand_trace):
    df = tables.prefetch_table(hand_trace, TopK(1), phase="decode")
    # decode tokens 1, 2, 3 predict experts 1, 2, 3 for layer 1; truth 2, 2, 3 -> 2 of 3 right
    assert df["layer"].tolist() == [1]
    assert df["recall"].iloc[0] == pytest.approx(2 / 3)
    assert df["precision"].iloc[0] == pytest.approx(2 / 3)
    assert df["mean_set_size"].iloc[0] == pytest.approx(1.0)


def test_prefetch_table_budget_of_all_experts_has_full_recall(hand_trace):
    df = tables.prefetch_table(hand_trace, CountBudget(4), phase="decode")
    assert df["recall"].iloc[0] == 1.0 and df["precision"].iloc[0] == pytest.approx(1 / 4)


def test_unknown_choices_are_refused(hand_trace):
    with pytest.raises(ValueError, match="unknown rule"):
        widgets.make_rule(hand_trace, "magic")
    with pytest.raises(TypeError, match="SelectionRule"):
        tables.prefetch_table(hand_trace, "top-k")
    with pytest.raises(ValueError, match="calibration trace"):
        widgets.cache_table(hand_trace, 0, 2, "miss_curve")


def test_cache_table_one_slot_per_layer_by_hand(hand_trace):
    # 1 slot per layer, LRU, no prefetch. Layer 0 sees 0,1,2,3: all misses. Layer 1 sees
    # 0,2,2,3: misses, then a hit on the repeated 2, then a miss -> decode hits: layer 0 none,
    # layer 1 one of three.
    df = widgets.cache_table(hand_trace, 0, 2, "uniform", "lru", "none (cache only)")
    assert df["slots"].tolist() == [1, 1]
    assert df["hits"].tolist() == [0, 1]
    assert df.attrs["overall"]["hit_rate_decode"] == pytest.approx(1 / 6)


def test_cache_table_with_oracle_prefetch_hits_every_layer1_use(hand_trace):
    df = widgets.cache_table(hand_trace, 0, 2, "uniform", "lru", "oracle")
    assert df["hits"].tolist() == [0, 4]  # layer 0 cannot be prefetched; layer 1 always is


def test_cache_grid_shape_and_monotone_in_budget(hand_trace):
    grid = tables.cache_grid(hand_trace, [0, 1], [2, 4, 8], "lru", None, phase="all")
    assert grid.shape == (2, 3)
    assert (grid.diff(axis=1).iloc[:, 1:] >= 0).all().all()


def test_explorers_build_without_a_browser(hand_trace):
    box = widgets.prefetch_explorer(hand_trace)
    assert box.rendered["phase"] == "decode" and box.rendered["table"]["layer"].tolist() == [1]
    box = widgets.cache_explorer(hand_trace)
    assert box.rendered["table"]["slots"].sum() > 0


def test_every_slider_spans_the_notebook_and_keeps_its_label(hand_trace):
    import ipywidgets as W

    from fate_lab.study.widgets import layout

    for box in (widgets.prefetch_explorer(hand_trace), widgets.cache_explorer(hand_trace)):
        sliders = [w for w in box.children if isinstance(w, (W.IntSlider, W.FloatSlider))]
        assert sliders
        for s in sliders:  # the track takes the row, the label a fixed column wide enough for it
            assert s.layout.width == "98%" and s.style.description_width == layout.LABEL_WIDTH
            assert len(s.description) <= 32


def test_the_prefetch_explorer_names_both_meanings_of_prefill(hand_trace):
    box = widgets.prefetch_explorer(hand_trace)
    phase = next(w for w in box.children if type(w).__name__ == "ToggleButtons")
    assert [label for label, _ in phase.options] == ["decode", "prefill, per token", "prefill, prompt-wide union"]
    phase.value = "prefill union"
    assert box.rendered["phase"] == "prefill union"
    # the prompt-wide set of the one prefill token equals its own set: the union of one token
    per_token = tables.prefetch_table(hand_trace, box.rendered["rule"], "prefill")
    assert box.rendered["table"]["mean_set_size"].iloc[0] == pytest.approx(per_token["mean_set_size"].iloc[0])


# --- the prefetch explorer, driven in plain Python (ipywidgets objects work without a browser)

def _controls(box):
    """The explorer's rule dropdown, and the sliders and labels a reader sees (display not 'none')."""
    import ipywidgets as W

    row = box.children
    dropdown = next(w for w in row if isinstance(w, W.Dropdown))
    sliders = [w for w in row if isinstance(w, (W.IntSlider, W.FloatSlider)) and w.layout.display != "none"]
    labels = [w for w in row if isinstance(w, W.Label) and w.layout.display != "none"]
    return dropdown, sliders, labels


# label -> (slider class name, min, max, value, words the slider's label must hold) on the hand trace (E=4, k=1)
EXPECTED_SLIDERS = {
    "top-(k+α)": ("IntSlider", 0, 3, 1, "extra experts"),
    "percentile (paper: q=75)": ("FloatSlider", 50.0, 99.0, 75.0, "percentile q (%)"),
    "cumulative probability": ("FloatSlider", 0.5, 0.99, 0.9, "cumulative mass p"),
    "count budget": ("IntSlider", 1, 4, 4, "experts per layer n"),
}


@pytest.mark.parametrize("path", [
    ["cumulative probability", "count budget"],  # the reported TraitError: min 1 set above max 0.99
    ["cumulative probability", "percentile (paper: q=75)", "cumulative probability"],
    ["count budget", "cumulative probability", "top-k", "count budget", "top-(k+α)", "percentile (paper: q=75)"],
], ids=["cumulative-to-budget", "percentile-roundtrip", "every-rule"])
def test_explorer_switching_rules_sets_the_right_slider_and_draws_that_rule(hand_trace, path):
    box = widgets.prefetch_explorer(hand_trace)
    dropdown, _, _ = _controls(box)
    for label in path:
        dropdown.value = label  # raised TraitError (min > max) on the way, leaving the old rule drawn
        _, sliders, labels = _controls(box)
        if label == "top-k":
            assert sliders == [] and [w.value for w in labels] == ["k = 1 (the model's top-k)"]
            assert box.rendered["rule"] == widgets.make_rule(hand_trace, "top-k")
            continue
        kind, lo, hi, value, words = EXPECTED_SLIDERS[label]
        assert len(sliders) == 1, f"{label}: one slider shown, got {sliders}"
        s = sliders[0]
        assert (type(s).__name__, s.min, s.max, s.value) == (kind, lo, hi, value), label
        assert words in s.description
        assert box.rendered["rule"] == widgets.make_rule(hand_trace, label, value)
        assert box.rendered["title"].startswith(label.split(" (")[0])


def test_explorer_count_budget_is_an_int_slider_up_to_the_number_of_experts(hand_trace):
    box = widgets.prefetch_explorer(hand_trace)
    dropdown, _, _ = _controls(box)
    dropdown.value = "count budget"
    _, (s,), _ = _controls(box)
    assert type(s).__name__ == "IntSlider" and s.max == hand_trace.num_experts == 4
    s.value = 2
    assert box.rendered["rule"] == widgets.make_rule(hand_trace, "count budget", 2)
    assert "n = 2 experts" in box.rendered["title"]
    assert box.rendered["table"]["mean_set_size"].iloc[0] == pytest.approx(2.0)


def test_explorer_draws_once_per_change(hand_trace, monkeypatch):
    box = widgets.prefetch_explorer(hand_trace)
    dropdown, _, _ = _controls(box)
    calls = []
    real = tables.prefetch_table
    monkeypatch.setattr(tables, "prefetch_table", lambda *a, **kw: calls.append(a[1:]) or real(*a, **kw))
    dropdown.value = "cumulative probability"  # 50..99 -> 0.5..0.99 clamps the value on the way
    dropdown.value = "count budget"
    assert calls == [(widgets.make_rule(hand_trace, "cumulative probability", 0.9), "decode"),
                     (CountBudget(4), "decode")]


def test_set_bounds_moves_either_way_without_min_above_max():
    import ipywidgets as W

    s = W.FloatSlider(min=0.5, max=0.99, value=0.9)
    widgets.set_bounds(s, 50.0, 99.0, 1.0, 75.0)  # up past the old max
    assert (s.min, s.max, s.value) == (50.0, 99.0, 75.0)
    widgets.set_bounds(s, 0.5, 0.99, 0.01, 0.9)  # down below the old min
    assert (s.min, s.max, s.value) == (0.5, 0.99, 0.9)


def test_make_rule_refuses_a_fractional_count(hand_trace):
    assert widgets.make_rule(hand_trace, "count budget", 3.0) == widgets.make_rule(hand_trace, "count budget", 3)
    with pytest.raises(ValueError, match="whole number"):
        widgets.make_rule(hand_trace, "count budget", 2.5)


def _recorded(seed: int = 6):
    from helpers import prompt_ids

    from fate_lab.core.shape import ModelShape
    from fate_lab.hardware.setups import Hardware
    from fate_lab.model.adapters import adapt
    from fate_lab.model.record import record_trace
    from fate_lab.model.testing import tiny_model

    model = tiny_model("olmoe", seed=seed)
    prompts = [prompt_ids(model.config.vocab_size, n=10, seed=s)[0].tolist() for s in range(2)]
    trace = record_trace(model, None, prompts, decode_tokens=8, progress=False)
    shape = ModelShape.from_adapter(adapt(model))
    return trace, shape, Hardware.scaled("qwen15_moe_rtx3090_pcie3")


def test_host_table_and_explorer():
    trace, shape, hw = _recorded()
    slots = shape.num_moe_layers * shape.num_experts // 4
    df = tables.host_table(trace, shape, hw, slots)
    assert df.loc["fate", "speed vs fate"] == 1.0
    assert df.loc["all_host", "experts moved per token"] == 0.0  # nothing lives on the device
    slow = tables.host_table(trace, shape, hw, slots, speed=1 / 64)  # a host 64x slower: loading wins again
    assert slow.loc["all_host", "decode tok/s"] < df.loc["all_host", "decode tok/s"]
    assert slow.loc["fate", "decode tok/s"] == pytest.approx(df.loc["fate", "decode tok/s"])
    with pytest.raises(ValueError, match="host speed"):
        tables.host_table(trace, shape, hw, slots, speed=0)
    box = widgets.host_explorer(trace, shape, hw, slots)
    assert box.rendered["profile"] == "desktop_ddr4" and "speed vs fate" in box.rendered["table"]


def test_threshold_table_and_explorer():
    import pandas as pd

    trace, shape, hw = _recorded()
    slots = shape.num_moe_layers * shape.num_experts // 4
    none = tables.threshold_table(trace, shape, hw, slots, "drop", 0.0)  # nothing is below a share of 0
    assert none["simulated decode tok/s"].iloc[1] == pytest.approx(none["simulated decode tok/s"].iloc[0])
    every = tables.threshold_table(trace, shape, hw, slots, "drop", 1.0)  # every decode miss dropped
    assert every["experts moved per token"].iloc[1] < every["experts moved per token"].iloc[0]
    measured = pd.DataFrame({"policy": ["fate", "drop", "drop"], "threshold": [None, 0.1, 0.5],
                             "perplexity change": [0.0, 0.01, 0.2], "greedy agreement": [1.0, 0.95, 0.7],
                             "speed vs fate": [1.0, 1.1, 1.4]})
    t = tables.threshold_table(trace, shape, hw, slots, "drop", 0.5, measured)
    assert t["greedy agreement"].iloc[1] == 0.7 and t["measured speed vs fate"].iloc[1] == 1.4
    off = tables.threshold_table(trace, shape, hw, slots, "drop", 0.4, measured)  # not measured: no quality shown
    assert off["greedy agreement"].isna().iloc[1]
    with pytest.raises(ValueError, match="lossy rule"):
        tables.threshold_table(trace, shape, hw, slots, "skip", 0.1)
    box = widgets.threshold_explorer(trace, shape, hw, slots, measured)
    slider = next(w for w in box.children if type(w).__name__ == "SelectionSlider")
    assert list(slider.options) == [0.1, 0.5]  # only what was measured
    slider.value = 0.5
    assert box.rendered["threshold"] == 0.5
    pd.testing.assert_frame_equal(box.rendered["table"], tables.threshold_table(trace, shape, hw, slots, "drop", 0.5,
                                                                               measured))
    with pytest.raises(ValueError, match="no lossy rule with a measured threshold"):
        widgets.threshold_explorer(trace, shape, hw, slots, measured[measured["policy"] == "fate"])


def test_plan_explorer_draws_the_plan_a_direct_call_gives():
    from fate_lab.study import plan as P
    from fate_lab.study.widgets import deploy

    box = widgets.plan_explorer("tiny_moe", "rtx3090", 0.07, presets=("load_on_demand", "lru", "fate"))
    args = box.rendered["args"]
    direct = P.plan(**args)
    pd_equal = deploy.plan_rows(direct).equals(deploy.plan_rows(box.rendered["plan"]))
    assert pd_equal and box.rendered["plan"].best == direct.best
    model = box.children[0]
    model.value = "tiny_deepseek"  # the budget slider moves into this model's range, and the plan follows
    assert box.rendered["args"]["model"] == "tiny_deepseek"
    lo, hi = deploy.budget_range("tiny_deepseek", "rtx3090")
    assert lo <= box.children[3].value <= hi
