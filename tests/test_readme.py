"""The README stays true: every path and dotted name it cites exists, and its runnable snippets run."""
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CODE = re.findall(r"`([^`\n]+)`", README) + re.findall(r"```(?:python|bash)\n(.*?)```", README, flags=re.S)

_PATH = re.compile(r"(?<![\w./-])((?:fate_lab|tests|benchmarks|docs|notebooks|data|scripts)/[\w./-]*[\w/])(?![\w./$-])")
_DOTTED = re.compile(r"(?<![\w.])(fate_lab(?:\.\w+)+)")
_MODULE = re.compile(r"python -m ((?:benchmarks|scripts|fate_lab)(?:\.\w+)*)")


def _cited(pattern) -> list[str]:
    return sorted({m for text in CODE for m in pattern.findall(text)})


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


def _snippet(heading: str) -> str:
    section = README.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]


@pytest.mark.parametrize("heading", ["One cache, three drivers", "Traces from other tools", "The offloaded runtime in five lines"])
def test_snippet_runs(heading, capsys):
    exec(compile(_snippet(heading), f"README: {heading}", "exec"), {})
    assert capsys.readouterr().out.strip()  # it printed what it says it prints
