"""Key retrieval through a compressed prompt (needle in a haystack, RULER style).

Each sample hides "The special magic number for KEY is VALUE." at a depth of a varied filler text
and asks for KEY's number at the end; with several keys, three distractor keys with their own numbers
are hidden elsewhere. The prompt is longer than the budget, so it is compressed right after its
prefill, with the question in the observation window. The assistant's answer starts with "The
special magic number for KEY is" and greedy decoding must produce exactly VALUE.

Run: `zipage eval needle`.
"""

from __future__ import annotations

from collections import defaultdict

from zipage.cli.eval import common as ec
from zipage.cli.eval.filler import filler_sentences, filler_tokens
from zipage.engine.config import DEFAULT_MODEL

KEYS = ["lemon", "falcon", "granite", "violet", "harbor", "cobalt", "maple", "tiger", "saffron", "glacier",
        "orchid", "copper", "meadow", "raven", "walnut", "comet", "juniper", "otter", "amber", "thistle"]
KINDS = ("single", "multi")
NUM_DISTRACTORS = 3
DEFAULT_LENGTHS = (512, 1024)
DEFAULT_DEPTHS = (0, 50, 100)
INTRO = ("Below is a long text. Some special magic numbers are hidden in it. Memorize them: "
         "I will ask you about one of them.")


def needle(key: str, value: str) -> str:
    return f"The special magic number for {key} is {value}."


def render(tokenizer, sentences: list[str], key: str) -> tuple[list[int], str]:
    """The chat prompt with the answer's start already in the assistant turn."""
    user = f"{INTRO}\n\n{' '.join(sentences)}\n\nWhat is the special magic number for {key}?"
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)
    text += f"The special magic number for {key} is"
    return tokenizer.encode(text, add_special_tokens=False), text


def make_sample(tokenizer, rng, length: int, depth: int, kind: str) -> dict:
    keys = rng.sample(KEYS, 1 + (NUM_DISTRACTORS if kind == "multi" else 0))
    values = [str(rng.randrange(10000, 100000)) for _ in keys]
    overhead = len(render(tokenizer, [], keys[0])[0]) + sum(
        len(tokenizer.encode(" " + needle(k, v), add_special_tokens=False)) for k, v in zip(keys, values))
    sentences = filler_tokens(tokenizer, rng, max(length - overhead, 8))
    sentences += filler_sentences(rng, len(keys) - len(sentences))  # room for every key, however short
    # The asked key goes at `depth` of the text; distractors at random other places.
    slots = len(sentences) + 1
    target = round(depth / 100 * (slots - 1))
    others = rng.sample([s for s in range(slots) if s != target], len(keys) - 1) if len(keys) > 1 else []
    placed = sorted(zip([target, *others], range(len(keys))), reverse=True)
    for slot, k in placed:
        sentences.insert(slot, needle(keys[k], values[k]))
    prompt, _ = render(tokenizer, sentences, keys[0])
    answer = " " + values[0]
    return {"prompt": prompt, "value": values[0], "depth": depth, "kind": kind, "length": length,
            "needle": needle(keys[0], values[0]),
            "free_tokens": len(tokenizer.encode(answer, add_special_tokens=False)) + 1}


def exact_match(text: str, value: str) -> bool:
    """The generated text starts with the value, and the number ends there."""
    text = text.strip()
    return text.startswith(value) and not text[len(value):len(value) + 1].isdigit()


def build(tokenizer, split: str, num_samples: int, lengths, depths) -> tuple[ec.Task, list[list[dict]]]:
    for length in lengths:
        ec.check_count("length", length, 64)
    for depth in depths:
        ec.check_count("depth", depth, 0, 100)
    groups, meta = [], []
    index = 0
    for length in lengths:
        samples = []
        for _ in range(num_samples):
            for depth in depths:
                for kind in KINDS:
                    samples.append(make_sample(tokenizer, ec.sample_rng("needle", split, index), length, depth, kind))
                    index += 1
        groups.append([ec.Request(prompt=s["prompt"], free_tokens=s["free_tokens"]) for s in samples])
        meta.append(samples)

    def score(outputs, observed, reference) -> dict:
        hits = defaultdict(list)
        for samples, outs in zip(meta, outputs):
            for s, out in zip(samples, outs):
                ok = exact_match(tokenizer.decode(out), s["value"])
                hits["all"].append(ok)
                hits[f"depth {s['depth']}%"].append(ok)
                hits[s["kind"]].append(ok)
                hits[f"length {s['length']}"].append(ok)
        return {"score": ec.mean(hits.pop("all")),
                **{name: ec.mean(v) for name, v in sorted(hits.items())}}

    task = ec.Task(name="needle", groups=groups, score=score,
                   spans=lambda g, i: [("needle", meta[g][i]["needle"])])
    return task, meta


def run(model: str = DEFAULT_MODEL, split: str = "report", num_samples: int = 1, lengths=DEFAULT_LENGTHS,
        depths=DEFAULT_DEPTHS, budgets=None, block_size: int = 32, window: int = 16, device: str = "cpu",
        configurations: list[str] | None = None, settings: dict | None = None, json_path: str | None = None,
        progress: ec.Progress | None = None, trace: str | None = None) -> dict:
    ec.check_count("num_samples", num_samples)
    lengths, depths = list(lengths), list(depths)
    return ec.run_task(model, lambda tokenizer: build(tokenizer, split, num_samples, lengths, depths)[0],
                       {"split": split, "num_samples": num_samples, "lengths": lengths, "depths": depths},
                       budgets, block_size, window, device, configurations, settings, json_path, progress, trace)
