"""The main job (``make main`` / ``python -m fate_lab main``): run every notebook, collect their verdicts.

What it is: the one command that regenerates every figure and table of the suite, on every embedded model by
default (``tiny_moe``, then ``tiny_deepseek``) or on the models named, writing executed notebooks into
``out/<model>/notebooks``; it then reads each notebook's closing claims back (`study.verdict.Claim`, carried
as data by `lab.paper_table`), puts the models side by side, writes ``out/paper_vs_ours.md`` and
``out/verdicts-<mode>.json``, and from the same data rewrites the results page, ``docs/results.md`` (every
row, between `RESULTS_BEGIN` and `RESULTS_END`), and the README's headline (the verdict counts per notebook,
between `HEADLINE_BEGIN` and `HEADLINE_END`). ``--tables-only`` executes nothing and rebuilds all of that from
the notebooks already in ``out``. When both a FAST and a full verdict file are in ``out``, the rows whose verdict
words differ between the two are printed.
What it is not: a place for analysis; each notebook calls the package.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results.md"
RESULTS_BEGIN = "<!-- results:begin (written by `python -m fate_lab main`; edits inside are overwritten) -->"
RESULTS_END = "<!-- results:end -->"
HEADLINE_BEGIN = "<!-- results-headline:begin (written by `python -m fate_lab main`; edits inside are overwritten) -->"
HEADLINE_END = "<!-- results-headline:end -->"


def _last_code_outputs(path: Path) -> list[dict]:
    nb = json.loads(Path(path).read_text())
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    return code[-1].get("outputs", []) if code else []


def final_claims(path: Path) -> tuple[list, dict] | None:
    """(claims, meta) of an executed notebook's closing table (`lab.paper_table`), or None without one."""
    from fate_lab.study.lab import TABLE_MIME
    from fate_lab.study.verdict import Claim

    for o in _last_code_outputs(path):
        table = o.get("data", {}).get(TABLE_MIME)
        if table and "claims" in table:
            return [Claim.from_dict(c) for c in table["claims"]], dict(table.get("meta") or {})
    return None


def final_rows(path: Path) -> list[list[str]] | None:
    """The rows of an executed notebook's closing table as text (quantity, reference, ours, verdict, why)."""
    found = final_claims(path)
    return None if found is None else [[c.quantity, c.reference, c.ours, c.verdict, c.why] for c in found[0]]


def side_by_side(tables: dict[str, list | None]) -> list[dict[str, str]]:
    """One row per quantity: the reference, each model's number, verdict and reason, and whether the models'
    verdicts differ. ``tables`` maps a model name to its notebook's claims; a model whose notebook showed no
    table gets '—'."""
    order: list[str] = []
    ref: dict[str, str] = {}
    by_model: dict[str, dict] = {}
    for name, claims in tables.items():
        by_model[name] = {}
        for c in claims or []:
            if c.quantity not in ref:
                order.append(c.quantity)
                ref[c.quantity] = c.reference
            by_model[name][c.quantity] = c
    out = []
    for q in order:
        row = {"quantity": q, "paper or target": ref[q]}
        for name in tables:
            c = by_model[name].get(q)
            row[name] = "—" if c is None else c.ours
            row[f"verdict ({name})"] = "—" if c is None else c.verdict
            row[f"why ({name})"] = "" if c is None else c.why
        verdicts = {by_model[n][q].verdict for n in tables if q in by_model[n]}
        row["models"] = "same verdict" if len(verdicts) <= 1 else "DIFFER"
        out.append(row)
    return out


def markdown(rows: list[dict[str, str]], keys: list[str] | None = None) -> str:
    """A side-by-side table as markdown (all its keys, or `keys`)."""
    if not rows:
        return "(no table)"
    keys = keys or list(rows[0])
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def machine() -> str:
    """This machine in a few words: the CPU model, its cores, the torch threads the measurements pin."""
    from fate_lab.study.clock import THREADS

    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
    except OSError:
        pass
    return f"{cpu or 'a CPU'}, {os.cpu_count()} cores, measurements on {THREADS} torch thread(s)"


def collect(done: dict[str, dict[str, Path]]) -> dict:
    """The verdict data of executed notebooks (model -> notebook stem -> path): per notebook and model, the claims
    and the meta (mode, clock) their closing table carried."""
    data: dict = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "notebooks": {}}
    for name, paths in done.items():
        for stem, path in paths.items():
            found = final_claims(path)
            entry = data["notebooks"].setdefault(stem, {})
            entry[name] = None if found is None else {"claims": [c.as_dict() for c in found[0]], "meta": found[1]}
    modes = {bool(m["meta"].get("fast")) for nb in data["notebooks"].values() for m in nb.values() if m}
    data["fast"] = modes.pop() if len(modes) == 1 else None  # None: a mix of modes
    return data


def _claims(entry) -> list | None:
    from fate_lab.study.verdict import Claim

    return None if entry is None else [Claim.from_dict(c) for c in entry["claims"]]


def _models(data: dict) -> list[str]:
    return sorted({m for nb in data["notebooks"].values() for m in nb}, key=lambda m: (m != "tiny_moe", m))


def _mode(data: dict) -> str:
    return {True: "FAST mode (the tests' sizes)", False: "full size", None: "mixed modes"}[data.get("fast")]


def _rows(data: dict, stem: str) -> list[dict[str, str]]:
    entry = data["notebooks"][stem]
    return side_by_side({m: _claims(entry.get(m)) for m in _models(data)})


def verdict_counts(data: dict) -> dict[str, dict[str, int]]:
    """Per notebook of verdict data (`collect`), how many rows of each model got each verdict."""
    out: dict[str, dict[str, int]] = {}
    for stem in data["notebooks"]:
        counts = out.setdefault(stem, {})
        for r in _rows(data, stem):
            for m in _models(data):
                v = r[f"verdict ({m})"]
                if v != "—":
                    counts[v] = counts.get(v, 0) + 1
    return out


def _total(counts: dict[str, dict[str, int]]) -> str:
    total: dict[str, int] = {}
    for per in counts.values():
        for v, n in per.items():
            total[v] = total.get(v, 0) + n
    return ", ".join(f"{n} {v}" for v, n in sorted(total.items()))


def results_section(data: dict) -> str:
    """The results page's section from verdict data (`collect`): per notebook, the paper's number or our target
    beside each model's number and verdict, then the reason of every row that does not agree."""
    from fate_lab.study.verdict import AGREES

    models = _models(data)
    parts = [f"What `python -m fate_lab main` printed on {data['date']} ({_mode(data)}; {data['machine']}). Every "
             "verdict is computed from the numbers in the row (`fate_lab/study/verdict.py`); `python -m fate_lab main "
             "--tables-only` rewrites this section from the executed notebooks in `results/`. Speed rows are one run "
             "on a shared machine: their spread is in the row where it was measured.",
             f"In all: {_total(verdict_counts(data))}.", ""]
    for stem in data["notebooks"]:
        rows = _rows(data, stem)
        if not rows:
            continue
        parts.append(f"**{stem}**\n")
        view = [{"quantity": r["quantity"], "paper or target": r["paper or target"],
                 **{m: f"{r[m]} — {r[f'verdict ({m})']}" for m in models}} for r in rows]
        parts.append(markdown(view))
        notes = [f"- *{r['quantity']}*, `{m}`: {r[f'verdict ({m})']}: {r[f'why ({m})']}"
                 for r in rows for m in models if r[f"verdict ({m})"] not in (AGREES, "—")]
        parts += ["", *notes, ""]
    return "\n".join(parts).rstrip() + "\n"


def headline(data: dict) -> str:
    """The README's headline from the same verdict data: the date, the machine, the verdict counts in all and per
    notebook, and the link to every row."""
    from fate_lab.study.verdict import AGREES, DISAGREES, NOT_COMPARABLE

    counts = {stem: per for stem, per in verdict_counts(data).items() if per}
    words = (AGREES, DISAGREES, NOT_COMPARABLE)
    lines = [f"What `python -m fate_lab main` printed on {data['date']} ({_mode(data)}; {data['machine']}), over "
             f"the closing tables of {len(counts)} notebooks on {' and '.join(f'`{m}`' for m in _models(data))}: "
             f"**{_total(counts)}**. Every verdict is computed from the numbers in its row; every row, with the "
             "reason of each that does not agree: [docs/results.md](docs/results.md).", "",
             "| notebook | " + " | ".join(words) + " |", "|---|" + "---|" * len(words)]
    lines += [f"| {stem} | " + " | ".join(str(per.get(w, 0)) for w in words) + " |" for stem, per in counts.items()]
    return "\n".join(lines) + "\n"


def write_between(path: Path, begin: str, end: str, text: str) -> Path:
    """Replace what lies between the markers `begin` and `end` of a markdown file with `text` (both must be there)."""
    doc = path.read_text()
    if doc.count(begin) != 1 or doc.count(end) != 1 or doc.index(begin) > doc.index(end):
        raise ValueError(f"{path} has not one pair of markers {begin!r} ... {end!r}: add them where this section "
                         "belongs")
    head, rest = doc.split(begin, 1)
    path.write_text(f"{head}{begin}\n{text}{rest[rest.index(end):]}")
    return path


def write_results(data: dict, results: Path | None = RESULTS, readme: Path | None = README) -> None:
    """Write the results page's section and the README's headline from one verdict data (either may be None)."""
    if results is not None:
        write_between(results, RESULTS_BEGIN, RESULTS_END, results_section(data))
    if readme is not None:
        write_between(readme, HEADLINE_BEGIN, HEADLINE_END, headline(data))


def verdict_changes(a: dict, b: dict) -> list[str]:
    """The rows whose verdict words differ between two verdict files (`collect`), e.g. a FAST and a full run;
    a row the first run left undecided (not comparable: too close to tell, too few tokens) says so."""
    from fate_lab.study.verdict import NOT_COMPARABLE

    out = []
    for stem in sorted(set(a["notebooks"]) & set(b["notebooks"])):
        for model in sorted(set(a["notebooks"][stem]) & set(b["notebooks"][stem])):
            ca, cb = _claims(a["notebooks"][stem][model]) or [], _claims(b["notebooks"][stem][model]) or []
            va, vb = {c.quantity: c.verdict for c in ca}, {c.quantity: c.verdict for c in cb}
            for q in [q for q in va if q in vb and va[q] != vb[q]]:
                undecided = " (the first run could not tell)" if va[q] == NOT_COMPARABLE else ""
                out.append(f"{stem} / {model}: {q}: {va[q]} -> {vb[q]}{undecided}")
    return out


def run_main(out: Path, models: list[str] | None = None, fast: bool = False, tables_only: bool = False,
             results: Path | None = RESULTS, readme: Path | None = README) -> Path:
    """Execute every notebook for each model into ``out/<model>/notebooks`` (or, ``tables_only``, read the ones
    already there), then write the side-by-side tables, the verdict data and (unless this is a FAST run) the
    results page and the README's headline (`write_results`; None skips either); returns the markdown file of the
    tables. Every notebook of
    one run shares one calibration of this machine (`study.clock`, through ``$FATE_LAB_RUN_DIR``)."""
    from fate_lab.paths import EMBEDDED_MODELS, model_name
    from fate_lab.study.clock import RUN_DIR_ENV
    from fate_lab.study.notebooks import notebook_paths, run_notebook

    models = list(models) if models else list(EMBEDDED_MODELS)
    names = [model_name(m) for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"two models share the name {names}: rename a folder so that their results do not mix")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    nbs = notebook_paths()
    done: dict[str, dict[str, Path]] = {}
    run_dir = out / ".run"
    if not tables_only:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "clock.json").unlink(missing_ok=True)  # a new run calibrates anew
    for model, name in zip(models, names, strict=True):
        params = {"MODEL": "" if model is None else str(model), "FAST": fast}
        if tables_only:
            done[name] = {nb.stem: out / name / "notebooks" / nb.name for nb in nbs}
            missing = [str(p) for p in done[name].values() if not p.is_file()]
            if missing:
                raise FileNotFoundError(f"no executed notebook {missing[0]} (and {len(missing) - 1} more): "
                                        f"run `python -m fate_lab main` first")
            continue
        done[name] = {}
        before = os.environ.get(RUN_DIR_ENV)
        os.environ[RUN_DIR_ENV] = str(run_dir.resolve())  # the kernels run in notebooks/, not here
        try:
            for nb in tqdm(nbs, desc=f"notebooks ({name})", unit="nb"):
                done[name][nb.stem] = run_notebook(nb, out / name / "notebooks", params)
        finally:
            if before is None:
                os.environ.pop(RUN_DIR_ENV, None)
            else:
                os.environ[RUN_DIR_ENV] = before
    data = collect(done)
    mode = "fast" if data["fast"] else "full" if data["fast"] is False else "mixed"
    (out / f"verdicts-{mode}.json").write_text(json.dumps(data, indent=1))
    sections = []
    for nb in nbs:
        rows = side_by_side({name: _claims(data["notebooks"][nb.stem].get(name)) for name in names})
        sections.append(f"## {nb.stem}: paper vs ours\n\n{markdown(rows)}\n")
        print(f"\n== {nb.stem}: paper vs ours ({', '.join(names)})")
        for r in rows:
            ours = " | ".join(f"{n}: {r[n]} ({r[f'verdict ({n})']})" for n in names)
            print(f"- {r['quantity']}: {r['paper or target']} | {ours}  [{r['models']}]")
    summary = out / "paper_vs_ours.md"
    summary.write_text(f"# Paper vs ours, {', '.join(names)}\n\nWritten by `python -m fate_lab main`"
                       f"{' --fast' if fast else ''}{' --tables-only' if tables_only else ''}; executed notebooks "
                       f"in {out}/<model>/notebooks.\n\n" + "\n".join(sections))
    if tables_only or not fast:
        write_results(data, results, readme)
        written = " and ".join(str(p) for p in (results, readme) if p is not None)
        if written:
            print(f"[fate_lab] {written} rewritten from {out}/verdicts-{mode}.json")
    if (out / "verdicts-fast.json").is_file() and (out / "verdicts-full.json").is_file():
        changes = verdict_changes(json.loads((out / "verdicts-fast.json").read_text()),
                                  json.loads((out / "verdicts-full.json").read_text()))
        print(f"[fate_lab] FAST vs full: {len(changes)} verdict(s) differ" + "".join(f"\n  {c}" for c in changes))
    print(f"\n[fate_lab] {len(nbs)} notebooks x {len(names)} model(s) ({', '.join(names)}) "
          f"{'read from' if tables_only else 'executed into'} {out}/<model>/notebooks in {time.time() - t0:.0f} s; "
          f"tables side by side in {summary}")
    return summary


__all__ = ["HEADLINE_BEGIN", "HEADLINE_END", "README", "RESULTS", "RESULTS_BEGIN", "RESULTS_END", "collect",
           "final_claims", "final_rows", "headline", "machine", "markdown", "results_section", "run_main",
           "side_by_side", "verdict_changes", "verdict_counts", "write_between", "write_results"]
