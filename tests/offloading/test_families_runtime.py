"""The generated support table, as a test: every experts-interface family the model side builds is offloaded
exactly -- greedy tokens equal and logits within float tolerance of the plain model, under lru, fate,
host_compute and all_host on the instant link and fate on an emulated link, a left-padded batch of two, per-layer
cache counters that add up, its own checkpoint opened with load_offloaded (the SSD tier reading its on-disk
layout) -- or refused with a reason; none gives wrong output or fails with an error that is not a refusal
(`offloading/support.py`, the same run `scripts/family_table.py` writes to docs/families.md). Also: a refused
layout leaves the model untouched, a transposed family's quantized runtime computes what the quantized model copy
computes, and the newest-release report names what a release broke."""
from __future__ import annotations

import pytest
import torch
from helpers import greedy, prompt_ids
from torch import nn

from fate_lab.core.config import OffloadConfig
from fate_lab.model.adapters import adapt
from fate_lab.model.families import experts_interface_families, experts_interface_modules
from fate_lab.offloading.runtime import offload
from fate_lab.offloading.support import check_family, support_counts
from fate_lab.quant import QuantSpec, quantize_model_experts

MODULES = experts_interface_modules()
_ROWS: dict = {}


@pytest.mark.parametrize("module", list(MODULES))
def test_every_family_is_exact_or_refused_never_wrong(module):
    row = check_family(module, MODULES[module])
    _ROWS[module] = row
    assert row.verdict not in ("wrong", "failed"), f"{module} ({row.family}): {row.verdict}: {row.reason}"
    if row.verdict == "refused":
        assert row.family in row.reason and "fate_lab cannot offload" in row.reason  # names family and layout
    if row.family in experts_interface_families():  # every causal family the model side builds here
        assert row.verdict in ("exact", "refused"), f"{module}: {row.verdict}: {row.reason}"
    if row.verdict == "exact":
        expected = ["lru@instant", "fate@instant", "host_compute@instant", "all_host@instant", "fate@test_fast",
                    "load_offloaded@instant", "batch2"] if row.kind == "causal" else \
            ["lru@instant (forward)", "fate@instant (forward)"]
        assert list(row.runs) == expected


def test_the_table_counts_add_up():
    if len(_ROWS) < len(MODULES):
        pytest.skip("runs after the per-family test (whole file)")
    c = support_counts(list(_ROWS.values()))
    assert c["wrong"] == c["failed"] == 0 and c["exact"] + c["refused"] == c["built"]
    assert c["built"] + c["not built"] == c["modules"]
    assert c["exact"] >= len(experts_interface_families())  # every causal family, and the text towers


def test_a_layout_it_cannot_serve_is_refused_at_offload_naming_family_and_what_to_do(tiny_models):
    model = tiny_models("mixtral", seed=0)
    a = adapt(model)
    mod = a.experts_module(1)  # what a quantization integration leaves: a tensor fate_lab has no dequantizer for
    mod.register_parameter("gate_up_proj_scales", nn.Parameter(torch.ones(4, 80), requires_grad=False))
    before = [(a.experts_module(m).gate_up_proj, a.experts_module(m).down_proj) for m in range(a.num_moe_layers)]
    with pytest.raises(NotImplementedError, match=r"MoE layer 1: mixtral: MixtralExperts holds tensors .*"
                                                  r"gate_up_proj_scales.*load the checkpoint in a float dtype"):
        offload(model, OffloadConfig.preset("lru", link="instant", slots=2))
    after = [(a.experts_module(m).gate_up_proj, a.experts_module(m).down_proj) for m in range(a.num_moe_layers)]
    # nothing taken
    assert all(x is y for pb, pa in zip(before, after, strict=True) for x, y in zip(pb, pa, strict=True))
    assert model.config._experts_implementation != "fate_offload"


def test_quantized_runtime_of_a_transposed_biased_family_computes_the_quantized_model(tiny_models):
    """gpt-oss stores experts transposed, interleaved and with biases: the runtime's packed experts (INT8 on the
    canonical layout, biases at full precision) compute what `quantize_model_experts` gives on the plain model."""
    model = tiny_models("gpt_oss", seed=1, intermediate_size=64)  # groups of 64 divide H and I
    ids = prompt_ids(model.config.vocab_size)
    q_tokens, q_logits = greedy(quantize_model_experts(model, QuantSpec.preset("int8")), ids, 6)
    with offload(model, OffloadConfig.preset("fate_int8", link="instant", slots=6)) as rt:
        assert rt.packed_slots is not None
        tokens, logits = greedy(model, ids, 6)
    assert torch.equal(tokens, q_tokens)
    torch.testing.assert_close(logits, q_logits, rtol=1e-4, atol=1e-4)


def test_the_newest_release_report_names_what_it_broke_added_and_fixed():
    """`scripts/family_table.py --compare` (what `make check-newest` runs): module by module against a table written
    before, from that table's markdown alone."""
    import importlib.util
    from pathlib import Path

    import transformers

    from fate_lab.offloading.support import FamilySupport, support_markdown

    path = Path(__file__).parents[2] / "scripts" / "family_table.py"
    spec = importlib.util.spec_from_file_location("family_table", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    before = [FamilySupport("a", "a", "causal", "exact"), FamilySupport("b", "b", "causal", "exact"),
              FamilySupport("c", None, "none", "not built", "no class"), FamilySupport("d", "d", "causal", "exact")]
    now = [FamilySupport("a", "a", "causal", "exact"), FamilySupport("b", "b", "causal", "failed", "RuntimeError: x"),
           FamilySupport("c", "c", "text tower", "exact"), FamilySupport("e", "e", "causal", "refused", "why")]
    version, pinned = script.table_verdicts(support_markdown(before, "cmd"))
    assert version == transformers.__version__
    assert pinned == {"a": "exact", "b": "exact", "c": "not built", "d": "exact"}
    lines, broken = script.compare(now, pinned, "5.0.0")
    assert broken == 2
    assert lines[0].endswith("against the table of transformers 5.0.0: 2 families broken, 1 new module(s), 1 fixed")
    assert "  BROKEN b: exact with 5.0.0, now failed: RuntimeError: x" in lines
    assert "  BROKEN d: exact with 5.0.0, now gone (no longer an experts-interface module)" in lines
    assert "  new    e: refused: why" in lines and "  fixed  c: not built with 5.0.0, now exact" in lines
