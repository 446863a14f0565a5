"""OpenAI tools on a chat model: `tools` and `tool_choice` -> the tools the chat template renders and the
JSON schema the output must match; the output -> `tool_calls` (docs/serving.md, "Tools").

`tool_choice: "required"` and a named function constrain the whole output (structured output): a JSON
list of calls `{"name", "arguments"}` for "required", the named function's arguments for a name. "auto"
leaves the model free and reads the calls it writes the way tool-trained templates ask for them:
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3), or an answer
that is one JSON object naming a tool (Llama 3, with "parameters"). "none" shows the tools and reads no
calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from zipage.cli.serve.openai_protocol import bad_request

CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
CALL_OPEN = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3's mark before a call


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass
class ToolPlan:
    """What a chat request's tools ask: `tools` for the template, `mode` ("none", "auto", "required" or
    "named"), the function `name` when named, and the `schema` the output must match (None: free)."""

    tools: list[dict]
    mode: str
    name: str | None = None
    schema: dict | None = None

    @property
    def names(self) -> set[str]:
        return {tool["function"]["name"] for tool in self.tools}

    def read(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer. An answer cut short (finish_reason "length") or one that
        names no known tool is content only."""
        if self.mode == "none" or finish_reason not in ("stop", None):
            return text, []
        if self.mode == "named":
            return None, [ToolCall(self.name, text)]
        if self.mode == "required":
            return None, [ToolCall(call["name"], json.dumps(call["arguments"])) for call in json.loads(text)]
        return self._read_free(text)

    def _read_free(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = []
        for block in CALL_BLOCK.findall(text):
            call = self._call_of(block)
            if call is None:
                return text, []  # a block that is no call of a known tool: the answer is text
            calls.append(call)
        if calls:
            content = CALL_BLOCK.sub("", text).strip()
            return content or None, calls
        bare = text.strip().removeprefix(PYTHON_TAG).strip()
        call = self._call_of(bare) if bare.startswith("{") else None
        return (None, [call]) if call is not None else (text, [])

    def _call_of(self, text: str) -> ToolCall | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text already
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        return ToolCall(value["name"], json.dumps(arguments)) if isinstance(arguments, dict) else None


def tool_plan(body: dict, template_takes_tools: bool) -> ToolPlan | None:
    """The plan of a chat body's `tools`, `tool_choice` and `parallel_tool_calls`; None without tools.
    ApiError (400) for a malformed tool, an unknown choice, or a template that cannot show tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise bad_request(f"tool_choice={choice!r} needs tools", "tool_choice")
        if body.get("parallel_tool_calls") is not None:
            raise bad_request("parallel_tool_calls needs tools", "parallel_tool_calls")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {type: function, function: {name, parameters}} objects", "tools")
    for i, tool in enumerate(tools):
        _check_tool(i, tool)
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) < len(names):
        raise bad_request("tools: two functions have the same name", "tools")
    if not template_takes_tools:
        raise bad_request("tools: this model's chat template does not take tools, so it cannot be told about "
                          "them", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request(f"parallel_tool_calls={parallel!r}: must be true or false", "parallel_tool_calls")
    choice = "auto" if choice is None else choice
    if choice in ("none", "auto"):
        return ToolPlan(tools, choice)
    if choice == "required":
        return ToolPlan(tools, "required", schema=_calls_schema(tools, parallel))
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        else None
    if not isinstance(name, str):
        raise bad_request(f"tool_choice={choice!r}: must be none, auto, required or "
                          "{type: function, function: {name}}", "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return ToolPlan(tools, "named", name, _arguments_schema(tools[names.index(name)]))


def _check_tool(i: int, tool) -> None:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise bad_request(f"tools[{i}] must be {{type: function, function: {{name, description, parameters}}}}",
                          "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")


def _arguments_schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def _calls_schema(tools: list[dict], parallel: bool) -> dict:
    """A list of one call or more, each {"name": one tool's, "arguments": its parameters}."""
    calls = [{"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                               "arguments": _arguments_schema(tool)},
              "required": ["name", "arguments"], "additionalProperties": False} for tool in tools]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    return {**schema, "maxItems": 1} if not parallel else schema


class ToolStream:
    """Streams an answer's text but what may be a call: after "<tool_call>" (or a partial one at the end),
    or the whole answer when it opens as a JSON object or under a constraint. The calls come at the end
    (`finish`)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text streamed as content

    def feed(self, delta: str) -> str:
        """The part of the new text that is surely content."""
        self.text += delta
        if self.plan.mode in ("named", "required"):
            return ""
        if self.plan.mode == "auto":
            held = self._held_from()
            if held <= self.sent:
                return ""
            out, self.sent = self.text[self.sent:held], held
            return out
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    def _held_from(self) -> int:
        """Where text that may be a call starts (the end if none)."""
        opened = self.text.find(CALL_OPEN)
        if opened >= 0:
            return opened
        stripped = self.text.lstrip()
        if stripped and (stripped.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(stripped)):
            return len(self.text) - len(stripped)
        for size in range(min(len(CALL_OPEN) - 1, len(self.text)), 0, -1):  # "<tool" could become a call
            if CALL_OPEN.startswith(self.text[-size:]):
                return len(self.text) - size
        return len(self.text)

    def finish(self, finish_reason: str | None) -> tuple[str, list[ToolCall]]:
        """(the content not streamed yet, the calls) once the answer has ended."""
        content, calls = self.plan.read(self.text, finish_reason)
        unsent, self.sent = self.text[self.sent:], len(self.text)
        if not calls:
            return unsent, []
        # What was held back holds every call whole (holding starts at the first one).
        return ("" if content is None else CALL_BLOCK.sub("", unsent).rstrip()), calls
