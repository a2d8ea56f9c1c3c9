"""Paper-vs-ours rows whose verdict is computed from data: agrees, disagrees or not comparable.

What it is: `Claim`, one comparison stated as data -- what is compared, the reference (the paper's number,
or our own target where the paper gives none), our number, how the two are compared and with which
tolerance -- with its computed `verdict` and a one-line `reason`. The builders state the usual kinds:

    close(...)           ours within +-tolerance of the reference          (88.83% cosine, 97.15% recall)
    beats(...)           ours above (or below) a threshold, beyond the run's spread   (a speed-up > 1x)
    at_least(...)        ours not below a floor, within a tolerance       (all resident vs the plain model)
    holds(...)           a yes/no fact that must hold                     (identical tokens)
    not_comparable(...)  no verdict, and why                              (a figure without a number)

and `hidden_structure` names where a mean hides structure (one layer pair far from the others), which a
claim then carries in its reason. `lab.paper_table` displays claims; the main job reads them back from
the executed notebooks (`Claim.from_dict`) and writes the README's results from the same data.
What it is not: the numbers (the notebooks compute them) or their display (`lab.paper_table`).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

AGREES, DISAGREES, NOT_COMPARABLE = "agrees", "disagrees", "not comparable"
VERDICTS = (AGREES, DISAGREES, NOT_COMPARABLE)
UNITS = ("%", "x", "", "pts")  # '%': values are fractions shown as percentages; 'x': ratios


def fmt(value: float | None, unit: str = "") -> str:
    """A number as the tables print it: fractions as percentages with 3 significant digits, ratios with 'x'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if unit == "%":
        return f"{sig(100 * value)}%"
    if unit == "x":
        return f"{sig(value)}x"
    if unit == "pts":
        return f"{value:+.1f} points"
    return sig(value)


def sig(x: float, digits: int = 3) -> str:
    """x rounded to `digits` significant digits, in plain notation with thousands separators (no exponent)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if x == 0:
        return "0"
    if isinstance(x, bool):
        return str(x)
    if math.isinf(x):
        return "∞" if x > 0 else "−∞"
    if abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    mag = math.floor(math.log10(abs(x)))
    decimals = max(0, digits - 1 - mag)
    rounded = round(x, decimals if decimals else -(mag - digits + 1))
    return f"{rounded:,.{decimals}f}"


def _gap(ours: float, ref: float, unit: str) -> str:
    """How far ours is from ref, in the unit a reader compares them in (points for percentages)."""
    if unit == "%":
        return f"{abs(100 * (ours - ref)):.1f} points"
    if unit == "pts":
        return f"{abs(ours - ref):.1f} points"
    if ref:
        return f"{abs(ours / ref - 1):.0%}"
    return fmt(abs(ours - ref), unit)


@dataclass(frozen=True)
class Claim:
    """One row of a paper-vs-ours table: the comparison as data, and the verdict computed from it."""

    quantity: str  # what is compared, with where it was measured
    reference: str  # the paper's number as the paper states it, or our target ("target: within 10%")
    ours: str  # our number as printed
    verdict: str  # one of VERDICTS
    reason: str  # one line: the test that decided it, or why not
    kind: str  # "close" | "beats" | "at least" | "holds" | "not comparable"
    ours_value: float | None = None
    reference_value: float | None = None
    tolerance: float | None = None
    spread: float | None = None  # relative run-to-run spread of ours (speed rows), when measured
    unit: str = ""
    source: str = "paper"  # "paper": the paper's number; "target": our own expectation (the paper gives none)
    structure: str = ""  # where a mean hides structure ("" when it hides none)
    clocked: bool = False  # judged against the run's one calibration of this machine (simulator vs runtime):
    # undecided when the machine's speed drifted during the run (`drifted`)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r}: one of {VERDICTS}")
        if self.source not in ("paper", "target"):
            raise ValueError(f"source {self.source!r}: 'paper' or 'target'")

    def as_dict(self) -> dict:
        """The claim as plain data (JSON-able)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Claim":
        """A claim back from `as_dict` (unknown keys refused, so that a renamed field is noticed)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        extra = set(d) - fields
        if extra:
            raise ValueError(f"not fields of a Claim: {sorted(extra)}")
        return cls(**dict(d))

    @property
    def why(self) -> str:
        """The reason, with the hidden structure after it when there is one."""
        return self.reason + (f"; {self.structure}" if self.structure else "")


def _check_unit(unit: str) -> None:
    if unit not in UNITS:
        raise ValueError(f"unit {unit!r}: one of {UNITS}")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def close(quantity: str, paper: float, ours: float, tolerance: float, unit: str = "%", reference: str | None = None,
          note: str = "", structure: str = "", source: str = "paper", detail: str = "",
          uncertainty: float = 0.0, clocked: bool = False) -> Claim:
    """Agrees when |ours - paper| <= tolerance (in the values' own scale: 0.05 is 5 points for a '%' unit; for
    'pts' both values are in points). `detail` follows our number in parentheses (which preset, which layer).
    `uncertainty`: the half-width of our number's own sampling error (e.g. `rate_uncertainty`); where the
    tolerance's edge lies inside ours +- uncertainty the run cannot tell: not comparable, saying so.
    `clocked`: the comparison rests on the run's calibration of this machine (a prediction against a measurement):
    `drifted` leaves it undecided when the machine's speed changed meanwhile."""
    _check_unit(unit)
    ref_text = reference or fmt(paper, unit)
    ours_text = fmt(ours, unit) + (f" ({detail})" if detail else "")
    if not (_finite(ours) and _finite(paper)):
        return Claim(quantity, ref_text, ours_text, NOT_COMPARABLE, "no number measured" if not _finite(ours)
                     else "no reference number", "close", None, None, tolerance, None, unit, source, structure,
                     clocked)
    tol_text = (f"±{100 * tolerance:g} points" if unit == "%" else f"±{tolerance:g} points" if unit == "pts"
                else f"±{tolerance / abs(paper):.0%}" if unit == "x" and paper else f"±{fmt(tolerance, unit)}")
    named = ref_text if source == "paper" else fmt(paper, unit)
    u = abs(uncertainty) if _finite(uncertainty) else 0.0
    if u and abs(abs(ours - paper) - tolerance) < u:
        verdict, reason = NOT_COMPARABLE, (f"{_gap(ours, paper, unit)} from {named}: the {tol_text} edge is within "
                                           f"ours ±{fmt(u, unit) if unit != '%' else f'{100 * u:.2g} points'} "
                                           "(sampling error): too close to tell")
    elif abs(ours - paper) <= tolerance:
        verdict, reason = AGREES, f"within {tol_text} of {named}"
    else:
        side = "above" if ours > paper else "below"
        verdict, reason = DISAGREES, f"{_gap(ours, paper, unit)} {side} {named}, outside {tol_text}"
    if note:
        reason += f" ({note})"
    return Claim(quantity, ref_text, ours_text, verdict, reason, "close", float(ours), float(paper),
                 float(tolerance), None, unit, source, structure, clocked)


def rate_uncertainty(rate: float, n: int) -> float:
    """Two binomial standard errors of a rate measured over n events (a hit rate over n expert uses): the
    sampling error of a short trace. Uses are correlated in time, so this is a lower bound on the true error."""
    if isinstance(n, bool) or not isinstance(n, (int,)) or n < 1:
        raise ValueError(f"n={n!r}: give the number of events (an int >= 1) the rate was measured over")
    if not (_finite(rate) and 0.0 <= rate <= 1.0):
        raise ValueError(f"rate={rate!r}: give a fraction in [0, 1]")
    return 2.0 * math.sqrt(rate * (1.0 - rate) / n)


def mean_uncertainty(samples, groups=None) -> float:
    """Two standard errors of the mean of `samples` (one value per token, say: its cosine averaged over layers),
    the sampling error of a mean over a short trace. Neighbouring tokens are correlated: with `groups` (one
    label per sample, e.g. its prompt) the error is also computed from the group means, treating groups as the
    independent units, and the larger of the two is returned. Either is a lower bound on the true error when the
    units themselves are correlated (as `rate_uncertainty`'s is)."""
    xs = [float(x) for x in samples]
    if len(xs) < 2:
        raise ValueError(f"{len(xs)} sample(s): the spread of a mean needs at least 2")
    if not all(math.isfinite(x) for x in xs):
        raise ValueError("samples must be finite numbers")

    def two_se(v: list[float]) -> float:
        m = sum(v) / len(v)
        return 2.0 * math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1) / len(v))

    if groups is None:
        return two_se(xs)
    labels = [g.item() if hasattr(g, "item") else g for g in groups]
    if len(labels) != len(xs):
        raise ValueError(f"{len(labels)} group labels for {len(xs)} samples")
    by: dict = {}
    for g, x in zip(labels, xs, strict=True):
        by.setdefault(g, []).append(x)
    means = [sum(v) / len(v) for v in by.values()]
    return max(two_se(xs), two_se(means)) if len(means) >= 2 else two_se(xs)


def beats(quantity: str, ours: float, threshold: float, reference: str, unit: str = "x", spread: float | None = None,
          above: bool = True, note: str = "", structure: str = "", source: str = "paper",
          magnitude: float | None = None, margin: float = 0.0, detail: str = "") -> Claim:
    """Agrees when ours is above `threshold` (below it with above=False) by more than its run-to-run `spread`
    (a relative half-range, e.g. 0.1 for ±10%); disagrees when it is on the other side by more than that;
    inside the spread the run cannot tell: not comparable, saying so. `magnitude`: the paper's own number
    ("up to 4.1x"), named beside ours in the reason. `margin`: an absolute difference too small to count (a
    deterministic quantity's noise floor), treated like the spread. `ours` may be a measured (value, spread)
    pair, as `bench.ratio` returns it."""
    _check_unit(unit)
    if isinstance(ours, tuple):
        ours, spread = ours
    if not _finite(ours):
        return Claim(quantity, reference, fmt(ours, unit), NOT_COMPARABLE, "no number measured", "beats", None,
                     threshold, None, spread, unit, source, structure)
    s = 0.0 if spread is None or not _finite(spread) else abs(spread)
    d = max(abs(ours) * s, abs(margin))
    lo, hi = ours - d, ours + d
    want = "above" if above else "below"
    within = f" (run-to-run spread ±{s:.0%})" if s else (f" (by more than {fmt(margin, unit)})" if margin else "")
    if (lo > threshold) if above else (hi < threshold):
        verdict, reason = AGREES, f"{fmt(ours, unit)} is {want} {fmt(threshold, unit)}{within}"
    elif (hi < threshold) if above else (lo > threshold):
        verdict, reason = DISAGREES, f"{fmt(ours, unit)} is not {want} {fmt(threshold, unit)}{within}"
    else:
        band = f"the run-to-run spread ±{s:.0%}" if d == abs(ours) * s and s else f"{fmt(d, unit)}"
        verdict, reason = NOT_COMPARABLE, (f"{fmt(ours, unit)} is within {band} of {fmt(threshold, unit)}: "
                                           "too close to tell")
    if magnitude is not None and verdict == AGREES:
        reason += f"; the paper's {fmt(magnitude, unit)} is {'reached' if ours >= magnitude else 'not reached'}"
    if note:
        reason += f" ({note})"
    shown = fmt(ours, unit) + (f" ±{s:.0%}" if s else "") + (f" ({detail})" if detail else "")
    return Claim(quantity, reference, shown,
                 verdict, reason, "beats",
                 float(ours), float(threshold), None, spread if spread is None or _finite(spread) else None, unit,
                 source, structure)


def at_least(quantity: str, ours: float, floor: float, tolerance: float = 0.0, unit: str = "x",
             reference: str | None = None, note: str = "", source: str = "target", detail: str = "") -> Claim:
    """Agrees when ours >= floor - tolerance (e.g. all experts resident never slower than the plain model,
    within the run's spread); disagrees below that. `ours` may be a measured (value, spread) pair: its spread,
    relative, then widens the tolerance."""
    _check_unit(unit)
    rel = None
    if isinstance(ours, tuple):
        ours, rel = ours
        rel = abs(rel) if _finite(rel) else None
        tolerance = max(tolerance, abs(ours * rel) if rel is not None and _finite(ours) else 0.0)
    ref_text = reference or f"target: at least {fmt(floor, unit)}"
    ours_text = fmt(ours, unit) + (f" ±{rel:.0%}" if rel else "") + (f" ({detail})" if detail else "")
    if not _finite(ours):
        return Claim(quantity, ref_text, ours_text, NOT_COMPARABLE, "no number measured", "at least", None, floor,
                     tolerance, rel, unit, source)
    band = f" (tolerance {fmt(tolerance, unit)})" if tolerance else ""
    if ours >= floor - tolerance:
        verdict, reason = AGREES, f"{fmt(ours, unit)} is at least {fmt(floor, unit)}{band}"
    else:
        verdict, reason = DISAGREES, f"{fmt(ours, unit)} is below {fmt(floor, unit)}{band}"
    if note:
        reason += f" ({note})"
    return Claim(quantity, ref_text, ours_text, verdict, reason, "at least", float(ours), float(floor),
                 float(tolerance), rel, unit, source)


def holds(quantity: str, fact: bool, ours: str, reference: str = "must hold", reason: str = "",
          source: str = "target") -> Claim:
    """A yes/no fact: agrees when it holds, disagrees when not (`reason` says what was checked)."""
    if not isinstance(fact, bool):
        raise TypeError(f"fact must be a bool, got {type(fact).__name__}")
    return Claim(quantity, reference, ours, AGREES if fact else DISAGREES,
                 reason or ("holds" if fact else "does not hold"), "holds", float(fact), 1.0, None, None, "", source)


def not_comparable(quantity: str, reference: str, ours: str, reason: str, source: str = "paper") -> Claim:
    """A row with no verdict, and why (the paper gives a figure without a number, another metric, ...)."""
    if not reason:
        raise ValueError("say why the row is not comparable")
    return Claim(quantity, reference, ours, NOT_COMPARABLE, reason, "not comparable", source=source)


def drifted(claims: list[Claim], change: float) -> list[Claim]:
    """`claims` with every `clocked` one made not comparable, saying why: the machine's speed changed by `change`
    (relative, `clock.Drift.change`) between the calibration the prediction used and the end of the measurement,
    so prediction and measurement describe two machines. The others are returned as they are."""
    if not _finite(change):
        raise ValueError(f"change={change!r}: give the drift's relative change of the layer time")
    why = (f"the machine's speed drifted ({change:+.0%} layer time) between the calibration and the end of the "
           "run: prediction and measurement describe two machines")
    return [dataclasses.replace(c, verdict=NOT_COMPARABLE, reason=f"{why} (else: {c.verdict}, {c.reason})")
            if c.clocked else c for c in claims]


def outliers(values: Mapping[str, float], tolerance: float) -> dict[str, float]:
    """The items of `values` (label -> value) farther than `tolerance` from the median of the others; none when
    fewer than three values, or when more than half would be 'outliers' (then there is no typical value)."""
    items = [(k, float(v)) for k, v in values.items() if _finite(v)]
    if len(items) < 3:
        return {}
    out = {}
    for k, v in items:
        rest = sorted(x for j, x in items if j != k)
        if abs(v - rest[len(rest) // 2]) > tolerance:
            out[k] = v
    return out if len(out) <= len(items) // 2 else {}


def hidden_structure(values: Mapping[str, float], tolerance: float, unit: str = "%", what: str = "the mean") -> str:
    """Where `what` (over `values`, label -> value) hides structure, in words: the `outliers`, named with their
    value and the others' range; '' when there are none."""
    _check_unit(unit)
    out = outliers(values, tolerance)
    if not out:
        return ""
    rest = [float(v) for k, v in values.items() if k not in out and _finite(v)]
    others = f"{fmt(min(rest), unit)}–{fmt(max(rest), unit)}" if len(rest) > 1 else fmt(rest[0], unit)
    return f"{what} hides " + ", ".join(f"{k} at {fmt(v, unit)}" for k, v in out.items()) + f" (the others {others})"


__all__ = ["AGREES", "DISAGREES", "NOT_COMPARABLE", "VERDICTS", "Claim", "at_least", "beats", "close", "drifted", "fmt",
           "hidden_structure", "holds", "mean_uncertainty", "not_comparable", "outliers", "rate_uncertainty", "sig"]
