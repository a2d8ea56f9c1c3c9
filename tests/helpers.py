"""Helpers the test files share (imported as `from helpers import ...`; pytest puts tests/ on the path)."""
import torch


def prompt_ids(vocab: int, n: int = 9, seed: int = 0) -> torch.Tensor:
    """A seeded random prompt [1, n] of token ids in [1, vocab)."""
    return torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids: torch.Tensor, n: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy `generate` of exactly n new tokens: (sequences [1, S], scores [n, 1, V])."""
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences, torch.stack(out.scores)  # (1, S), (n, 1, V)


def embedded_models() -> list:
    """pytest params, one per embedded model (tiny_moe, tiny_deepseek); a model whose weights are absent is
    skipped, named."""
    import pytest

    from fate_lab.paths import EMBEDDED_MODELS

    return [pytest.param(name, id=name, marks=pytest.mark.skipif(not (folder / "model.safetensors").is_file(),
                                                                 reason=f"embedded model data/{name} not present"))
            for name, folder in EMBEDDED_MODELS.items()]


class ScriptedMover:
    """A `policy.cache.Mover` a test drives by hand: transfers land only when the test says so.

    ``instant=True`` lands every transfer in ``submit`` (the replay's link). Otherwise a transfer stays in
    flight until ``land(handle)``; ``wait`` lands it (the stall a test can count in ``waits``); ``cancel``
    succeeds while it has not been ``start``-ed. ``submitted`` keeps (m, e, slot, urgent, reason) in order.
    """

    def __init__(self, instant: bool = False, capacity: int | None = None):
        self.instant, self.cap = instant, capacity
        self.timing = None  # what `view` answers (value-cache tests)
        self.submitted: list[tuple] = []
        self.landed: set[int] = set()
        self.started: set[int] = set()
        self.cancelled: list[tuple] = []
        self.waits: list[tuple[int, int]] = []
        self.reloads: list[tuple] = []
        self.fail: set[int] = set()  # handles that fail when they land

    def submit(self, m, e, slot, urgent, reason):
        self.submitted.append((m, e, slot, urgent, reason))
        h = len(self.submitted) - 1
        if self.instant:
            self.landed.add(h)
        return h

    def start(self, h: int) -> None:
        """The link begins moving h: it can no longer be cancelled."""
        self.started.add(h)

    def land(self, h: int) -> None:
        """h's bytes are in its slot now."""
        self.started.add(h)
        self.landed.add(h)

    def cancel(self, h) -> bool:
        if h in self.started or h in self.landed:
            return False
        self.cancelled.append(self.submitted[h])
        self.started.add(h)  # a cancelled transfer never lands
        return True

    def poll(self, h):
        if h in self.landed:
            return h not in self.fail
        return None

    def wait(self, m, e, h) -> bool:
        self.waits.append((m, e))
        self.land(h)
        return h not in self.fail

    def reload(self, m, e, slot, reason) -> None:
        self.reloads.append((m, e, slot, reason))

    def capacity(self, m):
        return self.cap

    def view(self, m):
        """The link's timing a value-cache test sets (`timing`: a `value.LinkView`, or None as on an instant link)."""
        return self.timing

    def kinds(self) -> list[str]:
        """'demand' / 'prefetch' of every submission, in order."""
        return ["demand" if s[3] else "prefetch" for s in self.submitted]


class SilentRecorder:
    """What `SimMover` asks of the driver core (its precision rule, a recorder), doing nothing: a link timed alone."""

    phase = "decode"  # the forward running (a prefill reads the prefill slow-downs)

    def spec(self, m, reason):
        return None

    def event(self, *a):
        pass

    def landed(self, *a):
        pass

    def stall(self, *a):
        pass
