"""The generated support table: which experts-interface families the runtime offloads exactly, checked, not written.

What this file is: `check_family(family)` offloads a tiny random model of one family (`model.testing.tiny_model`)
under several presets and compares it with the plain model -- greedy tokens exactly, logits within float
tolerance (the plain model's default experts kernel sums in another order) -- on the instant link and on an
emulated link, with a quarter of the experts cached so that misses, prefetches and evictions happen; the
family's own checkpoint (save_pretrained) opened with `load_offloaded`, its experts read from the files by the
SSD tier; a batch of two left-padded prompts against the plain model's batch; and the per-layer cache counters
of every run. A
text tower (no causal-LM class) is checked forward only. `support_table()` runs it over every modeling module
`model.families` lists, and `support_markdown(rows)` writes the table `scripts/family_table.py` puts in
`docs/families.md`; `tests/offloading/test_families_runtime.py` asserts on the same rows.
What it is not: a benchmark (tiny models, no timing) or a quality measure (lossless presets only).
"""
from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass, field

import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.offloading.load import load_offloaded
from fate_lab.offloading.runtime import offload

# (preset, overrides): what every family runs. host_compute on the instant link never finds the host cheaper
# than a free transfer, so all_host runs the host-side expert math on every expert.
RUNS: tuple[tuple[str, dict], ...] = (
    ("lru", {"link": "instant"}),
    ("fate", {"link": "instant"}),
    ("host_compute", {"link": "instant"}),
    ("all_host", {"link": "instant"}),
    ("fate", {"link": "test_fast"}),
)
NEW_TOKENS = 6
PROMPT = 9
RTOL = ATOL = 1e-4  # fp32 logits: the plain model's grouped_mm kernel sums in another order than the eager sum


@dataclass(frozen=True)
class FamilySupport:
    """One family's row: what was built, what ran, and the verdict."""

    module: str  # transformers.models.<module>
    family: str | None  # the model type built
    kind: str  # "causal" | "text tower" | "none"
    verdict: str  # "exact" | "refused" | "wrong" | "failed" (an error that is not a refusal) | "not built"
    reason: str = ""  # why refused / wrong / failed / not built
    runs: tuple[str, ...] = ()  # the checks that passed, e.g. "fate@instant", "batch2"
    max_logit_diff: float = 0.0
    layout: dict = field(default_factory=dict)  # the experts layout's flags
    router: str = ""  # scoring, linear or not


def _slots(model) -> int:
    """A quarter of all routed experts (at least one per MoE layer)."""
    from fate_lab.model.adapters import adapt

    a = adapt(model)
    return max(a.num_moe_layers, a.num_moe_layers * a.num_experts // 4)


def _greedy(model, ids: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, S], logits [n, B, V]) of a greedy generate of NEW_TOKENS tokens."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 9 and 6 tokens, left-padded: (ids [2, 9], attention mask [2, 9])."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


def _check_stats(rt, what: str) -> None:
    """Every MoE layer's counters exist and add up, and the decode forwards used experts."""
    for m, layer in enumerate(rt.stats.layers):
        for phase in ("prefill", "decode"):
            s = layer[phase]
            if s.hits + s.late + s.misses != s.uses or s.host > s.misses:
                raise AssertionError(f"{what}: layer {m} {phase}: hits {s.hits} + late {s.late} + misses {s.misses} "
                                     f"!= uses {s.uses}, or more host computes ({s.host}) than misses")
        if layer["decode"].uses <= 0:
            raise AssertionError(f"{what}: layer {m} counted no decode use")


def _compare(what: str, ref: tuple, got: tuple) -> float:
    """Max |logit difference|; AssertionError naming `what` unless the tokens are equal and the logits close."""
    if not torch.equal(ref[0], got[0]):
        raise AssertionError(f"{what}: tokens {got[0].tolist()} != plain {ref[0].tolist()}")
    diff = float((ref[1] - got[1]).abs().max())
    if not torch.allclose(ref[1], got[1], rtol=RTOL, atol=ATOL):
        raise AssertionError(f"{what}: logits differ from the plain model's by up to {diff:.2e}")
    return diff


def _prompt(model) -> torch.Tensor:
    """A seeded random prompt [1, PROMPT]."""
    return torch.randint(3, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))


def _reference(model, causal: bool):
    """The plain model's output on the prompt: (tokens, logits) of a causal LM, a tower's last hidden state."""
    if causal:
        return _greedy(model, _prompt(model))
    with torch.no_grad():
        return model(input_ids=_prompt(model)).last_hidden_state


def _check_causal(model, ref: tuple, passed: list[str]) -> float:
    """Every run of RUNS, then a left-padded batch of two, against the plain model; the max logit difference."""
    ids = _prompt(model)
    worst = 0.0
    for name, over in RUNS:
        what = f"{name}@{over['link']}"
        with offload(model, OffloadConfig.preset(name, slots=_slots(model), **over)) as rt:
            got = _greedy(model, ids)
            _check_stats(rt, what)
        worst = max(worst, _compare(what, ref, got))
        passed.append(what)
    with tempfile.TemporaryDirectory() as tmp:  # the SSD tier over the family's own on-disk layout, no copy in RAM
        model.save_pretrained(tmp)
        opened, _, rt = load_offloaded(tmp, OffloadConfig.preset("fate", link="instant", store="ssd",
                                                                 slots=_slots(model)))
        got = _greedy(opened, ids)
        _check_stats(rt, "load_offloaded")
        rt.close()
    worst = max(worst, _compare("load_offloaded (ssd)@instant", ref, got))
    passed.append("load_offloaded@instant")
    batch, mask = _batch(model.config.vocab_size)
    ref = _greedy(model, batch, mask)
    with offload(model, OffloadConfig.preset("fate", link="instant", slots=_slots(model))) as rt:
        got = _greedy(model, batch, mask)
        _check_stats(rt, "batch2")
    worst = max(worst, _compare("batch of 2, left-padded (fate@instant)", ref, got))
    passed.append("batch2")
    return worst


def _check_tower(model, ref: torch.Tensor, passed: list[str]) -> float:
    """A text tower runs forward only: its last hidden state, offloaded, against the plain model's."""
    ids = _prompt(model)
    worst = 0.0
    for name, over in RUNS[:2]:
        what = f"{name}@{over['link']} (forward)"
        with offload(model, OffloadConfig.preset(name, slots=_slots(model), **over)), torch.no_grad():
            got = model(input_ids=ids).last_hidden_state
        diff = float((ref - got).abs().max())
        if not torch.allclose(ref, got, rtol=RTOL, atol=ATOL):
            raise AssertionError(f"{what}: hidden states differ from the plain model's by up to {diff:.2e}")
        worst = max(worst, diff)
        passed.append(what)
    return worst


def check_family(module: str, types: tuple[str, ...], seed: int = 1) -> FamilySupport:
    """Build one modeling module's tiny model and check the runtime on it (see the module docstring)."""
    from fate_lab.model.adapters import adapt
    from fate_lab.model.families import experts_interface_families, text_tower_types
    from fate_lab.model.testing import tiny_model

    causal = [t for t in types if t in experts_interface_families()]
    family = causal[0] if causal else text_tower_types().get(module)
    kind = "causal" if causal else "text tower" if family else "none"
    if family is None:
        return FamilySupport(module, None, kind, "not built", f"neither a causal-LM class nor a text model among "
                                                              f"its model types {list(types)}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = tiny_model(family, seed=seed)
            ref = _reference(model, bool(causal))
    except Exception as err:  # noqa: BLE001 - the table reports every failure by name
        msg = str(err).strip().splitlines()[-1] if str(err).strip() else ""
        return FamilySupport(module, family, kind, "not built", f"the plain tiny model fails: {type(err).__name__}: "
                                                                f"{msg}"[:240])
    a = adapt(model)
    lay = a.layouts[0]
    layout = {k: getattr(lay, k) for k in ("has_gate", "has_bias", "is_transposed", "is_concatenated",
                                           "custom_gate", "accumulate")}
    routers = a.host_routers()
    router = f"{a.router_spec.scoring}, " + ("linear" if all(routers.is_linear(m) for m in range(len(routers)))
                                             else "module copy")
    passed: list[str] = []
    try:
        worst = _check_causal(model, ref, passed) if causal else _check_tower(model, ref, passed)
    except NotImplementedError as err:  # refused at offload time, with the reason
        return FamilySupport(module, family, kind, "refused", str(err), tuple(passed), layout=layout, router=router)
    except AssertionError as err:
        return FamilySupport(module, family, kind, "wrong", str(err), tuple(passed), layout=layout, router=router)
    except Exception as err:  # noqa: BLE001 - a release can break the runtime anywhere: the table names how
        msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return FamilySupport(module, family, kind, "failed", f"{type(err).__name__}: {msg}"[:240], tuple(passed),
                             layout=layout, router=router)
    return FamilySupport(module, family, kind, "exact", "", tuple(passed), worst, layout, router)


def support_table(modules: dict[str, tuple[str, ...]] | None = None, progress: bool = True) -> list[FamilySupport]:
    """`check_family` over every experts-interface modeling module of the installed transformers (or `modules`)."""
    from tqdm.auto import tqdm

    from fate_lab.model.families import experts_interface_modules

    modules = experts_interface_modules() if modules is None else modules
    return [check_family(mod, types) for mod, types in tqdm(modules.items(), desc="families", disable=not progress)]


def support_counts(rows: list[FamilySupport]) -> dict[str, int]:
    """{"modules", "built", "exact", "refused", "wrong", "failed", "not built"} over the rows."""
    out = {"modules": len(rows), "built": sum(r.verdict != "not built" for r in rows)}
    for v in ("exact", "refused", "wrong", "failed", "not built"):
        out[v] = sum(r.verdict == v for r in rows)
    return out


def support_markdown(rows: list[FamilySupport], command: str) -> str:
    """The family table as markdown: counts, the modules grouped by verdict and experts layout, then one row per
    modeling module."""
    import transformers

    runs = ", ".join(f"`{n}` ({o['link']})" for n, o in RUNS)
    lines = [
        "# Families the offloaded runtime serves",
        "",
        f"Generated by `{command}` with transformers {transformers.__version__} and torch {torch.__version__}; "
        "do not edit by hand.",
        "",
        f"Every modeling module of the installed transformers whose experts use its experts interface: a tiny "
        f"random model of each (hidden 64, 2-4 layers, 8 experts), offloaded with a quarter of its experts cached "
        f"under {runs}; its own checkpoint (save_pretrained) opened with `load_offloaded` (experts read from the "
        "files by the SSD tier, `fate`); then a left-padded batch of two under `fate`; greedy tokens must equal "
        "the plain model's "
        f"and logits agree within {RTOL:g} (the plain model's default kernel sums in another order), and every "
        "MoE layer's cache counters add up. A text tower (no causal-LM class) runs forward only.",
        "",
        "Another transformers release: every offload first runs the model's experts module with fate_lab's expert "
        "math and with the installed release's eager kernel on a probe, bit for bit, and refuses a family whose "
        "experts the release computes otherwise, with the reason (`model.experts.math_refusal`). "
        "`make check-newest` reruns this table and the exactness tests on the newest transformers `pyproject.toml` "
        "allows, in a venv of its own, and names each family it broke (CI runs it as a report).",
        "",
        f"**{_counts_line(rows)}.**",
        "",
        *support_layouts(rows),
        "",
        "Every module:",
        "",
        "| module | model type | kind | verdict | experts layout | router | max logit diff | reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        flags = ", ".join(k for k, v in r.layout.items() if v is True) or "-"
        if r.layout.get("accumulate", "output") != "output":
            flags += f", accumulate {r.layout['accumulate']}"
        reason = r.reason.replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.module} | {r.family or '-'} | {r.kind} | {r.verdict} | {flags} | {r.router or '-'} | "
                     f"{r.max_logit_diff:.1e} | {reason} |")
    return "\n".join(lines) + "\n"


README_BEGIN = "<!-- families:begin (written by `python -m scripts.family_table`; edits inside are overwritten) -->"
README_END = "<!-- families:end -->"


def _counts_line(rows: list[FamilySupport]) -> str:
    c = support_counts(rows)
    return (f"{c['modules']} modules: {c['built']} built, {c['exact']} exact, {c['refused']} refused with a reason, "
            f"{c['wrong']} wrong, {c['failed']} failed, {c['not built']} not built")


def support_layouts(rows: list[FamilySupport]) -> list[str]:
    """The modules grouped by verdict and experts layout, as the lines of a markdown table."""
    lines = ["| verdict | experts layout | modules |", "|---|---|---|"]
    groups: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        flags = ", ".join(k for k, v in r.layout.items() if v is True) or "-"
        groups.setdefault((r.verdict, flags if r.verdict != "not built" else "-"), []).append(r.module)
    order = {"exact": 0, "refused": 1, "wrong": 2, "failed": 3, "not built": 4}
    for (verdict, flags), mods in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 9), -len(kv[1]))):
        lines.append(f"| {verdict} | {flags} | {', '.join(sorted(mods))} |")
    return lines


def support_readme(rows: list[FamilySupport], command: str) -> str:
    """The README's line of the table: the counts, the command, and the link to the modules and every row."""
    return (f"**{_counts_line(rows)}** (`{command}`; the modules by experts layout, and every row: "
            "[docs/families.md](docs/families.md)).\n")


def write_readme_table(section: str, readme) -> None:
    """Replace what lies between the README's family markers with `section` (the markers must be there)."""
    from pathlib import Path

    readme = Path(readme)
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise ValueError(f"{readme} has no family markers ({README_BEGIN!r} ... {README_END!r})")
    head, rest = text.split(README_BEGIN, 1)
    readme.write_text(f"{head}{README_BEGIN}\n{section}{README_END}{rest.split(README_END, 1)[1]}")
