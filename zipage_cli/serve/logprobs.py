"""OpenAI's `logprobs` of a choice, whole or streamed, from the engine's TokenLogprobs (zipage.engine.logprobs)
and each token's own text (docs/serving.md, "Log-probabilities"). What a body may ask is checked in
openai_protocol.py."""

from __future__ import annotations

from zipage.engine.logprobs import TokenLogprobs


class TokenTexts:
    """Each token's own text, the tokenizer's decoding of that token alone (special tokens spelled out),
    remembered: at most one string per token of the vocabulary."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.known: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.known.get(token_id)
        if text is None:
            text = self.known[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def chat_logprobs(entries: list[TokenLogprobs], texts: TokenTexts) -> dict:
    """A chat choice's `logprobs` for these tokens: `content`, one entry per token with its k most likely."""
    return {"content": [dict(_chat_entry(entry.token_id, entry.logprob, texts),
                             top_logprobs=[_chat_entry(t, lp, texts) for t, lp in entry.top.items()])
                        for entry in entries]}


def _chat_entry(token_id: int, logprob: float, texts: TokenTexts) -> dict:
    text = texts(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class CompletionLogprobs:
    """A completions choice's `logprobs`, in the parts it streams in: `text_offset` counts on over the
    choice's whole text (the echoed prompt's tokens included)."""

    def __init__(self, texts: TokenTexts):
        self.texts = texts
        self.offset = 0

    def part(self, token_ids: list[int], entries: list[TokenLogprobs | None]) -> dict:
        """These tokens' lists. An entry of None (the first prompt token: nothing predicts it) gives null
        logprobs; each top_logprobs dict holds the k most likely tokens and the token itself, as OpenAI's."""
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, entries):
            text = self.texts(token_id)
            part["tokens"].append(text)
            part["text_offset"].append(self.offset)
            self.offset += len(text)
            part["token_logprobs"].append(None if entry is None else entry.logprob)
            top = None
            if entry is not None:
                top = {self.texts(t): lp for t, lp in entry.top.items()}
                top.setdefault(text, entry.logprob)
            part["top_logprobs"].append(top)
        return part


def texts_by_id(entries: list[TokenLogprobs], logprobs: dict | None) -> dict[int, str]:
    """The other way, for a client (`zipage chat --attach`): each token id's text, from a choice's OpenAI
    `logprobs` and the `logprobs_by_id` entries of the same tokens. A chat item lists its alternatives in
    the engine's order; completions key them by text, which can collide, so only its tokens' own count."""
    texts: dict[int, str] = {}
    if not logprobs:
        return texts
    if "content" in logprobs:
        for entry, item in zip(entries, logprobs["content"] or []):
            texts[entry.token_id] = item["token"]
            texts.update((t, alt["token"]) for t, alt in zip(entry.top, item.get("top_logprobs") or []))
    else:
        texts.update((entry.token_id, token) for entry, token in zip(entries, logprobs.get("tokens") or []))
    return texts


def joined(first: dict | None, second: dict | None) -> dict | None:
    """Two completions parts as one (the echoed prompt's, then the answer's)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


class LogprobReply:
    """What logprobs and echo add to each choice of one call: the echoed prompt's text, to put before the
    answer's, and the choice's `logprobs`, for a whole answer (`full`) or chunk by chunk (`streamed`)."""

    def __init__(self, chat: bool, texts: TokenTexts, logprobs: bool, echo: list[str] | None = None,
                 prompt_ids: list[list[int]] | None = None):
        self.chat, self.texts, self.logprobs = chat, texts, logprobs
        self.echo = echo  # completions with echo: each prompt's text, in prompt order
        self.prompt_ids = prompt_ids or []  # each prompt's token ids (what a stream echoes)
        self.parts: dict[int, CompletionLogprobs] = {}  # a streamed completions choice's offsets so far

    def full(self, index: int, out) -> tuple[str, dict | None]:
        if self.chat:
            return "", chat_logprobs(out.logprobs, self.texts) if self.logprobs else None
        part = CompletionLogprobs(self.texts)
        return self._completion(index, part, out.prompt_token_ids, out.prompt_logprobs, out.token_ids, out.logprobs)

    def streamed(self, index: int, out) -> tuple[str, dict | None]:
        """For each output of a stream in turn: what its chunk carries (the echo with the first)."""
        if self.chat:
            return "", chat_logprobs(out.new_logprobs, self.texts) if self.logprobs and out.new_logprobs else None
        first = index not in self.parts
        part = self.parts.setdefault(index, CompletionLogprobs(self.texts))
        prompt_ids = self.prompt_ids[index] if first else None
        echo, logprobs = self._completion(index, part, prompt_ids, out.prompt_logprobs, out.new_token_ids,
                                          out.new_logprobs)
        return (echo if first else ""), (logprobs if logprobs and logprobs["tokens"] else None)

    def _completion(self, index, part, prompt_ids, prompt_logprobs, ids, logprobs) -> tuple[str, dict | None]:
        echo = self.echo[index] if self.echo is not None else ""
        if not self.logprobs:
            return echo, None
        prompt = part.part(prompt_ids, prompt_logprobs) if self.echo is not None and prompt_ids else None
        return echo, joined(prompt, part.part(ids, logprobs))
