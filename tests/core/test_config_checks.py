"""Every numeric and named knob of OffloadConfig is checked: the error names the field, the value and what is
allowed."""
import dataclasses

import pytest

from fate_lab.core.config import (
    FLAT,
    PARTS,
    CacheConfig,
    LinkConfig,
    OffloadConfig,
    PlacementConfig,
    PrefetchConfig,
    ValuePrefetch,
)

CASES = [
    ({"transfer_timeout_s": float("nan")}, "transfer_timeout_s=nan.*cannot be switched off"),
    ({"transfer_timeout_s": 0}, "transfer_timeout_s=0.*seconds > 0"),
    ({"transfer_timeout_s": -1}, "transfer_timeout_s=-1"),
    ({"prefetch_buffer_experts": -2}, "prefetch_buffer_experts=-2: give an int >= 0"),
    ({"calibration_steps": 0}, "calibration_steps=0: give an int >= 2"),
    ({"admit_prefetch": "sometimes"}, "admit_prefetch='sometimes'.*on_use"),
    ({"link": "pcie9"}, "link='pcie9'.*instant"),
    ({"quant": "int5"}, "quant='int5'.*preset"),
    ({"replacement": "fifo"}, "replacement='fifo'"),
    ({"context_len": 0}, "context_len=0.*tokens of KV cache"),
    ({"prefetch_window": float("inf")}, "prefetch_window=inf"),
    ({"layer_compute_s": float("nan")}, "layer_compute_s=nan"),
    ({"lossy_threshold": float("nan")}, "lossy_threshold=nan"),
    ({"min_similarity": 2.0}, r"min_similarity=2.0.*\[-1, 1\]"),
    ({"cache": "yes"}, "cache='yes': give True or False"),
    ({"slots": 2.5}, "slots=2.5: give an int >= 0"),
    ({"budget": True}, "budget=True"),
    ({"timeline_max_events": -1}, "timeline_max_events=-1"),
    ({"rule": "percentile"}, "rule='percentile': give a selection rule"),
    ({"predictor": "oracle"}, "predictor='oracle'"),
    ({"allocation": "greedy"}, "allocation='greedy'"),
    ({"slots": 4, "slots_per_layer": (1, 1)}, "give the cache size once"),
    ({"prefetch_value": 1}, "prefetch_value=1: give True or False"),
    ({"prefetch_depth": 3}, r"prefetch_depth=3: choose one of \[1, 2\]"),
    ({"prefetch_depth": 2}, "prefetch_depth=2.*prefetch_value=True"),
    ({"prefetch_depth": 2, "prefetch_value": True, "predictor": "activation_path"}, "predictor='cross_layer_gate'"),
    ({"prefetch_low": True, "prefetch_value": True}, "prefetch_low=True.*needs quant="),
    ({"host_fill": True}, "host_fill=True.*set host='cost'"),
    ({"activation_collection": ((1,),)}, "predictor='activation_matrix' only"),
    ({"predictor": "activation_matrix", "activation_collection": (1, 2)}, "activation_collection=.*tuple of matrices"),
    ({"auto": "yes"}, "auto='yes'"),
    ({"auto": "quant"}, "auto='quant'.*give quant="),
]


@pytest.mark.parametrize("kw,match", CASES, ids=[next(iter(k)) + str(i) for i, (k, _) in enumerate(CASES)])
def test_a_bad_knob_is_refused_naming_it(kw, match):
    with pytest.raises(ValueError, match=match):
        OffloadConfig.preset("fate", **kw)


def test_every_preset_passes_its_own_checks():
    for name in OffloadConfig.preset_names(include_quant=True, include_auto=True):
        assert OffloadConfig.preset(name).name == name


def test_the_planned_presets_are_listed_apart():
    assert "auto" not in OffloadConfig.preset_names(include_quant=True)
    assert OffloadConfig.preset_names(include_auto=True)[-1] == "auto"  # lossless only without include_quant
    assert OffloadConfig.preset_names(include_quant=True, include_auto=True)[-2:] == ["auto", "auto_quant"]
    assert OffloadConfig.preset("auto_quant").auto == "quant" and OffloadConfig.preset("auto").quant is None


def test_a_wrong_name_or_keyword_says_what_it_was_probably_meant_to_be():
    with pytest.raises(ValueError, match=r"unknown preset 'fat' \(did you mean 'fate'"):
        OffloadConfig.preset("fat")
    with pytest.raises(TypeError, match=r"no field 'prefetch_windw' \(did you mean 'prefetch_window'"):
        OffloadConfig.preset("fate", prefetch_windw=2.0)
    with pytest.raises(TypeError, match=r"no field 'zzz'; its keywords by part: cache: budget, slots"):  # the list
        OffloadConfig.preset("fate", zzz=1)


def test_a_part_field_given_flat_names_its_part_and_keyword():
    with pytest.raises(TypeError, match=r"no keyword 'window': give prefetch_window= \(the prefetch part's 'window'\)"):
        OffloadConfig.preset("fate", window=2.0)
    with pytest.raises(TypeError, match=r"'layers': give host_layers= \(the placement part's"):
        OffloadConfig("x", layers=2)
    with pytest.raises(TypeError, match=r"'depth': give prefetch_depth= \(the prefetch.value part's"):
        OffloadConfig("x", depth=2)


def test_a_value_prefetch_knob_lives_in_the_value_part():
    # depth=2 without value prefetch has nowhere to go: the error says which part it belongs to
    with pytest.raises(ValueError, match=r"prefetch_depth=2 is a knob of the value prefetch \(prefetch.value.depth\)"):
        OffloadConfig("x", prefetch_depth=2)
    c = OffloadConfig("x", prefetch_value=True, prefetch_depth=2)
    assert c.prefetch.value == ValuePrefetch(depth=2) and (c.prefetch_value, c.prefetch_depth) == (True, 2)
    off = c.replace(prefetch_value=False)
    assert off.prefetch.value is None
    assert (off.prefetch_value, off.prefetch_depth, off.prefetch_low) == (False, 1, False)
    # a default value knob without value prefetch changes nothing (as a flat config always allowed it)
    assert OffloadConfig("x", prefetch_depth=1) == OffloadConfig("x")


def test_parts_flat_keywords_and_both_build_the_same_config():
    by_parts = OffloadConfig("mine", cache=CacheConfig(slots=8, replacement="lru", allocation="uniform"),
                             prefetch=PrefetchConfig(predictor=None),
                             link=LinkConfig("pcie4_x16", transfer_timeout_s=5.0))
    flat = OffloadConfig("mine", slots=8, replacement="lru", allocation="uniform", predictor=None, link="pcie4_x16",
                         transfer_timeout_s=5.0)
    mixed = OffloadConfig("mine", cache=CacheConfig(slots=8, replacement="lru", allocation="uniform"), predictor=None,
                          link="pcie4_x16", transfer_timeout_s=5.0)
    assert by_parts == flat == mixed and hash(by_parts) == hash(flat)
    assert flat.link.name == "pcie4_x16" and flat.replacement == "lru" and flat.cache.slots == 8


def test_every_flat_keyword_reads_back_what_it_set():
    # one non-default value per flat keyword, set alone, read back through the part path FLAT names
    values = {"budget": 10**9, "slots": 3, "slots_per_layer": (1, 2), "context_len": 7, "allocation": "uniform",
              "shallow_layers": 2, "miss_curves": ((0,),), "replacement": "lru", "cache": False, "all_resident": True,
              "popularity_order": False, "predictor": "activation_path", "rule": None, "probes": "/x",
              "prefetch_buffer_experts": 3, "prefetch_budget": "all", "prefetch_window": 3.0,
              "admit_prefetch": "on_load",
              "host": "cost", "host_layers": 3, "host_profile": "laptop_ddr5", "quant": "int8", "lossy": "drop",
              "lossy_threshold": 0.3, "min_similarity": 0.5, "standin_window": 2, "similarity": "/y",
              "link": "pcie4_x16", "native_link": True, "calibration_steps": 5, "layer_compute_s": 1e-3,
              "transfer_timeout_s": 9.0, "store": "ssd", "checkpoint": "/z", "direct_reads": True, "timeline": False,
              "timeline_max_events": 5}
    # these need another knob set beside them: below
    nested = {"prefetch_value", "prefetch_depth", "prefetch_low", "activation_collection", "host_fill"}
    assert set(values) | nested == set(FLAT)
    for k, v in values.items():
        c = OffloadConfig("x", **({"budget": None} if k == "slots_per_layer" else {}), **{k: v})
        part, field = FLAT[k]
        assert getattr(getattr(c, part), field) == v, k
        assert getattr(OffloadConfig("x"), part) != getattr(c, part), k  # it changed its own part ...
        assert all(getattr(OffloadConfig("x"), p) == getattr(c, p) for p in PARTS if p != part), k  # ... and no other
    c = OffloadConfig("x", predictor="activation_matrix", activation_collection=(((1,),),))
    assert c.prefetch.activation_collection == (((1,),),)
    c = OffloadConfig("x", quant="fate", prefetch_value=True, prefetch_depth=2, prefetch_low=True)
    assert c.prefetch.value == ValuePrefetch(2, True)
    assert OffloadConfig("x", host="cost", host_fill=True).placement == PlacementConfig("cost", fill=True)


def test_replace_keeps_the_rest_of_a_part_given_by_its_main_value():
    c = OffloadConfig.preset("fate", transfer_timeout_s=5.0, native_link=True)
    d = c.replace(link="disk")
    assert d.link == LinkConfig("disk", native=True, transfer_timeout_s=5.0)
    with pytest.raises(TypeError, match=r"would reset its other fields: use config.replace\(link='disk'\)"):
        dataclasses.replace(c, link="disk")
    assert dataclasses.replace(c, slots=4) == c.replace(slots=4)  # a plain field through dataclasses.replace is fine


def test_a_part_is_not_a_value():
    c = OffloadConfig.preset("fate")
    with pytest.raises(TypeError, match="compare one of its fields"):
        _ = c.link == "disk"
    with pytest.raises(TypeError, match="has no truth value"):
        bool(c.cache)
    with pytest.raises(TypeError, match=r"OffloadConfig\(placement='cost'\): give a PlacementConfig"):
        OffloadConfig("x", placement="cost")
    assert c.placement == PlacementConfig()


def test_a_part_checks_itself():
    with pytest.raises(ValueError, match=r"OffloadConfig.prefetch_window=0: give a finite number.*\[prefetch.window\]"):
        PrefetchConfig(window=0)
    with pytest.raises(ValueError, match="host_fill=True.*set host='cost'"):
        PlacementConfig(fill=True)
