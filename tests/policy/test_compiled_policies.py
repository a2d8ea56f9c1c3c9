"""The compiled policies (fate_lab/policy/kernels/) against their pure-Python references (tests/reference_policies.py),
victim for victim, on random traces; the registry as the one list of policies; CLOCK by hand."""
import ast
import random
from pathlib import Path

import numpy as np
import pytest
from reference_policies import REFERENCE

from fate_lab.policy.registry import POLICIES, policy_from_name, policy_record

ROOT = Path(__file__).resolve().parents[2]
KEYWORDS = {"lecar": [{"seed": 3}, {"seed": 11, "lru_weight": 0.2}], "lfu": [{"keep_history": False}],
            "lrfu": [{"lam": 0.5, "keep_history": False}], "s3fifo": [{"small_ratio": 0.3, "move_threshold": 1}],
            "lirs": [{"hir_ratio": 0.3}], "least_stale": [{"alpha": 0.6, "keep_history": True}],
            "router_ema": [{"decay": 0.5}]}
CASES = [(n, kw) for n in sorted(POLICIES) if n in REFERENCE for kw in [{}] + KEYWORDS.get(n, [])]


def _trace(rng: random.Random, E: int, N: int, k: int) -> list[list[int]]:
    hot = rng.sample(range(E), max(1, E // 3))
    return [[rng.choice(hot) if rng.random() < 0.6 else rng.randrange(E) for _ in range(k)] for _ in range(N)]


def _drive(p, future, probs, rng: random.Random) -> list:
    """What a driver does per token: tick, observe, an optional prefetch admit, the token's uses (protected)."""
    log = []
    for t, need in enumerate(future):
        if hasattr(p, "at"):
            p.at(t)
        if p.wants_scores:
            p.observe(probs[t], 1)
        if rng.random() < 0.3:  # a prefetch of an expert the token may not use, protecting the token's own
            e = rng.randrange(len(probs[t]))
            log.append(("pre", e, None if e in p else p.admit(e, frozenset(need))))
        prot = frozenset(need)
        for e in dict.fromkeys(need):
            if e in p:
                p.access(e)
                log.append(("hit", e))
            else:
                log.append(("miss", e, p.admit(e, prot)))
        log.append(sorted(p.resident()))
    return log


@pytest.mark.parametrize("name, kw", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_compiled_policy_takes_the_references_decisions(name, kw):
    for seed in range(6):
        rng = random.Random(seed)
        E, k = rng.choice([(6, 1), (8, 2), (16, 4), (40, 6)])
        future = _trace(rng, E, 150, k)
        probs = np.random.default_rng(seed).dirichlet(np.ones(E), size=len(future)).tolist()
        for cap in sorted({0, 1, k, E // 2, E - 1, E}):
            if policy_record(name).reads_future:
                ref, comp = REFERENCE[name](cap, future), policy_from_name(name, cap, E, future=future)
            else:
                ref, comp = REFERENCE[name](cap, **kw), policy_from_name(name, cap, E, **kw)
            got = _drive(comp, future, probs, random.Random(seed + 100))
            want = _drive(ref, future, probs, random.Random(seed + 100))
            assert got == want, f"{name} {kw} seed {seed} capacity {cap}: first difference at entry " \
                                f"{next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)}"


def test_every_policy_file_is_registered():
    files = {p.stem for p in (ROOT / "fate_lab/policy/kernels").glob("*.py")} - {"__init__", "blocks", "record"}
    assert files == set(POLICIES), "a policy file is a module of fate_lab/policy/kernels/ named by its policy"


def test_no_table_outside_the_registry_lists_policies():
    """A literal list, tuple, set or dict naming two policies or more is a second registry: none outside it."""
    names = set(POLICIES)
    found = []
    for path in (ROOT / "fate_lab").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "fate_lab/policy/registry.py" or "__pycache__" in rel:  # the replay's calls, written from it
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
            if not isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)) or items is None:
                continue
            hits = {i.value for i in items if isinstance(i, ast.Constant) and i.value in names}
            if len(hits) >= 2:
                found.append(f"{rel}:{node.lineno} {sorted(hits)}")
    assert not found, "policies listed outside registry.py: " + "; ".join(found)


def test_clock_by_hand():
    c = policy_from_name("clock", 3, 8)
    for e in (1, 2, 3):
        assert c.admit(e) is None  # ring: 1 2 3, hand at 1, every bit clear
    c.access(1)  # 1's bit set
    assert c.admit(4) == 2  # the hand clears 1's bit, passes it, evicts 2; ring 1 4 3, hand at 3
    c.access(3)
    assert c.admit(5, frozenset({1})) == 4  # 3 loses its bit, 1 is protected, 4 (bit clear) goes: hand at 3
    assert c.admit(6) == 3  # 3's bit was cleared on the last sweep
    assert c.admit(7, frozenset({1, 5, 6})) == 7  # every resident protected: not cached
    assert sorted(c.resident()) == [1, 5, 6]


def test_a_wrong_keyword_names_the_policys_keywords():
    with pytest.raises(TypeError, match="lrfu.*keywords: lam, keep_history"):
        policy_from_name("lrfu", 4, 8, lamda=0.1)
    with pytest.raises(ValueError, match="outside 0..7"):
        policy_from_name("lru", 4, 8).admit(9)


def test_victim_is_what_the_admit_then_evicts():
    rng = random.Random(5)
    for name in sorted(POLICIES):
        if policy_record(name).reads_future:
            continue
        p = policy_from_name(name, 4, 12)
        for _ in range(300):
            e = rng.randrange(12)
            if e in p:
                p.access(e)
                continue
            prot = frozenset(rng.sample(sorted(p.resident()), min(len(p), rng.randrange(3))))
            want = p.victim(e, prot)
            got = p.admit(e, prot)
            assert (None if got == e else got) == want, name


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_an_admit_with_room_ignores_the_protect_set(name):
    """`CompiledPolicy` skips marking the protect set while its cache has room: that is exact only if no registered
    policy evicts, or reads the protect set, before it is full. Checked on copies of the state: an admit with a
    random protect set and one with none return the same and leave the same state."""
    rng = random.Random(7)
    checked = 0
    for E, cap, k in ((8, 3, 2), (16, 6, 4), (40, 12, 6)):
        future = _trace(rng, E, 120, k)
        kw = {"future": future} if policy_record(name).reads_future else {}
        p = policy_from_name(name, cap, E, **kw)
        probs = np.random.default_rng(E).dirichlet(np.ones(E), size=len(future)).tolist()
        for t, need in enumerate(future):
            p.at(t)
            if p.wants_scores:
                p.observe(probs[t], 1)
            for e in list(dict.fromkeys(need)) + [rng.randrange(E)]:
                if e in p:
                    p.access(e)
                    continue
                if len(p) < cap:
                    prot = np.zeros(E + 8, np.uint8)
                    prot[rng.sample(range(E), rng.randrange(E))] = 1
                    a, b = p._st.copy(), p._st.copy()
                    ra = p.record.admit(a.I, a.F, a.S, a.G, a.R, E, e, prot)
                    rb = p.record.admit(b.I, b.F, b.S, b.G, b.R, E, e, np.zeros(E + 8, np.uint8))
                    assert ra == rb and ra in (-1, e), (name, t, e, ra, rb)
                    for x, y in zip((a.I, a.F, a.S, a.G, a.R), (b.I, b.F, b.S, b.G, b.R), strict=True):
                        assert np.array_equal(x, y), (name, t, e)
                    checked += 1
                p.admit(e, frozenset(need))
    assert checked >= 10, (name, checked)
