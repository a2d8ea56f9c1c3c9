"""Notebook 09's placement explorer draws what a direct call gives, and says why a placement does not fit."""
import pytest

pytest.importorskip("ipywidgets")


def test_placement_explorer_draws_the_direct_table():
    from fate_lab.study.widgets import deploy

    box = deploy.placement_explorer("Qwen3-30B-A3B", "rtx3060", "q4_k_m", 24, host_ram="32GiB",
                                    formats=("q4_k_m", "bf16"))
    direct = deploy.placement_table("Qwen3-30B-A3B", "rtx3060", "q4_k_m", 24, host_ram="32GiB")
    assert box.rendered["table"].equals(direct) and bool(direct["fits"].iloc[0])
    sweep = box.rendered["sweep"]
    assert set(sweep["format"]) == {"q4_k_m", "bf16"} and sweep["--n-cpu-moe"].max() == 48
    slider = box.children[6]
    slider.value = 0  # the whole model on a 12 GiB card: does not fit, said in the status line
    assert not box.rendered["table"]["fits"].iloc[0] and box.children[7].value.startswith("does not fit")
    box.children[4].value = "ddr9-1x2"  # a host that cannot parse: one line, no plan
    assert box.rendered["error"].startswith("--host 'ddr9-1x2'")
