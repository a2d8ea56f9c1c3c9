"""Write the table of families the offloaded runtime serves, from a run of the checks themselves.

Run: `OMP_NUM_THREADS=1 python -m scripts.family_table --out docs/families.md --readme README.md` (about a minute
on one core).
For every modeling module of the installed transformers whose experts use its experts interface it builds a
tiny random model, offloads it under the presets of `fate_lab.offloading.support.RUNS` and a left-padded
batch, compares tokens and logits with the plain model, and writes one row per module (exact / refused and
why / wrong / failed / not built) with the counts and the modules grouped by experts layout on top;
`--readme` puts the counts line in the README, between its family markers.
`tests/offloading/test_families_runtime.py` asserts on the same rows (`check_family`), so the table and the test
cannot disagree.

`--compare docs/families.md` (what `make check-newest` runs against the newest transformers `pyproject.toml`
allows) also says, module by module, what the installed release changed against that table: which families it
broke (exact there, not exact here), which it added, and which it fixed; exit 1 if it broke any.
"""
from __future__ import annotations

import argparse
import logging
import re
import warnings
from pathlib import Path

COMMAND = "OMP_NUM_THREADS=1 python -m scripts.family_table --out docs/families.md --readme README.md"
_ROW = re.compile(r"^\| (\w+) \| [^|]* \| [^|]* \| ([a-z ]+) \|")


def table_verdicts(markdown: str) -> tuple[str, dict[str, str]]:
    """(the transformers version it was generated with, {module: verdict}) of a family table written here."""
    version = re.search(r"with transformers (\S+) and torch", markdown)
    rows = {m.group(1): m.group(2).strip() for line in markdown.splitlines() if (m := _ROW.match(line))}
    rows.pop("module", None)
    return (version.group(1) if version else "?"), rows


def compare(rows, pinned: dict[str, str], pinned_version: str) -> tuple[list[str], int]:
    """(report lines, number of families broken): this run's rows against a table's {module: verdict}."""
    import transformers

    now = {r.module: r for r in rows}
    broken = [m for m, v in pinned.items() if v == "exact" and (m not in now or now[m].verdict != "exact")]
    added = [m for m in now if m not in pinned]
    fixed = [m for m, v in pinned.items() if v != "exact" and m in now and now[m].verdict == "exact"]
    head = f"transformers {transformers.__version__} against the table of transformers {pinned_version}"
    lines = [f"{head}: {len(broken)} famil{'y' if len(broken) == 1 else 'ies'} broken, {len(added)} new module(s), "
             f"{len(fixed)} fixed"]
    for m in broken:
        lines.append(f"  BROKEN {m}: exact with {pinned_version}, now " + (
            f"{now[m].verdict}: {now[m].reason}" if m in now else "gone (no longer an experts-interface module)"))
    lines += [f"  new    {m}: {now[m].verdict}{': ' + now[m].reason if now[m].reason else ''}" for m in added]
    lines += [f"  fixed  {m}: {pinned[m]} with {pinned_version}, now exact" for m in fixed]
    return lines, len(broken)


def main(argv: list[str] | None = None) -> int:
    """Run the support checks and write the markdown table; exit 1 if any family gives wrong output or fails, or
    (with --compare) if the installed release broke a family the table says is exact."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/families.md"), help="markdown file to write")
    parser.add_argument("--readme", type=Path, default=None,
                        help="also rewrite the counts line between this README's family markers")
    parser.add_argument("--compare", type=Path, default=None,
                        help="a family table written here before (e.g. docs/families.md): report what changed")
    args = parser.parse_args(argv)
    from fate_lab.offloading.support import (
        support_counts,
        support_markdown,
        support_readme,
        support_table,
        write_readme_table,
    )

    if args.compare is not None and not args.compare.is_file():
        parser.error(f"--compare {args.compare}: no such file; give a table this script wrote, e.g. docs/families.md")
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    rows = support_table()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(support_markdown(rows, COMMAND))
    if args.readme is not None:
        write_readme_table(support_readme(rows, COMMAND), args.readme)
    counts = support_counts(rows)
    print(f"wrote {args.out}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    broken = 0
    if args.compare is not None:
        version, pinned = table_verdicts(args.compare.read_text())
        lines, broken = compare(rows, pinned, version)
        print("\n".join(lines))
    return 1 if counts["wrong"] or counts["failed"] or broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
