"""The plain-text table `zipage generate --logprobs K` prints after the answer: each generated token,
its log-probability under the model's raw distribution, its rank there and the K most likely tokens at
its place (docs/design-notes.md, "Log-probabilities"). Tokens are quoted as JSON strings, so spaces and
newlines show."""

from __future__ import annotations

import json

HEADER = ("#", "token", "logprob", "rank", "most likely")


def logprob_table(tokenizer, logprobs: list) -> str:
    """One line per TokenLogprobs (zipage.engine.logprobs), under a header, columns aligned."""

    def text(token_id: int) -> str:
        return json.dumps(tokenizer.decode([token_id], skip_special_tokens=False), ensure_ascii=False)

    rows = [HEADER]
    for i, entry in enumerate(logprobs):
        alternatives = "  ".join(f"{text(t)} {logprob:.4f}" for t, logprob in entry.top.items())
        rows.append((str(i), text(entry.token_id), f"{entry.logprob:.4f}", str(entry.rank), alternatives))
    widths = [max(len(row[column]) for row in rows) for column in range(len(HEADER) - 1)]

    def line(row: tuple) -> str:
        number, token, logprob, rank, alternatives = row
        cells = (number.rjust(widths[0]), token.ljust(widths[1]), logprob.rjust(widths[2]), rank.rjust(widths[3]),
                 alternatives)
        return "  ".join(cells).rstrip()

    return "\n".join(line(row) for row in rows) + "\n"
