"""The main job (``make main`` / ``python -m fate_lab main``): run every notebook, print their tables.

What it is: the one command that regenerates every figure and table of the suite, on every embedded
model by default (``tiny_moe``, then ``tiny_deepseek``) or on the models named, writing executed
notebooks into ``out/<model>/notebooks`` and ending with each notebook's paper-vs-ours table, one
"ours" column per model beside the paper's (also written to ``out/paper_vs_ours.md``).
What it is not: a place for analysis; each notebook calls the package.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm.auto import tqdm


def _last_code_outputs(path: Path) -> list[dict]:
    nb = json.loads(Path(path).read_text())
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    return code[-1].get("outputs", []) if code else []


def final_rows(path: Path) -> list[list[str]] | None:
    """The rows (quantity, paper, ours, agreement) of an executed notebook's closing table, or None."""
    from fate_lab.study.lab import TABLE_MIME

    for o in _last_code_outputs(path):
        table = o.get("data", {}).get(TABLE_MIME)
        if table:
            return [list(r) for r in table["rows"]]
    return None


def side_by_side(tables: dict[str, list[list[str]] | None]) -> list[dict[str, str]]:
    """One row per quantity: the paper's number, each model's number and agreement sentence, and whether
    the models' verdicts differ (their agreement sentences, numbers aside, are not the same).

    ``tables`` maps a model name to its notebook's rows; a model whose notebook showed no table gets '—'.
    """
    import re

    order: list[str] = []
    paper: dict[str, str] = {}
    by_model: dict[str, dict[str, tuple[str, str]]] = {}
    for name, rows in tables.items():
        by_model[name] = {}
        for quantity, paper_value, ours, agreement in rows or []:
            if quantity not in paper:
                order.append(quantity)
                paper[quantity] = paper_value
            by_model[name][quantity] = (ours, agreement)

    def verdict(sentence: str) -> str:  # the words of an agreement sentence, without its numbers
        return re.sub(r"[-+]?\d[\d.,]*%?x?", "#", sentence).strip()

    out = []
    for q in order:
        row = {"quantity": q, "paper": paper[q]}
        for name in tables:
            row[name] = by_model[name].get(q, ("—", ""))[0]
        for name in tables:
            row[f"agreement ({name})"] = by_model[name].get(q, ("", "—"))[1]
        verdicts = {verdict(by_model[n][q][1]) for n in tables if q in by_model[n]}
        row["models"] = "same verdict" if len(verdicts) <= 1 else "DIFFER (see the README's results)"
        out.append(row)
    return out


def markdown(rows: list[dict[str, str]]) -> str:
    """A side-by-side table as markdown."""
    if not rows:
        return "(no table)"
    keys = list(rows[0])
    cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def run_main(out: Path, models: list[str] | None = None, fast: bool = False, tables_only: bool = False) -> Path:
    """Execute every notebook for each model into ``out/<model>/notebooks``, then print each notebook's
    paper-vs-ours table with a column per model; returns the markdown file holding those tables.
    ``tables_only``: execute nothing, rebuild the tables from the notebooks already in ``out`` (after a
    single notebook was rerun, for example)."""
    from fate_lab.paths import EMBEDDED_MODELS, model_name
    from fate_lab.study.notebooks import notebook_paths, run_notebook

    models = list(models) if models else list(EMBEDDED_MODELS)
    names = [model_name(m) for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"two models share the name {names}: rename a folder so that their results do not mix")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    nbs = notebook_paths()
    done: dict[str, dict[str, Path]] = {}
    for model, name in zip(models, names):
        params = {"MODEL": "" if model is None else str(model), "FAST": fast}
        if tables_only:
            done[name] = {nb.stem: out / name / "notebooks" / nb.name for nb in nbs}
            missing = [str(p) for p in done[name].values() if not p.is_file()]
            if missing:
                raise FileNotFoundError(f"no executed notebook {missing[0]} (and {len(missing) - 1} more): "
                                        f"run `python -m fate_lab main` first")
            continue
        done[name] = {}
        for nb in tqdm(nbs, desc=f"notebooks ({name})", unit="nb"):
            done[name][nb.stem] = run_notebook(nb, out / name / "notebooks", params)
    sections = []
    for nb in nbs:
        rows = side_by_side({name: final_rows(done[name][nb.stem]) for name in names})
        sections.append(f"## {nb.stem}: paper vs ours\n\n{markdown(rows)}\n")
        print(f"\n== {nb.stem}: paper vs ours ({', '.join(names)})")
        for r in rows:
            ours = " | ".join(f"{n}: {r[n]}" for n in names)
            print(f"- {r['quantity']}: paper {r['paper']} | {ours}  [{r['models']}]")
    summary = out / "paper_vs_ours.md"
    summary.write_text(f"# Paper vs ours, {', '.join(names)}\n\nWritten by `python -m fate_lab main`"
                       f"{' --fast' if fast else ''}{' --tables-only' if tables_only else ''}; executed notebooks "
                       f"in {out}/<model>/notebooks.\n\n" + "\n".join(sections))
    print(f"\n[fate_lab] {len(nbs)} notebooks x {len(names)} model(s) ({', '.join(names)}) "
          f"{'read from' if tables_only else 'executed into'} {out}/<model>/notebooks in {time.time() - t0:.0f} s; "
          f"tables side by side in {summary}")
    return summary
