"""Recall after decode-time compression: eviction during a long output.

The user gives a fact ("the access code for the KEY vault is VALUE") and asks for a long story. The
story (varied filler text) is fed to every configuration token by token (teacher forcing, so all see
the same text) while the request's KV fills its budget and is compressed again and again. Then the
conversation asks for the code, the assistant's answer starts with "The access code for the KEY vault
is", and greedy decoding must produce exactly VALUE.

Run: `zipage eval recall`.
"""

from __future__ import annotations

from zipage.cli.eval import common as ec
from zipage.cli.eval.filler import filler_tokens
from zipage.cli.eval.needle import exact_match
from zipage.engine.config import DEFAULT_MODEL

KEYS = ["north", "river", "garden", "silver", "harbor", "tower", "forest", "crystal", "desert", "island",
        "copper", "winter", "summit", "valley", "canyon", "meadow"]
DEFAULT_TOKENS = 384


def next_turn(tokenizer, text: str) -> list[int]:
    """The tokens that close the assistant's turn, ask `text` as the user and open the next answer,
    taken from the model's own chat template."""
    mark = "\u2063"  # an invisible separator that no template produces by itself
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": mark}, {"role": "user", "content": text}],
        tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(rendered.split(mark, 1)[1], add_special_tokens=False)


def make_sample(tokenizer, rng, tokens: int) -> dict:
    key, value = rng.choice(KEYS), str(rng.randrange(10000, 100000))
    fact = f"the access code for the {key} vault is {value}"
    user = f"Remember this: {fact}. Now write a long story about a town by the sea."
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                            add_generation_prompt=True), add_special_tokens=False)
    story = tokenizer.encode(" ".join(filler_tokens(tokenizer, rng, tokens)), add_special_tokens=False)[:tokens]
    question = next_turn(tokenizer, f"What is the access code for the {key} vault?")
    question += tokenizer.encode(f"The access code for the {key} vault is", add_special_tokens=False)
    answer = tokenizer.encode(" " + value, add_special_tokens=False)
    return {"prompt": prompt, "forced": story + question, "value": value, "free_tokens": len(answer) + 1,
            "fact": fact}


def build(tokenizer, split: str, num_samples: int, tokens: int) -> ec.Task:
    ec.check_count("tokens", tokens, 16)
    samples = [make_sample(tokenizer, ec.sample_rng("recall", split, i), tokens) for i in range(num_samples)]
    requests = [ec.Request(prompt=s["prompt"], forced=s["forced"], free_tokens=s["free_tokens"]) for s in samples]

    def score(outputs, observed, reference) -> dict:
        hits = [exact_match(tokenizer.decode(out[len(s["forced"]):]), s["value"])
                for s, out in zip(samples, outputs[0])]
        return {"score": ec.mean(hits)}

    return ec.Task(name="recall", groups=[requests], score=score, spans=lambda g, i: [("fact", samples[i]["fact"])])


def run(model: str = DEFAULT_MODEL, split: str = "report", num_samples: int = 8, tokens: int = DEFAULT_TOKENS,
        budgets=None, block_size: int = 32, window: int = 16, device: str = "cpu",
        configurations: list[str] | None = None, settings: dict | None = None, json_path: str | None = None,
        progress: ec.Progress | None = None, trace: str | None = None) -> dict:
    ec.check_count("num_samples", num_samples)
    return ec.run_task(model, lambda tokenizer: build(tokenizer, split, num_samples, tokens),
                       {"split": split, "num_samples": num_samples, "tokens": tokens},
                       budgets, block_size, window, device, configurations, settings, json_path, progress, trace)
