"""Training: a few steps lower the loss; the output folder loads back through load_model."""
import math

import pytest
import torch

from fate_lab.fit.train import TrainConfig, per_layer_balance_loss, train
from fate_lab.model.corpus import heldout_prompts, load_corpus


def test_corpus_split_is_by_whole_documents():
    docs = load_corpus()
    train_titles = {(d["source"], d["title"]) for d in docs if d["split"] == "train"}
    val_titles = {(d["source"], d["title"]) for d in docs if d["split"] == "val"}
    assert val_titles and train_titles and not (train_titles & val_titles)
    assert {d["source"] for d in docs} == {"web_bible", "jargon_file", "devils_dictionary", "henry_commentary",
                                           "scofield_notes", "treasury_of_david"}
    # every source of the corpus is in the held-out split, so held-out loss and load see every kind of text
    assert {s for s, _ in val_titles} == {d["source"] for d in docs}
    prompts = heldout_prompts(6)
    assert len(prompts) == 6 and all(p for p in prompts)


def test_balance_loss_is_one_when_uniform_and_larger_when_skewed():
    E, k = 4, 2
    uniform = torch.zeros(8, E)  # equal logits: every expert equally likely and (by ties) ...
    skew = torch.tensor([[5.0, 4.0, 0.0, 0.0]] * 8)  # ... vs always experts 0 and 1
    # hand value for skew: f = [.5, .5, 0, 0], P ~ [.73, .27, .0, .0] -> E * sum f P = 4 * .5 = 2.0
    assert per_layer_balance_loss((skew,), k).item() == pytest.approx(2.0, abs=0.05)
    assert per_layer_balance_loss((skew,), k) > per_layer_balance_loss((uniform + torch.randn(8, E) * 1e-3,), k)


def test_a_few_steps_lower_the_loss_and_output_loads(tmp_path):
    from fate_lab.model.models import load_model

    card = train(TrainConfig.preset("smoke", steps=25), tmp_path)
    assert card["train_loss"] < card["first_step_loss"] - 0.2
    assert math.isfinite(card["val_perplexity"])
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "MODEL_CARD.md").exists()
    assert card["final_eval_tokens"] == 4096 and "over 4,096 tokens" in (tmp_path / "MODEL_CARD.md").read_text()
    model, tok = load_model(tmp_path)
    ids = tok("The word of the day", return_tensors="pt")["input_ids"]
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok))


def test_the_saved_weights_are_those_of_the_best_heldout_check(tmp_path, monkeypatch):
    import fate_lab.fit.train as train_module
    from fate_lab.model.models import load_model

    # the third periodic held-out check is made to read worse than the second, so the best weights are step 8's;
    # the test keeps its own copy of the model's weights at each check (the reference the file must equal)
    real, calls, seen = train_module.evaluate, [], []

    def evaluate(model, stream, cfg, windows=-1):
        value = real(model, stream, cfg, windows)
        if windows == -1:
            calls.append(value)
            seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            return value + 10.0 if len(calls) == 3 else value
        return value

    cfg = TrainConfig.preset("smoke", steps=12, eval_every=4, lr=0.01, warmup_steps=1, min_lr_ratio=1.0)
    monkeypatch.setattr(train_module, "evaluate", evaluate)
    card = train(cfg, tmp_path)
    assert len(calls) == 3 and card["steps"] == 12 and card["best_step"] == 8
    saved = load_model(tmp_path)[0].state_dict()  # the file as transformers reads it back (bf16 on disk)

    def same(k, ref):
        return torch.equal(saved[k], ref[k].to(torch.bfloat16).to(saved[k].dtype))

    step8, step12 = seen[1], seen[2]
    assert saved.keys() == step8.keys() and all(same(k, step8) for k in saved)
    assert not all(same(k, step12) for k in saved)  # the last weights differ from the saved ones


def test_the_deepseek_preset_trains_a_dense_first_layer_model_that_loads(tmp_path):
    from fate_lab.model.adapters import adapt
    from fate_lab.model.models import load_model

    card = train(TrainConfig.preset("smoke_deepseek", steps=6), tmp_path)
    assert card["architecture"] == "DeepseekV2ForCausalLM"
    assert [row["layer"] for row in card["expert_load"]] == [1, 2]  # layer 0 is dense: no routing to report
    model, _ = load_model(tmp_path)
    a = adapt(model)
    assert (a.family, a.num_moe_layers, a.num_experts, a.top_k) == ("deepseek_v2", 2, 8, 3)
    assert model.config.n_shared_experts == 2 and model.config.first_k_dense_replace == 1
    assert "DeepSeek" in (tmp_path / "MODEL_CARD.md").read_text()


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="smoke"):
        TrainConfig.preset("huge")


def test_a_test_preset_never_overwrites_an_embedded_model_by_default():
    from fate_lab.cli import main

    with pytest.raises(SystemExit, match="--out is required for the 'smoke' preset"):
        main(["train", "--preset", "smoke", "--steps", "1"])


def test_final_held_out_numbers_over_less_than_one_window_are_refused(tmp_path):
    with pytest.raises(ValueError, match="final_eval_tokens=32: give at least one window of seq_len=64"):
        train(TrainConfig.preset("smoke", steps=2, final_eval_tokens=32), tmp_path)
