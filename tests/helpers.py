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
