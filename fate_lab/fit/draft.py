"""Train and load the dense draft model that ships in ``data/tiny_draft`` (speculative decoding).

What this file is: a seeded, CPU-friendly trainer for a small dense ``Qwen2ForCausalLM`` that
proposes tokens for the embedded tiny MoE (``data/tiny_moe``): the MoE's own tokenizer and
vocabulary, tied embeddings, a wall-clock budget, and the weights of the held-out best step.
Two things raise the draft's acceptance within a CPU budget of minutes, both optional:
  - ``init="moe"`` seeds the draft from the target: the token embeddings (tied, so also the
    output head), the final norm, and the first ``num_layers`` decoder layers' attention and
    norms, with each layer's *shared expert* as its dense MLP (the routed experts are dropped;
    the shared expert's sigmoid gate has no dense counterpart, so it is left out and training
    absorbs the scale);
  - ``distill > 0`` trains on ``distill * KL(MoE || draft) + (1 - distill) * CE(corpus)``, the
    MoE's logits computed on the fly (bf16 autocast, no gradient). Off for the shipped draft: on
    this CPU the teacher's forward costs more steps than its signal gains (see ``DraftConfig``).
``fate_lab.model.draft.load_draft()`` returns ``(model, tokenizer)`` from ``data/tiny_draft`` offline.

    python -m fate_lab train-draft --minutes 12            # the shipped draft (about 13 min at 1 thread)
    python -m fate_lab train-draft --minutes 0.2 --out /tmp/d --no-acceptance   # a quick check

What it is not: a general distillation library, or the speculative decoding itself (that is HF's
assisted generation, measured in ``fate_lab.study.speculative``). It never downloads anything.
"""
from __future__ import annotations

import copy
import json
import math
import platform
import random
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from fate_lab.fit.train import adamw, batch_stream, cosine_schedule, evaluate, token_stream
from fate_lab.model.corpus import CORPUS_FILE, load_corpus
from fate_lab.model.draft import TINY_DRAFT_DIR
from fate_lab.paths import TINY_MOE_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # copied from the target: one vocabulary


@dataclass(frozen=True)
class DraftConfig:
    """Draft shape and optimisation settings; presets by name via ``DraftConfig.preset``."""

    num_layers: int = 2  # a draft must be far cheaper per token than the target (8 MoE layers)
    hidden_size: int = 256  # = the MoE's hidden, so init="moe" can copy its embeddings and layers
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: the target's (so init="moe" can copy its attention)
    intermediate_size: int = 512  # = the MoE's shared expert width (init="moe" copies it)
    init: str = "moe"  # "moe": seed from the target (module docstring); "random": HF's initialisation
    distill: float = 0.0  # weight of KL(target || draft); 0: the corpus alone. The teacher's forward about
    # halves the steps a budget allows: in 2.5-min probes, 0.7 reached acceptance 0.109, 0 reached 0.141
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    steps: int = 20000  # an upper bound; the wall-clock budget usually ends training first
    minutes: float | None = 12.0  # stop when the wall-clock budget is spent (the cosine ends there)
    eval_every: int = 100
    eval_batches: int = 16  # x batch_size windows of the held-out split per evaluation
    patience: int = 6  # evaluations without a new best held-out loss before stopping
    seed: int = 0
    bf16: bool = True  # bf16 autocast on CPU
    threads: int = 1  # torch threads: the machine is shared

    @staticmethod
    def preset(name: str, **overrides) -> "DraftConfig":
        """A named configuration (``tiny``: the shipped draft; ``smoke``: seconds-long checks)."""
        presets = {
            "tiny": DraftConfig(),
            "smoke": DraftConfig(seq_len=64, batch_size=2, steps=6, minutes=None, eval_every=3, eval_batches=1,
                                 warmup_steps=1),
        }
        if name not in presets:
            raise ValueError(f"unknown draft preset {name!r}; choose one of {sorted(presets)}")
        return replace(presets[name], **overrides)


def draft_config(cfg: DraftConfig, target_config):
    """The ``Qwen2Config`` of a draft for ``target_config`` (same vocabulary, special tokens, RoPE and norm eps)."""
    from transformers import Qwen2Config

    rope = getattr(target_config, "rope_parameters", None) or {}
    return Qwen2Config(
        vocab_size=target_config.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
        num_key_value_heads=cfg.num_kv_heads or getattr(target_config, "num_key_value_heads", cfg.num_heads),
        max_position_embeddings=target_config.max_position_embeddings, tie_word_embeddings=True,
        rope_theta=rope.get("rope_theta", 10000.0), rms_norm_eps=target_config.rms_norm_eps,
        bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id,
        pad_token_id=target_config.pad_token_id,
    )


def init_from_target(draft, target) -> list[str]:
    """Copy embeddings, final norm and the first layers (attention, norms, shared expert as MLP) from a Qwen2-MoE."""
    tc = target.config
    if draft.config.hidden_size != tc.hidden_size:
        raise ValueError(f"init='moe' needs the draft's hidden size to equal the target's ({tc.hidden_size}), "
                         f"got {draft.config.hidden_size}; use init='random' or hidden_size={tc.hidden_size}")
    shared = getattr(tc, "shared_expert_intermediate_size", None)
    if draft.config.intermediate_size != shared:
        raise ValueError(f"init='moe' copies the target's shared expert (width {shared}) into the draft's MLP; "
                         f"set intermediate_size={shared} or use init='random'")
    if draft.config.num_hidden_layers > tc.num_hidden_layers:
        raise ValueError(f"the draft has {draft.config.num_hidden_layers} layers, "
                         f"the target only {tc.num_hidden_layers}")
    src = target.model
    pairs = {"model.embed_tokens.weight": src.embed_tokens.weight, "model.norm.weight": src.norm.weight}
    for i in range(draft.config.num_hidden_layers):
        layer = src.layers[i]
        mlp = getattr(layer.mlp, "shared_expert", None)
        if mlp is None:
            raise ValueError(f"target layer {i} has no shared expert to seed the draft's MLP; use init='random'")
        for name, p in layer.self_attn.named_parameters():
            pairs[f"model.layers.{i}.self_attn.{name}"] = p
        for norm in ("input_layernorm", "post_attention_layernorm"):
            pairs[f"model.layers.{i}.{norm}.weight"] = getattr(layer, norm).weight
        for proj in ("gate_proj", "up_proj", "down_proj"):
            pairs[f"model.layers.{i}.mlp.{proj}.weight"] = getattr(mlp, proj).weight
    own = dict(draft.named_parameters())
    with torch.no_grad():
        for name, value in pairs.items():
            if name not in own or own[name].shape != value.shape:
                raise ValueError(f"cannot seed draft parameter {name} from the target (shape "
                                 f"{tuple(value.shape)} vs {tuple(own[name].shape) if name in own else 'missing'})")
            own[name].copy_(value.to(own[name].dtype))
    return sorted(pairs)


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, targets: torch.Tensor,
                 distill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, corpus CE): distill * KL(teacher || student) + (1 - distill) * CE; logits [B, T, V], targets [B, T]."""
    s = student_logits.float().flatten(0, 1)  # (B*T, V)
    ce = F.cross_entropy(s, targets.flatten())
    if teacher_logits is None or distill == 0:
        return ce, ce
    t_logp = teacher_logits.float().flatten(0, 1).log_softmax(-1)  # (B*T, V)
    kl = F.kl_div(s.log_softmax(-1), t_logp, log_target=True, reduction="batchmean")
    return distill * kl + (1 - distill) * ce, ce


def train_draft(cfg: DraftConfig, out_dir: Path = TINY_DRAFT_DIR, target_dir: Path = TINY_MOE_DIR,
                corpus_file: Path = CORPUS_FILE) -> dict:
    """Train the draft against the target in ``target_dir``; save the best held-out step; return its card."""
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from fate_lab.model.models import load_model

    if cfg.init not in ("moe", "random"):
        raise ValueError(f"DraftConfig.init={cfg.init!r}; choose 'moe' or 'random'")
    if not 0 <= cfg.distill <= 1:
        raise ValueError(f"DraftConfig.distill={cfg.distill!r}: give a weight in [0, 1]")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    t_start = time.time()
    target, tokenizer = load_model(target_dir)
    target.requires_grad_(False)
    docs = load_corpus(corpus_file)
    train_ids = token_stream(tokenizer, [d["text"] for d in docs if d["split"] == "train"])
    val_ids = token_stream(tokenizer, [d["text"] for d in docs if d["split"] == "val"])

    model = Qwen2ForCausalLM(draft_config(cfg, target.config))
    seeded = init_from_target(model, target) if cfg.init == "moe" else []
    n_params = sum(p.numel() for p in model.parameters())
    opt = adamw(model, cfg)
    lr_at = cosine_schedule(cfg, t_start)

    first_val = evaluate(model, val_ids, cfg)
    best = {"val_ce": first_val, "step": 0, "state": copy.deepcopy(model.state_dict())}
    history = [{"step": 0, "val_ce": first_val, "minutes": (time.time() - t_start) / 60}]
    batches = batch_stream(train_ids, cfg, torch.Generator().manual_seed(cfg.seed))
    model.train()
    bar = tqdm(range(cfg.steps), desc="train draft", unit="step")
    step, stale, stop = 0, 0, "steps"
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = next(batches)  # (B, T), (B, T)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            teacher = None
            if cfg.distill > 0:
                with torch.no_grad():
                    teacher = target(input_ids=x).logits  # (B, T, V)
            student = model(input_ids=x).logits  # (B, T, V)
        loss, ce = distill_loss(student, teacher, y, cfg.distill)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", ce=f"{ce.item():.3f}", best=f"{best['val_ce']:.3f}")
        out_of_time = cfg.minutes is not None and time.time() - t_start > cfg.minutes * 60
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps or out_of_time:
            val = evaluate(model, val_ids, cfg)
            history.append({"step": step + 1, "train_loss": loss.item(), "train_ce": ce.item(), "val_ce": val,
                            "minutes": (time.time() - t_start) / 60})
            bar.write(json.dumps(history[-1]))
            if val < best["val_ce"]:
                best, stale = {"val_ce": val, "step": step + 1, "state": copy.deepcopy(model.state_dict())}, 0
            else:
                stale += 1
            if stale >= cfg.patience:
                stop = f"no better held-out loss in {cfg.patience} evaluations"
                break
        if out_of_time:
            stop = f"wall-clock budget of {cfg.minutes} min"
            break
    bar.close()
    wall = time.time() - t_start
    model.load_state_dict(best["state"])
    model.eval()
    val_ce = evaluate(model, val_ids, cfg)
    train_ce = evaluate(model, train_ids, cfg)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=target.config.bos_token_id, eos_token_id=target.config.eos_token_id,
        pad_token_id=target.config.pad_token_id, num_assistant_tokens=4, num_assistant_tokens_schedule="constant",
        assistant_confidence_threshold=0.0,  # propose exactly num_assistant_tokens (no early stop)
    )
    model.to(torch.bfloat16).config.dtype = "bfloat16"
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "model.safetensors").chmod(0o644)  # readable like the other shipped files
    for name in TOKENIZER_FILES:
        shutil.copy(Path(target_dir) / name, out_dir / name)
    card = {
        "architecture": "Qwen2ForCausalLM", "target": str(Path(target_dir).name), "parameters": n_params,
        "vocab_size": model.config.vocab_size,
        "train_config": asdict(cfg), "seeded_from_target": seeded, "corpus": str(Path(corpus_file).name),
        "train_tokens": train_ids.numel(), "val_tokens": val_ids.numel(),
        "steps": step + 1, "best_step": best["step"], "stopped_by": stop,
        "tokens_seen": (step + 1) * cfg.batch_size * cfg.seq_len, "wall_minutes": round(wall / 60, 1),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}",
        "initial_val_loss": round(first_val, 4), "train_loss": round(train_ce, 4), "val_loss": round(val_ce, 4),
        "train_perplexity": round(math.exp(train_ce), 2), "val_perplexity": round(math.exp(val_ce), 2),
        "history": history,
    }
    write_card(out_dir, card)
    return card


def write_card(out_dir: Path, card: dict) -> None:
    """Write ``training.json`` and ``MODEL_CARD.md`` (with the acceptance rate once it is in the card)."""
    out_dir = Path(out_dir)
    (out_dir / "training.json").write_text(json.dumps(card, indent=1))
    c = card["train_config"]
    init = ("seeded from the target (embeddings, final norm, first layers' attention and shared experts)"
            if c["init"] == "moe" else "random initialisation")
    objective = (f"{c['distill']} x KL(target logits || draft) + {1 - c['distill']:.1f} x next-token CE"
                 if c["distill"] > 0 else "next-token CE")
    lines = [
        "# fate_lab tiny draft", "",
        "Trained by `python -m fate_lab train-draft` (fate_lab/fit/draft.py) on the training split of "
        "`data/corpus` as the speculative-decoding draft of `data/tiny_moe` (same tokenizer, copied).", "",
        f"- Architecture: dense `Qwen2ForCausalLM`, {card['parameters'] / 1e6:.1f}M parameters: {c['num_layers']} "
        f"layers, hidden {c['hidden_size']}, MLP width {c['intermediate_size']}, {c['num_heads']} heads, tied "
        f"embeddings, vocab {card['vocab_size']}; {init}.",
        f"- Objective: {objective}.",
        f"- Training: {card['steps']} steps x {c['batch_size']} x {c['seq_len']} tokens = {card['tokens_seen']:,} "
        f"tokens, {card['wall_minutes']} min on {card['machine']}, bf16 autocast, seed {c['seed']}; stopped by "
        f"{card['stopped_by']}; weights of step {card['best_step']} (best held-out loss).",
        f"- Loss: train {card['train_loss']} (ppl {card['train_perplexity']}), held-out {card['val_loss']} "
        f"(ppl {card['val_perplexity']}); before training {card['initial_val_loss']}.",
    ]
    if card.get("notes"):
        lines.append(f"- Notes: {card['notes']}")
    acc = card.get("acceptance")
    if acc is not None:
        lines.append(
            f"- Acceptance against tiny_moe (greedy HF assisted generation, window {acc['window']}, "
            f"{acc['prompts']} held-out prompts x {acc['new_tokens']} tokens): {acc['acceptance']:.3f} of proposed "
            f"draft tokens accepted; {acc['tokens_per_verify']:.2f} tokens per target forward.")
    (out_dir / "MODEL_CARD.md").write_text("\n".join(lines) + "\n")
