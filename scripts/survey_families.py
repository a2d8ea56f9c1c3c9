"""Survey every MoE family of the installed transformers that uses its experts interface; write markdown.

Run: `OMP_NUM_THREADS=1 python -m scripts.survey_families --out survey.md` (about a minute on one core).
For each modeling module it builds a tiny random model (fate_lab.model.testing), adapts it, captures one
forward, saves it with save_pretrained and reads it back one expert at a time, and reports what it found:
the model type, config class, MoE block path, router (class, semantics, inputs), gate input, experts
(class, declared layout flags), shared experts, dense layers, hybrid layer types, the on-disk layout of
the experts and transformers' conversion rule for it. Modules that do not build are described from their
source (experts classes and their `@use_experts_implementation` flags) with the reason.
"""
from __future__ import annotations

import argparse
import ast
import re
import tempfile
from pathlib import Path

import torch


def _static(module: str) -> str:
    """The experts classes of a modeling module and their declared flags, read from its source."""
    import transformers

    out = []
    for f in (Path(transformers.__file__).parent / "models" / module).glob("modeling_*.py"):
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.ClassDef):
                decos = [ast.unparse(d) for d in node.decorator_list if "use_experts_implementation" in ast.unparse(d)]
                if decos:
                    flags = decos[0].split("(", 1)[1].rstrip(")") if "(" in decos[0] else "defaults"
                    gate = any(isinstance(n, ast.FunctionDef) and n.name == "_apply_gate" for n in node.body)
                    out.append(f"{node.name} ({flags}{', own _apply_gate' if gate else ''})")
    return "; ".join(out)


def _path(model, mod) -> str:
    """mod's path in model, with the layer number shown as {i}."""
    name = next(n for n, m in model.named_modules() if m is mod)
    return re.sub(r"layers\.\d+", "layers.{i}", name)


def _row(status, types) -> dict:
    """What a built family shows, or its static description and reason."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from fate_lab.model.adapters import adapt
    from fate_lab.model.checkpoint import ExpertIndex, load_without_experts
    from fate_lab.model.testing import tiny_model

    row = {"module": status.module, "types": ", ".join(types), "family": status.family or "-",
           "config": CONFIG_MAPPING[status.family].__name__ if status.family else "-",
           "status": ("builds + generates" if status.generates else "builds (text tower, forward only)")
           if status.builds else f"does not build: {status.reason}", "static": _static(status.module)}
    if not status.builds:
        return row
    model = tiny_model(status.family)
    a = adapt(model)
    seen = {}

    def keep(name):
        def hook(_mod, args):
            seen.setdefault(name, args[0])  # returns None: the call's arguments stay as they are
        return hook

    h1 = a.router(0).register_forward_pre_hook(keep("router"))
    h2 = a.experts_module(0).register_forward_pre_hook(keep("experts"))
    with torch.no_grad():
        model(input_ids=torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0)))
    h1.remove()
    h2.remove()
    same = seen["router"].reshape(-1, a.hidden_size).shape == seen["experts"].shape and torch.equal(
        seen["router"].reshape(seen["experts"].shape), seen["experts"])
    fitted = next(m for m in range(a.num_moe_layers) if set(a.router_site(m).missing) <= set(a.router_site(m).optional))
    spec, fit, site, layout = a.router_spec, a.fit(fitted), a.router_site(0), a.layouts[0]
    config = model.config.get_text_config()
    kinds = sorted({str(t) for t in (getattr(config, "layer_types", None) or [])})
    shared = a.shared_module(0)
    missing = {n for m in range(a.num_moe_layers) for n in a.router_site(m).missing}
    shared_gate = " + sigmoid gate" if hasattr(a.block(0), "shared_expert_gate") else ""
    row.update({
        "block": f"{_path(model, a.block(0))} ({type(a.block(0)).__name__})",
        "router": f"{type(a.router(0)).__name__} -> (scores [T, {spec.num_experts}], weights, indices); "
                  f"{spec.scoring}, choice on {fit.choice}{' + bias' if spec.has_correction_bias else ''}, "
                  f"norm={spec.norm_topk_prob}, scale={spec.routed_scaling_factor}"
                  f"{f', groups {spec.n_group}/{spec.topk_group}' if spec.n_group else ''}"
                  f"{'' if spec.exact else ', not select_experts-modelled'}"
                  f"{f'; block passes {list(site.bound)}' if site.bound else ''}"
                  f"{f'; needs {sorted(missing)}' if missing else ''}",
        "gate_input": "the experts' input" if same else "differs from the experts' input",
        "experts": f"{layout.experts_class}: gate={layout.has_gate}, bias={layout.has_bias}, "
                   f"transposed={layout.is_transposed}, concatenated={layout.is_concatenated}, "
                   f"post_norm={layout.has_post_expert_norm}, own_gate={layout.custom_gate}, "
                   f"accumulate={layout.accumulate}"
                   f"{', compute fp32' if layout.compute_fp32 else ''}",
        "E/k": f"{a.num_experts}/{a.top_k}",
        "shared": "-" if shared is None else type(shared).__name__ + shared_gate,
        "dense": str([i for i in range(a.num_layers) if i not in a.moe_layers]),
        "layer_types": ", ".join(kinds) or "-",
    })
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        index = ExpertIndex.build(model, tmp)
        row["on_disk"] = "; ".join(f"{k} <- {v}" for k, v in index.describe(0).items()) or "-"
        row["read"] = "one expert at a time" if index.refusal() is None and all(
            index.read(0, e).equal(a.expert(0, e)) for e in range(a.num_experts)) else f"refused: {index.refusal()}"
        if status.generates:
            try:
                load_without_experts(tmp)
                row["lean_load"] = "yes"
            except Exception as err:  # noqa: BLE001 - the survey reports it
                row["lean_load"] = f"no: {err}"
    return row


def main() -> None:
    """Build, adapt and save a tiny model of every family; write the survey as markdown."""
    import transformers

    from fate_lab.model.families import experts_interface_modules, text_tower_types
    from fate_lab.model.testing import family_status

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="markdown file to write")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    modules = experts_interface_modules()
    rows = []
    for module, types in modules.items():
        rows.append(_row(family_status(module, types), types))
        print(f"{module}: {rows[-1]['status'][:90]}", flush=True)
    n_types = sum(len(t) for t in modules.values())
    causal = [r for r in rows if r["status"] == "builds + generates"]
    towers = [r for r in rows if r["status"].startswith("builds (text")]
    n_causal = sum(1 for r in rows if r["family"] != "-" and r["family"] not in text_tower_types().values())
    read = sum(1 for r in rows if r.get("read") == "one expert at a time")
    lean = sum(1 for r in rows if r.get("lean_load") == "yes")
    lines = [f"# Experts-interface MoE families in transformers {transformers.__version__}", "",
             f"- modeling modules with `@use_experts_implementation` classes: **{len(modules)}** "
             f"({n_types} model types)",
             f"- with a causal-LM class: **{n_causal}**; tiny model builds and generates here: **{len(causal)}**",
             (f"- without one: {len(rows) - len(causal)}; of those, base text towers that build (forward only): "
              f"**{len(towers)}** ({', '.join(r['family'] for r in towers)})"),
             f"- one expert at a time from a save_pretrained checkpoint: {read}; "
             f"lean load (experts on meta): {lean}", ""]
    lines += ["| module | family | status | E/k | router | experts | on disk |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        short = r["status"] if len(r["status"]) < 60 else r["status"][:57] + "..."
        router = r.get("router", "").split(";")[1].strip() if ";" in r.get("router", "") else "-"
        experts = r.get("experts", r["static"]).split(":", 1)[-1].strip()
        on_disk = r.get("on_disk", "")
        disk = "per-expert keys" if "per-expert" in on_disk else "fused" if "fused" in on_disk else "-"
        lines.append(f"| {r['module']} | {r['family']} | {short.replace('|', '/')} | {r.get('E/k', '-')} | "
                     f"{router.replace('|', '/')} | {experts.replace('|', '/')} | {disk} |")
    lines.append("")
    cols = ["module", "types", "family", "config", "status", "static", "block", "router", "gate_input", "experts",
            "E/k", "shared", "dense", "layer_types", "on_disk", "read", "lean_load"]
    for r in rows:
        lines.append(f"## {r['module']}")
        lines += [f"- **{c}**: {str(r[c]).replace('|', '/')}" for c in cols[1:] if c in r]
        lines.append("")
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
