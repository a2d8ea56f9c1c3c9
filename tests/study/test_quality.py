"""Quality of a lossy offloaded config against the plain model: a lossless config reproduces the plain
model, a quantized one gives quant.quality_report's numbers, and the runtime is closed afterwards."""
import copy

import pytest
import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.model.adapters import is_offloaded
from fate_lab.model.testing import tiny_model
from fate_lab.offloading.runtime import offload
from fate_lab.paths import TINY_MOE_DIR
from fate_lab.quant import quality_report
from fate_lab.study.quality import heldout_inputs, lossy_quality, measure, reference_outputs

pytestmark = pytest.mark.skipif(not (TINY_MOE_DIR / "model.safetensors").is_file(),
                                reason="the embedded tiny MoE is not present")


@pytest.fixture(scope="module")
def tiny():
    """The embedded model, two 96-token held-out windows, two prompts with 6 greedy steps each."""
    from fate_lab.model.models import load_model

    model, tok = load_model()
    windows, prompts = heldout_inputs(tok, n_tokens=192, seq_len=96, n_prompts=2, prompt_chars=100)
    return model, windows, reference_outputs(model, windows, prompts, decode_tokens=6, progress=False)


def test_heldout_inputs_and_reference_sizes(tiny):
    model, windows, ref = tiny
    assert [tuple(w.shape) for w in windows] == [(1, 96), (1, 96)]
    assert ref.describe() == {"windows": 2, "window_positions": 190, "prompts": 2, "decode_steps": 12}
    V = model.config.vocab_size
    assert [tuple(t.shape) for t in ref.decode_logits] == [(1, 6, V)] * 2
    for tokens, logits in zip(ref.continuations, ref.decode_logits, strict=True):
        assert torch.equal(tokens, logits.argmax(-1))  # greedy: each token is the previous step's argmax


def test_the_plain_model_against_itself_is_exact(tiny):
    model, _, ref = tiny
    out = measure(model, ref, progress=False)
    assert out["perplexity_change"] == 0.0 and out["mean_kl"] == 0.0 and out["decode_mean_kl"] == 0.0
    assert out["greedy_agreement"] == 1.0 and out["decode_agreement"] == 1.0
    assert (out["n_tokens"], out["n_decode"]) == (190, 12)


def test_lossless_config_reproduces_the_plain_model(tiny):
    model, windows, ref = tiny
    out = lossy_quality(model, OffloadConfig.preset("fate", slots=64, link="instant"), ref, progress=False)
    assert out["config"] == "fate"
    assert out["greedy_agreement"] == 1.0 and out["decode_agreement"] == 1.0
    # the runtime adds the k expert outputs in another order than transformers: equal up to fp32 rounding
    assert abs(out["perplexity_change"]) < 1e-6 and out["mean_kl"] < 1e-9 and out["decode_mean_kl"] < 1e-9
    assert 0.0 < out["hit_rate_decode"] <= 1.0 and out["mib_moved"] > 0
    assert not is_offloaded(model)  # closed, experts back in place: the plain model again
    assert torch.equal(model(input_ids=windows[0]).logits[:, :-1], ref.window_logits[0])


def test_quantized_config_matches_quality_report(tiny):
    model, windows, ref = tiny
    config = OffloadConfig.preset("fate_quant", slots=64, link="instant")
    out = lossy_quality(model, config, ref, progress=False)
    q_model = copy.deepcopy(model)
    with offload(q_model, config):  # the way notebook 06 measures the runtime's mix
        expected = quality_report(model, q_model, windows, progress=False)
    for key in ("perplexity_fp", "perplexity_q", "greedy_agreement", "mean_kl", "n_tokens"):
        assert out[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key
    # the change is a ratio of the two perplexities, each equal within rel 1e-6 above (two torch threads sum in
    # another order from one run to the next): so the change within 2 x 1e-6 x q / fp, not 1e-6 of its own size
    change = expected["perplexity_q"] / expected["perplexity_fp"] - 1
    assert out["perplexity_change"] == pytest.approx(change, abs=2e-6 * (1 + change))
    assert out["mean_kl"] > 1e-4 and out["decode_mean_kl"] > 1e-4  # INT4/INT2 experts: really lossy
    assert not is_offloaded(model)


def test_errors_say_what_to_do():
    model = tiny_model("qwen2_moe")
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="nothing to measure"):
        reference_outputs(model, [], [[1, 2]], decode_tokens=0, progress=False)
    with pytest.raises(ValueError, match=">= 2 tokens"):
        reference_outputs(model, [ids[:, :1]], [], decode_tokens=0, progress=False)
    ref = reference_outputs(model, [ids], [ids[0, :4]], decode_tokens=2, progress=False)
    with pytest.raises(TypeError, match="OffloadConfig"):
        lossy_quality(model, "fate", ref)
    with offload(model, OffloadConfig.preset("lru", slots=8, link="instant")):
        with pytest.raises(RuntimeError, match="close"):
            reference_outputs(model, [ids], [], decode_tokens=0, progress=False)
        with pytest.raises(RuntimeError, match="already offloaded"):
            lossy_quality(model, OffloadConfig.preset("fate", slots=8, link="instant"), ref)
