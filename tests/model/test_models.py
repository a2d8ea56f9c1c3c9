"""models.py: load_model refuses a file path, missing or empty tokenizers and corrupted (NaN) weights.

Fixtures are folders in tmp_path built from the embedded model in data/tiny_moe; the weights are
linked, not copied, except where a test writes a modified copy. Only one test loads the weights.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from fate_lab.model.models import load_model
from fate_lab.paths import TINY_MOE_DIR

pytestmark = pytest.mark.skipif(not (TINY_MOE_DIR / "model.safetensors").is_file(),
                                reason="embedded model data/tiny_moe not built yet")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _model_folder(dst: Path, files: tuple[str, ...], weights: bool = True) -> Path:
    """dst holding config.json, the listed files of the embedded model and (linked) model.safetensors."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *files):
        shutil.copy(TINY_MOE_DIR / name, dst / name)
    if weights:
        try:
            os.symlink(TINY_MOE_DIR / "model.safetensors", dst / "model.safetensors")
        except OSError:  # no symlinks here: copy the 65 MB
            shutil.copy(TINY_MOE_DIR / "model.safetensors", dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_file_path_is_named_a_file(name):
    path = TINY_MOE_DIR / name
    with pytest.raises(NotADirectoryError, match=r"is a file, not a model folder.*config\.json.*\*\.safetensors") as e:
        load_model(path)
    assert str(path) in str(e.value) and str(TINY_MOE_DIR) in str(e.value).replace(str(path), "")
    assert "does not exist" not in str(e.value)


def test_embedded_models_are_picked_by_name():
    from fate_lab.paths import EMBEDDED_MODELS, model_dir, model_name

    assert model_dir(None) == model_dir("") == TINY_MOE_DIR == model_dir("tiny_moe")
    assert model_dir("tiny_deepseek") == EMBEDDED_MODELS["tiny_deepseek"]
    assert model_dir("./tiny_moe").name == "tiny_moe" and model_dir("./tiny_moe") != TINY_MOE_DIR  # a path stays one
    assert model_name(TINY_MOE_DIR) == "tiny_moe" and model_name("/x/other") == "other"


def test_an_unknown_name_lists_the_embedded_models():
    with pytest.raises(FileNotFoundError, match=r"does not exist.*'tiny_moe', 'tiny_deepseek'"):
        load_model("tiny_nonesuch")


def test_a_missing_folder_still_says_it_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")


@pytest.mark.parametrize("files", [(), ("tokenizer_config.json",)], ids=["none", "config_only"])
def test_a_folder_without_tokenizer_files_is_refused(tmp_path, files):
    # before: no tokenizer_config.json gave a tokenizer with an empty vocabulary that encoded every string to []
    folder = _model_folder(tmp_path / "m", files)
    with pytest.raises(FileNotFoundError, match=r"no tokenizer files in .*expected tokenizer\.json"):
        load_model(folder)


def test_a_tokenizer_with_an_empty_vocabulary_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = _model_folder(tmp_path / "m", ("tokenizer_config.json",))
    empty = Tokenizer(models.BPE())  # a valid tokenizer.json with no vocabulary
    empty.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    empty.save(str(folder / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"encodes text to no tokens"):
        load_model(folder)


def test_a_folder_without_config_is_refused(tmp_path):
    folder = _model_folder(tmp_path / "m", TOKENIZER_FILES)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no config\.json in"):
        load_model(folder)


def test_nan_weights_are_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _model_folder(tmp_path / "m", TOKENIZER_FILES, weights=False)
    tensors = load_file(str(TINY_MOE_DIR / "model.safetensors"))
    bad = "model.layers.2.self_attn.q_proj.weight"  # a name the file and the model share
    tensors[bad][7, 11] = float("nan")
    tensors[bad][30, 0] = float("inf")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    with pytest.raises(ValueError, match=rf"parameter '{bad}'.*holds 2 non-finite values.*first at index \(7, 11\)"):
        load_model(folder)


def test_no_hub_kernels_replace_the_modeling_files_layers():
    # transformers >= 5.25 kernelizes a loaded model by default (layers swapped for kernels from the Hub: a download,
    # and other math than the exactness tests check); the loaders turn that off
    model, _ = load_model(None)
    assert model.use_kernels is False
