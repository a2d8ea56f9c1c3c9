"""Bad traces and bad recording inputs get errors that name the file, the argument and what is allowed."""
import pytest
import torch

from fate_lab.model.record import record_trace
from fate_lab.model.trace import Trace, from_routing_array


def test_a_trace_file_that_is_a_folder_or_corrupt_is_named(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a folder"):
        Trace.load(tmp_path)
    bad = tmp_path / "t.safetensors"
    from_routing_array(torch.tensor([[[0, 1]], [[1, 2]]]), num_experts=3).save(bad)
    bad.write_bytes(bad.read_bytes()[:40])  # truncated
    with pytest.raises(ValueError, match="t.safetensors is not a readable safetensors file"):
        Trace.load(bad)
    with pytest.raises(FileNotFoundError, match="no trace file"):
        Trace.load(tmp_path / "nothing.safetensors")


def test_an_empty_routing_array_is_refused_before_it_is_saved():
    with pytest.raises(ValueError, match="0 tokens"):
        from_routing_array(torch.zeros(0, 2, 2, dtype=torch.long), num_experts=4)


@pytest.mark.parametrize("shape,says", [((2, 0, 2), "0 layers"), ((2, 2, 0), "k=0 experts per token")])
def test_a_routing_array_without_layers_or_experts_is_refused(shape, says):
    with pytest.raises(ValueError, match=rf"routing has shape \({shape[0]}, {shape[1]}, {shape[2]}\): {says}; .*"
                                         r"\[tokens, layers >= 1, k >= 1\]"):
        from_routing_array(torch.zeros(shape, dtype=torch.long), num_experts=4)


@pytest.mark.parametrize("shape", [(0, 2, 2), (3, 0, 2), (3, 2, 0)])
def test_an_empty_trace_file_is_refused_as_from_routing_array_would(tmp_path, shape):
    """A file holding 0 tokens (or 0 layers, or k = 0) -- written by hand, since Trace.save of a routing array never
    writes one -- is refused on load, naming the file and its shape."""
    from safetensors.torch import save_file

    n = shape[0]
    tensors = {"experts": torch.zeros(shape, dtype=torch.int64)}
    tensors.update({k: torch.zeros(n, dtype=torch.int64) for k in ("token_ids", "prompt_id", "position")})
    tensors["phase"] = torch.ones(n, dtype=torch.int64)
    path = tmp_path / "empty.safetensors"
    save_file(tensors, str(path), metadata={"fate_lab_trace": '{"format_version": 1, "num_experts": 4}'})
    with pytest.raises(ValueError, match=rf"empty\.safetensors holds an empty trace: .*shape {tuple(shape)}".replace(
            "(", r"\(").replace(")", r"\)")):
        Trace.load(path)


def test_router_weights_of_the_wrong_shape_are_refused_at_once():
    ex = torch.tensor([[[0, 1], [1, 2]]])
    kw = dict(experts=ex, token_ids=torch.zeros(1, dtype=torch.long), phase=torch.ones(1, dtype=torch.long),
              prompt_id=torch.zeros(1, dtype=torch.long), position=torch.zeros(1, dtype=torch.long),
              gate_inputs=torch.zeros(1, 2, 8))
    with pytest.raises(ValueError, match="router_weights must be"):
        Trace(**kw, router_weights=torch.zeros(2, 3, 5))  # hidden 5, gate inputs 8
    with pytest.raises(ValueError, match="router_weights must be"):
        Trace(**kw, router_weights=torch.zeros(1, 3, 8))  # one layer for two
    assert Trace(**kw, router_weights=torch.zeros(2, 3, 8)).num_layers == 2


def test_record_trace_refuses_what_it_cannot_record(tiny_models):
    model = tiny_models("olmoe", seed=0)
    with pytest.raises(ValueError, match="non-empty list"):
        record_trace(model, None, [], progress=False)
    with pytest.raises(ValueError, match="decode_tokens=2.5"):
        record_trace(model, None, [[1, 2]], decode_tokens=2.5, progress=False)
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 128\)"):
        record_trace(model, None, [[1, 500]], decode_tokens=1, progress=False)


def test_adapting_an_offloaded_model_says_what_to_do(tiny_models):
    from fate_lab.core.config import OffloadConfig
    from fate_lab.model.adapters import adapt
    from fate_lab.offloading.runtime import offload

    model = tiny_models("olmoe", seed=0)
    with offload(model, OffloadConfig.preset("lru", link="instant", slots=2)):
        with pytest.raises(RuntimeError, match="adapt the model before offload"):
            adapt(model)
    adapt(model)  # closed: fine again
