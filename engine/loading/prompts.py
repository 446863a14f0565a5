"""Reading prompts: text, UTF-8 bytes, token ids or chat messages -> checked token ids.

Needs only the tokenizer and the vocabulary size, so a server process can read prompts without the
model; whether a prompt fits the context and the KV pool is the engine's to say (EngineCore.check_prompt).
"""

from __future__ import annotations

import operator

import torch
from jinja2 import TemplateError

from zipage.engine.loading.loader import ModelSource


class PromptReader:
    def __init__(self, source: ModelSource):
        self.name = source.name
        self.tokenizer = source.tokenizer
        self.vocab_size = source.hf_config.vocab_size

    def read(self, prompt) -> list[int]:
        """Any prompt form: a non-empty list of message dicts is a chat, anything else `encode`."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.chat(prompt)
        return self.encode(prompt)

    def encode(self, prompt) -> list[int]:
        """Token ids for a prompt given as text, UTF-8 bytes, or token ids; ValueError when unusable."""
        if isinstance(prompt, (bytes, bytearray)):
            try:
                prompt = bytes(prompt).decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"prompt is not valid UTF-8: {e}") from None
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"prompt is not valid UTF-8: {e}") from None
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, (list, tuple)) or (isinstance(prompt, torch.Tensor) and prompt.dim() == 1):
            ids = _token_ids(prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def chat(self, messages: list[dict]) -> list[int]:
        """Token ids of chat messages through the model's chat template, ready for the reply."""
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            # Templates concatenate strings: anything else fails deep inside Jinja.
            if not isinstance(m["role"], str) or not isinstance(m["content"], str):
                raise ValueError(f"messages[{i}]: role and content must be strings, got "
                                 f"{type(m['role']).__name__} and {type(m['content']).__name__}")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.name!r} has no chat template")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as e:  # the template refused the messages (say, roles out of order)
            raise ValueError(f"the chat template of {self.name!r} refused these messages: {e}") from None
        return self.encode(text)


def _token_ids(values) -> list[int]:
    """Token ids as ints; a float, a string or a bool (True would silently become id 1) is a ValueError."""
    ids = []
    for t in values:
        if isinstance(t, bool):
            raise ValueError(f"prompt token ids must be integers, got {t!r}")
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt token ids must be integers, got {t!r}") from None
    return ids
