"""The explorers' common look: controls as wide as the notebook, labels that are never cut, one status line.

What it is: `slider` / `dropdown` / `toggle` (ipywidgets controls with a full-width track and a fixed,
readable label column), `status` (a line that says what is running), and `show_figure` (a figure drawn
into an Output area, then closed).
What it is not: a place that computes anything.
"""
from __future__ import annotations

from fate_lab.extras import need

LABEL_WIDTH = "230px"  # wide enough for the longest label ("experts per layer n", "cache share of 448 experts")


def _style() -> dict:
    return {"description_width": LABEL_WIDTH}


def slider(kind: str, description: str, **kw):
    """An IntSlider ('int'), FloatSlider ('float'), SelectionSlider ('select') or FloatLogSlider ('log') whose
    track fills the notebook's width; updates only when released."""
    W = need("ipywidgets")

    cls = {"int": W.IntSlider, "float": W.FloatSlider, "select": W.SelectionSlider, "log": W.FloatLogSlider}[kind]
    return cls(description=description, continuous_update=False, layout=W.Layout(width="98%"), style=_style(), **kw)


def dropdown(description: str, options, value=None):
    """A dropdown with the same label column as the sliders, wide enough for its longest option."""
    W = need("ipywidgets")

    longest = max((len(str(o if not isinstance(o, tuple) else o[0])) for o in options), default=10)
    width = f"calc({LABEL_WIDTH} + {max(12, longest) + 6}ch)"
    return W.Dropdown(description=description, options=options, value=value if value is not None else
                      (options[0] if not isinstance(options[0], tuple) else options[0][1]),
                      layout=W.Layout(width=width, max_width="98%"), style=_style())


def toggle(description: str, options, value=None):
    """Toggle buttons with the same label column, each button wide enough for its label."""
    W = need("ipywidgets")

    longest = max(len(str(o if not isinstance(o, tuple) else o[0])) for o in options)
    return W.ToggleButtons(description=description, options=options, value=value if value is not None else
                           (options[0] if not isinstance(options[0], tuple) else options[0][1]),
                           style={**_style(), "button_width": f"{max(8, longest) + 4}ch"})


def status(text: str = ""):
    """A one-line label as wide as the notebook."""
    W = need("ipywidgets")

    return W.Label(text, layout=W.Layout(width="98%"))


def show_figure(fig) -> None:
    """Display a matplotlib figure in the current output and close it (no figure piles up)."""
    plt = need("matplotlib.pyplot")
    display = need("IPython.display").display

    display(fig)
    plt.close(fig)
