"""Published speeds of MoE inference beside the sizing tool's predictions, each figure one `plan` command.

For every published figure with a stated setup (docs/published/published.json): the exact
`python -m fate_lab plan ...` command that expresses it, the prediction (the same `study.plan_cli.answer` the
command prints), predicted / published, whether the figure was used to calibrate an engine constant
("calibration": `hardware/engines.py` names it) or is held out, whether it depends on routing, and the reason
for every miss over 25%. The summary line counts the held-out figures alone. `--calibrate` solves each
calibrated constant again from its one figure (bisection, the others fixed) and prints it beside the committed
value: a constant that drifts from its source shows here. Where the separate `moe-fit` package answers the same
deployment offline (given a python that has it: `--moefit-python`), its storage-bound range is put beside ours.

    python -m benchmarks.bench_published            # writes docs/published_vs_predicted.md, the summary line
                                                    # into README.md and docs/sizing.md, a --fit run into the latter
    python -m benchmarks.bench_published --calibrate
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "docs" / "published" / "published.json"
WITHIN = 0.25


@dataclasses.dataclass(frozen=True)
class Case:
    """One published figure as one plan command."""

    id: str  # published.json id
    command: str  # the arguments after `python -m fate_lab plan`
    field: str = "decode"  # the published value compared: decode (tok/s), prefill (tok/s) or latency (s/token)
    note: str = ""  # why a miss over 25% is what it is
    routing: str = ""  # how the figure depends on routing, where it does


def _cmd(model: str, device: str, rest: str) -> str:
    return f"--model {model} --device {device} {rest}"


GPT120 = "--weights mxfp4_moe"
CASES = [
    Case("hwc_gptoss120b_3090_ncpumoe27", _cmd("gpt-oss-120b", "rtx3090", f"{GPT120} --n-cpu-moe 27 --host "
         "ddr4-3200x4,cores=16 --host-ram 64GiB --disk nvme_gen4 --prompt 500"),
         note="our bytes put 43 GiB of experts on the CPU, inside the 64 GB of RAM: RAM-bound, ~30 tok/s. 1.6 tok/s "
              "needs ~40% of the expert reads from disk, i.e. only ~26 GiB of page cache for them: what else held "
              "the RAM (Open WebUI ran beside it) is not stated, and the channel count of its 64 GB is not either"),
    Case("hwc_gptoss120b_3090_ngl13", _cmd("gpt-oss-120b", "rtx3090", f"{GPT120} -ngl 13 --host ddr4-3200x4,cores=16 "
         "--host-ram 64GiB --disk nvme_gen4 --prompt 71"), note="as the row above: the CPU's 40 GiB fit the stated "
         "64 GB, so we predict a RAM-bound speed; the measured 0.9 tok/s is ~20x slower, a disk-bound run"),
    Case("hwc_gptoss120b_3090_ncpumoe27", _cmd("gpt-oss-120b", "rtx3090", f"{GPT120} --n-cpu-moe 27 --host "
         "ddr4-3200x4,cores=16 --host-ram 64GiB --disk nvme_gen4 --prompt 500"), field="prefill",
         note="the prompt streams the 27 CPU layers' experts over PCIe 4.0 each 512-token batch (llama.cpp's op "
              "offload): bound by the link, not by RAM"),
    Case("localllama_ktrans21_llamacpp_cpu_q4km", _cmd("DeepSeek-V3", "none", "--weights q4_k_m --cpu-only --host "
         "epyc_7773x --prompt 500")),
    Case("localllama_ktrans21_ktrans_q4km", _cmd("DeepSeek-V3", "rtx3090ti", "--weights q4_k_m --cpu-moe --engine "
         "ktransformers --host epyc_7773x --prompt 500")),
    Case("ktransformers_v02_single_socket_8", _cmd("DeepSeek-V3", "rtx4090d", "--weights q4_k_m --cpu-moe --engine "
         "ktransformers --host ddr5-4800x8,cores=32,ghz=2.2,simd=avx512 --prompt 500")),
    Case("ktransformers_v02_dual_socket_8", _cmd("DeepSeek-V3", "rtx4090d", "--weights q4_k_m --cpu-moe --engine "
         "ktransformers --host xeon_gold_6454s --prompt 500")),
    Case("ktransformers_v02_llamacpp_8", _cmd("DeepSeek-V3", "none", "--weights q4_k_m --cpu-only --host "
         "xeon_gold_6454s --prompt 500"), note="llama.cpp on 2 x 32 cores: we give it no gain from the second "
         "socket and its threads' share of the cores of one"),
    Case("ktransformers_v021_8experts_1K", _cmd("DeepSeek-V3", "rtx4090", "--weights q4_k_m --cpu-moe --engine "
         "ktransformers --host xeon_gold_6454s --prompt 969"), note="V0.2.1 is ~15% faster than V0.2 (its "
         "release note), whose figures calibrated the kTransformers engine"),
    Case("ollama_pr15207_qwen3_3060_expert_offload", _cmd("Qwen3-30B-A3B", "rtx3060", "--weights q4_k_m --n-cpu-moe 21 "
         "--host-ram 24GiB"), note="the CPU and its memory are not stated (a 2-channel DDR4-3200 desktop taken) "
         "and neither is the N ollama chose (the smallest that fits taken); ollama's own engine, not llama.cpp's"),
    Case("ollama_pr15207_qwen3_3060_layer_split", _cmd("Qwen3-30B-A3B", "rtx3060", "--weights q4_k_m -ngl 28 "
         "--host-ram 24GiB"), note="as above; -ngl 28 is the largest that fits by our bytes"),
    Case("nvforum_dgx_spark_gptoss120b_tg32", _cmd("gpt-oss-120b", "dgx_spark", f"{GPT120} --host dgx_spark_cpu "
         "-ngl 999 --prompt 32")),
    Case("jetsonhacks_dgx_spark_gptoss20b_tg32", _cmd("gpt-oss-20b", "dgx_spark", f"{GPT120} --host dgx_spark_cpu "
         "-ngl 999 --prompt 32")),
    Case("lmsys_dgx_spark_gptoss20b", _cmd("gpt-oss-20b", "dgx_spark", f"{GPT120} --host dgx_spark_cpu -ngl 999 "
         "--prompt 2048"), note="Ollama's own gpt-oss engine, not llama.cpp: llama.cpp on the same box runs 79.7 "
         "tok/s (jetsonhacks' row), which we predict within 25%"),
    Case("llamacpp_pr15077_2x5090_ncpumoe3", _cmd("gpt-oss-120b", "rtx5090", f"{GPT120} --gpus 2 --n-cpu-moe 3")),
    Case("llamacpp_pr16991_pro6000_gptoss20b", _cmd("gpt-oss-20b", "rtx_pro_6000", f"{GPT120} -ngl 999 --prompt 1")),
    Case("llmgarage_gptoss120b_dual3090", _cmd("gpt-oss-120b", "rtx3090", f"{GPT120} --gpus 2 --n-cpu-moe 26 --host "
         "ryzen_7_5800x --host-ram 64GiB --disk nvme_gen4"), note="published as 10-17 tok/s (13.5 taken); its "
         "--split-mode row and the CPU's two DDR4 channels"),
    Case("ik_llama_gptoss120b_4080_5975wx", _cmd("gpt-oss-120b", "rtx4080", f"{GPT120} --cpu-moe --host "
         "threadripper_pro_5975wx --prompt 1"), note="the RAM configuration is not stated (8 channels taken); "
         "ik_llama.cpp runs with llama.cpp's constants"),
    Case("llmfit_qwen3_30b_rtx2080", _cmd("Qwen3-30B-A3B", "rtx2080", "--weights q4_k_m --n-cpu-moe 36 --host "
         "i9_10900x")),
    Case("llmfit_dscoderv2lite_rtx2080", _cmd("DeepSeek-V2-Lite", "rtx2080", "--weights q4_k_m --n-cpu-moe 16 --host "
         "i9_10900x"), note="DeepSeek-Coder-V2-Lite, the DeepSeek-V2-Lite shape"),
    Case("moefit_validation_395_qwen3coder", _cmd("Qwen3-30B-A3B", "none", "--weights q4_k_m --cpu-only --host "
         "ryzen_ai_max_395 --host-ram 14GiB --disk nvme_gen4"),
         note="we read the missing experts in the kernel's 128 KiB read-ahead windows (as this machine's mmap run "
              "read its experts in 8 MiB windows: benchmarks/results/big_disk_*.md), 16 in flight: the disk's "
              "3.2 GB/s. The run's 0.3 tok/s means ~0.12 GB/s, single 4 KiB pages with few in flight: the "
              "kernel's read-around switched off (it stops it for a file whose faults keep missing their "
              "windows), which a static plan cannot foresee"),
    Case("fiddler_abstract", _cmd("Mixtral-8x7B-v0.1", "quadro_rtx6000", "--weights bf16 --n-cpu-moe 25 --host "
         "xeon_gold_6126"), routing="Fiddler keeps 56 popular experts on the GPU (25.2% hit rate); taken here as "
         "7 layers' 56 experts (a 25% share), which llama.cpp's kernels compute",
         note="published as '>3'; Fiddler's own CPU kernels (AVX512_BF16) and popularity placement"),
    Case("hwc_gptoss120b_3090_ngl13", _cmd("gpt-oss-120b", "rtx3090", f"{GPT120} -ngl 13 --host ddr4-3200x4,cores=16 "
         "--host-ram 64GiB --disk nvme_gen4 --prompt 71"), field="prefill"),
    Case("localllama_ktrans21_llamacpp_cpu_q4km", _cmd("DeepSeek-V3", "none", "--weights q4_k_m --cpu-only --host "
         "epyc_7773x --prompt 500"), field="prefill"),
    Case("localllama_ktrans21_ktrans_q4km", _cmd("DeepSeek-V3", "rtx3090ti", "--weights q4_k_m --cpu-moe --engine "
         "ktransformers --host epyc_7773x --prompt 500"), field="prefill",
         note="kTransformers computes a prompt's experts on the CPU; we charge 40% of the EPYC's AVX2 FP32 peak (an "
              "estimate, no prefill constant is calibrated): its int8/AVX2 kernels reach twice that here"),
    Case("ktransformers_v02_single_socket_8", _cmd("DeepSeek-V3", "rtx4090d", "--weights q4_k_m --cpu-moe --engine "
         "ktransformers --host ddr5-4800x8,cores=32,ghz=2.2,simd=avx512 --prompt 500"), field="prefill"),
    Case("ktransformers_v02_dual_socket_8", _cmd("DeepSeek-V3", "rtx4090d", "--weights q4_k_m --cpu-moe --engine "
         "ktransformers --host xeon_gold_6454s --prompt 500"), field="prefill"),
    Case("ktransformers_v02_llamacpp_8", _cmd("DeepSeek-V3", "none", "--weights q4_k_m --cpu-only --host "
         "xeon_gold_6454s --prompt 500"), field="prefill",
         note="llama.cpp of February 2025 had no MLA: it expanded DeepSeek's latent KV to 128 full heads, whose "
              "attention FLOPs our model leaves out (it charges the weights' FLOPs only)"),
    Case("moeinfinity_issue_a5000_mixtral", _cmd("Mixtral-8x7B-v0.1", "rtx_a5000", "--presets load_on_demand "
         "--budget 23GiB"), field="latency", routing="MoE-Infinity caches and prefetches experts: load-on-demand "
         "is its no-hit bound"),
    Case("moeinfinity_issue_a5000_dsv2lite", _cmd("DeepSeek-V2-Lite", "rtx_a5000", "--presets load_on_demand"),
         field="latency", routing="as above"),
    Case("moeinfinity_issue_a5000_qwen3_30b", _cmd("Qwen3-30B-A3B", "rtx_a5000", "--presets load_on_demand"),
         field="latency", routing="as above"),
]


@dataclasses.dataclass(frozen=True)
class SimCase:
    """A figure of a runtime's own mechanism (load on demand of quantized experts): the simulator's preset with
    fate_lab's INT2/INT3 experts, run as the Python call shown (no command-line flag sets a preset's precision)."""

    id: str
    model: str
    device: str
    link: str
    quant: str
    note: str = ""

    @property
    def command(self) -> str:
        return (f"plan.plan({self.model!r}, {self.device!r}, link={self.link!r}, presets=('load_on_demand',)) with "
                f"OffloadConfig.preset('load_on_demand', quant={self.quant!r})")


_MO = ("our {q} experts are {qb} bits a weight against their ~{tb}; each on-demand load in their code costs a fixed "
       "overhead the bytes alone do not show (their per-expert rows reach under half the bandwidth of their "
       "whole-layer rows on the same GPU)")
SIM_CASES = [SimCase(f"mixtral_offloading_wo_{b}_{g}", "Mixtral-8x7B-v0.1", dev, link, q, _MO.format(q=q, qb=qb, tb=tb))
             for b, q, qb, tb in (("2bit", "int2", 3.0, "2.6"), ("3bit", "int3", 3.5, "3.3"))
             for g, dev, link in (("T4", "t4", "pcie3_x16_cloud"), ("3060", "rtx3060", "pcie3_x16"),
                                  ("A100", "a100_80gb", "pcie4_x16_cloud"))]


def run_sim_case(case: SimCase) -> float:
    """Decode tok/s of a SimCase: the simulator over a stand-in routing (load on demand does not depend on it)."""
    import torch

    from fate_lab.core.config import OffloadConfig
    from fate_lab.core.costs import compute_for
    from fate_lab.hardware.links import LINK_PROFILES
    from fate_lab.hardware.setups import Hardware
    from fate_lab.sim.simulate import simulate
    from fate_lab.study.plan import model_spec, standin_trace

    spec = model_spec(case.model, torch.float16)
    compute = compute_for(spec.shape, case.device, "desktop_ddr4", spec.vocab_size, spec.tied, context=256)
    cfg = OffloadConfig.preset("load_on_demand", quant=case.quant, context_len=256)
    hw = Hardware(compute, LINK_PROFILES[case.link])
    return simulate(standin_trace(spec.shape), cfg, hw, spec.shape).decode_tok_s


# the decode figures the sizing issue lists to be checked (the rest are welcome extras)
LISTED = {"hwc_gptoss120b_3090_ncpumoe27", "localllama_ktrans21_llamacpp_cpu_q4km", "localllama_ktrans21_ktrans_q4km",
          "ktransformers_v02_single_socket_8", "ktransformers_v02_dual_socket_8", "ktransformers_v02_llamacpp_8",
          "ollama_pr15207_qwen3_3060_expert_offload", "ollama_pr15207_qwen3_3060_layer_split",
          "nvforum_dgx_spark_gptoss120b_tg32", "llamacpp_pr15077_2x5090_ncpumoe3", "moefit_validation_395_qwen3coder",
          "fiddler_abstract", "moeinfinity_issue_a5000_mixtral", "moeinfinity_issue_a5000_dsv2lite",
          "moeinfinity_issue_a5000_qwen3_30b"}


def _published(entry: dict, field: str) -> float:
    v = entry["value"]
    if isinstance(v, str):  # a range "10-17" (its middle) or a bound ">3" (the bound)
        parts = [float(x) for x in v.strip("><~ ").split("-")]
        return sum(parts) / len(parts)
    if not isinstance(v, dict):
        return float(v)
    for k, x in v.items():
        if (field == "decode" and ("decode" in k or "generation" in k)) or (field == "prefill" and "prefill" in k) \
                or (field == "latency" and "latency" in k):
            return float(x)
    raise KeyError(f"no {field} figure in {entry['id']}: {list(v)}")


def run_case(case: Case, engines: dict | None = None) -> float | None:
    """The predicted value of one case: tok/s (decode or prefill) or s/token (latency)."""
    from fate_lab.study.plan_cli import add_plan_parser, answer

    ap = argparse.ArgumentParser()
    add_plan_parser(ap.add_subparsers())
    args = ap.parse_args(["plan", *shlex.split(case.command)])
    if engines is not None:
        from fate_lab.hardware import engines as E

        old = dict(E.ENGINES)
        E.ENGINES.update(engines)
        try:
            a = answer(args)
        finally:
            E.ENGINES.clear()
            E.ENGINES.update(old)
    else:
        a = answer(args)
    if a["mode"] == "presets":
        tok = a["rows"][0]["decode tok/s"] if a["rows"] else None
        return None if not tok else 1.0 / tok
    r = a["prediction"]
    return r["prefill tok/s"] if case.field == "prefill" else r["decode tok/s"]


def _lru_free(fid: str) -> dict:
    """The 'W/o LRU cache & pre-loading' entry of a mixtral-offloading id (the id is shared by two tables)."""
    return next(f for f in json.loads(PUBLISHED.read_text())["figures"] if f["id"] == fid and "LRU" in f["system"])


def calibration_ids() -> dict[str, str]:
    """published id -> the engine whose constant it calibrated."""
    from fate_lab.hardware.engines import ENGINES

    out = {}
    for e in ENGINES.values():
        for i in e.calibrated_on:
            out[i] = e.name
    return out


def _solve(case: Case, target: float, engine: str, field: str, lo: float, hi: float, extra=()) -> float:
    """The value of ENGINES[engine].<field> (and the same field of `extra` engines) at which case predicts target."""
    from fate_lab.hardware.engines import ENGINES

    def pred(x):
        eng = {n: dataclasses.replace(ENGINES[n], **{field: x}) for n in (engine, *extra)}
        return run_case(case, eng)

    rising = pred(hi) > pred(lo)
    for _ in range(40):
        mid = (lo + hi) / 2
        if (pred(mid) < target) == rising:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def calibrate() -> list[tuple[str, str, float, float]]:
    """(engine.constant, figure, solved, committed) for every calibrated constant, solved in dependency order."""
    from fate_lab.hardware.engines import ENGINES

    figures = {f["id"]: f for f in json.loads(PUBLISHED.read_text())["figures"]}
    by_id = {c.id: c for c in CASES if c.field != "prefill"}
    plan = [("llama.cpp", "layer_s", "llamacpp_pr16991_pro6000_gptoss20b", 1e-6, 200e-6, ("ktransformers",)),
            ("llama.cpp", "cpu_core_bps", "llmfit_qwen3_30b_rtx2080", 1e9, 20e9, ("ktransformers", "fate_lab")),
            ("llama.cpp", "cpu_bw_eff", "localllama_ktrans21_llamacpp_cpu_q4km", 0.05, 1.0, ("ktransformers",)),
            ("ktransformers", "numa_gain", "ktransformers_v02_dual_socket_8", 0.0, 1.0, ())]
    out = []
    for eng, field, fid, lo, hi, extra in plan:
        solved = _solve(by_id[fid], _published(figures[fid], "decode"), eng, field, lo, hi, extra)
        out.append((f"{eng}.{field}", fid, solved, getattr(ENGINES[eng], field)))
    return out


def moefit_answer(case: Case, python: str | None) -> str:
    """moe-fit's storage-bound range for a disk-bound case, run by a python that has moe-fit; else why not."""
    if not python:
        return "not installed"
    if "--disk" not in case.command or "--host-ram" not in case.command:
        return "— (no disk tier: moe-fit says 'compute decides')"
    from fate_lab.study.plan_cli import add_plan_parser, setting_of

    ap = argparse.ArgumentParser()
    add_plan_parser(ap.add_subparsers())
    s = setting_of(ap.parse_args(["plan", *shlex.split(case.command)]))
    p, fmt = s.spec.params, s.fmt
    tensors = [[f"blk.{i}.ffn_up_exps.weight", int(p.layers[i].experts * p.expert_bytes(fmt, i))]
               for i in range(p.n_layers) if p.layers[i].experts]
    tensors.append(["resident.weight", int(p.total_bytes(fmt) - sum(t[1] for t in tensors))])
    job = {"arch": "x", "layers": p.n_layers, "experts": p.n_experts, "used": p.top_k, "tensors": tensors,
           "vram": int((s.device.memory_gib if s.device else 0) * 2**30 * s.gpus), "ram": int(s.host.ram_bytes()),
           "bps": s.disk.bandwidth, "context": s.context}
    script = ("import json,sys; from moefit.gguf import Model, Tensor; from moefit.machine import Machine; "
              "from moefit.plan import make; j=json.load(sys.stdin); "
              "m=Model('x', {'general.architecture': 'x', 'x.block_count': j['layers'], 'x.expert_count': "
              "j['experts'], 'x.expert_used_count': j['used']}, [Tensor(n, (1,), 0, 0, b) for n, b in j['tensors']]); "
              "r=make(m, Machine(j['vram'], j['ram'], 10**15, '', j['bps']), j['context']); "
              "print(r.summary())")
    try:
        run = subprocess.run([python, "-c", script], input=json.dumps(job), capture_output=True, text=True, timeout=60)
    except OSError as exc:
        return f"not run ({exc})"
    return run.stdout.strip() or f"not run: {run.stderr.strip().splitlines()[-1][:120]}"


FIT_EXAMPLE = "--model Qwen3-30B-A3B --device rtx3060 --weights q4_k_m --host-ram 32GiB --fit"


def write_region(path: Path, name: str, text: str) -> None:
    """Replace what stands between `<!-- name:begin -->` and `<!-- name:end -->` in a markdown file."""
    doc = path.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in doc or end not in doc:
        raise ValueError(f"{path} has no {begin} ... {end} region to write")
    head, rest = doc.split(begin, 1)
    path.write_text(head + begin + "\n" + text.strip("\n") + "\n" + end + rest.split(end, 1)[1])


def fit_example() -> str:
    """The first lines `plan --fit` prints for FIT_EXAMPLE, as a fenced block with its command."""
    import contextlib
    import io

    from fate_lab.cli import main as cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cli(["plan", *shlex.split(FIT_EXAMPLE)])
    head = buf.getvalue().splitlines()[:5]
    return "\n".join(["```text", f"$ python -m fate_lab plan {FIT_EXAMPLE}", *head,
                      "(then one row per --n-cpu-moe: device GiB, fits, decode and prefill tok/s)", "```"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "published_vs_predicted.md"), help="markdown file to write")
    ap.add_argument("--calibrate", action="store_true", help="solve each calibrated engine constant from its figure "
                    "and print it beside the committed value (writes nothing)")
    ap.add_argument("--moefit-python", default=None, help="a python interpreter with moe-fit installed (a separate "
                    "venv; never a project dependency); without it the moe-fit column says 'not installed'")
    args = ap.parse_args(argv)
    if args.calibrate:
        for name, fid, solved, committed in calibrate():
            print(f"{name:28s} solved {solved:.4g}  committed {committed:.4g}  ({fid})")
        return
    figures = {f["id"]: f for f in json.loads(PUBLISHED.read_text())["figures"]}
    calib = calibration_ids()
    rows, held, listed, n_calib = [], [], [], 0
    for case in CASES:
        entry = figures[case.id]
        pub = _published(entry, case.field)
        pred = run_case(case)
        ratio = None if pred is None else (pub / pred if case.field == "latency" else pred / pub)
        role = "calibration" if case.id in calib and case.field == "decode" else "held-out"
        miss = ratio is None or abs(ratio - 1) > WITHIN
        if role == "held-out":
            held.append(not miss)
            if case.id in LISTED and case.field != "prefill":
                listed.append(not miss)
        else:
            n_calib += 1
        unit = "s/token" if case.field == "latency" else "tok/s"
        why = (case.note or "not explained") if miss else "within 25%"
        rows.append(f"| {case.id} | {case.field} ({unit}) | `plan {case.command}` | {pub:.3g} | "
                    f"{'—' if pred is None else f'{pred:.3g}'} | {'—' if ratio is None else f'{ratio:.2f}'} | {role} | "
                    f"{case.routing or 'no'} | {why} | {moefit_answer(case, args.moefit_python)} | "
                    f"{entry['source'][:80]} |")
        print(rows[-1], flush=True)
    for case in SIM_CASES:
        entry = _lru_free(case.id)
        pub, pred = _published(entry, "decode"), run_sim_case(case)
        ratio = pred / pub
        held.append(abs(ratio - 1) <= WITHIN)
        rows.append(f"| {case.id} (w/o LRU cache & pre-loading) | decode (tok/s) | {case.command} | {pub:.3g} | "
                    f"{pred:.3g} | {ratio:.2f} | held-out | no (load on demand) | "
                    f"{'within 25%' if abs(ratio - 1) <= WITHIN else case.note} | — | {entry['source'][:80]} |")
        print(rows[-1], flush=True)
    n_ok = sum(held)
    summary = (f"**Held-out: {n_ok} of {len(held)} figures within 25% ({100 * n_ok / max(1, len(held)):.0f}%)**; of "
               f"the figures the sizing issue lists, {sum(listed)} of {len(listed)} held-out ones "
               f"({100 * sum(listed) / max(1, len(listed)):.0f}%); {n_calib} more figures calibrated an engine "
               "constant and are not counted.")
    lines = [f"# Published MoE inference speeds beside the sizing tool's predictions ({time.strftime('%Y-%m-%d')})",
             "", "`python -m benchmarks.bench_published` (figures and sources: `docs/published/published.json`; each "
             "row is the `python -m fate_lab plan` command shown; batch 1). predicted / published for tok/s, "
             "published / predicted for latencies, so above 1 is always 'we predict faster'.", "", summary, "",
             "| figure | value | command | published | predicted | ratio | role | depends on routing | why they "
             "differ (> 25%) | moe-fit | source |", "|---|---|---|---|---|---|---|---|---|---|---|", *rows, "",
             "Calibration: each engine constant fitted to one figure is named with that figure in "
             "`fate_lab/hardware/engines.py`; `python -m benchmarks.bench_published --calibrate` solves them again.",
             "Not expressed: Krasis (its own engine), shimmy's DeepSeek-MoE-16B on a GH200 (no transformers class "
             "for `deepseek`, and a Grace host over NVLink-C2C), the Fate paper's absolute rates (routing, and "
             "secondary), HybriMoE (secondary), mixtral-offloading's full algorithm (routing)."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    line = f"{summary} ({time.strftime('%Y-%m-%d')}; docs/published_vs_predicted.md)"
    for doc in (ROOT / "README.md", ROOT / "docs" / "sizing.md"):
        write_region(doc, "published-summary", line)
    write_region(ROOT / "docs" / "sizing.md", "fit-example", fit_example())
    print(summary)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
