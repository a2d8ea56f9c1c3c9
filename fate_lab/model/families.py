"""Which model types of the installed transformers use its experts interface.

What this file is: `experts_interface_modules()` scans transformers' modeling files for classes
decorated with `@use_experts_implementation` and groups the model types by modeling module;
`experts_interface_families()` names the causal-LM model type of each module (its `*_text` type where
it has one): what fate_lab can load, adapt and offload; `text_tower_types()` names, for the modules
without a causal-LM class (vision-language, encoder-only), the base text model type whose MoE layers
fate_lab can still adapt (forward only: no generation).

What it is not: no model is built here (`testing.family_table` builds tiny ones and says which work).
"""

from __future__ import annotations

import functools
import pathlib


@functools.lru_cache(maxsize=1)
def experts_interface_modules() -> dict[str, tuple[str, ...]]:
    """{transformers modeling module: its model types} for every module using the experts interface."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    root = pathlib.Path(transformers.__file__).parent / "models"
    out: dict[str, list[str]] = {}
    for model_type in CONFIG_MAPPING_NAMES:
        module = model_type_to_module_name(model_type)
        if any("@use_experts_implementation" in f.read_text() for f in (root / module).glob("modeling_*.py")):
            out.setdefault(module, []).append(model_type)
    return {m: tuple(types) for m, types in sorted(out.items())}


@functools.lru_cache(maxsize=1)
def experts_interface_families() -> tuple[str, ...]:
    """The causal-LM model type of each experts-interface module (its `*_text` type where it has one)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for types in experts_interface_modules().values():
        causal = [t for t in types if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
        text = [t for t in causal if t.endswith("_text")]
        if text or causal:
            out.append((text or causal)[0])
    return tuple(out)


def base_model_class(model_type: str) -> type | None:
    """The base (headless) model class of a model type: transformers' auto mapping's, else the class of its
    modeling module whose `config_class` is the type's and whose name ends in `TextModel` (a text config the
    auto mapping does not list, e.g. step3p7's `step3p5`); None when neither exists."""
    import importlib

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_MAPPING, MODEL_MAPPING_NAMES

    config_class = CONFIG_MAPPING[model_type]
    if model_type in MODEL_MAPPING_NAMES:
        return MODEL_MAPPING[config_class]
    module = model_type_to_module_name(model_type)
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    found = [c for name, c in vars(modeling).items() if isinstance(c, type) and name.endswith("TextModel")
             and getattr(c, "config_class", None) is config_class]
    return found[0] if found else None


@functools.lru_cache(maxsize=1)
def text_tower_types() -> dict[str, str]:
    """{module: base text model type} for the experts-interface modules without a causal-LM class."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    out = {}
    causal = set(experts_interface_families())
    for module, types in experts_interface_modules().items():
        if causal & set(types):
            continue
        # a `*_text` type, or a type whose config holds no sub-configs (not a composite vision-language model)
        text = [t for t in types if not any(w in t for w in ("vision", "audio", "encoder"))
                and (t.endswith("_text") or not getattr(CONFIG_MAPPING[t], "sub_configs", None))
                and base_model_class(t) is not None]
        if text:
            out[module] = min(text, key=lambda t: not t.endswith("_text"))  # a `*_text` type first
    return out
