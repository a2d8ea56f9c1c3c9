"""One offloaded experts call: the expert math of MoE layer m, from device slots, on the host, or from stand-ins.

What this file is: `ExpertsCall`, built per call by the runtime. Its `compute(e, slot)` is what the layer step
(`policy/step.py`) calls for each needed expert, in the cache's order: from a device slot (`slots.weights`,
dequantized first when packed), on the host from the store's weights (the activations go there and back;
on a CPU-only machine the call then holds for the host profile's time), or from the resident INT2 copy
(HOBBIT's stand-in). `output()` sums the weighted outputs and renormalises what a lossy step dropped.
What it is not: the schedule (which expert when, from which slot: the cache) or a policy.
Letters: T tokens, K experts per token (top-k), H hidden, I expert intermediate.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from fate_lab.policy.cache import HOST
from fate_lab.policy.lossy import LOWP


class ExpertsCall:
    """The expert math of one call: hidden [T, H], top-k ids/weights [T, K]; see the module docstring."""

    def __init__(self, rt, m: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor):
        self.rt, self.m, self.x = rt, m, hidden_states
        self.T, self.K = top_k_index.shape
        self.idx_host = top_k_index.detach().to("cpu")  # (T, K)
        self.flat = self.idx_host.reshape(-1).tolist()  # (T*K,) expert per (token, k) position
        self.out_dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
        self.weighted = torch.zeros(self.T * self.K, hidden_states.shape[1], dtype=self.out_dtype,
                                    device=hidden_states.device)  # (T*K, H)
        self.flat_idx, self.flat_w = top_k_index.reshape(-1), top_k_weights.reshape(-1)  # (T*K,)
        self.module = rt.adapter.experts_module(m)

    def _place(self, e: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """weighted[positions of e] = w * down(act(gate_up(x)))."""
        if self.T == 1:  # decode: expert e sits at one position k of the single token
            k = self.flat.index(e)
            h = self.module._apply_gate(F.linear(self.x, gate_up))  # (1, I)
            self.weighted[k:k + 1] = F.linear(h, down) * self.flat_w[k:k + 1, None]  # (1, H)
        else:
            pos = (self.flat_idx == e).nonzero().squeeze(1)  # (n,) flat (token, k) positions of e
            h = self.module._apply_gate(F.linear(self.x[pos // self.K], gate_up))  # (n, I)
            self.weighted[pos] = F.linear(h, down) * self.flat_w[pos].unsqueeze(-1)  # (n, H)

    def compute(self, e: int, slot: int) -> None:
        """Expert e computes from `slot` (a device slot, `HOST` or `LOWP`)."""
        if slot == HOST:
            return self._on_host(e)
        if slot == LOWP:
            return self._from_standin(e)
        t0 = time.perf_counter()
        gate_up, down = self.rt.slots.weights(slot)  # (2I, H), (H, I); packed: dequantized into the scratch
        self._place(e, gate_up, down)
        self.rt.core.event("compute", self.m, e, t0, time.perf_counter())

    def _from_standin(self, e: int) -> None:
        """Expert e computes from its resident INT2 copy, dequantized right before use (HOBBIT's stand-in)."""
        t0 = time.perf_counter()
        q = self.rt.standin[self.m][e]
        self._place(e, q.gate_up.dequantize(self.rt.dtype), q.down.dequantize(self.rt.dtype))  # (2I, H), (H, I)
        self.rt.core.event("compute_lowp", self.m, e, t0, time.perf_counter())

    def _on_host(self, e: int) -> None:
        """Expert e computes on the host from the store's weights; the activations go there and back. On a
        CPU-only machine the host is emulated: the expert really computes, then the call holds until the host
        profile's time for its tokens has passed."""
        rt, m = self.rt, self.m
        t0 = time.perf_counter()
        w = rt.store.fetch(m, e)  # host tensors: gate_up (2I, H), down (H, I)
        pos = (self.flat_idx == e).nonzero().squeeze(1).cpu()  # (n,) flat (token, k) positions of e
        x = self.x[(pos // self.K).to(self.x.device)].to("cpu", w.gate_up.dtype)  # (n, H) to the host
        h = self.module._apply_gate(F.linear(x, w.gate_up))  # (n, I)
        y = F.linear(h, w.down).to(self.x.device, self.out_dtype)  # (n, H) back to the device
        p_dev = pos.to(self.x.device)
        self.weighted[p_dev] = y * self.flat_w[p_dev].unsqueeze(-1)  # (n, H)
        if rt.device.type == "cpu":
            hold = t0 + rt.core.host_time(len(pos)) - time.perf_counter()
            if hold > 0:
                time.sleep(hold)
        t1 = time.perf_counter()
        rt.core.stats.layers[m][rt.core.phase].host_s += t1 - t0
        rt.core.event("host", m, e, t0, t1)

    def output(self, order: list[int]) -> torch.Tensor:
        """The layer's output [T, H]: the weighted outputs summed over k; renormalised over the experts kept
        when a lossy step dropped some (order lacks them)."""
        out = self.weighted.view(self.T, self.K, -1).sum(dim=1)  # (T, H)
        kept_set = set(order)
        if len(kept_set) < len(set(self.flat)):
            kept = torch.tensor([e in kept_set for e in self.flat], device=self.flat_w.device)  # (T*K,)
            w_all, w_kept = self.flat_w.sum(), (self.flat_w * kept).sum()
            if w_kept > 0:
                out = out * (w_all / w_kept)
        return out.to(self.x.dtype)
