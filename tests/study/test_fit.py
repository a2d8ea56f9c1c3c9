"""`plan --fit`: only what fits is ranked, the smallest --n-cpu-moe is the first that fits, the largest context is
the edge of the fit; and the engine constants are still the ones their calibration figures give."""
import pytest

from fate_lab.hardware.placements import ALL, Placement
from fate_lab.study.fit import fit, n_cpu_moe_sweep, predict_placement, setting


def test_fit_ranks_only_what_fits_and_finds_the_edges():
    s = setting("Qwen3-30B-A3B", "rtx3060", weights="q4_k_m", host_ram="64GiB")
    r = fit(s)
    fits = [p.fits for p in r.n_cpu_moe]
    assert fits[r.best_n_cpu_moe] and not any(fits[:r.best_n_cpu_moe])
    assert r.best.fits and r.best.decode_tok_s == max(p.decode_tok_s for p in r.n_cpu_moe + r.ngl if p.fits)
    assert all(p.decode_tok_s is None for p in r.n_cpu_moe + r.ngl if not p.fits)
    edge = Placement(ALL, r.best_n_cpu_moe)
    from fate_lab.study.fit import _fitting

    f = _fitting(s)
    assert predict_placement(f, edge, r.max_context).fits and not predict_placement(f, edge, r.max_context + 256).fits
    assert r.fate_lab is not None and r.fate_lab.decode_tok_s < r.best.decode_tok_s  # its 0.5 ms a layer


def test_nothing_fits_says_so():
    r = fit(setting("DeepSeek-V3", "rtx3060", weights="bf16", host_ram="64GiB"))
    assert r.best is None and r.best_n_cpu_moe is None and r.max_context is None


def test_the_design_review_sweep_has_a_line_per_format():
    rows = n_cpu_moe_sweep("Qwen3-30B-A3B", "rtx4090", formats=("q4_k_m", "bf16"))
    q4 = [r for r in rows if r["format"] == "q4_k_m"]
    assert len(q4) == 49 and q4[0]["fits"] and not [r for r in rows if r["format"] == "bf16"][0]["fits"]


def test_engine_constants_are_the_ones_their_calibration_figures_give():
    from benchmarks.bench_published import calibrate

    for name, fid, solved, committed in calibrate():
        assert committed == pytest.approx(solved, rel=0.02), (name, fid)
