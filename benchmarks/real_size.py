"""A real-size routing array (180k tokens x 26 MoE layers x top-6 of 64, DeepSeek-V2-Lite's shape) for the benchmarks.

No public routing trace of that size could be found with a licence to commit (searched: SpecMD, moe-lrc,
MoE-Infinity-style trace releases; the repositories publish code, not traces), and nothing may be
downloaded at run time. So the array is built from the embedded `tiny_deepseek` model's own held-out
trace (top-6 of 64, 7 MoE layers, prefill + decode), by a block bootstrap: the output is a sequence of
64-token blocks drawn at random from the recorded trace (every layer of an output token comes from the
same recorded token, so a block keeps the model's token-to-token locality and its expert popularity),
and output layer l replays recorded layer l mod 7 with that layer's expert ids relabelled by a fixed
random permutation. It is as skewed and as local as the embedded model, not as a 16B model.
"""
from __future__ import annotations

import numpy as np


def real_size_routing(tokens: int = 180_000, layers: int = 26, block: int = 64, seed: int = 0):
    """(experts [tokens, layers, 6] int32, phase [tokens] int8 (0 prefill, 1 decode), E) from tiny_deepseek's trace."""
    from fate_lab.study.lab import get_trace

    tr = get_trace("tiny_deepseek")
    src = tr.experts.numpy()  # (N, 7, 6)
    phase = tr.phase.numpy().astype(np.int8)
    E = int(tr.meta["num_experts"])
    N, L, _ = src.shape
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, N - block, size=-(-tokens // block))
    rows = (starts[:, None] + np.arange(block)[None, :]).reshape(-1)[:tokens]  # recorded token of each output token
    perms = np.stack([rng.permutation(E) for _ in range(layers)])  # (layers, E)
    out = np.stack([perms[l][src[rows, l % L]] for l in range(layers)], axis=1).astype(np.int32)
    return out, phase[rows], E
