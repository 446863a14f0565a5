"""Where the probability view's data comes from: the TokenLogprobs the engine sent beside each answer
token of the requests this console submitted (kept_source.TokenBook collects them with the ids), and
the text of any token id: the local tokenizer's, or for an attached server the texts its logprobs gave
(`RemoteEngine.token_texts`).

Asking costs a request one reduction per answer token where its logits are (log_softmax, its rank, the
top k) and one small copy with the token ids; requests that do not ask pay nothing
(docs/design-notes.md, "Log-probabilities").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from zipage.engine.config import SamplingParams
from zipage.engine.logprobs import TokenLogprobs
from zipage.cli.console.kept_source import TokenBook
from zipage.cli.token_texts import token_pieces

TOP_LOGPROBS = 5  # alternatives the console asks for at each answer token


def with_logprobs(params: SamplingParams) -> SamplingParams:
    """The same request, asking for its answer's logprobs (unless it already asks for some)."""
    return params if params.logprobs is not None else dataclasses.replace(params, logprobs=TOP_LOGPROBS)


@dataclass(frozen=True)
class Scored:
    """What the probability view draws: one answer's tokens, each with its text and TokenLogprobs."""

    request: int
    pieces: list[str | None]  # each token's text (None where unknown here)
    entries: list[TokenLogprobs]
    text_of: Callable[[int], str | None]  # any token id's own text, for the alternatives
    done: bool  # the answer has ended: nothing more will come


class TokenTexts:
    """Each token id's text on its own (special tokens spelled out), remembered: from the door's tokenizer,
    or the texts an attached server's logprobs gave. None where neither knows it."""

    def __init__(self, door):
        self.tokenizer = getattr(door, "tokenizer", None)
        learned = getattr(door, "token_texts", None)  # the door's own dict: it grows as answers come
        self.learned: dict[int, str] = learned if learned is not None else {}
        self.known: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return self.learned.get(token_id) or None
        if token_id not in self.known:  # an id past the tokenizer's vocabulary decodes to nothing
            self.known[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False) or None
        return self.known[token_id]


class AnswerScores:
    """Reads one request's answer and logprobs from the book, as often as the view redraws: the token
    texts are worked out again only when the answer has grown."""

    def __init__(self, door, book: TokenBook, request: int):
        self.door, self.book, self.request = door, book, request
        self.text_of = TokenTexts(door)
        self._pieces: list[str | None] = []

    def __call__(self) -> Scored | str:
        """The answer so far, or a sentence saying why there is nothing to draw."""
        track = self.book.tracks.get(self.request)
        if track is None:
            return f"#{self.request} was not sent from this console: its log-probabilities are not known here"
        if track.logprobs is None:
            return f"#{self.request} did not ask for log-probabilities"
        output = getattr(track.handle, "output", None)
        entries = list(track.logprobs) or list(getattr(output, "logprobs", None) or [])  # a door without the hook
        ids = list(track.answer) or list(getattr(output, "token_ids", None) or [])
        count = min(len(entries), len(ids))
        if len(self._pieces) != count:
            self._pieces = self.pieces(ids[:count])
        return Scored(self.request, self._pieces, entries[:count], self.text_of, output is not None)

    def pieces(self, ids: list[int]) -> list[str | None]:
        """Each token's text in the answer: decoded in context here, else each token's own text."""
        tokenizer = getattr(self.door, "tokenizer", None)
        if tokenizer is not None:
            return list(token_pieces(tokenizer, ids))
        return [self.text_of(t) for t in ids]
