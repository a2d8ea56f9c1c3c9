"""`python -m fate_lab plan` as a user meets it: every bad input one line and a non-zero exit, strict JSON, and a
plan that never reports a speed for what does not fit. Each case failed before the sizing round (a traceback, a
NaN, or a wrong answer)."""
import json

import pytest
import torch

from fate_lab.cli import main

QWEN = ["--model", "Qwen3-30B-A3B", "--device", "rtx3090"]


def _error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["plan", *argv])
    assert exc.value.code not in (0, None)
    msg = str(exc.value.code)
    assert "\n" not in msg and "Traceback" not in capsys.readouterr().err
    return msg


def _cfg(tmp_path, text: str) -> str:
    p = tmp_path / "config.json"
    p.write_text(text)
    return str(p)


def _qwen_with(tmp_path, **fields) -> str:
    from fate_lab.study.plan_model import CONFIGS_DIR

    cfg = json.loads((CONFIGS_DIR / "Qwen3-30B-A3B" / "config.json").read_text())
    return _cfg(tmp_path, json.dumps({**cfg, **fields}))


@pytest.mark.parametrize("argv,match", [
    (["--budget", "1" + "0" * 400 + "GiB"], "too large to be a memory size"),
    (["--budget", "12"], "--budget '12' has no unit"),
    (["--budget", "12 parsecs"], "is not a size"),
    (["--budget", "30GiB"], "more than the GeForce RTX 3090's 24 GiB"),
    (["--context", "1e8"], "--context 100000000: .* from 1 to 1,048,576"),
    (["--context", "many"], "--context 'many': give a whole number"),
    (["--budget", "2GiB"], "below the working set of every preset: Qwen3-30B-A3B at bfloat16 .* --context 4096"),
    (["--weights", "q4_k_m"], "--weights applies to a placement"),
    (["--n-cpu-moe", "3", "--weights", "q5_foo"], "--weights 'q5_foo': unknown weight format"),
    (["--n-cpu-moe", "3", "--engine", "vllm"], "--engine 'vllm': unknown engine; choose one of llama.cpp"),
    (["--n-cpu-moe", "3", "--host", "ddr9-1x2"], "--host 'ddr9-1x2': give a host name"),
    (["--n-cpu-moe", "3", "--disk", "fast"], "--disk 'fast'"),
    (["--fit", "--n-cpu-moe", "3"], "--fit searches the placements itself"),
])
def test_a_bad_plan_input_is_one_line(capsys, argv, match):
    assert __import__("re").search(match, _error(capsys, *QWEN, *argv))


def test_an_unknown_device_is_one_line(capsys):
    assert "--device 'rtx9999': give a device name" in _error(capsys, "--model", "Qwen3-30B-A3B", "--device", "rtx9999")


@pytest.mark.parametrize("text,match", [("not json", "is not JSON"), ("", "is empty"), ("[1, 2]", "holds a JSON list"),
                                        ('{"hidden_size": 64}', "no 'model_type' field"),
                                        ('{"model_type": "banana"}', "model_type 'banana' is not a family")])
def test_a_config_that_is_not_a_config_is_one_line(capsys, tmp_path, text, match):
    assert match in _error(capsys, "--model", _cfg(tmp_path, text), "--device", "rtx3090")


@pytest.mark.parametrize("field,value", [("hidden_size", -4096), ("num_experts", 0), ("moe_intermediate_size", 0),
                                         ("num_experts_per_tok", 0)])
def test_a_bad_size_names_the_config_field(capsys, tmp_path, field, value):
    msg = _error(capsys, "--model", _qwen_with(tmp_path, **{field: value}), "--device", "rtx3090")
    assert f"config field {field}={value}" in msg


def test_a_trace_of_the_wrong_shape_is_one_line(capsys, tmp_path):
    from fate_lab.model.trace import from_routing_array

    path = from_routing_array(torch.zeros(4, 3, 2, dtype=torch.int64) + torch.tensor([0, 1]), num_experts=8).save(
        tmp_path / "t.safetensors")
    assert "give a trace of this model" in _error(capsys, "--model", "tiny_moe", "--device", "rtx3090",
                                                  "--trace", str(path))


def _strict(text: str) -> dict:
    def refuse(name):
        raise AssertionError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_json_is_strict_and_a_routing_only_trace_has_no_nan_ttft(capsys, tmp_path):
    from fate_lab.model.trace import from_routing_array
    from fate_lab.study.plan_model import model_spec

    s = model_spec("tiny_moe").shape
    ids = torch.stack([torch.randperm(s.num_experts)[:s.top_k] for _ in range(s.num_moe_layers * 6)])
    path = from_routing_array(ids.view(6, s.num_moe_layers, s.top_k), num_experts=s.num_experts).save(
        tmp_path / "r.safetensors")
    main(["plan", "--model", "tiny_moe", "--device", "rtx3090", "--budget", "0.07GiB", "--trace", str(path),
          "--presets", "load_on_demand,lru", "--json"])
    a = _strict(capsys.readouterr().out)
    assert {r["config"] for r in a["rows"]} == {"load_on_demand", "lru"}
    assert all(r["TTFT (ms)"] is None and "no prompt" in r["TTFT note"] for r in a["rows"])
    assert all(r["prefetch recall"] is None for r in a["rows"])  # no predictor: null, never NaN


def test_a_budget_that_fits_one_preset_marks_the_other(capsys):
    main(["plan", "--model", "tiny_moe", "--device", "rtx3090", "--budget", "0.05GiB", "--presets",
          "lru,all_resident", "--json"])
    a = _strict(capsys.readouterr().out)
    assert a["best"] == "lru" and a["skipped"]["all_resident"].startswith("does not fit: every expert resident")


def test_all_resident_never_wins_on_a_card_too_small(capsys):
    main(["plan", "--model", "gpt-oss-120b", "--device", "rtx3090", "--presets", "load_on_demand,all_resident",
          "--json"])
    a = _strict(capsys.readouterr().out)
    assert a["best"] == "load_on_demand" and "does not fit" in a["skipped"]["all_resident"]


def test_a_placement_and_fit_print_and_json(capsys):
    main(["plan", *QWEN, "--weights", "q4_k_m", "--n-cpu-moe", "10", "--host-ram", "64GiB", "--json"])
    a = _strict(capsys.readouterr().out)
    assert a["prediction"]["fits"] and a["prediction"]["flags"] == "-ngl 999 --n-cpu-moe 10"
    main(["plan", "--model", "gpt-oss-120b", "--device", "rtx3090", "--fit"])
    out = capsys.readouterr().out
    assert "smallest --n-cpu-moe" in out and "fate_lab engine, same placement" in out


@pytest.mark.parametrize("argv,match", [(["plan", "--device", "rtx3090"], "required: --model"),
                                        (["plan", *QWEN, "--bogus", "1"], "unrecognized arguments: --bogus"),
                                        (["trace", "--model", "/nonexistent/model"], "does not exist")])
def test_every_sub_command_reports_a_user_error_in_one_line(capsys, argv, match):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code not in (0, None) and match in str(exc.value.code) and "\n" not in str(exc.value.code)
    assert capsys.readouterr().err == ""  # no usage block, no traceback


@pytest.mark.parametrize("host,ghz", [("desktop_ddr4", 3.4), ("epyc_7742", 2.25), ("ddr4-3200x8", 3.0)])
def test_the_runtime_presets_charge_the_host_time_at_the_hosts_clock(capsys, host, ghz):
    # fate_lab's host time per experts call, 78 us measured on a 2.6 GHz core, at the host's all-core clock: a
    # named profile's (host_specs.py: a 5950X-class desktop 3.4 GHz, EPYC 7742 2.25 GHz) or a spec's default 3 GHz.
    # Before, plan charged the desktop's for every --host.
    main(["plan", "--model", "tiny_moe", "--device", "rtx3090", "--budget", "0.05GiB", "--presets", "lru",
          "--host", host, "--json"])
    a = _strict(capsys.readouterr().out)
    assert a["compute"]["call_s"] == pytest.approx(78e-6 * 2.6 / ghz)
