"""The contention trials (`fit/contention._trial`) against fake readers and a fake model that record when they ran:
every forward a trial times ran beside its busy readers from its start to its end."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from fate_lab.fit import contention


class _Engine:
    def __init__(self):
        self.reads: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def load_now(self, m, e, slot, spec):
        t0 = time.perf_counter()
        time.sleep(0.002)  # a 2 ms read
        t1 = time.perf_counter()
        with self.lock:
            self.reads.append((t0, t1))
        return t1 - t0


class _Runtime:
    def __init__(self):
        self.engine = _Engine()
        self.stats = SimpleNamespace(forward_s={"decode": [], "prefill": []},
                                     total=lambda phase: SimpleNamespace(compute_s=0.0))

    def reset_stats(self):
        self.stats.forward_s = {"decode": [], "prefill": []}


class _Model:
    """A prefill forward of forward_s seconds; records (start, end) and the runtime's forward time."""

    def __init__(self, rt, forward_s):
        self.rt, self.forward_s, self.spans = rt, forward_s, []

    def __call__(self, input_ids, use_cache, logits_to_keep):
        t0 = time.perf_counter()
        time.sleep(self.forward_s)
        t1 = time.perf_counter()
        self.spans.append((t0, t1))
        self.rt.stats.forward_s["prefill"].append(t1 - t0)


@pytest.mark.parametrize("forward_s", [0.03, 0.12])
def test_every_forward_a_trial_times_runs_beside_its_readers_to_its_end(monkeypatch, forward_s):
    monkeypatch.setattr(contention, "TRIAL_S", 0.1)
    rt = _Runtime()
    model = _Model(rt, forward_s)
    contention._trial(rt, [(0, 0, 0, None)], model, torch.zeros(1, 24, dtype=torch.long), 1, True, "prefill")
    assert model.spans and rt.engine.reads
    first_read = min(a for a, _ in rt.engine.reads)
    last_read = max(b for _, b in rt.engine.reads)
    # stopping the readers with the compute thread (as before) left the last forward running alone for up to a forward
    assert first_read <= model.spans[0][0] + 0.05 and last_read >= model.spans[-1][1]
    # at least MIN_FORWARDS forwards where 4 x TRIAL_S allows them (0.03 s forwards), else what the deadline allows
    if forward_s * contention.MIN_FORWARDS < 4 * contention.TRIAL_S:
        assert len(model.spans) >= contention.MIN_FORWARDS


def test_a_model_whose_experts_do_not_fit_in_memory_is_refused_before_anything_is_offloaded(monkeypatch):
    from fate_lab.model.testing import tiny_model

    model = tiny_model("mixtral")
    monkeypatch.setattr(contention, "available_bytes", lambda: 1000)  # 1 kB free: no expert fits
    with pytest.raises(MemoryError, match="every expert of this model resident"):
        contention.measure_contention(model, torch.zeros(1, 24, dtype=torch.long))
    monkeypatch.setattr(contention, "available_bytes", lambda: None)  # a system that does not say: no refusal here
    contention._check_memory(model)
