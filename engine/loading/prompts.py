"""Reading prompts: text, UTF-8 bytes, token ids or chat messages -> checked token ids.

Needs only the tokenizer and the vocabulary size, so a server process can read prompts without the
model; whether a prompt fits the context and the KV pool is the engine's to say (EngineCore.check_prompt).
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from functools import cached_property

import torch
from jinja2 import TemplateError

from zipage.engine.loading.loader import ModelSource

# Unicode normalizers (NFC, NFKC) shrink text by composing at most four code points into one; twice that
# keeps the bound below safe for any tokenizer that keeps every character (byte-level BPE, SentencePiece
# with byte fallback: every supported family).
NORMALIZER_SHRINK_BOUND = 8


@dataclass(frozen=True)
class Chat:
    """Chat messages and how the chat template renders them. `add_generation_prompt`: end with the
    header of a new assistant turn; `continue_final_message`: end inside the final message instead, so
    the model continues it (the two exclude each other). `template_kwargs`: extra template variables,
    such as Qwen3's `enable_thinking`. `tools`: function descriptions (OpenAI's shape) for a template
    that shows them (`PromptReader.template_takes_tools`)."""

    messages: list[dict]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict = field(default_factory=dict)
    tools: list[dict] | None = None


class PromptReader:
    def __init__(self, source: ModelSource):
        self.name = source.name
        self.tokenizer = source.tokenizer
        self.vocab_size = source.hf_config.vocab_size

    def read(self, prompt) -> list[int]:
        """Any prompt form: a Chat or a non-empty list of message dicts is a chat, anything else `encode`."""
        return self.encode(self.render(prompt))

    def render(self, prompt):
        """The prompt as the tokenizer will see it: a chat through its template, anything else as given."""
        if isinstance(prompt, Chat):
            return self.chat_text(prompt.messages, add_generation_prompt=prompt.add_generation_prompt,
                                  continue_final_message=prompt.continue_final_message,
                                  template_kwargs=prompt.template_kwargs, tools=prompt.tools)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.chat_text(prompt)
        return prompt

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

    def chat(self, messages: list[dict], **options) -> list[int]:
        """Token ids of chat messages through the model's chat template, ready for the reply (the
        options are `chat_text`'s)."""
        return self.encode(self.chat_text(messages, **options))

    def chat_text(self, messages: list[dict], *, add_generation_prompt: bool = True,
                  continue_final_message: bool = False, template_kwargs: dict | None = None,
                  tools: list[dict] | None = None) -> str:
        """Chat messages through the model's chat template, as text (see Chat for the options)."""
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            # Templates concatenate strings: anything else fails deep inside Jinja.
            if not isinstance(m["role"], str) or not isinstance(m["content"], str):
                raise ValueError(f"messages[{i}]: role and content must be strings, got "
                                 f"{type(m['role']).__name__} and {type(m['content']).__name__}")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt=True: a continued final message takes no generation prompt; "
                             "set add_generation_prompt to false with continue_final_message")
        template_kwargs = dict(template_kwargs or {})
        self.check_template_kwargs(template_kwargs)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.name!r} has no chat template")
        if tools and not self.template_takes_tools:
            raise ValueError(f"tools: the chat template of {self.name!r} does not take tools")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      tools=tools or None, **template_kwargs)
        # The template refused the messages (roles out of order), a template variable had a type it could
        # not use, or the final message to continue is not in the rendered text.
        except (TemplateError, TypeError, ValueError) as e:
            raise ValueError(f"the chat template of {self.name!r} refused these messages: {e}") from None

    def check_template_kwargs(self, template_kwargs: dict) -> None:
        """ValueError for a variable that would override one of apply_chat_template's own arguments (such
        as `tokenize` or `chat_template`) rather than reach the template."""
        taken = sorted(set(template_kwargs) & self.reserved_template_names)
        if taken:
            raise ValueError(f"chat_template_kwargs={taken}: these names are not template variables")

    @cached_property
    def template_takes_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (a template of its own for tools counts)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):
            return "tool_use" in template or any(map(_reads_tools, template.values()))
        return bool(template) and _reads_tools(template)

    @cached_property
    def reserved_template_names(self) -> frozenset[str]:
        parameters = inspect.signature(self.tokenizer.apply_chat_template).parameters.values()
        return frozenset({"messages"} | {p.name for p in parameters if p.kind is not p.VAR_KEYWORD})

    @cached_property
    def max_chars_per_token(self) -> int:
        """At least as many characters as any one token can stand for: a token covers at most its
        vocabulary entry's bytes (a byte-level entry spells one character per byte, a SentencePiece entry
        its characters, a byte-fallback entry such as "<0x41>" more than its one byte), a character is
        at least one byte, and normalizing can shrink text by at most NORMALIZER_SHRINK_BOUND."""
        return max(map(len, self.tokenizer.get_vocab()), default=1) * NORMALIZER_SHRINK_BOUND


def _reads_tools(template: str) -> bool:
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        return "tools" in meta.find_undeclared_variables(Environment(extensions=["jinja2.ext.loopcontrols"])
                                                         .parse(template))
    except TemplateSyntaxError:  # a tag of transformers' own ({% generation %}): read the text instead
        return "tools" in template


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
