"""Learned cross-layer probes as pure data: per-layer probes from layer l's gate input to layer l+1's experts.

What this file is: Fate predicts layer l+1's experts by applying layer l+1's router to layer l's gate
input x_l. Here a small probe per layer, *trained* for the same job (`fate_lab/fit/probes.py`), is kept
as plain tensors (`ProbeSet`, saved beside the model as `probes.safetensors` + `.json`), so that
predicting is a linear map (+ ReLU + linear for MLP probes) and a sigmoid on the host. The probes give
per-expert probabilities; the selection rule is a probability threshold (`Threshold`), one per phase
(prefill, decode) and source layer. `LearnedGate` is the predictor every driver shares.
What it is not: no fitting, no model run, no timing, no command line (`fate_lab/fit/probes.py`,
`python -m fate_lab fit-probes`); no device, no thread, no cache.
Letters: L MoE layers (L-1 probes; probe l reads x_l and predicts layer l+1), E experts, H hidden
size, D probe hidden width, T tokens of one call.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from fate_lab.paths import model_dir as _model_dir
from fate_lab.policy.predictors import CrossLayerGate
from fate_lab.policy.rules import RouterScores, SelectionRule

FIT_COMMAND = "python -m fate_lab fit-probes --model DIR"

PROBES_FILE = "probes.safetensors"
FORMAT_VERSION = 1
PHASE_NAMES = ("prefill", "decode")  # row 0 / row 1 of the thresholds, as PREFILL / DECODE in trace
MATCH_MODES = ("overall", "layer")
_META_KEY = "fate_lab_probes"
HIDDEN = 192  # default probe width: float16 probes for 8 layers x 32 experts x 256 stay under 1 MB


# ----------------------------------------------------------------------------- the selection rule


@dataclass(frozen=True)
class Threshold(SelectionRule):
    """Every expert whose probability is at least ``p``; the single best one when none is."""

    p: float

    def select(self, scores: Tensor) -> Tensor:
        mask = scores >= self.p  # (T, E) ties at p are all in: still a prefix of `order`
        empty = ~mask.any(-1)
        if empty.any():
            mask[empty, scores[empty].argmax(-1)] = True  # argmax: first maximum, as `order` ranks ties
        return mask

    def count(self, row: list[float]) -> int:
        return max(1, sum(1 for x in row if x >= self.p))


# ----------------------------------------------------------------------------- the probes


@dataclass(frozen=True)
class ProbeSet:
    """Per-layer probes as plain tensors: ``sigmoid(weight @ relu(hidden_weight @ x + hidden_bias) + bias)``.

    Linear probes have no hidden layer (``weight [L-1, E, H]``). The feature standardisation of the
    fit is folded into the first layer, so raw gate inputs go in. Tensors keep their storage dtype
    (float16 for the shipped file); scoring is in float32.
    """

    weight: Tensor  # (L-1, E, D) output layer; D = H for linear probes
    bias: Tensor  # (L-1, E)
    hidden_weight: Tensor | None = None  # (L-1, D, H) first layer of MLP probes (ReLU after it)
    hidden_bias: Tensor | None = None  # (L-1, D)
    thresholds: Tensor | None = None  # (2, L-1) probability thresholds: [prefill, decode] x source layer
    meta: dict = field(default_factory=dict)  # fit settings, training data, tuning targets
    _layers: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.weight.dim() != 3:
            raise ValueError(f"ProbeSet.weight must be [probes, experts, features]; got {tuple(self.weight.shape)}")
        P, E, D = self.weight.shape
        if tuple(self.bias.shape) != (P, E):
            raise ValueError(f"ProbeSet.bias must be [probes, experts] = {(P, E)}; got {tuple(self.bias.shape)}")
        if (self.hidden_weight is None) != (self.hidden_bias is None):
            raise ValueError("ProbeSet: give both hidden_weight and hidden_bias (MLP probes) or neither (linear)")
        if self.hidden_weight is not None:
            if self.hidden_weight.dim() != 3 or tuple(self.hidden_weight.shape[:2]) != (P, D):
                raise ValueError(f"ProbeSet.hidden_weight must be [probes, {D}, H]; got "
                                 f"{tuple(self.hidden_weight.shape)}")
            if tuple(self.hidden_bias.shape) != (P, D):
                raise ValueError(f"ProbeSet.hidden_bias must be {(P, D)}; got {tuple(self.hidden_bias.shape)}")
        if self.thresholds is not None and tuple(self.thresholds.shape) != (2, P):
            raise ValueError(f"ProbeSet.thresholds must be [2 phases (prefill, decode), {P} probes]; got "
                             f"{tuple(self.thresholds.shape)}")
        hidden = [None] * P if self.hidden_weight is None else list(zip(self.hidden_weight.float(),
                                                                         self.hidden_bias.float(), strict=False))
        # float32 views, made once
        self._layers.extend(zip(hidden, self.weight.float(), self.bias.float(), strict=False))

    @property
    def num_layers(self) -> int:
        """L, the MoE layers of the model (one probe per layer but the last)."""
        return self.weight.shape[0] + 1

    @property
    def num_experts(self) -> int:
        """E, routed experts per layer."""
        return self.weight.shape[1]

    @property
    def hidden_size(self) -> int:
        """H, the width of a gate input."""
        return (self.hidden_weight if self.hidden_weight is not None else self.weight).shape[2]

    @property
    def kind(self) -> str:
        """'linear' or 'mlp'."""
        return "linear" if self.hidden_weight is None else "mlp"

    def check(self, num_layers: int, num_experts: int, hidden_size: int) -> None:
        """ValueError unless these probes were fitted for a model of this shape."""
        have = (self.num_layers, self.num_experts, self.hidden_size)
        if have != (num_layers, num_experts, hidden_size):
            raise ValueError(f"these probes are for a model with (MoE layers, experts, hidden) = {have}, not "
                             f"{(num_layers, num_experts, hidden_size)}; fit probes for this model with "
                             f"`{FIT_COMMAND}`")

    def scores(self, layer: int, gate_input: Tensor) -> Tensor:
        """Probabilities ``[T, E]`` of the experts of layer+1, from layer ``layer``'s gate input ``[T, H]``."""
        if not 0 <= layer < len(self._layers):
            raise IndexError(f"probe layer {layer} out of range: probes read MoE layers 0..{len(self._layers) - 1} "
                             f"(the last MoE layer has no next layer to predict)")
        x = gate_input.detach().to("cpu", torch.float32)
        if x.dim() == 1:
            x = x.unsqueeze(0)  # (1, H) one decode token
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"gate_input must be [T, {self.hidden_size}] (or [{self.hidden_size}]); got "
                             f"{tuple(gate_input.shape)}")
        hidden, w, b = self._layers[layer]
        if hidden is not None:
            x = torch.relu(torch.nn.functional.linear(x, hidden[0], hidden[1]))  # (T, D)
        return torch.sigmoid(torch.nn.functional.linear(x, w, b))  # (T, E)

    def trace_scores(self, gate_inputs: Tensor) -> Tensor:
        """Every probe on a trace's gate inputs ``[N, L, H]`` -> ``[N, L-1, E]`` (row l predicts layer l+1)."""
        if gate_inputs.dim() != 3 or gate_inputs.shape[1] != self.num_layers:
            raise ValueError(f"gate_inputs must be [N, {self.num_layers}, {self.hidden_size}]; got "
                             f"{tuple(gate_inputs.shape)}")
        return torch.stack([self.scores(l, gate_inputs[:, l]) for l in range(self.num_layers - 1)], dim=1)

    def rule(self, layer: int, phase: str) -> Threshold:
        """The tuned selection rule of probe ``layer`` in ``phase`` ('prefill' or 'decode')."""
        if self.thresholds is None:
            raise ValueError("these probes have no tuned thresholds; call fate_lab.fit.probes.tune_thresholds(probes, "
                             "calib_trace)")
        if phase not in PHASE_NAMES:
            raise ValueError(f"phase must be one of {PHASE_NAMES}, not {phase!r}")
        return Threshold(float(self.thresholds[PHASE_NAMES.index(phase), layer]))

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (.safetensors: tensors at their dtype + metadata) and a readable ``.json`` beside it."""
        from safetensors.torch import save_file

        path = Path(path)
        if path.suffix != ".safetensors":
            raise ValueError(f"save a ProbeSet to a .safetensors path, got {path}")
        meta = dict(self.meta, format_version=FORMAT_VERSION, kind=self.kind, num_moe_layers=self.num_layers,
                    num_experts=self.num_experts, hidden_size=self.hidden_size,
                    thresholds=None if self.thresholds is None else self.thresholds.tolist())
        tensors = {"weight": self.weight, "bias": self.bias}
        for name in ("hidden_weight", "hidden_bias", "thresholds"):
            if getattr(self, name) is not None:
                tensors[name] = getattr(self, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={_META_KEY: json.dumps(meta)})
        path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "ProbeSet":
        """Read a file written by ``save`` (safetensors + JSON metadata; no pickles)."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(_META_KEY)
            if raw is None or "weight" not in f.keys():
                raise ValueError(f"{path} is a safetensors file but not fate_lab probes (no {_META_KEY!r} metadata "
                                 f"or no 'weight' tensor)")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(raw)
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path} has probe format {meta.get('format_version')!r}; this fate_lab reads "
                             f"{FORMAT_VERSION}. Refit: {FIT_COMMAND}")
        meta = {k: v for k, v in meta.items() if k not in ("format_version", "kind", "num_moe_layers", "num_experts",
                                                           "hidden_size", "thresholds")}
        return cls(weight=tensors["weight"], bias=tensors["bias"], hidden_weight=tensors.get("hidden_weight"),
                   hidden_bias=tensors.get("hidden_bias"), thresholds=tensors.get("thresholds"), meta=meta)


def probes_path(model_dir: str | Path | None = None) -> Path:
    """Where a model folder keeps its probes (None: the embedded tiny MoE)."""
    return _model_dir(model_dir) / PROBES_FILE


def load_probes(model_dir: str | Path | None = None) -> ProbeSet:
    """The probes kept with a model folder (None: the embedded tiny MoE)."""
    path = probes_path(model_dir)
    if not path.exists():
        raise FileNotFoundError(
            f"no learned expert predictor for the model in {path.parent} (looked for {path.name}); fit one with "
            f"`python -m fate_lab fit-probes --model {path.parent}` (it records a trace on training-split "
            f"text and fits one probe per MoE layer; minutes for the tiny model)")
    return ProbeSet.load(path)


# ----------------------------------------------------------------------------- the predictor


class LearnedGate(CrossLayerGate):
    """Fate's cross-layer gate with learned probes: ``next_scores`` are ``probes.scores(layer, x_layer)``.

    Its ``scores`` hook gives probe scores, not the router product. The threshold is chosen per source
    layer and phase; the phase is ``set_phase``'s, else inferred from the rows (one row: decode, more:
    prefill).
    """

    def __init__(self, probes: ProbeSet, thresholds: Tensor | None = None):
        thr = probes.thresholds if thresholds is None else torch.as_tensor(thresholds)
        if thr is None:
            raise ValueError("LearnedGate needs thresholds: tune them (fate_lab.fit.probes.tune_thresholds) or pass "
                             "[2, L-1] values")
        if tuple(thr.shape) != (2, probes.num_layers - 1):
            raise ValueError(f"thresholds must be [2 phases (prefill, decode), {probes.num_layers - 1} probes]; got "
                             f"{tuple(thr.shape)}")
        self.probes = probes
        self.thresholds = thr.float()
        self._gates = {(ph, l): CrossLayerGate(Threshold(float(thr[i, l])))
                       for i, ph in enumerate(PHASE_NAMES) for l in range(thr.shape[1])}
        self.rule = None  # one rule per (phase, layer): see `rule_for`
        self.name = f"learned[{probes.kind}]"
        self.phase: str | None = None

    def set_phase(self, phase: str | None) -> None:
        """Use the thresholds of ``phase`` ('prefill'/'decode'), or None to infer it from the rows."""
        if phase is not None and phase not in PHASE_NAMES:
            raise ValueError(f"phase must be one of {PHASE_NAMES} or None, not {phase!r}")
        self.phase = phase

    def rule_for(self, layer: int, phase: str) -> Threshold:
        """The selection rule used for source layer ``layer`` in ``phase``."""
        return self._gates[(phase, layer)].rule

    def scores(self, layer: int, gate_input: Tensor, router: RouterScores | None = None) -> Tensor:
        """What the driver passes as ``next_scores``: the probe's probabilities ``[T, E]`` for layer+1 (the
        router is not read: the probes replace the router product)."""
        return self.probes.scores(layer, gate_input)

    def predict(self, layer: int, next_scores: Tensor | None, cur_experts: Tensor) -> list[int]:
        """Experts predicted for layer ``layer + 1`` from probe scores ``[E]`` / ``[T, E]`` (see ``Predictor``)."""
        if next_scores is None:
            raise ValueError("LearnedGate needs next_scores = LearnedGate.scores(layer, gate input of layer)")
        rows = 1 if next_scores.dim() == 1 else next_scores.shape[0]
        gate = self._gates.get((self.phase or ("decode" if rows == 1 else "prefill"), layer))
        if gate is None:
            raise IndexError(f"no probe for layer {layer}: probes read MoE layers 0..{self.thresholds.shape[1] - 1}")
        return gate.predict(layer, next_scores, cur_experts)
