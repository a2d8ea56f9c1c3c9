"""Every numeric and named knob of OffloadConfig is checked: the error names the field, the value and what is
allowed."""
import pytest

from fate_lab.core.config import OffloadConfig

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
    with pytest.raises(TypeError, match=r"no field 'zzz'; its fields: name, budget, slots"):  # nothing close: the list
        OffloadConfig.preset("fate", zzz=1)
