"""The optional dependencies: `need(module)` imports one, or fails with one line naming the extra that installs it.

What it is: the map from each optional package to its extra in pyproject.toml (`plots`, `learned`, `notebooks`),
and the import that says which extra to install when the package is missing.
What it is not: a fallback; a missing package is an error, never a silently skipped figure or fit.
"""
from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {"matplotlib": "plots", "seaborn": "plots", "sklearn": "learned", "ipywidgets": "notebooks",
          "IPython": "notebooks"}


def need(module: str) -> ModuleType:
    """`importlib.import_module(module)`; a missing package raises ModuleNotFoundError naming its extra."""
    root = module.split(".")[0]
    if root not in EXTRAS:
        raise ValueError(f"{module!r} is not an optional dependency of fate_lab (those are {sorted(EXTRAS)})")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != root:
            raise  # the package is there but one of its own imports failed: its own error says which
        extra = EXTRAS[root]
        raise ModuleNotFoundError(f"{module} is not installed: it comes with fate_lab's {extra!r} extra "
                                  f"(pip install 'fate_lab[{extra}]')", name=root) from None
