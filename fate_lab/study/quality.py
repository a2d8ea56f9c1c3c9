"""What a lossy offloaded configuration costs in quality, measured against the plain model.

What this file is: `reference_outputs` runs the plain model once over held-out text windows and
over greedy continuations of held-out prompts and keeps what a comparison needs (`Reference`);
`lossy_quality(model, config, reference)` offloads the model with `fate_lab.offload(model,
config)` (a context manager), feeds it the same inputs, closes the runtime and returns the numbers;
`measure(model_q, reference)` is the comparison alone, for any model (a quantized copy, a runtime
you manage yourself). `heldout_inputs` cuts the usual inputs from the held-out corpus.

The numbers, computed exactly as `quant.quality_report` computes them (fp64 log-softmax of the
logits; every position of a window but the last predicts the next token):
  * perplexity_fp / perplexity_q on the windows, and perplexity_change = perplexity_q /
    perplexity_fp - 1, a fraction (format it with ``:+.2%``), as notebook 06 reports it;
  * greedy_agreement: share of window positions whose argmax token is the same (teacher-forced:
    both models read the same text, as in quality_report);
  * mean_kl: mean over positions of KL(plain || lossy) of the next-token distributions;
  * decode_agreement / decode_mean_kl: the same over decode steps. Each prompt is prefilled, then
    the plain model's own greedy continuation is fed one token at a time (teacher-forced decode):
    every step is a decode step of the runtime (where substitution and commit routing act), and
    the lossy model never drifts onto its own tokens, so each step compares like with like.
The windows run first (one prefill forward each), then the prompts, all in one runtime, so a
lossless config gives the plain model's numbers up to float summation order (the runtime adds
the k expert outputs in another order than transformers; on the tiny MoE the logits came out
bitwise equal on one CPU thread and ~1e-5 apart on two) and a quantized one the numbers
`quality_report(model, offloaded_model, windows)` gives.

What it is not: no policy and no runtime code; it does not choose configs or plot anything.
Letters: B batch, T window length, V vocabulary, P prompt length, D decode steps per prompt.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

from fate_lab.core.config import OffloadConfig
from fate_lab.model.adapters import is_offloaded
from fate_lab.offloading.runtime import offload

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class Reference:
    """The plain model's outputs on the evaluation inputs, computed once by `reference_outputs`.

    It holds fp32 logits: positions x V x 4 bytes (1024 window tokens of an 8192-token vocabulary: 32 MiB).
    """

    windows: list[torch.Tensor]  # each (B, T) token ids of held-out text
    window_logits: list[torch.Tensor]  # each (B, T-1, V) float32: position t predicts windows[:, t+1]
    prompts: list[torch.Tensor]  # each (1, P) prompt token ids
    continuations: list[torch.Tensor]  # each (1, D) the plain model's greedy tokens after the prompt
    decode_logits: list[torch.Tensor]  # each (1, D, V) float32: step i predicts continuations[:, i]

    def describe(self) -> dict:
        """Sizes: windows, predicted window positions, prompts, decode steps."""
        return {"windows": len(self.windows), "window_positions": sum(t.shape[:2].numel() for t in self.window_logits),
                "prompts": len(self.prompts), "decode_steps": sum(c.numel() for c in self.continuations)}


def heldout_inputs(tokenizer, n_tokens: int = 1024, seq_len: int = 256, n_prompts: int = 4,
                   prompt_chars: int = 300) -> tuple[list[torch.Tensor], list[list[int]]]:
    """(windows [1, seq_len] of held-out text, n_tokens in all; the first n_prompts held-out prompts as ids).

    The prompts are the eval split of `lab.get_trace`; with n_prompts <= 16 they stay disjoint from
    the calib split the shipped expert similarity was computed on.
    """
    from fate_lab.model.corpus import heldout_prompts, heldout_texts

    if n_tokens < seq_len or seq_len < 2:
        raise ValueError(f"need seq_len >= 2 and n_tokens >= seq_len, got n_tokens={n_tokens}, seq_len={seq_len}")
    ids: list[int] = []
    for text in heldout_texts():
        ids += tokenizer(text)["input_ids"]
        if len(ids) >= n_tokens:
            break
    ids = ids[: n_tokens - n_tokens % seq_len]
    windows = [torch.tensor(ids[i:i + seq_len]).unsqueeze(0) for i in range(0, len(ids), seq_len)]  # (1, T) each
    prompts = [tokenizer(p)["input_ids"] for p in heldout_prompts(n_prompts, max_chars=prompt_chars)]
    return windows, prompts


def _device(model: nn.Module) -> torch.device:
    """Where the model's (dense) parameters live."""
    return next(model.parameters()).device


@torch.no_grad()
def _decode(model: nn.Module, prompt: torch.Tensor, steps: int,
            forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill prompt [1, P], then steps-1 single-token forwards: (tokens [1, D], logits [1, D, V] float32).

    forced None: greedy (each step feeds its own argmax); else the tokens forced [1, D] are fed
    (teacher-forced decode) and returned as they are.
    """
    out = model(input_ids=prompt.to(_device(model)), use_cache=True)
    logits = [out.logits[:, -1:].float().cpu()]  # (1, 1, V) predicts token 0
    tokens = [logits[0].argmax(-1) if forced is None else forced[:, :1]]  # (1, 1)
    for i in range(1, steps):
        out = model(input_ids=tokens[-1].to(_device(model)), cache=out["cache"], use_cache=True)
        logits.append(out.logits[:, -1:].float().cpu())  # (1, 1, V) predicts token i
        tokens.append(logits[-1].argmax(-1) if forced is None else forced[:, i:i + 1])  # (1, 1)
    return torch.cat(tokens, dim=1), torch.cat(logits, dim=1)  # (1, D), (1, D, V)


@torch.no_grad()
def reference_outputs(model: nn.Module, token_batches, prompts_ids, decode_tokens: int,
                      progress: bool = True) -> Reference:
    """Run the plain model once: logits on each window, greedy continuation and logits of each prompt.

    token_batches: LongTensors [B, T] or [T] (T >= 2) of held-out text; prompts_ids: token-id lists
    or tensors [P] / [1, P]; decode_tokens: greedy steps per prompt (0: no decode part).
    """
    if is_offloaded(model):
        raise RuntimeError("reference_outputs needs the plain model, but this one is offloaded by a fate_lab "
                           "Runtime; close() the runtime first")
    if decode_tokens < 0:
        raise ValueError(f"decode_tokens must be >= 0, got {decode_tokens}")
    windows = [torch.as_tensor(ids, dtype=torch.long) for ids in token_batches]
    windows = [w.unsqueeze(0) if w.dim() == 1 else w for w in windows]  # (B, T) each
    prompts = [torch.as_tensor(p, dtype=torch.long).reshape(1, -1) for p in prompts_ids]  # (1, P) each
    if any(w.shape[-1] < 2 for w in windows) or any(p.numel() == 0 for p in prompts):
        raise ValueError("every window needs >= 2 tokens (one to predict) and every prompt >= 1 token")
    if not windows and not (prompts and decode_tokens):
        raise ValueError("nothing to measure: give token windows, or prompts with decode_tokens > 0")
    ref = Reference(windows, [], prompts, [], [])
    bar = tqdm(total=len(windows) + len(prompts), desc="reference", unit="input", disable=not progress)
    for w in windows:
        ref.window_logits.append(model(input_ids=w.to(_device(model))).logits[:, :-1].float().cpu())  # (B, T-1, V)
        bar.update(1)
    for p in prompts:
        if decode_tokens:
            tokens, logits = _decode(model, p, decode_tokens)
            ref.continuations.append(tokens)
            ref.decode_logits.append(logits)
        bar.update(1)
    bar.close()
    return ref


def _compare(logits_fp: torch.Tensor, logits_q: torch.Tensor, target: torch.Tensor) -> tuple[float, ...]:
    """Sums over positions: (nll_fp, nll_q, KL(fp || q), argmax agreements, positions), as quality_report."""
    lp_fp = logits_fp.double().log_softmax(-1)  # (B, T, V) fp64 for tiny KLs
    lp_q = logits_q.double().to(lp_fp.device).log_softmax(-1)  # (B, T, V)
    target = target.to(lp_fp.device).unsqueeze(-1)  # (B, T, 1)
    return (-lp_fp.gather(-1, target).sum().item(), -lp_q.gather(-1, target).sum().item(),
            (lp_fp.exp() * (lp_fp - lp_q)).sum().item(), (lp_fp.argmax(-1) == lp_q.argmax(-1)).sum().item(),
            target.numel())


@torch.no_grad()
def measure(model_q: nn.Module, reference: Reference, progress: bool = True, stepwise: bool = False) -> dict:
    """The quality numbers of model_q (any model: offloaded, quantized copy, ...) against the reference.

    stepwise: run each held-out window token by token (every position after the first a decode step, teacher-forced)
    instead of one forward: the perplexity of a policy that acts in decode steps only (lossy.MissPolicy).
    """
    win = [0.0] * 5  # nll_fp, nll_q, kl, agree, n
    dec = [0.0] * 5
    bar = tqdm(total=len(reference.windows) + len(reference.continuations), desc="quality", unit="input",
               disable=not progress, leave=False)
    for ids, logits_fp in zip(reference.windows, reference.window_logits, strict=True):
        if stepwise:
            logits_q = torch.cat([_decode(model_q, row[None, :1], row.numel() - 1, forced=row[None, 1:])[1]
                                  for row in ids])  # (B, T-1, V)
        else:
            logits_q = model_q(input_ids=ids.to(_device(model_q))).logits[:, :-1]  # (B, T-1, V)
        win = [a + b for a, b in zip(win, _compare(logits_fp, logits_q, ids[:, 1:]), strict=True)]
        bar.update(1)
    for prompt, tokens, logits_fp in zip(reference.prompts, reference.continuations, reference.decode_logits,
                                         strict=True):
        _, logits_q = _decode(model_q, prompt, tokens.shape[1], forced=tokens)  # (1, D, V)
        dec = [a + b for a, b in zip(dec, _compare(logits_fp, logits_q, tokens), strict=True)]
        bar.update(1)
    bar.close()
    nan = float("nan")
    ppl_fp, ppl_q = (math.exp(win[0] / win[4]), math.exp(win[1] / win[4])) if win[4] else (nan, nan)
    return {
        "perplexity_fp": ppl_fp, "perplexity_q": ppl_q, "perplexity_change": ppl_q / ppl_fp - 1,
        "greedy_agreement": win[3] / win[4] if win[4] else nan, "mean_kl": win[2] / win[4] if win[4] else nan,
        "n_tokens": int(win[4]),
        "decode_agreement": dec[3] / dec[4] if dec[4] else nan, "decode_mean_kl": dec[2] / dec[4] if dec[4] else nan,
        "n_decode": int(dec[4]),
    }


def lossy_quality(model: nn.Module, config: OffloadConfig, reference: Reference, progress: bool = True,
                  stepwise: bool | None = None) -> dict:
    """Offload model with config, measure it against the reference, close the runtime; the numbers.

    Adds the config's name, the runtime's hit rates (prefill, decode), bytes moved, and its decode
    tok/s over every decode step of the measurement. stepwise (see `measure`) defaults to True for
    a lossy config, whose rules act in decode steps only.
    """
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig (e.g. OffloadConfig.preset('fate', slots=64)), "
                        f"got {type(config).__name__}")
    if is_offloaded(model):
        raise RuntimeError("this model is already offloaded by a Runtime; close() it, then pass the plain model")
    from fate_lab.study.clock import pinned

    stepwise = config.lossy.kind is not None if stepwise is None else stepwise
    with pinned(), offload(model, config) as rt:  # torch's threads held while measuring (study/clock.py)
        out = measure(model, reference, progress, stepwise)
        summary = rt.stats.summary()
        dec = rt.stats.forward_s["decode"]
    return {"config": config.name, **out, "hit_rate_prefill": summary["prefill"]["hit_rate"],
            "hit_rate_decode": summary["decode"]["hit_rate"],
            "mib_moved": (summary["prefill"]["bytes_moved"] + summary["decode"]["bytes_moved"]) / 2**20,
            "decode_tok_s": len(dec) / sum(dec) if dec else float("nan"),
            "dropped_share": summary["decode"]["dropped"] / max(1, summary["decode"]["uses"]),
            "substituted_share": summary["decode"]["substituted"] / max(1, summary["decode"]["uses"])}


LOSSY_PRESET = {"drop": "drop_low", "substitute": "substitute", "commit": "commit", "standin": "standin"}
_KNOB = {"standin": "standin_window"}  # the parameter a rule's "threshold" sets (default: lossy_threshold)


def _equal_memory(model: nn.Module, kind: str, over: dict) -> dict:
    """standin keeps an INT2 copy of every expert resident: at a slot budget, it gets that many fewer slots."""
    if kind != "standin" or over.get("slots") is None:
        return over
    from fate_lab.core.sizing import standin_pool_bytes
    from fate_lab.model.adapters import adapt

    a = adapt(model)
    pool = standin_pool_bytes(a.num_moe_layers, a.num_experts, (2 * a.expert_intermediate_size, a.hidden_size),
                              (a.hidden_size, a.expert_intermediate_size))
    return dict(over, slots=max(0, over["slots"] - -(-pool // a.bytes_per_expert())))


def sweep_lossy(model: nn.Module, tokenizer, thresholds: dict[str, list[float]], link: str = "qwen15_moe_rtx3090_pcie3",
                slots: int | None = None, n_tokens: int = 256, n_prompts: int = 2, decode_tokens: int = 16,
                baselines: tuple[str, ...] = ("fate", "fate_quant", "lru_quant"), progress: bool = True):
    """Quality and speed of each lossy rule at each threshold (and the baselines), measured in the runtime in
    one run: every config decodes the same held-out text token by token over the same link (a scaled link
    is calibrated once), so its decode tok/s and its quality come from the same decode steps.

    thresholds: {"drop" | "substitute" | "commit": [threshold, ...]}. Returns a DataFrame, one row per run.
    """

    import pandas as pd

    from fate_lab.hardware.setups import is_scaled
    from fate_lab.study.clock import machine_clock

    unknown = set(thresholds) - set(LOSSY_PRESET)
    if unknown:
        raise ValueError(f"unknown lossy rule(s) {sorted(unknown)}; choose from {list(LOSSY_PRESET)}")
    over: dict = {"link": link}
    if slots is not None:
        over.update(slots=slots, budget=None)
    if is_scaled(link):
        over["layer_compute_s"] = machine_clock(model).layer_s  # the run's one clock: one link for every row
    windows, prompts = heldout_inputs(tokenizer, n_tokens=n_tokens, seq_len=min(256, n_tokens), n_prompts=n_prompts)
    ref = reference_outputs(model, windows, prompts, decode_tokens, progress=progress)
    jobs = [(b, None, OffloadConfig.preset(b, **over)) for b in baselines]
    jobs += [(kind, t, OffloadConfig.preset(LOSSY_PRESET[kind], **{_KNOB.get(kind, "lossy_threshold"): t},
                                            **_equal_memory(model, kind, over)))
             for kind, ts in thresholds.items() for t in ts]
    rows = []
    for name, t, cfg in tqdm(jobs, desc="lossy sweep", unit="run", disable=not progress):
        q = lossy_quality(model, cfg, ref, progress=False, stepwise=True)
        rows.append({"policy": name, "threshold": t, "perplexity change": q["perplexity_change"],
                     "greedy agreement": q["greedy_agreement"], "mean KL": q["mean_kl"],
                     "decode tok/s": q["decode_tok_s"], "hit rate decode": q["hit_rate_decode"],
                     "dropped share": q["dropped_share"], "substituted share": q["substituted_share"]})
    df = pd.DataFrame(rows)
    if "fate" in baselines:
        df["speed vs fate"] = df["decode tok/s"] / df.loc[df["policy"] == "fate", "decode tok/s"].iloc[0]
    return df


def scheme_quality(model: nn.Module, windows: list[torch.Tensor], decode_windows: list[torch.Tensor], slots: int,
                   link: str = "instant") -> tuple:
    """Quality of every static quantization scheme (every expert at one precision, no runtime) and of Fate's
    INT4/INT2 mix as the runtime produces it (the `fate_quant` preset with `slots`, prefill: one forward per
    window; decode: the same text token by token), on held-out `windows` ([1, T] token ids). The mix runs over
    `link` ("instant" by default: which expert arrives at which precision then depends on the policies alone,
    a fixed schedule whose numbers reproduce). Returns (one row per scheme: `quant.quality_report`'s numbers and
    ``perplexity change``; the share of each precision among the experts the runtime moved, per mode)."""
    import copy

    import pandas as pd

    from fate_lab.offloading.hookup import StepwiseForward
    from fate_lab.quant import QuantSpec, quality_report, quantize_model_experts

    static = {"int8": QuantSpec.preset("int8"), "int4 (Fate cache)": QuantSpec.preset("int4"),
              "int3": QuantSpec.preset("int3"), "int2 (Fate I/O)": QuantSpec.preset("int2")}
    out = {name: quality_report(model, quantize_model_experts(model, spec), windows) for name, spec in static.items()}
    mixed, mix = copy.deepcopy(model), {}
    for mode, wrap, batch in (("prefill", lambda m: m, windows), ("decode", StepwiseForward, decode_windows)):
        with offload(mixed, OffloadConfig.preset("fate_quant", slots=slots, link=link)) as rt:
            out[f"Fate mix, {mode} (runtime)"] = quality_report(model, wrap(mixed), batch)
            moved = pd.Series({label: n for (_, _, label), n in rt.stats.moved.items()}).groupby(level=0).sum()
            mix[mode] = (moved / moved.sum()).to_dict() if moved.sum() else {}
    del mixed
    df = pd.DataFrame(out).T
    df["perplexity change"] = df["perplexity_q"] / df["perplexity_fp"] - 1
    return df, mix


def standin_quality(sim) -> "pd.DataFrame":
    """Per MoE layer of an `ExpertSimilarity`: the best stand-in's similarity (mean over experts) and how many
    experts have a stand-in better than dropping them (similarity > 0)."""
    import pandas as pd

    others = sim.sim.clone()  # (M, E, E)
    for m in range(sim.num_layers):
        others[m].fill_diagonal_(float("-inf"))  # an expert is not its own stand-in
    best = others.max(dim=2).values  # (M, E)
    return pd.DataFrame({"best stand-in similarity (mean over experts)": best.mean(dim=1).numpy(),
                         "experts with a stand-in better than dropping": (best > 0).sum(dim=1).numpy()}
                        ).rename_axis("layer")


def best_within(sweep, ppl_bound: float = 0.01, agreement_bound: float = 0.9):
    """Each lossy rule of a `sweep_lossy` table at its fastest threshold within the quality bounds (perplexity
    change <= ppl_bound, greedy agreement >= agreement_bound); a rule with none is absent."""
    ok = sweep[(sweep["perplexity change"] <= ppl_bound) & (sweep["greedy agreement"] >= agreement_bound)
               & sweep["threshold"].notna()]
    return ok.loc[ok.groupby("policy")["speed vs fate"].idxmax()] if len(ok) else ok


def dominating(sweep, reference: str = "fate_quant"):
    """The lossy runs of a `sweep_lossy` table both faster than `reference` and with a smaller perplexity change."""
    ref = sweep[sweep["policy"] == reference].iloc[0]
    return sweep[sweep["threshold"].notna() & (sweep["decode tok/s"] > ref["decode tok/s"])
                 & (sweep["perplexity change"] < ref["perplexity change"])]
