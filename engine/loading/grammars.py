"""Structured output: a request's JSON schema -> a grammar over this tokenizer's tokens, and its state
as the request's output grows (docs/design-notes.md, "Structured output").

The grammar library is llguidance: no dependencies of its own, one wheel for every Python, grammars
compiled in about a millisecond and a token mask in tens of microseconds on the host. The tokenizer it
needs (every token's bytes) is built on the first request that asks, so an engine where none asks pays
nothing.
"""

from __future__ import annotations

import json
import threading

import torch

# How a schema's JSON is spaced unless the schema says otherwise (its own "x-guidance"): the way
# json.dumps writes it. Free whitespace would let a small model emit blank lines without end.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

ANY_OBJECT = {"type": "object"}  # json_schema=True: OpenAI's json_object, any JSON object


def schema_of(json_schema) -> dict:
    """The schema a SamplingParams.json_schema stands for (True: any object; a string: its JSON);
    ValueError naming the field when it is none."""
    if json_schema is True:
        return dict(ANY_OBJECT)
    if isinstance(json_schema, str):
        try:
            json_schema = json.loads(json_schema)
        except ValueError as e:
            raise ValueError(f"json_schema={_short(json_schema)}: not valid JSON: {e}") from None
    if not isinstance(json_schema, dict):
        raise ValueError(f"json_schema={_short(json_schema)}: must be True (any JSON object), a JSON schema "
                         "object, or its JSON text")
    return json_schema


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


class OutputGrammar:
    """One request's grammar: which tokens may come next, fed each token the request outputs."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.consumed = 0  # output tokens fed so far: a mask is only right for all of them

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 host bitmask (bit t: token t)."""
        view = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())

    def accept(self, token: int) -> str | None:
        """Feed the token the request output; why the grammar refuses it, or None."""
        self.consumed += 1
        if self.matcher.consume_token(token):
            return None
        return f"the output left its JSON schema at token {token}: {self.matcher.get_error() or 'refused'}"

    @property
    def done(self) -> bool:
        """The output is complete: nothing but its end may follow (or it has ended)."""
        return self.matcher.is_stopped()


class Grammars:
    """Compiles requests' schemas for one tokenizer. Thread-safe: front doors check requests on their
    own threads while the engine runs."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._lltokenizer = None

    def compile(self, json_schema) -> OutputGrammar:
        """The grammar of a SamplingParams.json_schema, ready for the request's first token; ValueError
        (naming json_schema and what the library said) for a schema it cannot compile."""
        import llguidance

        schema = schema_of(json_schema)
        schema = {**schema, "x-guidance": {**COMPACT_JSON, **schema.get("x-guidance", {})}}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        except (ValueError, TypeError) as e:  # not JSON-serialisable, or refused outright
            raise ValueError(f"json_schema={_short(json_schema)}: {e}") from None
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar)
        if matcher.is_error():
            raise ValueError(f"json_schema={_short(json_schema)}: the schema cannot be compiled: "
                             f"{matcher.get_error()}")
        return OutputGrammar(matcher)

    def _tokenizer(self):
        with self._lock:
            if self._lltokenizer is None:
                import llguidance.hf

                self._lltokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                                 eos_token=self.eos_token_ids)
            return self._lltokenizer
