"""The README and the docs pages it links stay true, and the README stays a front door.

What this file checks: every page reached from README.md by links (transitively) exists, and so does every heading
a link names; every `docs/*.md` page is one link from the README; every path, dotted name, `python -m` module and
`make` target those pages cite exists; every python snippet in them runs and prints (one that names a user's own
folder, `/path/to/...`, is compiled only); the two commands are the Makefile's targets that CI runs; the lines
generated into the README agree with the pages they summarize; the README has at most 200 lines.
What it is not: a check of the numbers themselves (their generators and their own tests do that).
"""
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"```(\w*)\n(.*?)```", flags=re.S)
_PATH = re.compile(r"(?<![\w./-])((?:fate_lab|tests|benchmarks|docs|notebooks|data|scripts)/[\w./-]*[\w/])(?![\w./$-])")
_DOTTED = re.compile(r"(?<![\w.])(fate_lab(?:\.\w+)+)")
_MODULE = re.compile(r"python -m ((?:benchmarks|scripts|fate_lab)(?:\.\w+)*)")
_MAKE = re.compile(r"(?<![\w-])make ([a-z][\w-]*)")


def _local_links(page: Path, text: str) -> list[tuple[Path, str]]:
    """(target file, anchor) of every link of a page that stays in this repository."""
    out = []
    for target in _LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        out.append(((page.parent / file).resolve() if file else page, anchor))
    return out


def _pages() -> dict[Path, str]:
    """README.md and every markdown page of this repository reached from it by links."""
    seen: dict[Path, str] = {}
    todo = [README]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen[page] = page.read_text()
        todo += [f for f, _ in _local_links(page, seen[page])
                 if f.suffix == ".md" and f.is_file() and ROOT in f.parents]
    return seen


PAGES = _pages()
TEXT = "\n".join(PAGES.values())
CODE = [c for text in PAGES.values() for c in re.findall(r"`([^`\n]+)`", text)] + [b for _, b in _FENCE.findall(TEXT)]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _cited(pattern) -> list[str]:
    return sorted({m for text in CODE for m in pattern.findall(text)})


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_the_pages_are_found():
    # the crawl must reach the pages the README's table names, or every check below would pass on too little
    assert {"docs/install.md", "docs/runtime.md", "docs/results.md", "docs/families.md"} <= {_name(p) for p in PAGES}


def test_every_link_leads_to_a_file_and_heading_that_exist():
    bad = [f"{_name(page)} -> {target.name}#{anchor}" for page, text in PAGES.items()
           for target, anchor in _local_links(page, text)
           if not target.exists() or (anchor and target.suffix == ".md" and anchor not in _anchors(target))]
    assert bad == []


def test_every_docs_page_is_one_link_from_the_readme():
    linked = {f for f, _ in _local_links(README, PAGES[README])}
    assert sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked) == []


def test_every_cited_path_exists():
    missing = [p for p in _cited(_PATH) if "<" not in p and "*" not in p and not (ROOT / p.rstrip("/")).exists()
               and not p.startswith(("data/tiny_moe/", "notebooks/results"))]
    assert missing == []


def test_every_cited_name_resolves():
    bad = []
    for name in _cited(_DOTTED):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                bad.append(name)
            break
        else:
            bad.append(name)
    assert bad == []


def test_every_cited_module_command_exists():
    missing = [m for m in _cited(_MODULE) if importlib.util.find_spec(m) is None]
    assert missing == []


def _make_targets() -> set[str]:
    return set(re.findall(r"^([a-zA-Z_-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_every_cited_make_target_exists():
    assert _cited(_MAKE) and [t for t in _cited(_MAKE) if t not in _make_targets()] == []


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]


def test_the_two_commands_are_the_makefile_targets_ci_runs():
    block = _FENCE.findall(_section(PAGES[README], "Two commands"))[0][1]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]
    assert commands == ["make main", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    recipe = {t: makefile.split(f"\n{t}: ", 1)[1].split("\n\n", 1)[0] for t in ("main", "test")}
    assert "-m fate_lab main --out results" in recipe["main"]  # "into results/<model>/"
    assert recipe["test"].rstrip().endswith("-m pytest -q")  # "the whole test suite"
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), flags=re.M)  # CI runs the README's command


def _snippets() -> list[tuple[str, str]]:
    return [(f"{_name(page)}#{i}", code) for page, text in PAGES.items()
            for i, code in enumerate(c for lang, c in _FENCE.findall(text) if lang == "python")]


RUNNABLE = [s for s in _snippets() if "/path/to/" not in s[1]]


def test_the_snippets_are_found():
    assert len(RUNNABLE) >= 3 and len(_snippets()) > len(RUNNABLE)


@pytest.mark.parametrize("where,code", [s for s in _snippets() if s not in RUNNABLE],
                         ids=[w for w, _ in _snippets() if (w, _) not in RUNNABLE])
def test_a_snippet_for_your_own_folder_compiles(where, code):
    compile(code, where, "exec")


@pytest.mark.parametrize("where,code", RUNNABLE, ids=[w for w, _ in RUNNABLE])
def test_snippet_runs(where, code, capsys):
    exec(compile(code, where, "exec"), {})
    assert capsys.readouterr().out.strip()  # it printed what it says it prints


def _counts(text: str) -> dict[str, dict[str, int]]:
    """Verdicts per notebook, counted from the results page's tables (one '<number> — <verdict>' cell per model)."""
    out: dict[str, dict[str, int]] = {}
    stem = None
    for line in text.splitlines():
        if m := re.match(r"^\*\*(\d\d_\w+)\*\*$", line):
            stem = m.group(1)
            out[stem] = {}
        elif stem and line.startswith("| ") and not line.startswith("| quantity"):
            for cell in line.strip("| ").split(" | ")[2:]:
                verdict = cell.rsplit(" — ", 1)[1]
                if verdict != "—":
                    out[stem][verdict] = out[stem].get(verdict, 0) + 1
    return out


def _between(text: str, name: str) -> str:
    return text.split(f"<!-- {name}:begin", 1)[1].split("-->", 1)[1].split(f"<!-- {name}:end -->", 1)[0]


def test_the_readme_headline_counts_the_results_page():
    from fate_lab.study.verdict import AGREES, DISAGREES, NOT_COMPARABLE

    results = _between((ROOT / "docs" / "results.md").read_text(), "results")
    head = _between(PAGES[README], "results-headline")
    when = r"^What `python -m fate_lab main` printed on (.*?\))[.,] "
    assert re.search(when, results, re.M).group(1) == re.search(when, head, re.M).group(1)  # one run, date, machine
    counts = _counts(results)
    rows = {r[0]: [int(n) for n in r[1:]] for r in (line.strip("| ").split(" | ") for line in head.splitlines()
                                                    if re.match(r"^\| \d\d_", line))}
    words = (AGREES, DISAGREES, NOT_COMPARABLE)
    assert rows == {stem: [per.get(w, 0) for w in words] for stem, per in counts.items()}
    total = ", ".join(f"{sum(r[i] for r in rows.values())} {w}" for i, w in enumerate(words))
    assert f"**{total}**" in head and f"In all: {total}." in results


def test_the_readme_family_line_is_the_family_tables():
    line = re.compile(r"\*\*(\d+ modules: [^*]*?)\.?\*\*")
    assert line.search(_between(PAGES[README], "families")).group(1) == \
        line.search((ROOT / "docs" / "families.md").read_text()).group(1)


def test_the_readme_published_summary_is_the_sizing_guides():
    assert _between(PAGES[README], "published-summary") == \
        _between((ROOT / "docs" / "sizing.md").read_text(), "published-summary")


def test_the_readme_is_a_front_door():
    assert len(PAGES[README].splitlines()) <= 200
