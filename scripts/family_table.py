"""Write the table of families the offloaded runtime serves, from a run of the checks themselves.

Run: `OMP_NUM_THREADS=1 python -m scripts.family_table --out docs/families.md --readme README.md` (about a minute on one core).
For every modeling module of the installed transformers whose experts use its experts interface it builds a
tiny random model, offloads it under the presets of `fate_lab.offloading.support.RUNS` and a left-padded
batch, compares tokens and logits with the plain model, and writes one row per module (exact / refused and
why / wrong / not built) with the counts on top. `tests/offloading/test_families_runtime.py` asserts on the
same rows (`check_family`), so the table and the test cannot disagree.
"""
from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path

COMMAND = "OMP_NUM_THREADS=1 python -m scripts.family_table --out docs/families.md --readme README.md"


def main(argv: list[str] | None = None) -> int:
    """Run the support checks and write the markdown table; exit 1 if any family gives wrong output."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/families.md"), help="markdown file to write")
    parser.add_argument("--readme", type=Path, default=None, help="also rewrite this README's family section")
    args = parser.parse_args(argv)
    from fate_lab.offloading.support import support_counts, support_markdown, support_readme, support_table, write_readme_table

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    rows = support_table()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(support_markdown(rows, COMMAND))
    if args.readme is not None:
        write_readme_table(support_readme(rows, COMMAND), args.readme)
    counts = support_counts(rows)
    print(f"wrote {args.out}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return 1 if counts["wrong"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
