"""Verdicts computed from data (study/verdict.py): each builder on hand examples, both sides of its line."""
import math

import pytest

from fate_lab.study import verdict as v


def test_close_agrees_inside_the_tolerance_and_disagrees_outside_with_the_gap():
    ok = v.close("cosine", 0.8883, 0.8706, 0.05, reference="88.83%")
    assert (ok.verdict, ok.reason, ok.ours) == ("agrees", "within ±5 points of 88.83%", "87.1%")
    bad = v.close("hit rate", 0.9908, 0.598, 0.05, reference="99.08%")
    assert bad.verdict == "disagrees" and bad.reason == "39.3 points below 99.08%, outside ±5 points"
    high = v.close("cosine", 0.8883, 0.957, 0.05, reference="88.83%")
    assert high.reason.startswith("6.9 points above")
    x = v.close("sim / runtime", 1.0, 0.245, 0.10, unit="x", source="target", detail="all_resident")
    assert (x.verdict, x.ours, x.reason) == ("disagrees", "0.245x (all_resident)", "76% below 1.00x, outside ±10%")


def test_close_without_a_number_is_not_comparable():
    c = v.close("recall", 0.97, float("nan"), 0.05)
    assert c.verdict == "not comparable" and c.reason == "no number measured" and c.ours == "—"


def test_beats_uses_the_spread_and_the_margin():
    assert v.beats("speed-up", 1.5, 1.0, "up to 4.1x", spread=0.1).verdict == "agrees"
    assert v.beats("speed-up", 0.9, 1.0, "2.2x", spread=0.05).verdict == "disagrees"
    tight = v.beats("speed-up", 0.963, 1.0, "2.2x", spread=0.06)  # 0.963 +- 6% reaches 1.0: cannot tell
    assert tight.verdict == "not comparable" and "too close to tell" in tight.reason
    assert v.beats("entropy", 0.758, 0.757, "shallow flatter", unit="", margin=0.02).verdict == "not comparable"
    assert v.beats("entropy", 0.80, 0.757, "shallow flatter", unit="", margin=0.02).verdict == "agrees"
    below = v.beats("top-1, first vs last", 0.414, 0.230, "first below last", unit="", above=False)
    assert below.verdict == "disagrees" and below.reason == "0.414 is not below 0.230"
    paired = v.beats("speed-up", (2.25, 0.07), 1.0, "up to 4.1x", magnitude=4.1)  # a (value, spread) pair
    assert paired.spread == 0.07 and paired.ours == "2.25x ±7%" and "the paper's 4.10x is not reached" in paired.reason


def test_at_least_widens_its_tolerance_by_the_spread():
    assert v.at_least("resident vs plain", 0.95, 1.0, 0.0).verdict == "disagrees"
    assert v.at_least("resident vs plain", (0.95, 0.1), 1.0).verdict == "agrees"  # 5% below, spread 10%
    assert v.at_least("resident vs plain", 1.3, 1.0).reason == "1.30x is at least 1.00x"
    paired = v.at_least("resident vs plain", (0.97, 0.02), 1.0)  # 3% below, spread 2%: below the band
    assert paired.verdict == "disagrees" and paired.ours == "0.970x ±2%" and paired.spread == 0.02


def test_a_claim_close_to_its_tolerance_edge_is_too_close_to_tell_within_the_measured_spread():
    """The simulator/runtime rows: 1.11x against a +-10% target disagrees when measured exactly, and cannot be
    told when the measured rate itself spreads by 3%."""
    assert v.close("sim / runtime", 1.0, 1.11, 0.10, unit="x").verdict == "disagrees"
    assert v.close("sim / runtime", 1.0, 1.11, 0.10, unit="x", uncertainty=1.11 * 0.03).verdict == "not comparable"
    assert v.close("sim / runtime", 1.0, 1.25, 0.10, unit="x", uncertainty=1.25 * 0.03).verdict == "disagrees"
    assert v.close("sim / runtime", 1.0, 1.02, 0.10, unit="x", uncertainty=1.02 * 0.03).verdict == "agrees"


def test_holds_and_not_comparable():
    assert v.holds("same text", True, "True").verdict == "agrees"
    assert v.holds("same text", False, "False", reason="2 presets differ").why == "2 presets differ"
    with pytest.raises(TypeError, match="bool"):
        v.holds("same text", 1, "1")
    with pytest.raises(ValueError, match="say why"):
        v.not_comparable("x", "a figure", "0.5", "")


def test_hidden_structure_names_the_pair_a_mean_hides():
    pairs = {"layers 0→1": 0.343, "layers 1→2": 0.935, "layers 2→3": 0.942, "layers 3→4": 0.970}
    assert v.outliers(pairs, 0.1) == {"layers 0→1": 0.343}
    assert v.hidden_structure(pairs, 0.1) == "the mean hides layers 0→1 at 34.3% (the others 93.5%–97.0%)"
    assert v.hidden_structure({k: 0.95 for k in pairs}, 0.1) == ""
    assert v.outliers({"a": 0.1, "b": 0.9}, 0.1) == {}  # too few values to call one an outlier
    claim = v.close("cosine", 0.8883, 0.7975, 0.05, structure=v.hidden_structure(pairs, 0.1))
    assert claim.why.endswith("; the mean hides layers 0→1 at 34.3% (the others 93.5%–97.0%)")


def test_claims_round_trip_as_data_and_refuse_unknown_fields():
    c = v.beats("speed-up", (2.25, 0.07), 1.0, "up to 4.1x", magnitude=4.1)
    assert v.Claim.from_dict(c.as_dict()) == c
    with pytest.raises(ValueError, match="not fields"):
        v.Claim.from_dict({**c.as_dict(), "verdict_words": "agrees"})
    with pytest.raises(ValueError, match="verdict"):
        v.Claim("q", "r", "o", "fine", "why", "close")


@pytest.mark.parametrize("x, text", [(12345, "12,300"), (0.001234, "0.00123"), (99.08, "99.1"), (1.5, "1.50"),
                                     (5265.2, "5,270"), (0, "0"), (8e-13, "8.00e-13"), (float("nan"), "—"),
                                     (-0.5, "-0.500"), (float("inf"), "∞"), (-float("inf"), "−∞")])
def test_three_significant_digits(x, text):
    assert v.sig(x) == text


def test_fmt_by_unit():
    assert (v.fmt(0.5, "%"), v.fmt(2.0, "x"), v.fmt(18.4, "pts"), v.fmt(None), v.fmt(math.nan, "%")) == \
        ("50.0%", "2.00x", "+18.4 points", "—", "—")


def test_close_with_a_sampling_error_cannot_tell_at_the_tolerance_edge():
    # FAST's replay: 768 decode uses at 97.0%, two standard errors 1.23 points; 99.08% +- 2 points
    u = v.rate_uncertainty(0.970, 768)
    assert u == pytest.approx(2 * math.sqrt(0.97 * 0.03 / 768))
    edge = v.close("hit rate", 0.9908, 0.970, 0.02, uncertainty=u)
    assert edge.verdict == v.NOT_COMPARABLE and "too close to tell" in edge.why
    assert v.close("hit rate", 0.9908, 0.970, 0.02).verdict == v.DISAGREES  # without it: a 0.08-point miss
    # 49,152 uses (the full-size trace) at 97.26%: the edge is outside the error band
    assert v.close("hit rate", 0.9908, 0.9726, 0.02, uncertainty=v.rate_uncertainty(0.9726, 49152)).verdict == v.AGREES
    assert v.close("hit rate", 0.9908, 0.60, 0.02, uncertainty=0.05).verdict == v.DISAGREES  # far: still decided
    with pytest.raises(ValueError, match="n=0"):
        v.rate_uncertainty(0.5, 0)
    with pytest.raises(ValueError, match="rate=1.5"):
        v.rate_uncertainty(1.5, 10)


def test_mean_uncertainty_is_two_standard_errors_of_the_mean():
    import statistics

    xs = [0.91, 0.95, 0.97, 0.88, 0.93, 0.96]
    assert v.mean_uncertainty(xs) == pytest.approx(2 * statistics.stdev(xs) / math.sqrt(len(xs)))
    assert v.mean_uncertainty([1.0, 3.0]) == pytest.approx(2.0)  # hand: sd sqrt(2), / sqrt(2), x 2
    assert v.mean_uncertainty([0.5] * 10) == 0.0
    with pytest.raises(ValueError, match="at least 2"):
        v.mean_uncertainty([0.5])
    with pytest.raises(ValueError, match="finite"):
        v.mean_uncertainty([0.5, float("nan")])
    # two prompts whose tokens agree within a prompt but not across: the prompt means carry the error
    ys, prompts = [0.90, 0.90, 0.90, 0.96, 0.96, 0.96], [0, 0, 0, 1, 1, 1]
    assert v.mean_uncertainty(ys, prompts) == pytest.approx(0.06)  # hand: means 0.90, 0.96; 2 * 0.03
    assert v.mean_uncertainty(ys, prompts) > v.mean_uncertainty(ys)
    assert v.mean_uncertainty(xs, [0] * len(xs)) == v.mean_uncertainty(xs)  # one group: the token-level error
    with pytest.raises(ValueError, match="group labels"):
        v.mean_uncertainty(xs, [0, 1])


def test_a_drifted_machine_leaves_the_rows_judged_against_its_calibration_undecided():
    """A prediction calibrated at 1.0 ms per layer against a run that ended at 1.4 ms: the simulator/runtime row
    cannot be judged; a measured speed-up (both sides timed on the same machine) keeps its verdict."""
    from fate_lab.study import lab
    from fate_lab.study.clock import Clock, Drift

    sim = v.close("simulator / runtime", 1.0, 1.25, 0.10, unit="x", clocked=True)
    speedup = v.beats("fate over load-on-demand", 2.0, 1.0, "up to 4.1x")
    assert sim.verdict == "disagrees"
    held = Drift(Clock("m", 1e-3, (1e-3,) * 3, 1), Clock("m", 1.05e-3, (1.05e-3,) * 3, 1))
    assert [c.verdict for c in lab.paper_table([sim, speedup], drift=held).claims] == ["disagrees", "agrees", "agrees"]
    moved = Drift(Clock("m", 1e-3, (1e-3,) * 3, 1), Clock("m", 1.4e-3, (1.4e-3,) * 3, 1))
    table = lab.paper_table([sim, speedup], drift=moved)
    assert [c.verdict for c in table.claims] == ["not comparable", "agrees", "disagrees"]  # the last: the drift row
    assert "+40% layer time" in table.claims[0].reason and "else: disagrees" in table.claims[0].reason
    assert v.Claim.from_dict(table.claims[0].as_dict()) == table.claims[0]
    with pytest.raises(ValueError, match="change"):
        v.drifted([sim], float("nan"))
