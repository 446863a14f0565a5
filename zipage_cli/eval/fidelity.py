"""How closely compressed KV follows full KV: teacher-forced top-1 agreement and KL divergence.

1. Full KV generates greedy continuations of the prompts; at every step the top-k of its next-token
   distribution is kept (k = 1024 holds nearly all of the mass; the rest is one lumped bucket).
2. Each compressed configuration is fed exactly those tokens (teacher forcing) and, at every step,
   compared with the full-KV distribution: does its argmax equal the full-KV token, and what is
   KL(full || compressed)?

The 16 built-in prompts are split in two seeded halves: `selection` (for tuning) and `report`.

Run: `zipage eval fidelity`.
"""

from __future__ import annotations

import math

import torch

from zipage.cli.eval import common as ec
from zipage.engine.config import DEFAULT_MODEL

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

TOP_K = 1024
DEFAULT_TOKENS = 384


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


def observer(group: int, reference: dict | None):
    """Full KV (no reference yet): keep the top-k log-probs of every step. Compressed: compare each
    step with full KV's token and distribution."""
    if reference is None:
        rows: dict[int, list] = {}

        def keep(i, seq, logits):
            logp = torch.log_softmax(logits.float(), dim=-1)
            top = torch.topk(logp, min(TOP_K, logp.numel()))
            rows.setdefault(i, []).append((top.values.cpu(), top.indices.cpu().to(torch.int32)))

        return keep, rows
    tokens, tops = reference["outputs"][group], reference["observed"][group]
    tally = {"agree": 0, "kl": 0.0, "steps": 0}

    def compare(i, seq, logits):
        step = seq.num_output_tokens
        logp = torch.log_softmax(logits.float(), dim=-1).cpu()
        values, ids = tops[i][step]
        tally["agree"] += int(int(logp.argmax()) == tokens[i][step])
        tally["kl"] += kl_top_k(values, ids.long(), logp)
        tally["steps"] += 1

    return compare, tally


def score(outputs, observed, reference) -> dict:
    steps = sum(t["steps"] for t in observed)
    return {"score": sum(t["agree"] for t in observed) / max(steps, 1),
            "mean_kl": sum(t["kl"] for t in observed) / max(steps, 1), "steps": steps}


def full_kv_metrics(reference) -> dict:
    return {"score": 1.0, "mean_kl": 0.0, "steps": sum(len(o) for g in reference["outputs"] for o in g)}


def build(tokenizer, split: str, num_samples: int, tokens: int) -> ec.Task:
    ec.check_count("tokens", tokens, 1)
    chosen = ec.split_indices(len(PROMPTS), split)
    ec.check_count("num_samples", num_samples, 1, len(chosen))
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i]}],
                                                              tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False) for i in chosen[:num_samples]]
    requests = [ec.Request(prompt=p, free_tokens=tokens) for p in prompts]
    return ec.Task(name="fidelity", groups=[requests], score=score, observer=observer, teacher_forced=True,
                   full_kv_metrics=full_kv_metrics, reference_key={"top_k": TOP_K}, metric="top-1 agreement")


def cell(metrics: dict) -> str:
    return f"{metrics['score'] * 100:.1f}% / {metrics['mean_kl']:.4f}"


def run(model: str = DEFAULT_MODEL, split: str = "report", num_samples: int = 4, tokens: int = DEFAULT_TOKENS,
        budgets=None, block_size: int = 32, window: int = 16, device: str = "cpu",
        configurations: list[str] | None = None, settings: dict | None = None, json_path: str | None = None,
        progress: ec.Progress | None = None, trace: str | None = None) -> dict:
    return ec.run_task(model, lambda tokenizer: build(tokenizer, split, num_samples, tokens),
                       {"split": split, "num_samples": num_samples, "tokens": tokens},
                       budgets, block_size, window, device, configurations, settings, json_path, progress, trace)
