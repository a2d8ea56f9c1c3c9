"""Train the embedded tiny MoE that ships in ``data/tiny_moe`` (and tiny test models).

What it is: a seeded, CPU-friendly trainer for a ``Qwen2MoeForCausalLM`` (the architecture of
Qwen1.5-MoE, the paper's model) on the project's public-domain corpus, with a byte-level BPE
tokenizer trained on the same corpus and a **per-layer** load-balancing loss.
What it is not: a general trainer. It never downloads anything.

    python -m fate_lab train --minutes 75          # the shipped model
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

    vocab_size: int = 8192  # byte-level BPE trained on the corpus
    hidden_size: int = 256
    num_layers: int = 8  # enough depth for shallow-vs-deep routing to differ
    num_heads: int = 4
    num_experts: int = 32  # fine-grained experts, like Qwen1.5-MoE's 60
    top_k: int = 4
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 512  # Qwen1.5-MoE: shared expert = 4 routed experts
    norm_topk_prob: bool = False  # Qwen1.5-MoE does not renormalise the top-k weights
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    balance_coef: float = 0.01  # per-layer Switch-style balancing term
    z_loss_coef: float = 1e-3  # keeps router logits small (ST-MoE)
    steps: int = 3000
    minutes: float | None = None  # stop early when the wall-clock budget is spent
    eval_every: int = 250
    eval_batches: int = 16
    seed: int = 0
    bf16: bool = True  # bf16 autocast on CPU

    @staticmethod
    def preset(name: str, **overrides) -> "TrainConfig":
        """A named configuration (``tiny``: the shipped model; ``smoke``: seconds-long tests)."""
        presets = {
            "tiny": TrainConfig(),
            "smoke": TrainConfig(
                vocab_size=512, hidden_size=64, num_layers=4, num_experts=8, top_k=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=64, seq_len=64,
                batch_size=4, warmup_steps=2, steps=20, eval_every=10, eval_batches=2,
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
    """The ``Qwen2MoeConfig`` for a training configuration."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        intermediate_size=cfg.shared_expert_intermediate_size, moe_intermediate_size=cfg.moe_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k, norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
        max_position_embeddings=max(1024, cfg.seq_len), tie_word_embeddings=True, rope_theta=10000.0,
        output_router_logits=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )


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


def _token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for chunk in range(0, len(texts), 256):
        for enc in tokenizer(texts[chunk : chunk + 256])["input_ids"]:
            ids.extend(enc)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def _batches(stream: torch.Tensor, cfg: TrainConfig, gen: torch.Generator):
    n = stream.numel() - cfg.seq_len - 1
    while True:
        starts = torch.randint(0, n, (cfg.batch_size,), generator=gen)
        x = torch.stack([stream[s : s + cfg.seq_len + 1] for s in starts.tolist()])  # (B, T+1)
        yield x[:, :-1], x[:, 1:]


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, cfg: TrainConfig) -> float:
    """Mean next-token cross-entropy over fixed, non-overlapping windows of ``stream``."""
    model.eval()
    T = cfg.seq_len
    n_windows = min(cfg.eval_batches * cfg.batch_size, (stream.numel() - 1) // T)
    losses = []
    for i in range(0, n_windows, cfg.batch_size):
        idx = range(i, min(i + cfg.batch_size, n_windows))
        x = torch.stack([stream[j * T : j * T + T + 1] for j in idx])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = model(input_ids=x[:, :-1]).logits
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def expert_load(model, stream: torch.Tensor, tokens: int = 16384, seq_len: int = 256) -> list[list[float]]:
    """Share of routed assignments each expert receives, per MoE layer, on ``tokens`` tokens."""
    model.eval()
    counts = None
    n = min(tokens // seq_len, (stream.numel() - 1) // seq_len)
    for i in range(n):
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
    """Train tokenizer + model, save safetensors (bf16), config, tokenizer and a model card."""
    from transformers import Qwen2MoeForCausalLM

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    t_start = time.time()
    docs = load_corpus(corpus_file)
    train_texts = [d["text"] for d in docs if d["split"] == "train"]
    val_texts = [d["text"] for d in docs if d["split"] == "val"]
    tokenizer = train_tokenizer(train_texts, cfg.vocab_size)
    train_ids = _token_stream(tokenizer, train_texts)
    val_ids = _token_stream(tokenizer, val_texts)

    mcfg = model_config(cfg, len(tokenizer))
    model = Qwen2MoeForCausalLM(mcfg)
    model.set_experts_implementation("grouped_mm")
    n_params = sum(p.numel() for p in model.parameters())
    opt = adamw(model, cfg)
    lr_at = cosine_schedule(cfg, t_start)

    gen = torch.Generator().manual_seed(cfg.seed)
    batches = _batches(train_ids, cfg, gen)
    history = []
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
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            history.append({"step": step + 1, "train_ce": ce.item(), "val_ce": evaluate(model, val_ids, cfg),
                            "balance": bal.item(), "minutes": (time.time() - t_start) / 60})
            bar.write(json.dumps(history[-1]))
        if cfg.minutes is not None and time.time() - t_start > cfg.minutes * 60:
            history.append({"step": step + 1, "train_ce": ce.item(), "val_ce": evaluate(model, val_ids, cfg),
                            "balance": bal.item(), "minutes": (time.time() - t_start) / 60})
            break
    steps_done = step + 1
    wall = time.time() - t_start

    train_ce = evaluate(model, train_ids, cfg)
    val_ce = evaluate(model, val_ids, cfg)
    load = expert_load(model, val_ids, seq_len=cfg.seq_len)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    E = cfg.num_experts
    load_summary = [
        {"layer": i, "cold_experts(<0.25x uniform)": sum(s < 0.25 / E for s in row),
         "busiest_vs_uniform": round(max(row) * E, 2)}
        for i, row in enumerate(load)
    ]
    card = {
        "architecture": "Qwen2MoeForCausalLM",
        "parameters": n_params,
        "train_config": asdict(cfg),
        "corpus": str(corpus_file.name),
        "train_tokens": train_ids.numel(), "val_tokens": val_ids.numel(),
        "steps": steps_done, "tokens_seen": steps_done * cfg.batch_size * cfg.seq_len,
        "wall_minutes": round(wall / 60, 1),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
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
    lines = [
        "# fate_lab tiny MoE", "",
        "Trained by `python -m fate_lab train` (fate_lab/train.py) on `data/corpus` "
        "(World English Bible, Jargon File, Devil's Dictionary; public domain; see data/corpus/SOURCES.md).", "",
        f"- Architecture: `Qwen2MoeForCausalLM`, {card['parameters'] / 1e6:.1f}M parameters: {c['num_layers']} layers, "
        f"hidden {c['hidden_size']}, {c['num_experts']} routed experts of width {c['moe_intermediate_size']}, "
        f"top-{c['top_k']}, one shared expert of width {c['shared_expert_intermediate_size']}, "
        f"byte-level BPE vocab {c['vocab_size']}.",
        f"- Training: {card['steps']} steps x {c['batch_size']} x {c['seq_len']} tokens = {card['tokens_seen']:,} tokens "
        f"(corpus: {card['train_tokens']:,} train / {card['val_tokens']:,} held-out tokens), "
        f"{card['wall_minutes']} min on {card['machine']}, bf16 autocast, seed {c['seed']}.",
        f"- Loss: train {card['train_loss']} (ppl {card['train_perplexity']}), "
        f"held-out {card['val_loss']} (ppl {card['val_perplexity']}).",
        f"- Balancing: per-layer Switch loss x {c['balance_coef']}, router z-loss x {c['z_loss_coef']}.", "",
        "## Expert load per layer (held-out text, share of top-k assignments)", "",
        "| layer | cold experts (< 1/4 of uniform) | busiest expert vs uniform |", "|---|---|---|",
    ]
    for row in card["expert_load"]:
        lines.append(f"| {row['layer']} | {row['cold_experts(<0.25x uniform)']} | {row['busiest_vs_uniform']}x |")
    (out_dir / "MODEL_CARD.md").write_text("\n".join(lines) + "\n")
