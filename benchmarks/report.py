"""What every benchmark does with its markdown table: print it, and write it to ``--out`` when given."""
from __future__ import annotations

from pathlib import Path


def emit(lines: list[str], out: str | None) -> str:
    """The lines as one markdown text: printed, written to `out` (if any, with a final newline), returned."""
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return text
