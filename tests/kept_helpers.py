"""Kept maps built by hand for the kept view, the teaching notes and the trace pictures: varied the way
real ones are (sinks, a recent window, a prompt kept whole and scored entries that differ per layer
and head), with shares known in advance."""

from __future__ import annotations

from zipage.engine.kv.kept import KeptMap

PROMPT = ("The special magic number for lemon is 48213. Gulls circled above the roofs. "
          "What is the magic number for lemon?")
ANSWER = " The magic number for lemon is 48213. It was written on the wall."


def word_pieces(text: str) -> list[str]:
    """Tokens as words with their leading space: "The", " special", " magic", ..."""
    pieces, word = [], ""
    for ch in text:
        if ch == " " and word:
            pieces.append(word)
            word = ""
        word += ch
    return pieces + ([word] if word else [])


PIECES = word_pieces(PROMPT) + word_pieces(ANSWER)
PROMPT_TOKENS = len(word_pieces(PROMPT))
GONE = {PROMPT_TOKENS + 1, PROMPT_TOKENS + 2}  # the answer's " magic number": held nowhere in varied_map


def head_map(num_positions: int, held: dict[int, str], scores: dict[int, float] | None = None):
    """One head's (positions, reasons, scores) from {position: reason}."""
    positions = sorted(p for p in held if p < num_positions)
    return (positions, [held[p] for p in positions],
            [(scores or {}).get(p, 0.5) if held[p] == "score" else None for p in positions])


def varied_map(num_positions: int = len(PIECES), layers: int = 6, heads: int = 2, compressions: int = 2,
               prompt_whole_layers: int = 2, recent: int = 6) -> KeptMap:
    """Every layer keeps two sinks and a recent window. Layers 0..prompt_whole_layers-1 keep the prompt
    whole; the middle layers keep scored tokens that differ per layer and head; the last layer keeps
    only " 48213." (position 7) by score, in its first head. The answer's " magic number" (GONE) is
    held nowhere."""
    pos, why, score = [], [], []
    window = range(num_positions - recent, num_positions)
    for layer in range(layers):
        lp, lw, ls = [], [], []
        for head in range(heads):
            held: dict[int, str] = {0: "sink", 1: "sink"}
            if layer < prompt_whole_layers:
                held.update({p: "prompt" for p in range(2, PROMPT_TOKENS)})
            elif layer < layers - 1:
                picks = {7} if head == 0 else set()
                picks |= {p for p in range(2, num_positions - recent) if (p + layer + head) % 4 == 0} - GONE
                held.update({p: "score" for p in picks})
            elif head == 0:
                held[7] = "score"
            held.update({p: "recent" for p in window})
            p_, w_, s_ = head_map(num_positions, held, {p: round(0.1 + 0.01 * p + 0.1 * layer, 3) for p in held})
            lp.append(p_)
            lw.append(w_)
            ls.append(s_)
        pos.append(lp)
        why.append(lw)
        score.append(ls)
    return KeptMap(request_id=1, num_positions=num_positions, compressions=compressions, positions=pos,
                   reasons=why, scores=score)


def dropping_map(num_positions: int, drops: dict[tuple[int, int], set[int]], layers: int = 6, heads: int = 2,
                 compressions: int = 1) -> KeptMap:
    """Every (layer, head) holds every position except those `drops[(layer, head)]` names."""
    pos, why, score = [], [], []
    for layer in range(layers):
        heads_ = [head_map(num_positions, {p: "score" for p in range(num_positions)
                                           if p not in drops.get((layer, head), set())}) for head in range(heads)]
        pos.append([h[0] for h in heads_])
        why.append([h[1] for h in heads_])
        score.append([h[2] for h in heads_])
    return KeptMap(1, num_positions, compressions, pos, why, score)


def everything_map(num_positions: int, layers: int = 6, heads: int = 2) -> KeptMap:
    """A request never compressed: every head holds every position ("recent")."""
    head = head_map(num_positions, {p: "recent" for p in range(num_positions)})
    return KeptMap(1, num_positions, 0, [[head[0]] * heads for _ in range(layers)],
                   [[head[1]] * heads for _ in range(layers)], [[head[2]] * heads for _ in range(layers)])
