"""Training: a few steps lower the loss; the output folder loads back through load_model."""
import math

import pytest
import torch

from fate_lab.model.corpus import heldout_prompts, load_corpus
from fate_lab.model.train import TrainConfig, per_layer_balance_loss, train


def test_corpus_split_is_by_whole_documents():
    docs = load_corpus()
    train_titles = {(d["source"], d["title"]) for d in docs if d["split"] == "train"}
    val_titles = {(d["source"], d["title"]) for d in docs if d["split"] == "val"}
    assert val_titles and train_titles and not (train_titles & val_titles)
    assert {d["source"] for d in docs} == {"web_bible", "jargon_file", "devils_dictionary"}
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
    model, tok = load_model(tmp_path)
    ids = tok("The word of the day", return_tensors="pt")["input_ids"]
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok))


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="smoke"):
        TrainConfig.preset("huge")
