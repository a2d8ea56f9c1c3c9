"""Fixtures every test folder shares: tiny random models built once per session, embedded models loaded once."""
import copy

import pytest

from fate_lab.model.testing import tiny_model


@pytest.fixture(scope="session")
def tiny_models():
    """A factory: ``tiny_models(family, seed=0, **overrides)`` -> a fresh copy of a tiny random model of that
    family (each distinct model is built once per session; every call gets its own copy to change freely)."""
    built: dict = {}

    def get(family: str, seed: int = 0, **kw):
        key = (family, seed, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in built:
            built[key] = tiny_model(family, seed=seed, **kw)
        return copy.deepcopy(built[key])

    return get


@pytest.fixture(scope="session")
def embedded_model():
    """A factory: ``embedded_model(name)`` -> (model, tokenizer) of an embedded model, loaded once per session;
    the model is shared: a test that changes it must work on ``copy.deepcopy(model)``."""
    from fate_lab.model.models import load_model

    loaded: dict = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load_model(name)
        return loaded[name]

    return get
