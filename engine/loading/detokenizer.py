"""Streaming text from token ids: incremental decoding and stop strings."""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    A token may end in the middle of a UTF-8 character; such text is held back until the
    character completes. Text that could still become a stop string is held back too, so a
    stop string is never streamed before it is cut.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        # Only a short tail is re-decoded per token: window[prefix:read] is text already taken.
        self.window: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        # Ids that decode to nothing (special tokens when skipped, ids past the tokenizer's vocabulary)
        # stay out of the window: else, while a character waits for its last bytes, each of them would
        # make every later token re-decode the whole run (random-weight models sample little else).
        self.silent = set(tokenizer.all_special_ids) if skip_special_tokens else set()
        self.vocab_len = len(tokenizer)
        self.text = ""  # decoded so far (complete characters only)
        self.emitted = 0  # characters of self.text already streamed
        self.stopped_at: int | None = None
        # The Rust tokenizer directly, when transformers' decode would only wrap it (no clean-up of
        # spaces): the wrapper costs more than the decoding, twice per token of every stream.
        backend = getattr(tokenizer, "_tokenizer", None)
        plain = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._backend_decode = backend.decode if backend is not None and plain else None

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Add new output ids; return the text now safe to stream."""
        self.token_ids.extend(token_ids)
        self.window.extend(t for t in token_ids if t < self.vocab_len and t not in self.silent)
        prefix_text = self._decode(self.window[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.window[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self.text += new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.window)
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s)))
            if at >= 0 and (self.stopped_at is None or at < self.stopped_at):
                self.stopped_at = at
        if self.stopped_at is not None:
            return self._emit_until(self.stopped_at)
        return self._emit_until(len(self.text) - self.holdback)

    def finish(self, include_stop: bool = False) -> str:
        """The final delta once the request ends (incomplete trailing bytes included). Stop strings
        are looked for again in the whole text: one whose last character came in the same tokens as
        a broken one (bytes no character completes) was still held back when the request ended."""
        self.text = self._decode(self.token_ids)
        for s in self.stop:
            at = self.text.find(s)
            if at >= 0 and (self.stopped_at is None or at < self.stopped_at):
                self.stopped_at = at
        if self.stopped_at is not None:
            end = self.stopped_at
            if include_stop:
                end += len(next(s for s in self.stop if self.text.startswith(s, self.stopped_at)))
            self.text = self.text[:end]
        return self._emit_until(len(self.text))

    def _emit_until(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    @property
    def final_text(self) -> str:
        return self.text
