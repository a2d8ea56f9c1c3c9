"""Prose checked against numbers: every number a notebook's markdown states must be printed by one of its cells.

What it is: `markdown_numbers` (the numbers a reader would check in a markdown cell: decimals, percentages and
ratios such as 88.83%, 2.9 or 4.1x; code spans, arXiv ids and link generations like "PCIe 3.0" are names, not
claims), `printed_text` (everything an executed notebook's cells printed) and `unprinted_numbers` (the first
against the second), and `stderr_outputs` (anything a cell wrote to stderr: a warning in red is a defect).
What it is not: a judge of whether a number is right; the verdicts do that (`verdict.py`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

_NUMBER = re.compile(r"(?<![\w.,])[-+]?(?:\d+(?:\.\d+)?x\b|\d[\d,]*\.\d+%?|\d+%)")
_NOT_CLAIMS = (re.compile(r"`[^`]*`"), re.compile(r"\b\d{4}\.\d{4,5}\b"), re.compile(r"PCIe \d\.\d"),
               re.compile(r"\(https?://[^)]*\)"))


def _text(data) -> str:
    return "".join(data) if isinstance(data, list) else str(data or "")


def markdown_numbers(source: str) -> list[str]:
    """The numbers a markdown cell states (module docstring), in order."""
    for pattern in _NOT_CLAIMS:
        source = pattern.sub(" ", source)
    return [m.group(0).lstrip("+").rstrip(",") for m in _NUMBER.finditer(source)]


def printed_text(nb: dict) -> str:
    """Everything the code cells of an executed notebook printed or displayed as text or HTML."""
    parts = []
    for c in nb.get("cells", []):
        for o in c.get("outputs", []) or []:
            if o.get("output_type") == "stream":
                parts.append(_text(o.get("text")))
            for key in ("text/plain", "text/html", "text/markdown"):
                parts.append(_text(o.get("data", {}).get(key)))
    return "\n".join(parts)


def unprinted_numbers(path: Path) -> list[str]:
    """'cell N: number' for each number a markdown cell of an executed notebook states and no cell printed."""
    nb = json.loads(Path(path).read_text())
    printed = printed_text(nb).replace("&#x27;", "'")
    out = []
    for i, c in enumerate(nb.get("cells", [])):
        if c.get("cell_type") != "markdown":
            continue
        for n in markdown_numbers(_text(c.get("source"))):
            if n not in printed:
                out.append(f"markdown cell {i}: {n}")
    return out


def stderr_outputs(path: Path) -> list[str]:
    """'cell N: first line' for each output an executed notebook's cells wrote to stderr."""
    nb = json.loads(Path(path).read_text())
    return [f"cell {i}: {_text(o.get('text')).strip().splitlines()[0][:200] if _text(o.get('text')).strip() else ''}"
            for i, c in enumerate(nb.get("cells", [])) for o in c.get("outputs", []) or []
            if o.get("output_type") == "stream" and o.get("name") == "stderr"]


__all__ = ["markdown_numbers", "printed_text", "stderr_outputs", "unprinted_numbers"]
