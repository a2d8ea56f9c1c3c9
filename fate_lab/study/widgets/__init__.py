"""Interactive explorers for the notebooks: each wires sliders and dropdowns to an ordinary table function.

What it is: one ``*_explorer(...)`` call per notebook widget, in three modules by what they explore --
`trace` (a recorded trace: prefetch rules, 03; the expert cache, 04), `runs` (real and simulated runs: a real
offloaded decode, 05; host compute and speculative windows, 07; a lossy rule's threshold, 08) and `deploy`
(sizing a deployment, 09) -- the maps from what a reader picks (a label) to the objects the table functions
take, and `layout` (the controls' common look: full-width sliders, readable labels). Every number shown comes
from a function of `fate_lab.study.tables`, `whatif` or `plan` that a test calls without a browser; each
explorer's returned box keeps what it drew last in ``box.rendered``.
What it is not: a place for tables or metrics.
"""
from fate_lab.study.widgets.deploy import plan_explorer
from fate_lab.study.widgets.runs import (
    decode_config,
    decode_explorer,
    host_explorer,
    threshold_explorer,
    window_explorer,
)
from fate_lab.study.widgets.trace import (
    ALLOCATION_CHOICES,
    PARAM_LABELS,
    PREDICTOR_CHOICES,
    RULE_CHOICES,
    cache_config,
    cache_explorer,
    cache_table,
    make_rule,
    prefetch_explorer,
    rule_caption,
    rule_parameter,
    set_bounds,
)

__all__ = ["ALLOCATION_CHOICES", "PARAM_LABELS", "PREDICTOR_CHOICES", "RULE_CHOICES", "cache_config", "cache_explorer",
           "cache_table", "decode_config", "decode_explorer", "host_explorer", "make_rule", "plan_explorer",
           "prefetch_explorer", "rule_caption", "rule_parameter", "set_bounds", "threshold_explorer", "window_explorer"]
