"""How closely compressed KV follows full KV: teacher-forced top-1 agreement and KL divergence.

1. Full KV generates greedy continuations of the prompts; at every step the top-k of its next-token
   distribution is kept (k = 1024 holds nearly all of the mass; the rest is one lumped bucket).
2. Each compressed configuration is fed exactly those tokens (teacher forcing) and, at every step,
   compared with the full-KV distribution: does its argmax equal the full-KV token, and what is
   KL(full || compressed)?

Run: `zipage eval fidelity` or `python -m zipage.cli.fidelity`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field

import torch

from zipage.engine.config import EngineConfig, SamplingParams
from zipage.engine.core import EngineCore
from zipage.engine.loader import resolve_model

PROMPTS = [
    "A train leaves at 3:40 pm and arrives at 6:15 pm. How long is the trip? Think step by step.",
    "If 3x + 7 = 25, what is x? Explain each step.",
    "A rectangle has a perimeter of 36 cm and its length is twice its width. Find its area.",
    "Is 221 a prime number? Reason carefully before answering.",
    "Sara has 5 more apples than Tom. Together they have 23. How many does each have?",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "What is the sum of the first 50 positive integers? Show your reasoning.",
    "Explain why the sky looks blue during the day and red at sunset.",
    "A shop discounts a $80 jacket by 25%, then adds 10% tax. What is the final price?",
    "List the steps to solve a quadratic equation by completing the square, with an example.",
    "How many minutes are there in a week? Work it out step by step.",
    "Compare bubble sort and merge sort: how do they work and which is faster?",
    "A car travels 150 km in 2.5 hours. What is its average speed in m/s?",
    "Why do we have seasons on Earth? Give a careful explanation.",
    "Find the greatest common divisor of 84 and 126 using Euclid's algorithm.",
    "Plan a three-day study schedule for an exam on fractions and decimals.",
]

# Ablation ladder, then the two baselines, all at the same budget.
CONFIGURATIONS = [
    ("window score", dict(use_global_score=False, use_redundancy=False, enable_pooling=False, recent_share=0.0)),
    ("+ global score", dict(use_global_score=True, use_redundancy=False, enable_pooling=False, recent_share=0.0)),
    ("+ redundancy", dict(use_global_score=True, use_redundancy=True, enable_pooling=False, recent_share=0.0)),
    ("+ pooling", dict(use_global_score=True, use_redundancy=True, enable_pooling=True, recent_share=0.0)),
    ("+ recent share (Zipage)", dict(use_global_score=True, use_redundancy=True, enable_pooling=True)),
    ("random eviction", dict(eviction="random")),
    ("sinks + recent", dict(eviction="recent", num_sink_tokens=4)),
]
TOP_K = 1024


@dataclass
class Reference:
    prompts: list[list[int]]
    continuations: list[list[int]]
    top_logp: list[torch.Tensor]  # per prompt [steps, TOP_K] log-probs of full KV
    top_ids: list[torch.Tensor]  # per prompt [steps, TOP_K]


@dataclass
class Score:
    agree: int = 0
    kl_sum: float = 0.0
    steps: int = 0
    compressions: int = 0
    seconds: float = 0.0
    per_prompt: list = field(default_factory=list)

    @property
    def agreement(self) -> float:
        return self.agree / max(self.steps, 1)

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / max(self.steps, 1)


def _drive(engine: EngineCore, prompts, tokens: int, forced: list[list[int]] | None, observer,
           index: dict[int, int]) -> list:
    """Run the prompts to completion (greedy, or fed `forced` tokens), calling observer(seq, logits)
    at every sampled step; `index` maps request ids to prompt positions before the first step."""
    engine.runner.logits_observer = observer
    for i, ids in enumerate(prompts):
        n = len(forced[i]) if forced is not None else tokens
        seq = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        if forced is not None:
            seq.forced_tokens = forced[i]
        index[seq.id] = i
    outputs = [None] * len(prompts)
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                outputs[index[out.id]] = out
    engine.runner.logits_observer = None
    return outputs


def build_reference(source, prompts, tokens: int, block_size: int, **engine_kwargs) -> Reference:
    engine = EngineCore(EngineConfig(model=source.name, compression=False, block_size=block_size,
                                     **engine_kwargs), source=source)
    rows: dict[int, list] = {}

    def observe(seq, logits):
        logp = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(logp, min(TOP_K, logp.numel()))
        rows.setdefault(seq.id, []).append((top.values.cpu(), top.indices.cpu()))

    index: dict[int, int] = {}
    outputs = _drive(engine, prompts, tokens, None, observe, index)
    engine.close()
    by_prompt = {index[sid]: r for sid, r in rows.items()}
    return Reference(
        prompts=prompts, continuations=[o.token_ids for o in outputs],
        top_logp=[torch.stack([v for v, _ in by_prompt[i]]) for i in range(len(prompts))],
        top_ids=[torch.stack([k for _, k in by_prompt[i]]) for i in range(len(prompts))])


def kl_top_k(ref_logp: torch.Tensor, ref_ids: torch.Tensor, logp: torch.Tensor) -> float:
    """KL(full || compressed) over the full-KV top-k tokens plus one bucket for all other tokens."""
    p = ref_logp.exp()
    q_logp = logp[ref_ids]
    kl = float((p * (ref_logp - q_logp)).sum())
    p_rest = max(1.0 - float(p.sum()), 0.0)
    q_rest = max(1.0 - float(q_logp.exp().sum()), 1e-12)
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return kl


def score_configuration(source, ref: Reference, budget: int, block_size: int, window: int,
                        overrides: dict, **engine_kwargs) -> Score:
    engine = EngineCore(EngineConfig(model=source.name, compression=True, block_size=block_size,
                                     max_cache_blocks_per_seq=budget, window=window, async_compress=False,
                                     **overrides, **engine_kwargs), source=source)
    score = Score()
    seq_prompt: dict[int, int] = {}

    def observe(seq, logits):
        i = seq_prompt[seq.id]
        step = seq.num_output_tokens
        logp = torch.log_softmax(logits.float(), dim=-1).cpu()
        score.agree += int(int(logp.argmax()) == ref.continuations[i][step])
        score.kl_sum += kl_top_k(ref.top_logp[i][step], ref.top_ids[i][step], logp)
        score.steps += 1

    start = time.monotonic()
    _drive(engine, ref.prompts, 0, ref.continuations, observe, seq_prompt)
    score.compressions = engine.totals["compressions"]
    score.seconds = time.monotonic() - start
    engine.close()
    return score


def run(model: str = "smollm2-135m", num_prompts: int = 16, tokens: int = 1024, budgets=(4, 8, 16),
        block_size: int = 32, window: int = 16, device: str = "cpu", progress=print,
        configurations: list[str] | None = None, settings: dict | None = None) -> dict:
    """Score every configuration (or only those named in `configurations`) at every budget;
    `settings` (engine knobs) apply on top of each row's own, for sweeps."""
    known = [name for name, _ in CONFIGURATIONS]
    for name in configurations or []:
        if name not in known:
            raise ValueError(f"unknown configuration {name!r}; known: {', '.join(known)}")
    source = resolve_model(model)
    tok = source.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for p in PROMPTS[:num_prompts]]
    common = dict(device=device)
    start = time.monotonic()
    ref = build_reference(source, prompts, tokens, block_size, **common)
    progress(f"full-KV reference: {num_prompts} x {tokens} tokens in {time.monotonic() - start:.0f} s")
    results = {"model": model, "num_prompts": num_prompts, "tokens": tokens, "block_size": block_size,
               "window": window, "budgets": list(budgets), "rows": []}
    for name, overrides in CONFIGURATIONS:
        if configurations and name not in configurations:
            continue
        overrides = {**overrides, **(settings or {})}
        row = {"configuration": name, "overrides": overrides, "by_budget": {}}
        for budget in budgets:
            s = score_configuration(source, ref, budget, block_size, window, overrides, **common)
            row["by_budget"][str(budget)] = {"agreement": s.agreement, "mean_kl": s.mean_kl, "steps": s.steps,
                                             "compressions": s.compressions, "seconds": round(s.seconds, 1)}
            progress(f"{name:22s} budget {budget:3d}: top-1 agreement {s.agreement:.4f}, "
                     f"mean KL {s.mean_kl:.4f} ({s.compressions} compressions, {s.seconds:.0f} s)")
        results["rows"].append(row)
    return results


def parse_settings(items: list[str]) -> dict:
    """["recent_share=0.5", "enable_pooling=false"] -> {"recent_share": 0.5, "enable_pooling": False}."""
    settings = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KNOB=VALUE")
        if key not in {f.name for f in dataclasses.fields(EngineConfig)}:
            raise ValueError(f"--set {item!r}: unknown engine knob {key!r}")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    return settings


def markdown_table(results: dict) -> str:
    budgets = results["budgets"]
    bs = results["block_size"]
    head = "| configuration | " + " | ".join(f"{b} blocks ({b * bs} tok): agree / KL" for b in budgets) + " |"
    lines = [head, "|---|" + "---|" * len(budgets)]
    for row in results["rows"]:
        cells = [f"{row['by_budget'][str(b)]['agreement'] * 100:.1f}% / {row['by_budget'][str(b)]['mean_kl']:.4f}"
                 for b in budgets]
        lines.append(f"| {row['configuration']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--budgets", default="4,8,16")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--configurations", default=None, help="only these rows, separated by ';'")
    parser.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                        help="an engine knob applied on top of every row (repeatable)")
    args = parser.parse_args(argv)
    results = run(args.model, args.num_prompts, args.tokens, [int(b) for b in args.budgets.split(",")],
                  args.block_size, args.window, args.device,
                  configurations=args.configurations.split(";") if args.configurations else None,
                  settings=parse_settings(args.set))
    print(markdown_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
