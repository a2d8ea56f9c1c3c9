"""A broken checkpoint folder is refused naming the file, what is wrong and what to do (`model/folder.py`), by
`load_offloaded` and `load_model` alike: truncated or corrupt safetensors headers, a shard index that is not JSON or
lists a missing shard, a config.json that is not JSON, not an object, without or with an unknown model_type, or with
a dtype torch lacks, an expert tensor deleted from its file, weights whose shapes are not the config's, and a
transformers release whose expert math is not fate_lab's."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fate_lab
from fate_lab.core.config import OffloadConfig
from fate_lab.model import experts as ex
from fate_lab.model.folder import BadCheckpointFile, read_config
from fate_lab.model.testing import tiny_model
from fate_lab.offloading.load import load_offloaded
from fate_lab.paths import TINY_MOE_DIR

CONFIG = OffloadConfig.preset("fate", link="instant", store="ssd", slots=4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{"one": a tiny OLMoE in one file, "shards": the same in 7 shards with an index}; both with tokenizer files."""
    root = tmp_path_factory.mktemp("ckpt")
    model = tiny_model("olmoe", seed=0)
    out = {"one": root / "one", "shards": root / "shards"}
    model.save_pretrained(out["one"])
    model.save_pretrained(out["shards"], max_shard_size="100KB")
    for folder in out.values():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TINY_MOE_DIR / name, folder / name)
    assert len(list(out["shards"].glob("*.safetensors"))) > 2
    return out


@pytest.fixture
def ckpt(saved, tmp_path):
    """A fresh copy of a saved checkpoint, to break: ckpt("one") or ckpt("shards")."""
    def copy(kind: str = "one") -> Path:
        dst = tmp_path / kind
        shutil.copytree(saved[kind], dst)
        return dst
    return copy


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _opened_by_both(folder: Path, *fragments: str, error=BadCheckpointFile) -> None:
    """load_offloaded and load_model both refuse the folder with one error holding every fragment."""
    for load in (lambda: load_offloaded(folder, CONFIG), lambda: fate_lab.load_model(folder)):
        with pytest.raises(error) as err:
            load()
        missing = [f for f in fragments if f not in str(err.value)]
        assert not missing, f"{err.value!s} lacks {missing}"


# --- safetensors headers ------------------------------------------------------------------------------------------
def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])


HEADERS = {  # what safetensors says about each corruption
    "truncated": (_truncate, "incomplete metadata"),
    "header too small": (lambda f: f.write_bytes(b"\x01\x00"), "header too small"),
    "header length": (lambda f: f.write_bytes(struct.pack("<Q", 4) + b"{}"), "invalid header length"),
    "header too large": (lambda f: f.write_bytes(struct.pack("<Q", 10**12) + f.read_bytes()[8:]), "header too large"),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_a_corrupt_safetensors_file_is_named(ckpt, case):
    folder = ckpt("one")
    corrupt, says = HEADERS[case]
    corrupt(folder / "model.safetensors")
    _opened_by_both(folder, str(folder / "model.safetensors"), says, "truncated or corrupt", "re-copy")


def test_a_corrupt_shard_is_named(ckpt):
    folder = ckpt("shards")
    shard = sorted(folder.glob("*.safetensors"))[1]
    shard.write_bytes(b"\x01")
    _opened_by_both(folder, str(shard), "header too small")


# --- the shard index ------------------------------------------------------------------------------------------------
def test_an_index_that_is_not_json_is_named(ckpt):
    folder = ckpt("shards")
    (folder / "model.safetensors.index.json").write_text("{not json")
    for load in (lambda: load_offloaded(folder, CONFIG), lambda: fate_lab.load_model(folder)):
        with pytest.raises(BadCheckpointFile, match=r"model\.safetensors\.index\.json is not valid JSON \(.* line 1, "
                                                    r"column 2\)"):
            load()


def test_an_index_without_a_weight_map_or_with_a_missing_shard_is_named(ckpt):
    folder = ckpt("shards")
    index = folder / "model.safetensors.index.json"
    good = index.read_text()
    index.write_text("[1, 2]")
    with pytest.raises(BadCheckpointFile, match=r"index\.json has no \"weight_map\""):
        load_offloaded(folder, CONFIG)
    index.write_text(good)
    gone = sorted(folder.glob("*.safetensors"))[-1]
    gone.unlink()
    with pytest.raises(BadCheckpointFile, match=rf"lists shards that are not in .*{gone.name}.*copy the missing"):
        load_offloaded(folder, CONFIG)


# --- config.json ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,says", [
    ("{\"model_type\": \"olmoe\",", "is not valid JSON"),
    ("", "is empty"),
    ("[1, 2, 3]", "holds a JSON list, not an object"),
    ("{\"hidden_size\": 64}", "has no \"model_type\""),
    ("{\"model_type\": \"olmoe9\"}", "'olmoe9' is not a model type of the installed transformers"),
])
def test_a_config_that_is_not_a_config_is_named(ckpt, text, says):
    folder = ckpt("one")
    (folder / "config.json").write_text(text)
    with pytest.raises(BadCheckpointFile) as err:
        read_config(folder)
    assert str(folder / "config.json") in str(err.value) and says in str(err.value)
    _opened_by_both(folder, str(folder / "config.json"), says)


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_a_dtype_torch_lacks_is_named_with_the_allowed_ones(ckpt, key):
    folder = ckpt("one")
    _edit_config(folder, **{key: "banana"})
    _opened_by_both(folder, "config.json", f"\"{key}\": 'banana' is not a torch dtype", "\"bfloat16\"")


def test_a_config_transformers_rejects_is_named(ckpt):
    folder = ckpt("one")
    _edit_config(folder, hidden_size="big")
    with pytest.raises(BadCheckpointFile, match=r"config\.json is not a valid 'olmoe' config"):
        read_config(folder)


# --- tensors: deleted, wrong shapes ---------------------------------------------------------------------------------
def test_an_expert_tensor_deleted_from_its_file_is_named_when_opened(ckpt):
    folder = ckpt("one")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BadCheckpointFile) as err:
        load_offloaded(folder, CONFIG)
    for part in (str(folder), "lacks 1 routed-expert tensor", "model.layers.1.mlp.experts.3.down_proj.weight",
                 "expert 3 of MoE layer 1", "re-export"):
        assert part in str(err.value)


def test_a_fused_tensor_with_fewer_experts_is_named_when_opened(ckpt, tmp_path):
    """A checkpoint that stores each layer's experts fused ([E, ...]) but holds fewer than the config's E."""
    model = tiny_model("qwen2_moe", seed=0)
    folder = tmp_path / "fused"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["model.layers.0.mlp.experts.down_proj"] = state["model.layers.0.mlp.experts.down_proj"][:5].contiguous()
    folder.mkdir()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    with pytest.raises(BadCheckpointFile, match=r"experts 5\.\.7 of model\.layers\.0\.mlp\.experts\.down_proj "
                                                r"\(model\.safetensors holds 5 of MoE layer 0's 8\)"):
        load_offloaded(folder, CONFIG)


def test_weights_whose_shapes_are_not_the_configs_are_named_not_the_above_report(ckpt):
    """transformers' own error says "look at the above report!"; here the tensor, both shapes and the fix."""
    folder = ckpt("one")
    _edit_config(folder, vocab_size=130)
    _opened_by_both(folder, str(folder), "model.embed_tokens.weight", "(128, 64)", "(130, 64)",
                    "config.json and the weights are not the same model")


# --- the installed transformers' expert math --------------------------------------------------------------------------
def test_load_offloaded_probes_the_expert_math_with_experts_read_from_the_files(ckpt, tmp_path, monkeypatch):
    """The model holds no experts (they stay in the files), so the offload-time probe reads two from disk; when the
    installed release computes them otherwise (simulated: fate_lab made to sum in float32), the folder is refused."""
    model = tiny_model("mixtral", seed=0, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    opened, _, rt = load_offloaded(tmp_path / "bf16", CONFIG)
    rt.close()
    real = ex.eager_facts
    monkeypatch.setattr(ex, "eager_facts", lambda cls: ("float32", *real(cls)[1:]))
    with pytest.raises(NotImplementedError, match=r"cannot offload MoE layer 0: mixtral: MixtralExperts computes other "
                                                  r"numbers .* constraints\.txt"):
        load_offloaded(tmp_path / "bf16", CONFIG)
