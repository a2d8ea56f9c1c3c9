"""One offloaded experts call: the expert math of MoE layer m, from device slots, on the host, or from stand-ins.

What this file is: `ExpertsCall`, built per call by the runtime from `ExpertSources`, the collaborators the
runtime hands over once (the adapter, the slots' and the store's weights, the stand-ins, the host time, the
recorder). It is the runtime's `policy.step.ComputeTarget`: the layer step's `dispatch` sends each needed expert, in
the cache's order, to `on_device` (from a device slot, `slots.weights`, dequantized first when packed), `on_host`
(from the store's weights; the activations go there and back; on a CPU-only machine the call then holds for the
host profile's time) or `from_standin` (the resident INT2 copy, HOBBIT's stand-in). Every expert computes with
`model.experts.expert_apply` on its `ExpertWeights`, so each layout the model side serves (no gate, biases,
transposed or interleaved storage, a family's own gate, fp32 compute) computes as transformers' eager experts
forward does. `output()` sums the weighted outputs as
that forward sums them -- expert by expert in id order, in the layout's accumulation dtype -- and
renormalises what a lossy step dropped.
What it is not: the schedule (which expert when, from which slot: the cache) or a policy.
Letters: T tokens, K experts per token (top-k), H hidden, n tokens of one expert.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from fate_lab.core.recorder import Recorder
from fate_lab.model.adapters import MoEAdapter
from fate_lab.model.experts import ExpertWeights, expert_apply

_ACCUMULATE = {"float32": torch.float32}  # layout.accumulate -> dtype ("output": the hidden's; "weights": theirs)


@dataclass(frozen=True)
class ExpertSources:
    """Where an experts call finds its experts and where it reports: what it needs of the runtime, and no more."""

    adapter: MoEAdapter  # each MoE layer's experts module and layout
    slot_weights: Callable[[int], ExpertWeights]  # a device slot's weights (packed ones dequantized into scratch)
    fetch: Callable[[int, int], ExpertWeights]  # (layer, expert) -> the host store's weights
    standin: list | None  # [layer][expert] resident INT2 copies (HOBBIT), or None
    dtype: torch.dtype  # the model's dtype (a stand-in dequantizes to it)
    device: torch.device
    host_time: Callable[[int], float] | None  # n tokens -> the host profile's time for one expert (host placement)
    rec: Recorder  # events and host time go here


class ExpertsCall:
    """The expert math of one call: hidden [T, H], top-k ids/weights [T, K]; see the module docstring."""

    def __init__(self, src: ExpertSources, m: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor):
        self.src, self.m, self.x = src, m, hidden_states
        self.module, self.layout = src.adapter.experts_module(m), src.adapter.layouts[m]
        self.T, self.K = top_k_index.shape
        self.idx_host = top_k_index.detach().to("cpu")  # (T, K)
        self.flat = self.idx_host.reshape(-1).tolist()  # (T*K,) expert per (token, k) position
        E = self.layout.num_experts
        if min(self.flat) < 0 or max(self.flat) >= E:
            bad = next(e for e in self.flat if not 0 <= e < E)
            raise NotImplementedError(f"{src.adapter.family}: the router of MoE layer {m} passed expert id {bad} to "
                                      f"its experts ({E} experts); fate_lab does not serve routers that mark "
                                      "skipped slots with out-of-range ids")
        self.idx, self.w = top_k_index, top_k_weights
        acc = self.layout.accumulate
        self.acc_dtype = top_k_weights.dtype if acc == "weights" else _ACCUMULATE.get(acc, hidden_states.dtype)
        self.fp32 = self.layout.compute_fp32
        self.outputs: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # e -> (token rows, weighted (n, H))

    def _rows(self, e: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(token rows (n,) or None for the single decode token, their hidden [n, H], their weights [n, 1]); a token
        whose top-k names e twice (hash routing can) counts twice, as in the eager forward."""
        if self.T == 1 and self.flat.count(e) == 1:  # decode: expert e sits at one position k of the single token
            k = self.flat.index(e)
            return None, self.x, self.w[0:1, k:k + 1]  # (1, H), (1, 1)
        pos, tok = torch.where(self.idx.T == e)  # (n,), (n,) position-major: the eager forward's row order, so its
        # matmul sees the same rows in the same order (some BLAS kernels round a row by where it sits in the batch)
        return tok, self.x[tok], self.w[tok, pos, None]  # (n,), (n, H), (n, 1)

    def _weigh(self, e: int, tok: torch.Tensor | None, y: torch.Tensor, w: torch.Tensor) -> None:
        """Keep expert e's output y [n, H] times its routing weights w [n, 1], in the accumulation dtype."""
        if self.fp32:
            w = w.float()
        self.outputs[e] = (tok, (y * w).to(self.acc_dtype))  # (n, H)

    def _place(self, e: int, weights: ExpertWeights) -> None:
        """Expert e on its tokens with weights (on the device)."""
        tok, x, w = self._rows(e)
        self._weigh(e, tok, expert_apply(self.module, x, weights), w)  # (n, H)

    def on_device(self, e: int, slot: int) -> None:
        """Expert e computes from device slot `slot`."""
        t0 = time.perf_counter()
        self._place(e, self.src.slot_weights(slot))  # packed: dequantized into the scratch first
        self.src.rec.event("compute", self.m, e, t0, time.perf_counter())

    def from_standin(self, e: int) -> None:
        """Expert e computes from its resident INT2 copy, dequantized right before use (HOBBIT's stand-in)."""
        t0 = time.perf_counter()
        self._place(e, self.src.standin[self.m][e].dequantize(self.src.dtype))
        self.src.rec.event("compute_lowp", self.m, e, t0, time.perf_counter())

    def on_host(self, e: int) -> None:
        """Expert e computes on the host from the store's weights; the activations go there and back. On a
        CPU-only machine the host is emulated: the expert really computes, then the call holds until the host
        profile's time for its tokens has passed."""
        src, m = self.src, self.m
        t0 = time.perf_counter()
        weights = src.fetch(m, e)  # host tensors, canonical
        tok, x, w = self._rows(e)
        n = 1 if tok is None else tok.numel()
        norm_here = not self.layout.has_post_expert_norm or src.device.type == "cpu"
        y = expert_apply(self.module, x.to("cpu", weights.gate_up.dtype), weights, post_norm=norm_here)  # (n, H)
        y = y.to(self.x.device)  # back to the device
        if not norm_here:
            y = self.module.post_expert_norm(y)  # (n, H) its weights live on the device
        self._weigh(e, tok, y, w)
        if src.device.type == "cpu":
            hold = t0 + src.host_time(n) - time.perf_counter()
            if hold > 0:
                time.sleep(hold)
        src.rec.host(m, e, t0, time.perf_counter())

    def output(self, order: list[int]) -> torch.Tensor:
        """The layer's output [T, H]: the weighted outputs added expert by expert in id order (as the eager
        forward adds them); renormalised over the experts kept when a lossy step dropped some (order lacks them).
        A decode call starts from its first expert's output instead of zeros (0 + y is y, so the sum is the
        eager forward's, bit for bit)."""
        outs = self.outputs
        if self.T == 1 and outs and all(tok is None for tok, _ in outs.values()):
            ids = sorted(outs)
            out = outs[ids[0]][1]  # (1, H) fresh: made by `_weigh`, owned by this call
            for e in ids[1:]:
                out += outs[e][1]  # (1, H)
        else:
            out = torch.zeros(self.x.shape, dtype=self.acc_dtype, device=self.x.device)  # (T, H)
            for e in sorted(outs):
                tok, y = outs[e]
                if tok is None:
                    out += y  # (1, H)
                else:
                    out.index_add_(0, tok, y)  # (T, H)
        if len(order) < len(set(self.flat)):  # a lossy step dropped experts: renormalise over the kept ones
            kept_set = set(order)
            flat_w = self.w.reshape(-1)  # (T*K,)
            kept = torch.tensor([e in kept_set for e in self.flat], device=flat_w.device)  # (T*K,)
            w_all, w_kept = flat_w.sum(), (flat_w * kept).sum()
            if w_kept > 0:
                out = out * (w_all / w_kept)
        return out.to(self.x.dtype)
