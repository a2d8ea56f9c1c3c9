"""Speculative decoding: offloaded target + HF assisted generation gives the plain model's greedy tokens
(embedded model with its shipped draft, and tiny random models of other families); a verify step
moves each needed expert at most once; the simulator's verify steps reproduce HF's accept lengths;
exact numbers for the pure parts (accept runs, union sizes, the roofline's pick)."""
from __future__ import annotations

import copy
from collections import Counter

import pandas as pd
import pytest
import torch
from helpers import embedded_models, prompt_ids
from transformers import Qwen2Config, Qwen2ForCausalLM

from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.fit.draft import DraftConfig, draft_config, init_from_target, train_draft
from fate_lab.hardware.setups import Hardware
from fate_lab.model.adapters import adapt
from fate_lab.model.draft import load_draft
from fate_lab.model.record import record_trace
from fate_lab.model.testing import tiny_model
from fate_lab.model.trace import DECODE, PREFILL, Trace
from fate_lab.offloading.runtime import offload
from fate_lab.sim.simulate import simulate
from fate_lab.sim.speculative import (
    accept_runs,
    break_even_acceptance,
    expected_accepted,
    per_token_acceptance,
    pick_window,
    prompt_rows,
    simulate_speculative,
    union_sizes,
    verify_steps,
)
from fate_lab.study.speculative import (
    acceptance_run,
    draft_matches,
    generate_logged,
    roofline_table,
    speculative_decode,
    window_table,
)
from fate_lab.study.widgets import window_explorer

NEW = 16


def _noisy_copy(model, std: float, seed: int = 0):
    """A draft that agrees with `model` often but not always: its weights plus seeded noise."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return draft


def _random_dense_draft(vocab: int, seed: int = 0):
    """A tiny random dense Qwen2 draft of the target's vocabulary (it rarely agrees: the rejection path)."""
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()


def _plain(model, ids, n=NEW):
    """The plain (un-offloaded, unassisted) greedy tokens: exactly n new ones."""
    return model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)[0].tolist()


# --- exact greedy equality --------------------------------------------------------------------------


@pytest.mark.parametrize("model_name", embedded_models())
def test_embedded_model_with_its_draft_matches_plain_greedy(model_name):
    from fate_lab.model.corpus import heldout_prompts
    from fate_lab.model.models import load_model

    torch.set_num_threads(1)
    model, tok = load_model(model_name)
    draft, dtok = load_draft()
    assert dtok.get_vocab() == tok.get_vocab()  # one vocabulary: HF's plain assisted generation applies
    ids = [tok(t, return_tensors="pt")["input_ids"][:, :20] for t in heldout_prompts(2)]
    ref = [_plain(model, x, 24) for x in ids]
    for window in (1, 4):
        row = speculative_decode(model, draft, ids, OffloadConfig.preset("fate", slots=16, link="instant"), window,
                                 24, min_new_tokens=24)
        assert row["sequences"] == ref, window
        assert row["accepted"] > 0 and row["verify_forwards"] < row["decode_tokens"]  # proposals were accepted
    assert _plain(model, ids[0], 24) == ref[0]  # the runtime closed and gave the experts back


@pytest.mark.parametrize("family,preset", [("olmoe", "fate"), ("mixtral", "fate"), ("deepseek_v3", "fate"),
                                           ("mixtral", "lru")])
def test_other_family_assisted_matches_plain_greedy(family, preset):
    model = tiny_model(family, seed=3)
    V = model.config.vocab_size
    ids = [prompt_ids(V, 9, seed=s) for s in range(2)]
    ref = [_plain(model, x) for x in ids]
    a = adapt(model)
    cfg = OffloadConfig.preset(preset, slots=a.num_moe_layers * a.num_experts // 4, link="instant")
    rows = {}
    for name, draft in (("dense", _random_dense_draft(V)), ("noisy", _noisy_copy(model, 0.003))):
        for window in (1, 3):
            row = speculative_decode(model, draft, ids, cfg, window, NEW, min_new_tokens=NEW)
            assert row["sequences"] == ref, (name, window)
            assert row["proposed"] > 0 and row["generated"] == 2 * NEW
            rows[name, window] = row
    noisy = rows["noisy", 3]
    assert noisy["acceptance"] > 0 and noisy["target_forwards"] < 2 * NEW  # proposals were accepted
    if family != "olmoe":  # the tiny random OLMoE repeats one token: a close copy agrees on every proposal
        assert noisy["acceptance"] < 1, noisy["acceptance"]  # ... elsewhere both accept and reject paths ran


# --- the mechanism: a verify step loads each needed expert once ------------------------------------------


@pytest.mark.parametrize("preset", ["load_on_demand", "fate"])
def test_verify_step_moves_each_needed_expert_at_most_once(preset):
    model = tiny_model("qwen2_moe", seed=4)
    a = adapt(model)
    M, K = a.num_moe_layers, a.top_k
    draft = _noisy_copy(model, 0.01)
    with offload(model, OffloadConfig.preset(preset, slots=4, link="instant")) as rt:
        runs = [generate_logged(model, prompt_ids(128, 9, seed=s), draft, 4, NEW, rt, min_new_tokens=NEW)
                for s in range(2)]
        timeline = list(rt.stats.timeline)
        records = []
        for r in runs:
            records += r["records"]
    verify = [r for r in records if r.phase == "decode" and r.tokens > 1]
    assert len(verify) >= 4
    overlapping = 0
    for r in verify:
        c = r.counters
        assert c["calls"] == M  # one experts call per MoE layer for all the step's tokens
        assert c["uses"] <= M * min(a.num_experts, r.tokens * K)
        assert c["bytes_moved"] <= (c["uses"] + c["prefetch_wasted"]) * rt.expert_bytes
        moved = Counter((m, e) for kind, m, e, *_ in timeline[r.timeline[0]:r.timeline[1]]
                        if kind in ("demand", "prefetch", "sync_load"))
        assert all(n == 1 for n in moved.values()), moved  # no expert of a layer moved twice in one step
        if preset == "load_on_demand":  # nothing cached: every distinct needed expert moves exactly once
            assert c["bytes_moved"] == c["uses"] * rt.expert_bytes and c["misses"] == c["uses"]
            assert c["moved"] == c["uses"]
        overlapping += c["uses"] < M * r.tokens * K
    assert overlapping > 0  # some step's tokens shared experts: one load served several tokens


def test_runtime_counts_verify_steps_as_decode():  # transformers 5 passes the KV cache as `cache=`
    model = tiny_model("qwen2_moe", seed=4)
    draft = _noisy_copy(model, 0.001)
    with offload(model, OffloadConfig.preset("fate", slots=4, link="instant")) as rt:
        run = generate_logged(model, prompt_ids(128, 9), draft, 3, NEW, rt, min_new_tokens=NEW)
    assert rt.stats.summary()["prefill"]["forwards"] == 1
    assert rt.stats.summary()["decode"]["forwards"] == run["verify_forwards"]


# --- simulator side: pure parts with exact numbers --------------------------------------------------------


def _hand_trace(P: int, D: int, experts: list[list[int]] | None = None, E: int = 4) -> Trace:
    """One prompt: P prefill and D decode rows, one MoE layer, k = 1 (experts per row given or 0)."""
    N = P + D
    ex = torch.tensor(experts if experts is not None else [[0]] * N).view(N, 1, 1)
    return Trace(experts=ex, token_ids=torch.arange(N), phase=torch.tensor([PREFILL] * P + [DECODE] * D),
                 prompt_id=torch.zeros(N, dtype=torch.long), position=torch.arange(N), meta={"num_experts": E})


def test_accept_runs_and_expected_acceptance_by_hand():
    assert accept_runs(torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)).tolist() == [2, 1, 0, 3, 2, 1, 0]
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    p = per_token_acceptance(expected_accepted(0.6, 4) / 4, 4)
    assert p == pytest.approx(0.6, abs=1e-9)


def test_verify_steps_by_hand():
    t = _hand_trace(P=2, D=7)  # 8 new tokens; positions 0..8
    as_tuples = lambda steps: [(s.start, s.end, s.phase, s.proposed, s.accepted) for s in steps]  # noqa: E731
    # every proposal accepted: prompt + 3 proposals -> 4 tokens; then [last, 3 proposals] -> 4 tokens
    assert as_tuples(verify_steps(t, 3, matches=torch.ones(9, dtype=torch.bool))) == [
        (0, 5, "prefill", 3, 3), (5, 9, "decode", 3, 3)]
    # none accepted: one token per forward; the proposals shrink as the length budget runs out
    steps = verify_steps(t, 3, matches=torch.zeros(9, dtype=torch.bool))
    assert as_tuples(steps)[:2] == [(0, 5, "prefill", 3, 0), (2, 6, "decode", 3, 0)]
    assert [s.proposed for s in steps] == [3, 3, 3, 3, 3, 2, 1, 0] and sum(s.produced for s in steps) == 8
    # runs from the matches: row 1 (the last prompt row) starts a run of 2, row 4 a run of 1
    m = torch.tensor([0, 1, 1, 0, 1, 0, 0, 0, 0], dtype=torch.bool)
    assert as_tuples(verify_steps(t, 3, matches=m)) == [
        (0, 5, "prefill", 3, 2), (4, 8, "decode", 3, 1), (6, 9, "decode", 2, 0), (7, 9, "decode", 1, 0),
        (8, 9, "decode", 0, 0)]
    # window 0: the prefill, then one decode forward per decode row
    assert as_tuples(verify_steps(t, 0)) == [(0, 2, "prefill", 0, 0)] + [(r, r + 1, "decode", 0, 0)
                                                                        for r in range(2, 9)]
    # an acceptance probability: the expected accept lengths, carried as fractions (totals exact)
    steps = verify_steps(t, 2, acceptance=0.5)  # E[accepted] = 0.75 per full window
    assert [s.accepted for s in steps] == [0, 1, 1, 1, 0]  # carry .75, 1.5, 1.25, 1.0, -
    with pytest.raises(ValueError, match="exactly one"):
        verify_steps(t, 2)


def test_union_sizes_by_hand():
    # decode rows use experts 0, 1, 0, 2 (one layer, k=1): windows of 2 -> {0,1},{0,1},{0,2}: 2 each;
    # windows of 3 -> {0,1} (2), {0,1,2} (3): mean 2.5; of 4 -> 3
    t = _hand_trace(P=1, D=4, experts=[[3], [0], [1], [0], [2]])
    u = union_sizes(t, 4)
    assert u[:5] == [0.0, 1.0, 2.0, 2.5, 3.0]


def test_pick_window_by_hand():
    from fate_lab.hardware.compute import ComputeProfile
    from fate_lab.hardware.links import LinkProfile

    comp = ComputeProfile("free compute", dense_s=1e-12, dense_per_token_s=0.0, expert_s=0.0, expert_per_token_s=0.0,
                          call_s=0.0, predict_s=0.0)  # negligible next to the 1 s link (all zero is refused)
    shape = ModelShape(num_layers=1, num_moe_layers=1, num_experts=8, top_k=1, hidden=4, intermediate=2,
                       dtype=torch.float32, dense_bytes=0, kv_bytes_per_token=0)
    link = LinkProfile("1 s per expert", bandwidth=shape.nbytes(None), latency=0.0, source="test")
    hw = Hardware(comp, link)
    # link-bound, nothing cached: step time = union experts x 1 s; tokens = 1 + E[accepted]
    union = [0.0, 1.0, 1.0, 1.0]  # the tokens of a step all use one expert: bigger windows are free
    best, rows = pick_window(union, shape, hw, acceptance=0.5, hit_rate=0.0, windows=range(3))
    assert best == 2 and [r["tok_s"] for r in rows] == pytest.approx([1.0, 1.5, 1.75])
    union = [0.0, 1.0, 2.0, 3.0]  # every token its own expert: no window pays off
    best, rows = pick_window(union, shape, hw, acceptance=0.5, hit_rate=0.0, windows=range(3))
    assert best == 0 and [r["tok_s"] for r in rows] == pytest.approx([1.0, 0.75, 1.75 / 3])
    # break-even: 1.5 experts for 2 tokens -> 1 + p = 1.5; 2 experts for 3 tokens -> 1 + p + p^2 = 2
    _, rows = pick_window([0.0, 1.0, 1.5, 2.0], shape, hw, acceptance=0.5, hit_rate=0.0, windows=range(3))
    assert break_even_acceptance(rows, 1) == pytest.approx(0.5)
    assert break_even_acceptance(rows, 2) == pytest.approx((5 ** 0.5 - 1) / 2)
    _, rows = pick_window([0.0, 1.0, 3.0], shape, hw, acceptance=0.5, hit_rate=0.0, windows=range(2))
    assert break_even_acceptance(rows, 1) != break_even_acceptance(rows, 1)  # NaN: 3 experts for at most 2 tokens


@pytest.fixture(scope="module")
def recorded():
    """A tiny qwen2_moe target, a noisy-copy draft, and a greedy trace of two prompts."""
    model = tiny_model("qwen2_moe", seed=5)
    draft = _noisy_copy(model, 0.02, seed=1)
    prompts = [prompt_ids(128, 9, seed=s)[0].tolist() for s in (10, 11)]
    trace = record_trace(model, None, prompts, decode_tokens=NEW - 1, progress=False)
    return model, draft, prompts, trace


def test_simulated_verify_steps_equal_hf_assisted_generation(recorded):
    model, draft, prompts, trace = recorded
    matches = draft_matches(draft, trace)
    for window in (1, 2, 4):
        steps = verify_steps(trace, window, matches=matches)
        row = acceptance_run(model, draft, [torch.tensor([p]) for p in prompts], window, NEW)
        assert row["generated"] == 2 * NEW  # no end-of-text stopped a prompt early
        for _p, (first, _P, rows), seq in zip(prompts, prompt_rows(trace), row["sequences"], strict=True):
            assert seq[:-1] == trace.token_ids[first:first + rows].tolist()  # the trace's greedy tokens
        assert row["target_forwards"] == len(steps), window
        assert row["accepted"] == sum(s.accepted for s in steps), window
        assert row["proposed"] == sum(s.proposed for s in steps), window


def test_speculative_window0_equals_plain_simulation(recorded):
    model, _, _, trace = recorded
    a = adapt(model)
    shape = ModelShape.from_adapter(a)
    hw = Hardware.scaled("qwen15_moe_rtx3090_pcie3")
    cfg = OffloadConfig.preset("fate", slots=4)
    plain = simulate(trace, cfg, hw, shape)
    spec = simulate_speculative(trace, cfg, hw, shape, 0)
    assert spec.stats.summary() == plain.summary()
    assert spec.decode_tok_s == pytest.approx(plain.decode_tok_s, rel=1e-12)
    assert spec.ttft_s == pytest.approx(plain.ttft_s, rel=1e-12)


def test_window_table_and_explorer_without_a_browser(recorded):
    model, draft, _, trace = recorded
    a = adapt(model)
    shape = ModelShape.from_adapter(a)
    hw = Hardware.scaled("qwen15_moe_rtx3090_pcie3")
    cfg = OffloadConfig.preset("fate", slots=4)
    matches = draft_matches(draft, trace)
    df = window_table(trace, cfg, hw, shape, 3, matches=matches)
    assert df["window"].tolist() == [0, 3] and df["moved_ratio"].iloc[0] == 1.0
    assert df["decode_tokens"].iloc[0] == 2 * (NEW - 1) and df["decode_tokens"].iloc[1] <= 2 * (NEW - 1)
    assert df["verify_forwards"].iloc[1] < df["verify_forwards"].iloc[0]
    best, roof = roofline_table(trace, cfg, hw, shape, acceptance_rate=0.5, measured_window=4, max_window=3)
    assert roof["window"].tolist() == [0, 1, 2, 3] and best == roof.loc[roof["tok_s"].idxmax(), "window"]
    box = window_explorer(trace, cfg, hw, shape, matches=matches)
    assert box.rendered["window"] == 4 and len(box.rendered["table"]) == 2
    box.children[0].value = 2
    assert box.rendered["window"] == 2
    pd.testing.assert_frame_equal(box.rendered["table"], window_table(trace, cfg, hw, shape, 2, matches=matches))


# --- the draft ------------------------------------------------------------------------------------------


def test_load_draft_says_how_to_train_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m fate_lab train-draft"):
        load_draft(tmp_path)


def test_init_from_target_copies_embeddings_and_shared_experts():
    target = tiny_model("qwen2_moe", seed=6)
    cfg = DraftConfig(num_layers=1, hidden_size=64, num_heads=4, intermediate_size=48)
    draft = Qwen2ForCausalLM(draft_config(cfg, target.config))
    init_from_target(draft, target)
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(draft.model.layers[0].mlp.up_proj.weight,
                       target.model.layers[0].mlp.shared_expert.up_proj.weight)
    assert torch.equal(draft.model.layers[0].self_attn.q_proj.bias, target.model.layers[0].self_attn.q_proj.bias)
    with pytest.raises(ValueError, match="intermediate_size=48"):
        init_from_target(Qwen2ForCausalLM(draft_config(DraftConfig(num_layers=1, hidden_size=64, intermediate_size=32),
                                                       target.config)), target)


def test_smoke_training_saves_a_loadable_draft(tmp_path):
    card = train_draft(DraftConfig.preset("smoke"), tmp_path)
    assert card["val_loss"] <= card["initial_val_loss"] and card["steps"] == 6
    draft, tok = load_draft(tmp_path)
    assert draft.config.vocab_size == 8192 and draft.config.tie_word_embeddings
    assert (tmp_path / "MODEL_CARD.md").exists() and (tmp_path / "training.json").exists()
