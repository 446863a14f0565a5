"""What real clients send for structured answers: `response_format` (json_object, json_schema) and
`tools` / `tool_choice`, through the `openai` client against a real `zipage serve` process, streaming
included; and how an answer's text is read into tool calls (docs/serving.md, "Structured output" and
"Tools")."""

from __future__ import annotations

import json

import httpx
import pytest

from serve_helpers import API_KEY, openai_client, start_server, stop_server
from zipage.cli.serve.tool_calls import ToolPlan, ToolStream
from zipage.testing import save_random_model

# A ChatML template that shows tools the way Hermes-style models are trained to see them.
TOOLS_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call these functions, each as <tool_call>{"name": ..., "arguments": ...}</tool_call>:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls %}<tool_call>{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Every argument is a choice, so even a random model's calls end within a few dozen tokens.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "celsius"],
                   "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools-model")
    save_random_model(folder, "llama-tiny", seed=3, chat_template=TOOLS_TEMPLATE)
    server = start_server(folder / "server.log", model=str(folder))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def post(server, body: dict) -> httpx.Response:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        return http.post("/v1/chat/completions", json={"messages": ASK, **body})


def assert_weather_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "Oslo") and type(arguments["celsius"]) is bool


# -- response_format ----------------------------------------------------------------------------
def test_a_json_schema_response_parses_and_matches(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=ASK, temperature=1.0, seed=seed, max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA,
                                                                    "strict": True}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        value = json.loads(choice.message.content)
        assert value["answer"] in ("yes", "no", "maybe") and type(value["sure"]) is bool


def test_a_streamed_json_schema_response_joins_into_the_same_answer(client):
    model = client.models.list().data[0].id
    kwargs = dict(model=model, messages=ASK, temperature=0, max_tokens=60,
                  response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(stream=True, **kwargs) if chunk.choices)
    assert streamed == whole and json.loads(whole)


def test_json_object_mode_gives_an_object(server):
    body = {"temperature": 0.8, "seed": 1, "max_tokens": 300,
            "response_format": {"type": "json_object"}}
    reply = post(server, body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # cut at max_tokens: what came so far is still the start of an object
        assert choice["message"]["content"].startswith("{")


@pytest.mark.parametrize("response_format, why", [
    ({"type": "xml"}, "must be"),
    ({"type": "json_schema"}, "must be"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "nonsense"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "schema object"),
])
def test_a_bad_response_format_is_a_400_naming_it(server, response_format, why):
    reply = post(server, {"response_format": response_format, "max_tokens": 5})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert why in error["message"] and error["param"] in ("response_format", "json_schema")


def test_response_format_and_a_required_tool_call_cannot_both_hold(server):
    reply = post(server, {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert reply.status_code == 400 and "response_format" in reply.json()["error"]["message"]


def test_an_attached_console_asks_the_server_for_the_same_structure(server):
    from zipage.cli.serve.remote import RemoteEngine
    from zipage.engine import SamplingParams

    with RemoteEngine(server.url, API_KEY) as remote:
        out = remote.submit(ASK, SamplingParams(temperature=0, max_tokens=60, json_schema=SCHEMA)).result()
    value = json.loads(out.text)
    assert value["answer"] in ("yes", "no", "maybe") and type(value["sure"]) is bool


# -- tools ------------------------------------------------------------------------------------------
def test_a_required_call_comes_as_tool_calls(client):
    model = client.models.list().data[0].id
    for seed in range(3):
        reply = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], seed=seed,
                                               tool_choice="required", parallel_tool_calls=False,
                                               temperature=1.0, max_tokens=120)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls  # one call at most without parallel calls
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert_weather_call(call)
        else:
            assert call.function.name == "get_time" and arguments["zone"] in ("UTC", "CET")


def test_required_parallel_calls_are_read_in_order():
    plan = ToolPlan([WEATHER, TIME], "required")
    text = ('[{"name": "get_time", "arguments": {"zone": "UTC"}}, '
            '{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": false}}]')
    content, calls = plan.read(text, "stop")
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Oslo", "celsius": False}
    assert plan.read(text[:30], "length") == (text[:30], [])  # cut short: no calls, the text as it is


def test_a_named_function_is_called_with_its_arguments_and_streams_the_same(client):
    model = client.models.list().data[0].id
    kwargs = dict(model=model, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    assert_weather_call(whole.message.tool_calls[0])
    chunks = [chunk for chunk in client.chat.completions.create(stream=True, **kwargs) if chunk.choices]
    deltas = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in deltas] == ["get_weather"] and deltas[0].index == 0
    assert deltas[0].function.arguments == whole.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks)


def test_a_tool_result_goes_back_into_the_conversation(client, server):
    model = client.models.list().data[0].id
    first = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=120).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    reply = post(server, {"messages": history, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 4,
                          "temperature": 0, "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert "tool_calls" not in body["choices"][0]["message"]  # "none": text only
    # The byte tokenizer: a byte is its own id (the special tokens, above 255, are left out).
    prompt = bytes(t for t in body["prompt_token_ids"] if t < 256).decode("utf-8", "replace")
    assert "<tool_response>18 degrees and sunny</tool_response>" in prompt
    assert f'<tool_call>{{"name": "get_weather", "arguments": {call.function.arguments}}}</tool_call>' in prompt


@pytest.mark.parametrize("body, why", [
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
    ({"tools": [WEATHER, WEATHER]}, "same name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "must be none"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]}, "tool_call_id"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "not JSON"),
])
def test_malformed_tools_are_400s(server, body, why):
    reply = post(server, body)
    assert reply.status_code == 400, reply.text
    assert why in reply.json()["error"]["message"]


def test_a_template_without_tools_refuses_them(tmp_path):
    server = start_server(tmp_path / "server.log")  # the built-in tiny preset: plain ChatML, no tools
    try:
        reply = post(server, {"tools": [WEATHER]})
        assert reply.status_code == 400
        assert "does not take tools" in reply.json()["error"]["message"]
        assert post(server, {"max_tokens": 2}).status_code == 200
    finally:
        stop_server(server)


# -- reading calls from free text ("auto") -----------------------------------------------------------
AUTO = ToolPlan([WEATHER, TIME], "auto")


def test_hermes_blocks_become_calls_and_the_rest_content():
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": true}}\n'
            '</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    content, calls = AUTO.read(text, "stop")
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "celsius": True}), ("get_time", {"zone": "UTC"})]


def test_a_llama_style_answer_is_one_call():
    content, calls = AUTO.read('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', "stop")
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("text, reason", [
    ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', "stop"),  # no such tool
    ('<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>', "stop"),  # not JSON
    ('{"name": "get_time", "arguments": {"zone": "UTC"}}', "length"),  # cut short
    ("Plain words about {braces}.", "stop"),
])
def test_what_is_no_call_stays_text(text, reason):
    assert AUTO.read(text, reason) == (text, [])


def test_streaming_holds_back_only_what_may_be_a_call():
    stream = ToolStream(AUTO)
    pieces = ["Sure, ", "I'll look", " <tool", "_call>", '{"name": "get_time", "arguments": {"zone": "UTC"}}',
              "</tool_call>"]
    shown = [stream.feed(piece) for piece in pieces]
    assert "".join(shown) == "Sure, I'll look "
    assert shown[2] == " "  # "<tool" might open a call
    rest, calls = stream.finish("stop")
    assert rest == "" and [c.name for c in calls] == ["get_time"]

    plain = ToolStream(AUTO)
    assert [plain.feed(p) for p in ["a < b", " and <t", "he end>"]] == ["a < b", " and ", "<the end>"]
    assert plain.finish("stop") == ("", [])

    bare = ToolStream(AUTO)
    assert bare.feed('{"name": "get_time", ') == "" and bare.feed('"arguments": {"zone": "UTC"}}') == ""
    assert [c.name for c in bare.finish("stop")[1]] == ["get_time"]

    text_after_all = ToolStream(AUTO)
    assert text_after_all.feed("{not a call}") == ""
    assert text_after_all.finish("stop") == ("{not a call}", [])


# -- the clients people use (the `clients` extra) ---------------------------------------------------
def test_langchain_structured_output_and_tool_calls(server):
    langchain_openai = pytest.importorskip("langchain_openai", reason='the clients extra: pip install -e ".[clients]"')
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        answer: Literal["yes", "no", "maybe"]
        sure: bool

    chat = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key=API_KEY, model=_served(server),
                                       temperature=0, max_tokens=80, max_retries=0)
    verdict = chat.with_structured_output(Verdict).invoke("Is Paris in France?")  # a json_schema response_format
    assert isinstance(verdict, Verdict)
    message = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Oslo?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo")
    streamed = None
    for chunk in chat.bind_tools([WEATHER], tool_choice="get_weather").stream("Weather in Oslo?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls[0]["args"] == call["args"]


@pytest.mark.filterwarnings("ignore::UserWarning")  # litellm's own pydantic models warn on import
def test_litellm_json_and_tools(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch its price list: loopback only
    litellm = pytest.importorskip("litellm", reason='the clients extra: pip install -e ".[clients]"')
    common = dict(model=f"openai/{_served(server)}", api_base=server.url + "/v1", api_key=API_KEY, messages=ASK,
                  temperature=0, max_tokens=80)
    reply = litellm.completion(**common, response_format={
        "type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}})
    assert json.loads(reply.choices[0].message.content)["answer"] in ("yes", "no", "maybe")
    reply = litellm.completion(**common, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"


def _served(server) -> str:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        return http.get("/v1/models").json()["data"][0]["id"]
