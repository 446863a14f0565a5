"""Variable tracking (RULER style): a multi-step use of a compressed prompt.

A chain of assignments is spread through a varied filler text ("VAR ABCDE = 41234.", then "VAR
FGHIJ = VAR ABCDE.", ...), with a second chain of another value as a distractor. The question asks
for the value of the chain's last variable, so the answer needs every link of the chain. The
assistant's answer starts with "The value of VAR NAME is" and greedy decoding must produce exactly
the value.

Run: `zipage eval vartrack`.
"""

from __future__ import annotations

import string

from zipage.cli.eval import common as ec
from zipage.cli.eval.filler import filler_sentences, filler_tokens
from zipage.engine.config import DEFAULT_MODEL
from zipage.cli.eval.needle import exact_match

DEFAULT_LENGTH = 512
DEFAULT_HOPS = 2
INTRO = "Below is a long text with variable assignments hidden in it. Keep track of the variables."


def render(tokenizer, sentences: list[str], name: str) -> list[int]:
    user = f"{INTRO}\n\n{' '.join(sentences)}\n\nWhat is the value of VAR {name}?"
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text + f"The value of VAR {name} is", add_special_tokens=False)


def chain(rng, hops: int, value: str, taken: set) -> tuple[list[str], str]:
    names = []
    while len(names) < hops:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in taken:
            taken.add(name)
            names.append(name)
    return [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])], names[-1]


def make_sample(tokenizer, rng, length: int, hops: int) -> dict:
    taken: set = set()
    value, other = (str(v) for v in rng.sample(range(10000, 100000), 2))
    links, last = chain(rng, hops, value, taken)
    decoy, _ = chain(rng, hops, other, taken)
    overhead = len(render(tokenizer, links + decoy, last))
    sentences = filler_tokens(tokenizer, rng, max(length - overhead, 8))
    sentences += filler_sentences(rng, hops - len(sentences))  # room for every link, however short
    # Each chain's links keep their order, at random places of the text.
    for statements in (links, decoy):
        slots = sorted(rng.sample(range(len(sentences) + 1), len(statements)), reverse=True)
        for slot, statement in zip(slots, reversed(statements)):
            sentences.insert(slot, statement)
    return {"prompt": render(tokenizer, sentences, last), "value": value, "links": links,
            "free_tokens": len(tokenizer.encode(" " + value, add_special_tokens=False)) + 1}


def build(tokenizer, split: str, num_samples: int, length: int, hops: int) -> ec.Task:
    ec.check_count("length", length, 64)
    ec.check_count("hops", hops, 1, 8)
    samples = [make_sample(tokenizer, ec.sample_rng("vartrack", split, i), length, hops) for i in range(num_samples)]
    requests = [ec.Request(prompt=s["prompt"], free_tokens=s["free_tokens"]) for s in samples]

    def score(outputs, observed, reference) -> dict:
        return {"score": ec.mean(exact_match(tokenizer.decode(out), s["value"]) for s, out in zip(samples, outputs[0]))}

    def spans(g: int, i: int) -> list[tuple[str, str]]:
        links = samples[i]["links"]
        return [("value", links[0])] + ([("asked", links[-1])] if len(links) > 1 else [])

    return ec.Task(name="vartrack", groups=[requests], score=score, spans=spans)


def run(model: str = DEFAULT_MODEL, split: str = "report", num_samples: int = 12, length: int = DEFAULT_LENGTH,
        hops: int = DEFAULT_HOPS, budgets=None, block_size: int = 32, window: int = 16, device: str = "cpu",
        configurations: list[str] | None = None, settings: dict | None = None, json_path: str | None = None,
        progress: ec.Progress | None = None, trace: str | None = None) -> dict:
    ec.check_count("num_samples", num_samples)
    return ec.run_task(model, lambda tokenizer: build(tokenizer, split, num_samples, length, hops),
                       {"split": split, "num_samples": num_samples, "length": length, "hops": hops},
                       budgets, block_size, window, device, configurations, settings, json_path, progress, trace)
