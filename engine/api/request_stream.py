"""One request's outputs, rebuilt where the text is made: from the token ids an engine process sends.

Ids gather until the reader takes them, then become one RequestOutput: one detokenizing call, one
chunk to send, however many tokens a reader that lagged behind finds waiting.
"""

from __future__ import annotations

from zipage.engine.config import SamplingParams
from zipage.engine.core.outputs import RequestOutput
from zipage.engine.loading.detokenizer import IncrementalDetokenizer


class RequestStream:
    """`add` and `end` as the engine reports; `take` what arrived since the last take. Text is
    detokenized here, except for requests with stop strings, which the engine has to match itself:
    their deltas come with their ids."""

    def __init__(self, request_id: int, session: str | None, tokenizer, params: SamplingParams):
        self.id, self.session = request_id, session
        self.detok = None if params.stop else IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.ids: list[int] = []  # every output id so far
        self.logprobs: list | None = [] if params.logprobs is not None else None  # one per id, where asked
        self.prompt_logprobs: list | None = None  # until the first output takes them
        self.taken = 0  # of which the reader has had these
        self.engine_text: list[str] = []  # deltas from the engine, not yet taken
        self.final: RequestOutput | None = None
        self.text = ""
        self.finished = False  # the final output was taken: nothing follows it

    def add(self, new_ids: list[int], delta: str | None) -> None:
        self.ids += new_ids
        if delta:
            self.engine_text.append(delta)

    def add_logprobs(self, new: list, prompt: list | None) -> None:
        """The logprobs of the ids `add` just gave, and the prompt's with the first of them."""
        if self.logprobs is not None:
            self.logprobs += new
        if prompt is not None:
            self.prompt_logprobs = prompt

    def end(self, out: RequestOutput) -> None:
        """The engine's final output (every output id in it)."""
        if self.final is None:
            self.final = out

    def fail(self, error: str) -> None:
        """The request cannot go on (its engine is gone): it ends with an error after what arrived."""
        if self.final is None:
            self.final = RequestOutput(self.id, self.session, [], list(self.ids), "", "", True, "error", error,
                                       num_output_tokens=len(self.ids))

    def take(self) -> RequestOutput | None:
        """Everything new as one output (the final one once the request ended); None if nothing is new."""
        final = self.final
        if self.finished:
            return None
        ids = (final.token_ids if final is not None else self.ids)[self.taken:]
        if not ids and final is None:
            return None
        given = self.taken
        self.taken += len(ids)
        if self.detok is not None:
            delta = self.detok.add(ids) if ids else ""
            if final is not None:
                delta += self.detok.finish()
        else:
            delta = "".join(self.engine_text) + (final.delta if final is not None else "")
            self.engine_text.clear()
        self.text += delta
        if final is None:
            prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None  # the first output's alone
            return RequestOutput(self.id, self.session, [], [], self.text, delta, False, new_token_ids=list(ids),
                                 num_output_tokens=self.taken, prompt_logprobs=prompt_logprobs,
                                 new_logprobs=self.logprobs[given:self.taken] if self.logprobs is not None else None)
        final.delta, final.new_token_ids, final.text = delta, list(ids), self.text
        if final.logprobs is not None:
            final.new_logprobs = final.logprobs[given:self.taken]
        self.finished = True
        return final
