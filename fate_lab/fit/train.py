"""Train the embedded MoE models that ship in ``data/`` (and tiny test models).

What it is: a seeded, CPU-friendly trainer for two of transformers' own MoE classes on the
project's public-domain corpus, with a byte-level BPE tokenizer trained on the same corpus, a
**per-layer** load-balancing loss, and the weights of the best held-out loss kept:

* ``tiny`` -> ``data/tiny_moe``: ``Qwen2MoeForCausalLM`` shaped like Qwen1.5-MoE (the paper's model):
  32 experts, top-4, one gated shared expert, every layer MoE.
* ``tiny_deepseek`` -> ``data/tiny_deepseek``: ``DeepseekV2ForCausalLM`` shaped like DeepSeek-V2-Lite:
  64 fine-grained experts, top-6, two shared experts, the first layer dense, MLA attention.

What it is not: a general trainer. It never downloads anything.

    python -m fate_lab train --minutes 55                         # the default model
    python -m fate_lab train --preset tiny_deepseek --minutes 55  # the second embedded model
    python -m fate_lab train --preset smoke --steps 20 --out /tmp/m   # a quick check
"""
from __future__ import annotations

import json
import math
import platform
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from fate_lab.model.corpus import CORPUS_FILE, load_corpus

EOS = "<|endoftext|>"


@dataclass(frozen=True)
class TrainConfig:
    """Model shape and optimisation settings; presets by name via ``TrainConfig.preset``."""

    architecture: str = "qwen2_moe"  # or "deepseek_v2"
    vocab_size: int = 8192  # byte-level BPE trained on the corpus
    hidden_size: int = 256
    num_layers: int = 8  # enough depth for shallow-vs-deep routing to differ
    num_heads: int = 4
    num_experts: int = 32  # fine-grained experts, like Qwen1.5-MoE's 60
    top_k: int = 4
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 512  # Qwen1.5-MoE: shared expert = 4 routed experts
    num_shared_experts: int = 1  # deepseek_v2: shared experts, each of width moe_intermediate_size
    first_dense_layers: int = 0  # deepseek_v2: leading layers with a dense MLP (first_k_dense_replace)
    dense_intermediate_size: int = 512  # width of those dense MLPs
    kv_lora_rank: int = 128  # deepseek_v2 MLA: compressed KV width
    norm_topk_prob: bool = False  # Qwen1.5-MoE does not renormalise the top-k weights
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    balance_coef: float = 0.03  # per-layer Switch-style balancing term (0.01 left layer 0 with cold experts)
    z_loss_coef: float = 1e-3  # keeps router logits small (ST-MoE)
    steps: int = 3000
    minutes: float | None = None  # stop early when the wall-clock budget is spent
    eval_every: int = 250
    eval_batches: int = 16
    final_eval_tokens: int | None = None  # the final held-out numbers' tokens (None: the whole split)
    seed: int = 0
    bf16: bool = True  # bf16 autocast on CPU

    @staticmethod
    def preset(name: str, **overrides) -> "TrainConfig":
        """A named configuration (``tiny``: the shipped model; ``smoke``: seconds-long tests)."""
        presets = {
            "tiny": TrainConfig(),
            "tiny_deepseek": TrainConfig(
                architecture="deepseek_v2", num_experts=64, top_k=6, moe_intermediate_size=64,
                num_shared_experts=2, first_dense_layers=1, dense_intermediate_size=512,
            ),
            "smoke": TrainConfig(
                vocab_size=512, hidden_size=64, num_layers=4, num_experts=8, top_k=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=64, seq_len=64,
                batch_size=4, warmup_steps=2, steps=20, eval_every=10, eval_batches=2, final_eval_tokens=4096,
            ),
            "smoke_deepseek": TrainConfig(
                architecture="deepseek_v2", vocab_size=512, hidden_size=64, num_layers=3, num_experts=8, top_k=3,
                moe_intermediate_size=16, num_shared_experts=2, first_dense_layers=1, dense_intermediate_size=64,
                kv_lora_rank=32, seq_len=64, batch_size=4, warmup_steps=2, steps=20, eval_every=10, eval_batches=2,
                final_eval_tokens=4096,
            ),
        }
        if name not in presets:
            raise ValueError(f"unknown training preset {name!r}; choose one of {sorted(presets)}")
        return replace(presets[name], **overrides)


def train_tokenizer(texts: list[str], vocab_size: int):
    """Train a byte-level BPE tokenizer and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=EOS)


def model_config(cfg: TrainConfig, vocab_size: int):
    """The transformers config (``Qwen2MoeConfig`` or ``DeepseekV2Config``) for a training configuration."""
    common = dict(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        moe_intermediate_size=cfg.moe_intermediate_size, num_experts_per_tok=cfg.top_k,
        norm_topk_prob=cfg.norm_topk_prob, max_position_embeddings=max(1024, cfg.seq_len), tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    if cfg.architecture == "qwen2_moe":
        from transformers import Qwen2MoeConfig

        if cfg.first_dense_layers:
            raise ValueError("first_dense_layers is a deepseek_v2 setting; the qwen2_moe preset has MoE in every layer")
        return Qwen2MoeConfig(
            **common, intermediate_size=cfg.shared_expert_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, num_experts=cfg.num_experts,
            decoder_sparse_step=1, rope_theta=10000.0, output_router_logits=False,
        )
    if cfg.architecture == "deepseek_v2":
        from transformers import DeepseekV2Config

        head = cfg.hidden_size // cfg.num_heads
        return DeepseekV2Config(
            **common, intermediate_size=cfg.dense_intermediate_size, n_routed_experts=cfg.num_experts,
            n_shared_experts=cfg.num_shared_experts, first_k_dense_replace=cfg.first_dense_layers,
            topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
            kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=head // 4,
            qk_nope_head_dim=head - head // 4, v_head_dim=head, head_dim=head // 4,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        )
    raise ValueError(f"unknown architecture {cfg.architecture!r}; choose 'qwen2_moe' or 'deepseek_v2'")


def build_model(cfg: TrainConfig, vocab_size: int):
    """A freshly initialised model for ``cfg`` (routers drawn like every other matrix, never all-zero)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(model_config(cfg, vocab_size))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.dim() == 2 and not p.any():
                p.normal_(0.0, model.config.initializer_range)  # DeepSeek's router starts at zeros
    model.set_experts_implementation("grouped_mm")
    return model


def moe_layer_indices(model) -> list[int]:
    """Decoder layers that route (the order of ``output_router_logits``)."""
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def per_layer_balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Mean over layers of E * sum_e f_e * P_e, each layer balanced on its own (1.0 = uniform)."""
    losses = []
    for logits in router_logits:  # each (T, E)
        probs = logits.float().softmax(-1)  # (T, E)
        E = probs.shape[-1]
        top = probs.topk(top_k, dim=-1).indices  # (T, k)
        frac = F.one_hot(top, E).float().sum(1).mean(0) / top_k  # (E,) share of assignments
        losses.append(E * (frac * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def router_z_loss(router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Mean squared log-partition of the router logits (ST-MoE's z-loss)."""
    return torch.stack([torch.logsumexp(l.float(), -1).pow(2).mean() for l in router_logits]).mean()


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Every text tokenized and joined with the EOS id: one long id stream [n]."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for chunk in range(0, len(texts), 256):
        for enc in tokenizer(texts[chunk : chunk + 256])["input_ids"]:
            ids.extend(enc)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def batch_stream(stream: torch.Tensor, cfg: TrainConfig, gen: torch.Generator):
    """Endless random (input, target) windows [batch, seq_len] cut from a token stream (seeded by gen)."""
    n = stream.numel() - cfg.seq_len - 1
    while True:
        starts = torch.randint(0, n, (cfg.batch_size,), generator=gen)
        x = torch.stack([stream[s : s + cfg.seq_len + 1] for s in starts.tolist()])  # (B, T+1)
        yield x[:, :-1], x[:, 1:]


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, cfg: TrainConfig, windows: int | None = -1) -> float:
    """Mean next-token cross-entropy over fixed, non-overlapping windows of ``stream``: ``windows`` of them
    (-1: ``cfg.eval_batches`` batches, the periodic check; None: every window, the final number)."""
    if windows == -1:
        windows = cfg.eval_batches * cfg.batch_size
    model.eval()
    T = cfg.seq_len
    total = (stream.numel() - 1) // T
    n_windows = total if windows is None else min(windows, total)
    # windows spread evenly over the whole stream: a prefix would be one source of the corpus only
    picks = torch.linspace(0, total - 1, n_windows).round().long().tolist()
    losses = []
    for i in range(0, n_windows, cfg.batch_size):
        idx = picks[i : i + cfg.batch_size]
        x = torch.stack([stream[j * T : j * T + T + 1] for j in idx])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = model(input_ids=x[:, :-1]).logits
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).item() * len(idx))
    model.train()
    return sum(losses) / n_windows


@torch.no_grad()
def expert_load(model, stream: torch.Tensor, tokens: int | None = None, seq_len: int = 256) -> list[list[float]]:
    """Share of routed assignments each expert receives, per MoE layer, over ``tokens`` tokens of ``stream``
    (None: all of it) in windows spread evenly over it (the held-out split interleaves no sources, so a
    prefix would measure one source only)."""
    model.eval()
    counts = None
    total = (stream.numel() - 1) // seq_len
    n = total if tokens is None else min(tokens // seq_len, total)
    for i in torch.linspace(0, total - 1, n).round().long().tolist():
        x = stream[i * seq_len : (i + 1) * seq_len][None]
        out = model(input_ids=x, output_router_logits=True)
        k = model.config.num_experts_per_tok
        per_layer = torch.stack([F.one_hot(l.topk(k, -1).indices, l.shape[-1]).sum((0, 1)) for l in out.router_logits])
        counts = per_layer if counts is None else counts + per_layer
    return (counts.float() / counts.sum(-1, keepdim=True)).tolist()


def adamw(model, cfg) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (no decay on norms, biases and embeddings)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )


def cosine_schedule(cfg, t_start: float):
    """step -> learning rate: linear warm-up, then a cosine to min_lr_ratio that ends with whichever of
    cfg.steps and cfg.minutes (wall clock since t_start) runs out first."""
    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        if cfg.minutes is not None:
            t = max(t, (time.time() - t_start) / (cfg.minutes * 60))
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))

    return lr_at


def train(cfg: TrainConfig, out_dir: Path, corpus_file: Path = CORPUS_FILE) -> dict:
    """Train tokenizer + model, save safetensors (bf16) of the best held-out loss, config, tokenizer and
    a model card."""
    if cfg.final_eval_tokens is not None and cfg.final_eval_tokens < cfg.seq_len:
        raise ValueError(f"final_eval_tokens={cfg.final_eval_tokens!r}: give at least one window of seq_len="
                         f"{cfg.seq_len} tokens, or None for the whole held-out split")
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    t_start = time.time()
    docs = load_corpus(corpus_file)
    train_texts = [d["text"] for d in docs if d["split"] == "train"]
    val_texts = [d["text"] for d in docs if d["split"] == "val"]
    tokenizer = train_tokenizer(train_texts, cfg.vocab_size)
    train_ids = token_stream(tokenizer, train_texts)
    val_ids = token_stream(tokenizer, val_texts)

    model = build_model(cfg, len(tokenizer))
    n_params = sum(p.numel() for p in model.parameters())
    opt = adamw(model, cfg)
    lr_at = cosine_schedule(cfg, t_start)

    gen = torch.Generator().manual_seed(cfg.seed)
    batches = batch_stream(train_ids, cfg, gen)
    history = []
    best = None  # (val_ce, step, state_dict) of the best held-out loss so far
    first_ce = None
    model.train()
    bar = tqdm(range(cfg.steps), desc="train", unit="step")
    step = 0
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            out = model(input_ids=x, output_router_logits=True)
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())
        bal = per_layer_balance_loss(out.router_logits, cfg.top_k)
        z = router_z_loss(out.router_logits)
        loss = ce + cfg.balance_coef * bal + cfg.z_loss_coef * z
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        first_ce = ce.item() if first_ce is None else first_ce
        bar.set_postfix(ce=f"{ce.item():.3f}", bal=f"{bal.item():.3f}")
        out_of_time = cfg.minutes is not None and time.time() - t_start > cfg.minutes * 60
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps or out_of_time:
            history.append({"step": step + 1, "train_ce": ce.item(), "val_ce": evaluate(model, val_ids, cfg),
                            "balance": bal.item(), "minutes": (time.time() - t_start) / 60})
            bar.write(json.dumps(history[-1]))
            if best is None or history[-1]["val_ce"] < best[0]:
                best = (history[-1]["val_ce"], step + 1, {k: v.detach().clone() for k, v in model.state_dict().items()})
        if out_of_time:
            break
    steps_done = step + 1
    wall = time.time() - t_start
    if best is not None and best[1] != steps_done:  # stop at the best held-out loss
        model.load_state_dict(best[2])
    best_step = best[1] if best is not None else steps_done

    windows = None if cfg.final_eval_tokens is None else cfg.final_eval_tokens // cfg.seq_len  # spread over the split
    n_final = (len(val_ids) // cfg.seq_len if windows is None else windows) * cfg.seq_len  # held-out tokens evaluated
    train_ce = evaluate(model, train_ids, cfg, windows=n_final // cfg.seq_len)  # as many tokens as held-out
    val_ce = evaluate(model, val_ids, cfg, windows=windows)
    load = expert_load(model, val_ids, tokens=None if windows is None else n_final, seq_len=cfg.seq_len)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    E = cfg.num_experts
    load_summary = [
        {"layer": i, "cold_experts(<0.25x uniform)": sum(s < 0.25 / E for s in row),
         "quietest_vs_uniform": round(min(row) * E, 2), "busiest_vs_uniform": round(max(row) * E, 2)}
        for i, row in zip(moe_layer_indices(model), load, strict=False)
    ]
    card = {
        "architecture": type(model).__name__,
        "parameters": n_params,
        "train_config": asdict(cfg),
        "corpus": str(corpus_file.name),
        "train_tokens": train_ids.numel(), "val_tokens": val_ids.numel(),
        "final_eval_tokens": n_final,
        "steps": steps_done, "best_step": best_step, "tokens_seen": steps_done * cfg.batch_size * cfg.seq_len,
        "wall_minutes": round(wall / 60, 1),
        "machine": f"{platform.machine()}, {_threads()}, torch {torch.__version__}",
        "first_step_loss": round(first_ce, 4), "train_loss": round(train_ce, 4), "val_loss": round(val_ce, 4),
        "train_perplexity": round(math.exp(train_ce), 2), "val_perplexity": round(math.exp(val_ce), 2),
        "expert_load": load_summary, "expert_load_shares": load,
        "history": history,
    }
    (out_dir / "training.json").write_text(json.dumps(card, indent=1))
    _write_model_card(out_dir, card)
    return card


def _write_model_card(out_dir: Path, card: dict) -> None:
    c = card["train_config"]
    n = card.get("final_eval_tokens")
    part = f", over {n:,} tokens spread over the split" if n and n < card["val_tokens"] - c["seq_len"] else ""
    if c.get("architecture", "qwen2_moe") == "deepseek_v2":
        title, cmd = "fate_lab tiny DeepSeek-V2-shaped MoE", "python -m fate_lab train --preset tiny_deepseek"
        shape = (f"{c['num_layers']} layers (the first {c['first_dense_layers']} dense, MLP width "
                 f"{c['dense_intermediate_size']}), hidden {c['hidden_size']}, MLA attention (KV rank "
                 f"{c['kv_lora_rank']}), {c['num_experts']} routed experts of width {c['moe_intermediate_size']}, "
                 f"top-{c['top_k']} (softmax, greedy, not renormalised), {c['num_shared_experts']} shared experts "
                 f"of width {c['moe_intermediate_size']}")
    else:
        title, cmd = "fate_lab tiny MoE", "python -m fate_lab train"
        shape = (f"{c['num_layers']} layers, hidden {c['hidden_size']}, {c['num_experts']} routed experts of width "
                 f"{c['moe_intermediate_size']}, top-{c['top_k']}, one shared expert of width "
                 f"{c['shared_expert_intermediate_size']}")
    size_mb = sum(f.stat().st_size for f in out_dir.glob("*.safetensors")) / 1e6
    lines = [
        f"# {title}", "",
        f"Trained by `{cmd}` (fate_lab/fit/train.py) on `data/corpus` (public-domain texts from Debian "
        "packages; see data/corpus/SOURCES.md).", "",
        f"- Architecture: `{card['architecture']}`, {card['parameters'] / 1e6:.1f}M parameters "
        f"({size_mb:.1f} MB of bf16 safetensors): {shape}, byte-level BPE vocab {c['vocab_size']}.",
        f"- Training: {card['steps']} steps x {c['batch_size']} x {c['seq_len']} tokens = "
        f"{card['tokens_seen']:,} tokens "
        f"(corpus: {card['train_tokens']:,} train / {card['val_tokens']:,} held-out tokens), "
        f"{card['wall_minutes']} min on {card['machine']}, bf16 autocast, seed {c['seed']}; the weights are those "
        f"of step {card.get('best_step', card['steps'])}, the best held-out loss.",
        f"- Loss: train {card['train_loss']} (ppl {card['train_perplexity']}), "
        f"held-out {card['val_loss']} (ppl {card['val_perplexity']}){part}.",
        f"- Balancing: per-layer Switch loss x {c['balance_coef']}, router z-loss x {c['z_loss_coef']}.", "",
        f"## Expert load per MoE layer ({'part of the' if part else 'whole'} held-out split, share of top-k "
        "assignments)", "",
        "| layer | cold experts (< 1/4 of uniform) | quietest expert vs uniform | busiest expert vs uniform |",
        "|---|---|---|---|",
    ]
    for row in card["expert_load"]:
        lines.append(f"| {row['layer']} | {row['cold_experts(<0.25x uniform)']} | "
                     f"{row.get('quietest_vs_uniform', '')}x | {row['busiest_vs_uniform']}x |")
    (out_dir / "MODEL_CARD.md").write_text("\n".join(lines) + "\n")


def _threads() -> str:
    n = torch.get_num_threads()
    return f"{n} thread" + ("s" if n != 1 else "")
