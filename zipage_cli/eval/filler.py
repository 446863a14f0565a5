"""Varied filler text for the long-context tasks, generated from a small grammar with a seeded
generator: every sentence differs, nothing is downloaded, and the same seed gives the same text."""

from __future__ import annotations

import random

SUBJECTS = ["The old harbour master", "A young botanist", "The village baker", "Our neighbour", "The night nurse",
            "A travelling musician", "The school librarian", "My grandmother", "The bridge engineer",
            "A retired pilot", "The museum guard", "The ferry captain", "A quiet student", "The city gardener",
            "The apprentice carpenter", "A market trader", "The lighthouse keeper", "The new teacher"]
VERBS = ["repaired", "painted", "carried", "described", "found", "sold", "measured", "photographed", "cleaned",
         "borrowed", "planted", "sketched", "returned", "counted", "wrapped", "tested", "moved", "polished"]
OBJECTS = ["a blue lantern", "the wooden gate", "an old map of the coast", "three baskets of pears",
           "a broken violin", "the winter coats", "a jar of honey", "the copper kettle", "a box of letters",
           "the garden bench", "a pair of boots", "the iron railings", "a stack of books", "the fishing nets",
           "a clay teapot", "the striped umbrella", "a bundle of firewood", "the kitchen clock"]
PLACES = ["near the market", "by the river", "behind the station", "in the square", "at the end of the pier",
          "under the bridge", "beside the chapel", "in the back room", "on the hill", "outside the bakery",
          "along the canal", "in the library", "at the harbour", "by the orchard wall"]
TIMES = ["on Tuesday", "before dawn", "after the storm", "in early spring", "late in the evening",
         "during the festival", "at noon", "last winter", "on a rainy morning", "before the ferry left",
         "after lunch", "on the first day of autumn"]
CLAUSES = ["while the bells rang", "because the weather had turned", "although nobody had asked",
           "as the tide came in", "so that the children could watch", "before anyone else arrived",
           "when the shops were closing", "and then went home", "and told nobody about it",
           "with great care", "without saying a word", "just as the lamps were lit"]
REMARKS = ["The air smelled of salt and rain.", "Gulls circled above the roofs.", "It was quieter than usual.",
           "A dog barked somewhere down the lane.", "The clouds drifted slowly east.",
           "Someone was whistling an old tune.", "The streets were still wet.", "A cart rattled over the stones.",
           "The windows glowed orange.", "Nobody seemed to be in a hurry.", "The wind picked up a little.",
           "Far away, a train sounded its horn."]


def sentence(rng: random.Random) -> str:
    if rng.random() < 0.2:
        return rng.choice(REMARKS)
    parts = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(PLACES), rng.choice(TIMES)]
    if rng.random() < 0.5:
        parts.append(rng.choice(CLAUSES))
    return " ".join(parts) + "."


def filler_sentences(rng: random.Random, count: int) -> list[str]:
    return [sentence(rng) for _ in range(count)]


def filler_tokens(tokenizer, rng: random.Random, num_tokens: int) -> list[str]:
    """Sentences whose token count, joined by spaces, just reaches num_tokens."""
    out, total = [], 0
    while total < num_tokens:
        s = sentence(rng)
        out.append(s)
        total += len(tokenizer.encode(" " + s, add_special_tokens=False))
    return out
