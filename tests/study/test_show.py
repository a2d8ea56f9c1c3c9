"""Readable tables (study/show.py): names, units, significant digits, '—', and splitting what is too wide."""
import pandas as pd

from fate_lab.study import show


def test_cells_by_column_kind():
    assert show.column_kind("decode hit rate") == "percent"
    assert show.column_kind("perplexity change") == "signed percent"
    assert show.column_kind("bytes per expert") == "bytes"
    assert show.column_kind("MiB moved per token") == "number"
    assert show.column_kind("set size (probes, equal recall)") == "number"  # a size, not a rate
    assert show.column_kind("host calls per token") == "number"
    assert show.column_kind("acceptance") == "percent"  # a speculative draft's accepted share, as 07 prints it
    assert (show.cell(0.5, "percent"), show.cell(0.0188, "signed percent"), show.cell(393216, "bytes")) == \
        ("50.0%", "+1.88%", "384 KiB")
    assert (show.cell(float("nan")), show.cell(None), show.cell(True), show.cell([8, 8, 0])) == \
        ("—", "—", "yes", "8 8 0")
    assert (show.cell(1234567), show.cell(12.3456)) == ("1,234,567", "12.3")


def test_readable_renames_formats_and_keeps_the_numbers():
    df = pd.DataFrame({"hit_rate_decode": [0.5, float("nan")], "bytes_per_expert": [393216, 196608],
                       "decode tok/s": [12.345, 1234.5]})
    t = show.readable(df, caption="link: PCIe 3.0 x16")
    assert list(t.text.columns) == ["decode hit rate", "bytes per expert", "decode tok/s"]
    assert t.text.iloc[:, 0].tolist() == ["50.0%", "—"] and t.text.iloc[:, 1].tolist() == ["384 KiB", "192 KiB"]
    assert t.text.iloc[:, 2].tolist() == ["12.3", "1,230"]
    assert t.frame["decode tok/s"].iloc[0] == 12.345  # the numbers stay for code
    html = t._repr_html_()
    assert html.startswith('<p class="fate-lab-caption">link: PCIe 3.0 x16</p>') and "nan" not in html.lower()
    assert not t.index  # 0, 1, 2, ... is no information
    assert repr(t).splitlines()[0] == "link: PCIe 3.0 x16"


def test_a_wide_table_is_split_and_every_part_fits():
    wide = pd.DataFrame({f"a long column name {i}": [123456.789] for i in range(14)}, index=["fate"])
    t = show.readable(wide)
    assert len(t.parts) > 1
    assert sum(len(p.columns) for p in t.parts) == 14
    for p in t.parts:
        px = sum(show._width_px(p[c], c) for c in p.columns)
        assert px <= show.MAX_WIDTH_PX
    narrow = show.readable(wide.iloc[:, :2])
    assert len(narrow.parts) == 1


def test_a_ratio_over_a_zero_measurement_is_undefined_not_infinite():
    # 05's decode explorer: a real run with no stall (0 ms/token) next to a predicted stall has no ratio
    from fate_lab.study.tables import ratio_where_defined

    pred = pd.Series({"decode tok/s": 30.0, "stall (ms/token)": 1.5, "TTFT (ms)": 0.0})
    meas = pd.Series({"decode tok/s": 25.0, "stall (ms/token)": 0.0, "TTFT (ms)": 0.0})
    r = ratio_where_defined(pred, meas)
    assert r["decode tok/s"] == 1.2 and pd.isna(r["stall (ms/token)"]) and pd.isna(r["TTFT (ms)"])
    assert show.cell(r["stall (ms/token)"]) == "—" and show.cell(float("inf")) == "∞"
