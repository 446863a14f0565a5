"""The OpenAI wire format, on its own: request bodies -> prompts and SamplingParams, engine outputs ->
response and stream-chunk bodies, and the error shape. No HTTP here (see server.py)."""

from __future__ import annotations

import re
import time

from zipage.engine.config import SamplingParams
from zipage.engine.core.outputs import PromptTooLong, RequestOutput


class ApiError(Exception):
    """A request the server refuses, reported in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


# OpenAI's error code for a prompt that leaves no room to answer; clients test for it.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def from_value_error(e: ValueError) -> ApiError:
    """The engine's ValueErrors read "field=value: why"; the field becomes the error's param."""
    if isinstance(e, PromptTooLong):
        return bad_request(str(e), code=CONTEXT_LENGTH_EXCEEDED)
    field = re.match(r"([a-z_]+)=", str(e))
    return bad_request(str(e), field.group(1) if field else None)


# Fields the engine has no use for: refused unless they carry their neutral value, so that a client never
# silently gets something other than what it asked for.
NEUTRAL_VALUES = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logprobs": (False, 0),
                  "top_logprobs": (0,), "echo": (False,), "best_of": (1,), "logit_bias": ({},), "tools": ([],),
                  "suffix": ("",), "functions": ([],), "response_format": ({"type": "text"},)}

# Roles a chat template knows; "developer" is OpenAI's newer name for "system". Tool messages need tools,
# which are not supported.
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# Sampling fields taken as they come; SamplingParams validates them. kv_budget is the request's own KV
# budget in blocks; one the engine cannot hold (past its pool, or with compression off) is refused when the
# engine takes the request, and that ValueError is a 400 too (docs/design-notes.md, "Budgets").
PASSED_THROUGH = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "kv_budget")


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(400, f"model {model!r} is not served here; this server serves {served!r}", "model",
                       "model_not_found")


def sampling_params(body: dict, max_model_len: int) -> SamplingParams:
    """SamplingParams from a chat or completions body; a bad or unsupported value raises ApiError (400)."""
    n = body.get("n")
    if n is not None and n != 1:
        raise bad_request(f"n={n!r}: only n=1 is supported", "n")
    for name, neutral in NEUTRAL_VALUES.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(v) and value == v for v in neutral):
            raise bad_request(f"{name}={value!r}: not supported by this server", name)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise bad_request(f"stop={stop!r}: must be a string or a list of strings", "stop")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request(f"ignore_eos={ignore_eos!r}: must be true or false", "ignore_eos")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    # Without a limit a request may run to the end of the context, as with vLLM.
    fields = {name: body[name] for name in PASSED_THROUGH if body.get(name) is not None}
    try:
        return SamplingParams(**fields, max_tokens=max_model_len if max_tokens is None else max_tokens, stop=stop,
                              ignore_eos=ignore_eos)
    except ValueError as e:
        raise from_value_error(e) from None


def chat_messages(body: dict) -> list[dict]:
    """Messages with plain-text content; content given as a list of text parts is joined."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role", "messages")
        if m["role"] not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role={m['role']!r}: must be one of {', '.join(CHAT_ROLES)}",
                              "messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
        plain.append({"role": CHAT_ROLES[m["role"]], "content": content})
    return plain


def completion_prompt(body: dict) -> str | list[int]:
    """One prompt: a string or a list of token ids (also either of them wrapped in a one-item list)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise bad_request("prompt must be a string or a list of token ids (one prompt per request)", "prompt")


def stream_options(body: dict) -> bool:
    """Whether the client asked for a final usage chunk."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    return bool(options.get("include_usage"))


# -- responses ---------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Reply:
    """Builds the bodies of one answer: `chat` for /v1/chat/completions, else /v1/completions."""

    def __init__(self, chat: bool, request_id: int, model: str, prompt_tokens: int, token_ids: bool = False):
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.token_ids = token_ids  # also return token ids (as vLLM's return_token_ids does)

    def _envelope(self, choices: list, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def full(self, out: RequestOutput) -> dict:
        choice = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        if self.token_ids:
            choice["token_ids"] = list(out.token_ids)
        body = self._envelope([choice], chunk=False)
        body["usage"] = usage(self.prompt_tokens, len(out.token_ids))
        if self.token_ids:
            body["prompt_token_ids"] = list(out.prompt_token_ids)
        return body

    def chunk(self, text: str, finish_reason: str | None = None, new_token_ids: list[int] | None = None,
              role: bool = False) -> dict:
        choice: dict = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": text} if role
                               else {"content": text} if text or finish_reason is None else {})
        else:
            choice["text"] = text
        if self.token_ids and new_token_ids is not None:
            choice["token_ids"] = new_token_ids
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, completion_tokens: int) -> dict:
        body = self._envelope([], chunk=True)
        body["usage"] = usage(self.prompt_tokens, completion_tokens)
        return body
