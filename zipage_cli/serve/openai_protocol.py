"""The OpenAI wire format, on its own: request bodies -> prompts and SamplingParams, engine outputs ->
response and stream-chunk bodies, and the error shape. No HTTP here (see server.py)."""

from __future__ import annotations

import json
import math
import re
import time

from zipage.engine.config import MAX_LOGPROBS, SamplingParams
from zipage.engine.core.outputs import PromptTooLong, RequestOutput
from zipage.engine.loading.prompts import Chat
from zipage.cli.serve.logprobs import LogprobReply

MAX_MESSAGE_CHARS = 2000  # an error message quotes what it refuses; a huge value is cut short


class ApiError(Exception):
    """A request the server refuses, reported in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        message = shortened(message)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def shortened(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS} more characters)"


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
    field = re.match(r"(?:prompt\[\d+\]: )?([a-z_]+)=", str(e))  # after the index of a prompt among several
    return bad_request(str(e), field.group(1) if field else None)


# Fields the engine has no use for: refused unless they carry their neutral value, so that a client never
# silently gets something other than what it asked for.
NEUTRAL_VALUES = {"best_of": (1,), "logit_bias": ({},), "suffix": ("",), "functions": ([],),
                  "function_call": ("none",)}

# Roles a chat template knows; "developer" is OpenAI's newer name for "system". A tool message carries a
# tool's result back (tool_calls.py).
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

# Sampling fields taken as they come; SamplingParams validates them. kv_budget is the request's own KV
# budget in blocks; one the engine cannot hold (past its pool, or with compression off) is refused when the
# engine takes the request, and that ValueError is a 400 too (docs/design-notes.md, "Budgets").
PASSED_THROUGH = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                  "presence_penalty", "seed", "kv_budget")
REAL_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
               "presence_penalty")  # the rest of them are integers

# Every field a body may carry; any other is refused by name rather than ignored.
COMMON_FIELDS = frozenset({"model", "stream", "stream_options", "user", "max_tokens", "max_completion_tokens",
                           "stop", "n", "ignore_eos", "return_token_ids", "response_format", *PASSED_THROUGH,
                           *NEUTRAL_VALUES})
CHAT_FIELDS = COMMON_FIELDS | {"messages", "add_generation_prompt", "continue_final_message",
                               "chat_template_kwargs", "logprobs", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo"}

# Bounds on what one request may carry, each far past any real use: every stop string is matched against
# the whole new text at each step (and the longest is held back from streaming), every message is rendered
# by the chat template, and every string in the body may be shown in snapshots and events.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256
MAX_MESSAGES = 2048
MAX_USER_CHARS = 512
MAX_NESTING = 32  # of JSON arrays and objects; a chat body needs five
MAX_PROMPTS = 256  # prompts in one completions request, each an engine request of its own


# -- the body ----------------------------------------------------------------------------------
def read_request(raw: bytes, served: str) -> dict:
    """A request body as a dict of the fields given (a null is a field not given), its strings all valid
    Unicode and its model the one served; ApiError otherwise."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_nesting_and_text(body)
    body = {name: value for name, value in body.items() if value is not None}
    check_model(body, served)
    check_user(body)
    check_bool(body, "return_token_ids")
    return body


def parse_json(raw: bytes):
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise bad_request(f"the request body nests arrays or objects too deeply (at most {MAX_NESTING} levels)") \
            from None
    except (ValueError, UnicodeDecodeError) as e:  # a JSONDecodeError, or an integer of too many digits
        raise bad_request(f"the request body is not valid JSON: {e}") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def check_nesting_and_text(body: dict) -> None:
    """Every array and object at most MAX_NESTING deep, every string (keys too) encodable as UTF-8. A lone
    surrogate (JSON's "\\ud800") would fail later wherever the string is written out: a snapshot, an
    event, a log line."""
    for field, value in body.items():
        if not _encodes(field):
            raise bad_request("a field name of the request body is not valid Unicode (a lone surrogate)")
        check_field_value(field, value)


def check_field_value(field: str, value) -> None:
    """Walks one field's value without recursion (the body itself is level 1); numbers are skipped
    unnamed, so a long list of token ids costs little."""
    todo = [(field, value, 2)]
    while todo:
        where, value, depth = todo.pop()
        if isinstance(value, str):
            if not _encodes(value):
                raise bad_request(f"{where} is not valid Unicode text: it holds a lone surrogate", field)
            continue
        if depth > MAX_NESTING:
            raise bad_request(f"{where} nests arrays or objects too deeply (at most {MAX_NESTING} levels)", field)
        if isinstance(value, dict):
            if not all(_encodes(key) for key in value):
                raise bad_request(f"{where} has a key that is not valid Unicode (a lone surrogate)", field)
            todo.extend((f"{where}.{key}", item, depth + 1) for key, item in value.items() if _has_text(item))
        elif isinstance(value, list) and not set(map(type, value)) <= PLAIN_TYPES:
            todo.extend((f"{where}[{i}]", item, depth + 1) for i, item in enumerate(value) if _has_text(item))


PLAIN_TYPES = {int, float, bool, type(None)}  # what JSON values hold no text and nest nothing


def _has_text(value) -> bool:
    return type(value) not in PLAIN_TYPES


def _encodes(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_fields(body: dict, known: frozenset[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(f"{unknown[0]}: not supported by this server", unknown[0])


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model={model!r}: must be a string", "model")
    if model is not None and model != served:
        raise ApiError(404, f"model {model!r} is not served here; this server serves {served!r}", "model",
                       "model_not_found")


def check_user(body: dict) -> None:
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise bad_request(f"user={user!r}: must be a string of at most {MAX_USER_CHARS} characters", "user")


def check_bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{name}={value!r}: must be true or false", name)
    return value


# -- sampling ----------------------------------------------------------------------------------
def sampling_params(body: dict, max_model_len: int, chat: bool = False, tool_schema: dict | None = None
                    ) -> SamplingParams:
    """SamplingParams from a chat (`chat`) or completions body; a bad or unsupported value raises ApiError
    (400). Without max_tokens, max_tokens is max_model_len: the answer may run to the end of the context,
    as with vLLM. A max_tokens given must leave room for the prompt (EngineClient checks it once the
    prompt is read), so one of max_model_len or more is refused here. `tool_schema`: the JSON schema the
    tools ask the output to match (tool_calls.py), which excludes a response_format."""
    check_n(body)
    for name, neutral in NEUTRAL_VALUES.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(v) and value == v for v in neutral):
            raise bad_request(f"{name}={value!r}: not supported by this server", name)
    for name in REAL_FIELDS:
        check_finite_number(body, name)
    stop = stop_strings(body)
    ignore_eos = check_bool(body, "ignore_eos") or False
    max_tokens = requested_max_tokens(body, max_model_len)
    if max_tokens == 0 and (chat or not body.get("echo")):
        raise bad_request("max_tokens=0: generates nothing, which is taken only on /v1/completions with echo=true "
                          "(to score the prompt)", "max_tokens")
    fields = {name: body[name] for name in PASSED_THROUGH if body.get(name) is not None}
    fields.update(chat_logprobs(body) if chat else completion_logprobs(body, max_tokens))
    json_schema = response_format(body)
    if json_schema is not None and tool_schema is not None:
        raise bad_request("response_format and a tool_choice that requires a call both constrain the answer; "
                          "send one of them", "response_format")
    json_schema = tool_schema if json_schema is None else json_schema
    if json_schema is not None:
        if ignore_eos:
            raise bad_request("ignore_eos=true: a structured answer ends where its JSON does", "ignore_eos")
        fields["json_schema"] = json_schema
    try:
        return SamplingParams(**fields, max_tokens=max_model_len if max_tokens is None else max_tokens, stop=stop,
                              ignore_eos=ignore_eos)
    except ValueError as e:
        raise from_value_error(e) from None


def response_format(body: dict) -> dict | bool | None:
    """The json_schema of a response_format (docs/serving.md, "Structured output"): None for text, True for
    "json_object" (any JSON object), the schema of "json_schema" (any JSON object when it has none)."""
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and len(value) == 1:
        return None
    if kind == "json_object" and len(value) == 1:
        return True
    spec = value.get("json_schema") if kind == "json_schema" else None
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        raise bad_request(f"response_format={value!r}: must be {{type: text}}, {{type: json_object}} or "
                          "{type: json_schema, json_schema: {name, schema, strict}}", "response_format")
    schema = spec.get("schema", True)
    if not isinstance(schema, dict) and schema is not True:
        raise bad_request("response_format.json_schema.schema must be a JSON schema object", "response_format")
    return schema


def chat_logprobs(body: dict) -> dict:
    """The engine's logprobs of a chat body: `logprobs` true for each token's, `top_logprobs` (which needs
    it) for that many alternatives (docs/serving.md, "Log-probabilities")."""
    wanted = check_bool(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= MAX_LOGPROBS):
        raise bad_request(f"top_logprobs={top!r}: must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs")
    if top is not None and not wanted:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    return {"logprobs": top or 0} if wanted else {}


def completion_logprobs(body: dict, max_tokens: int | None) -> dict:
    """The engine's logprobs of a completions body: `logprobs` k for each token's and its k alternatives;
    with `echo`, the prompt's as well (and with max_tokens 0, which only scores the prompt)."""
    top = body.get("logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= MAX_LOGPROBS):
        raise bad_request(f"logprobs={top!r}: must be an integer in [0, {MAX_LOGPROBS}]", "logprobs")
    echo = check_bool(body, "echo")
    fields = {"logprobs": top}
    if echo and (top is not None or max_tokens == 0):
        fields["prompt_logprobs"] = top or 0
    return fields


def check_n(body: dict) -> None:
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):  # true == 1 in Python: a bool is not an n
        raise bad_request(f"n={n!r}: only n=1 is supported", "n")


def check_finite_number(body: dict, name: str) -> None:
    """A real number that a float holds finitely; SamplingParams checks its range. An integer such as
    10**400 passes Python's type checks but overflows the float every comparison makes of it."""
    value = body.get(name)
    if value is None:
        return
    try:
        finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:
        finite = False
    if not finite:
        raise bad_request(f"{name}={value!r}: must be a finite number", name)


def stop_strings(body: dict) -> str | list | None:
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise bad_request(f"stop={stop!r}: must be a string or a list of strings", "stop")
    strings = [stop] if isinstance(stop, str) else stop or []
    if len(strings) > MAX_STOP_STRINGS:
        raise bad_request(f"stop: {len(strings)} stop strings; at most {MAX_STOP_STRINGS} are taken", "stop")
    if any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in strings):
        raise bad_request(f"stop: a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    return stop  # SamplingParams checks the items


def requested_max_tokens(body: dict, max_model_len: int) -> int | None:
    """max_completion_tokens (OpenAI's newer name), else max_tokens, else None."""
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    # One token of prompt at least: a limit this large can never fit the context.
    if type(max_tokens) is int and max_tokens >= max_model_len:
        raise bad_request(f"max_tokens={max_tokens}: this model's context holds {max_model_len} tokens, prompt "
                          "and answer together", "max_tokens", CONTEXT_LENGTH_EXCEEDED)
    return max_tokens


# -- prompts -----------------------------------------------------------------------------------
def chat_messages(body: dict, tools: list[dict] | None = None) -> Chat:
    """The chat to render: messages with plain-text content (content given as a list of text parts is
    joined), the assistant's tool calls and the tools' results (`tool_call_message`), the template options
    and the `tools` the template shows."""
    check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"messages: {len(messages)} messages; at most {MAX_MESSAGES} are taken", "messages")
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
        if content is None and m.get("tool_calls"):
            content = ""  # an assistant turn that only called tools
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
        plain.append(tool_call_message(i, m, {"role": CHAT_ROLES[m["role"]], "content": content}))
    return Chat(plain, **chat_template_options(body), tools=tools)


def tool_call_message(i: int, message: dict, plain: dict) -> dict:
    """`plain` with the tool calls of an assistant message, their arguments as objects (templates write
    them out with tojson), or the tool_call_id and name of a tool message."""
    calls = message.get("tool_calls")
    if calls is not None:
        if message["role"] != "assistant" or not isinstance(calls, list):
            raise bad_request(f"messages[{i}].tool_calls: only an assistant message has them, as a list", "messages")
        plain["tool_calls"] = [_template_call(i, call) for call in calls]
    for name in ("tool_call_id", "name"):
        value = message.get(name)
        if value is not None and message["role"] == "tool":
            if not isinstance(value, str):
                raise bad_request(f"messages[{i}].{name} must be a string", "messages")
            plain[name] = value
    return plain


def _template_call(i: int, call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"messages[{i}].tool_calls: each must be {{id, type: function, function: "
                          "{name, arguments}}", "messages")
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise bad_request(f"messages[{i}].tool_calls: the arguments of {function['name']!r} are not JSON",
                          "messages") from None
    return {"id": call.get("id"), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def chat_template_options(body: dict) -> dict:
    """add_generation_prompt (default true), continue_final_message (default false; the final message is
    continued, so no generation prompt may follow it) and chat_template_kwargs (template variables)."""
    continue_final = check_bool(body, "continue_final_message") or False
    add_generation = check_bool(body, "add_generation_prompt")
    if add_generation is None:
        add_generation = not continue_final
    if add_generation and continue_final:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true: a continued "
                          "message takes no generation prompt", "continue_final_message")
    kwargs = body.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise bad_request(f"chat_template_kwargs={kwargs!r}: must be an object of template variables",
                          "chat_template_kwargs")
    return {"add_generation_prompt": add_generation, "continue_final_message": continue_final,
            "template_kwargs": kwargs}


def completion_prompts(body: dict) -> list[str | list[int]]:
    """The prompts, in order: a string or a list of token ids is one prompt; a list of strings or a list of
    token-id lists is one prompt each, at most MAX_PROMPTS of them."""
    check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (_token_ids(prompt) and prompt):
        return [prompt]
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS:
        raise bad_request(f"prompt: {len(prompt)} prompts; at most {MAX_PROMPTS} are taken in one request", "prompt")
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(_token_ids(p) for p in prompt)):
        return prompt
    raise bad_request("prompt must be a string, a list of token ids, or a non-empty list of strings or of "
                      "token-id lists (all of one kind)", "prompt")


def _token_ids(value) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)  # a bool is no token id


def stream_options(body: dict) -> bool:
    """Whether the client asked for a final usage chunk; stream_options come only with stream."""
    options = body.get("stream_options")
    if options is None:
        return False
    if body.get("stream") is not True:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise bad_request(f"stream_options.{unknown[0]}: not supported by this server", "stream_options")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad_request(f"stream_options.include_usage={include_usage!r}: must be true or false",
                          "stream_options")
    return bool(include_usage)


# -- responses ---------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, ended: list[RequestOutput] = ()) -> dict:
    """OpenAI's usage, with the prompt tokens the prefix cache served the `ended` requests and, a zipage
    extension, how many times their KV caches were compressed."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(o.metrics.get("cached_prompt_tokens", 0) for o in ended)},
            "kv_compressions": sum(o.metrics.get("times_compressed", 0) for o in ended)}


class Reply:
    """Builds the bodies of one answer: `chat` for /v1/chat/completions, else /v1/completions."""

    def __init__(self, chat: bool, request_id: int, model: str, prompt_tokens: int, token_ids: bool = False,
                 logprobs: LogprobReply | None = None, tools=None):
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.tools = tools  # a tool_calls.ToolPlan: the answer's tool calls are read from its text
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.token_ids = token_ids  # also return token ids (as vLLM's return_token_ids does)
        self.logprobs = logprobs  # each choice's logprobs and echoed prompt, where asked

    def _envelope(self, choices: list, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def full(self, outs: list[RequestOutput]) -> dict:
        """The whole answer: one choice per prompt, its `index` the prompt's place in the request."""
        body = self._envelope([self._choice(out, index) for index, out in enumerate(outs)], chunk=False)
        body["usage"] = usage(self.prompt_tokens, sum(len(out.token_ids) for out in outs), outs)
        if self.token_ids and len(outs) == 1:
            body["prompt_token_ids"] = list(outs[0].prompt_token_ids)
        elif self.token_ids:  # several prompts: each choice carries its own, where vLLM puts them
            for choice, out in zip(body["choices"], outs):
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
        return body

    def _choice(self, out: RequestOutput, index: int) -> dict:
        choice = {"index": index, "finish_reason": out.finish_reason, "logprobs": None}
        echo = ""
        if self.logprobs is not None:
            echo, choice["logprobs"] = self.logprobs.full(index, out)
        if self.chat:
            choice["message"] = {"role": "assistant", "content": out.text}
            content, calls = self.tools.read(out.text, out.finish_reason) if self.tools else (out.text, [])
            if calls:
                choice["message"] = {"role": "assistant", "content": content,
                                     "tool_calls": [call.to_dict() for call in calls]}
                choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = echo + out.text
        if self.token_ids:
            choice["token_ids"] = list(out.token_ids)
            if out.logprobs is not None:
                choice["logprobs_by_id"] = [entry.to_dict() for entry in out.logprobs]
        return choice

    def chunk(self, text: str, finish_reason: str | None = None, new_token_ids: list[int] | None = None,
              role: bool = False, index: int = 0, logprobs: dict | None = None, new_logprobs: list | None = None,
              tool_calls: list | None = None) -> dict:
        """A stream chunk of the prompt at `index` (its choice's index). `new_logprobs`: the engine's
        TokenLogprobs of `new_token_ids`, sent beside them as `logprobs_by_id`. `tool_calls`: the answer's
        calls (tool_calls.ToolCall), all in its last chunk."""
        choice: dict = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": text} if role
                               else {"content": text} if text or finish_reason is None else {})
            if tool_calls:
                choice["delta"]["tool_calls"] = [call.to_dict(n) for n, call in enumerate(tool_calls)]
                choice["finish_reason"] = "tool_calls" if finish_reason else None
        else:
            choice["text"] = text
        if self.token_ids and new_token_ids is not None:
            choice["token_ids"] = new_token_ids
            if new_logprobs:
                choice["logprobs_by_id"] = [entry.to_dict() for entry in new_logprobs]
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, completion_tokens: int, ended: list[RequestOutput] = ()) -> dict:
        body = self._envelope([], chunk=True)
        body["usage"] = usage(self.prompt_tokens, completion_tokens, ended)
        return body
