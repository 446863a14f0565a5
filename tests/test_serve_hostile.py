"""`zipage serve` against bodies no good client sends: each gets its status and OpenAI error shape (never a
500), the server keeps serving, and nothing it cannot write out (a lone surrogate) gets in."""

from __future__ import annotations

import json
import socket

import pytest

from zipage.engine.loading.loader import resolve_model
from zipage.engine.loading.model_registry import CHATML_TEMPLATE
from zipage.engine.loading.prompts import Chat, PromptReader
from serve_helpers import API_KEY, MODEL, start_server, stop_server, wait_until_idle

MAX_MODEL_LEN = 8192  # the test server's (the preset's context length)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("hostile") / "server.log")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def reader():
    """The server's prompt reader, rebuilt here: the same preset gives the same tokenizer and template."""
    return PromptReader(resolve_model(MODEL))


def encoded(body: dict) -> bytes:
    """JSON as a lax client writes it: lone surrogates as "\\ud800" escapes, NaN and Infinity as literals."""
    return json.dumps({"model": MODEL, **body}).encode()


def post(http, path: str, body: dict | bytes):
    content = body if isinstance(body, bytes) else encoded(body)
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def chat(**fields) -> tuple[str, dict]:
    return CHAT, {"messages": HI, **fields}


def completion(**fields) -> tuple[str, dict]:
    return COMPLETIONS, {"prompt": "hi", **fields}


def raw(text: str) -> tuple[str, bytes]:
    return COMPLETIONS, text.encode()


# (path, body), status, code, param
REFUSED = {
    # Bodies the JSON parser cannot take.
    "100k nested brackets": (raw(nested(100_000).decode()), 400, None, None),
    "max_tokens of 5000 digits": (raw('{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}"), 400, None, None),
    "NaN": (raw('{"prompt": "hi", "temperature": NaN}'), 400, None, None),
    "Infinity": (raw('{"prompt": "hi", "top_p": Infinity}'), 400, None, None),
    "-Infinity": (raw('{"prompt": "hi", "min_p": -Infinity}'), 400, None, None),
    "nesting inside a field": (chat(chat_template_kwargs={"x": json.loads(nested(40))}), 400, None,
                               "chat_template_kwargs"),
    # Numbers a float cannot hold, and wrong types.
    "temperature 10**400": (completion(temperature=10**400), 400, None, "temperature"),
    "top_p 10**400": (completion(top_p=10**400), 400, None, "top_p"),
    "min_p 10**400": (completion(min_p=10**400), 400, None, "min_p"),
    "repetition_penalty 10**400": (completion(repetition_penalty=10**400), 400, None, "repetition_penalty"),
    "frequency_penalty 10**400": (completion(frequency_penalty=10**400), 400, None, "frequency_penalty"),
    "presence_penalty -1e400": (raw('{"prompt": "hi", "presence_penalty": -1e400}'), 400, None, "presence_penalty"),
    "presence_penalty true": (chat(presence_penalty=True), 400, None, "presence_penalty"),
    "frequency_penalty list": (completion(frequency_penalty=[1]), 400, None, "frequency_penalty"),
    "temperature 1e400": (raw('{"prompt": "hi", "temperature": 1e400}'), 400, None, "temperature"),
    "n true": (completion(n=True), 400, None, "n"),
    "n 1.0": (completion(n=1.0), 400, None, "n"),
    "max_tokens true": (completion(max_tokens=True), 400, None, "max_tokens"),
    "max_tokens 2.0": (completion(max_tokens=2.0), 400, None, "max_tokens"),
    "top_k true": (completion(top_k=True), 400, None, "top_k"),
    "seed true": (completion(seed=True), 400, None, "seed"),
    "temperature string": (completion(temperature="0.5"), 400, None, "temperature"),
    "ignore_eos 1": (completion(ignore_eos=1), 400, None, "ignore_eos"),
    "return_token_ids string": (completion(return_token_ids="yes"), 400, None, "return_token_ids"),
    "user number": (completion(user=5), 400, None, "user"),
    "model number": (completion(model=5), 400, None, "model"),
    # Text that is not valid Unicode, wherever it is.
    "prompt surrogate": (completion(prompt="hi \ud800"), 400, None, "prompt"),
    "prompt list surrogate": (completion(prompt=["\udfff"]), 400, None, "prompt"),
    "content surrogate": (chat(messages=[{"role": "user", "content": "\ud800"}]), 400, None, "messages"),
    "content part surrogate": (chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]),
                               400, None, "messages"),
    "user surrogate": (completion(user="\ud800"), 400, None, "user"),
    "stop surrogate": (completion(stop="\ud800"), 400, None, "stop"),
    "stop list surrogate": (completion(stop=["end", "\ud800"]), 400, None, "stop"),
    "template variable surrogate": (chat(chat_template_kwargs={"name": "\ud800"}), 400, None,
                                    "chat_template_kwargs"),
    # Lists and strings past their bounds.
    "33 stop strings": (completion(stop=[f"s{i}" for i in range(33)]), 400, None, "stop"),
    "a 257-character stop string": (completion(stop="x" * 257), 400, None, "stop"),
    "2049 messages": (chat(messages=HI * 2049), 400, None, "messages"),
    "a 513-character user": (completion(user="u" * 513), 400, None, "user"),
    "257 prompts": (completion(prompt=[[5]] * 257), 400, None, "prompt"),
    "10000 prompts": (completion(prompt=["p"] * 10_000), 400, None, "prompt"),
    "an empty list of prompts": (completion(prompt=[]), 400, None, "prompt"),
    "a token id that is a bool": (completion(prompt=[[5, True]]), 400, None, "prompt"),
    "a token id that is a float": (completion(prompt=[5, 6.0]), 400, None, "prompt"),
    "prompts nested three deep": (completion(prompt=[[[5]]]), 400, None, "prompt"),
    "strings and token ids mixed": (completion(prompt=["hi", [5]]), 400, None, "prompt"),
    "a prompt that is an object": (completion(prompt=[{"text": "hi"}]), 400, None, "prompt"),
    "the second prompt past max_model_len": (completion(prompt=[[5], [7] * (MAX_MODEL_LEN + 1)]), 400,
                                             "context_length_exceeded", None),
    "the third prompt a 5 MB text": (completion(prompt=["a", "b", "x" * 5_000_000]), 400,
                                     "context_length_exceeded", None),
    "prompt ids past max_model_len": (completion(prompt=[7] * (MAX_MODEL_LEN + 1)), 400,
                                      "context_length_exceeded", None),
    "prompt ids of max_model_len": (completion(prompt=[7] * MAX_MODEL_LEN), 400, "context_length_exceeded", None),
    "a 5 MB text prompt": (completion(prompt="x" * 5_000_000), 400, "context_length_exceeded", None),
    "a text prompt of more tokens than max_model_len": (completion(prompt="y" * 9000), 400,
                                                        "context_length_exceeded", None),
    # Prompt and answer past the context.
    "max_tokens 10**12": (completion(max_tokens=10**12), 400, "context_length_exceeded", "max_tokens"),
    "max_completion_tokens 10**12": (chat(max_completion_tokens=10**12), 400, "context_length_exceeded",
                                     "max_tokens"),
    "max_tokens of max_model_len": (completion(max_tokens=MAX_MODEL_LEN), 400, "context_length_exceeded",
                                    "max_tokens"),
    "8191 prompt ids and max_tokens 100": (completion(prompt=[7] * 8191, max_tokens=100), 400,
                                           "context_length_exceeded", None),
    "3 prompt ids and one token too many": (completion(prompt=[5, 6, 7], max_tokens=MAX_MODEL_LEN - 2), 400,
                                            "context_length_exceeded", None),
    # Fields this server does not honour.
    "stream_options without stream": (completion(stream_options={"include_usage": True}), 400, None,
                                      "stream_options"),
    "stream_options with stream false": (chat(stream=False, stream_options={"include_usage": True}), 400, None,
                                         "stream_options"),
    "an unknown stream option": (chat(stream=True, stream_options={"continuous_usage_stats": True}), 400, None,
                                 "stream_options"),
    "tool_choice without tools": (chat(tool_choice="auto"), 400, None, "tool_choice"),
    "function_call": (chat(function_call={"name": "f"}), 400, None, "function_call"),
    "parallel_tool_calls without tools": (chat(parallel_tool_calls=True), 400, None, "parallel_tool_calls"),
    "chat_template": (chat(chat_template="{{ messages }}"), 400, None, "chat_template"),
    "guided_json": (chat(guided_json={"type": "object"}), 400, None, "guided_json"),
    "modalities": (chat(modalities=["text", "audio"]), 400, None, "modalities"),
    "messages on completions": (completion(messages=HI), 400, None, "messages"),
    "prompt on chat": (chat(prompt="hi"), 400, None, "prompt"),
    "add_generation_prompt string": (chat(add_generation_prompt="yes"), 400, None, "add_generation_prompt"),
    "continue_final_message 1": (chat(continue_final_message=1), 400, None, "continue_final_message"),
    "both generation prompt and continuing": (chat(add_generation_prompt=True, continue_final_message=True), 400,
                                              None, "continue_final_message"),
    "chat_template_kwargs list": (chat(chat_template_kwargs=["enable_thinking"]), 400, None,
                                  "chat_template_kwargs"),
    "chat_template_kwargs overriding tokenize": (chat(chat_template_kwargs={"tokenize": True}), 400, None,
                                                 "chat_template_kwargs"),
    # A model not served here.
    "unknown model": (completion(model="gpt-4"), 404, "model_not_found", "model"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_hostile_body_is_refused_in_openai_shape_and_the_server_keeps_serving(server, case):
    (path, body), status, code, param = REFUSED[case]
    with server.client() as http:
        response = post(http, path, body)
        assert response.status_code == status, response.text[:2000]
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert (error["code"], error["param"]) == (code, param), error["message"]
        assert len(error["message"]) < 3000  # a huge value is quoted cut short
        ok = post(http, COMPLETIONS, {"prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1


def test_a_null_field_is_a_field_not_given(server):
    body = {"prompt": [5, 6, 7], "max_completion_tokens": None, "max_tokens": 3, "ignore_eos": True,
            "temperature": None, "top_p": None, "top_k": None, "min_p": None, "repetition_penalty": None,
            "frequency_penalty": None, "presence_penalty": None,
            "seed": None, "stop": None, "n": None, "user": None, "stream": None, "stream_options": None,
            "logprobs": None, "tools": None, "kv_budget": None, "return_token_ids": None}
    with server.client() as http:
        response = post(http, COMPLETIONS, body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3  # max_tokens, not max_model_len
        chat_body = {"messages": HI, "max_completion_tokens": None, "max_tokens": 2, "ignore_eos": True,
                     "add_generation_prompt": None, "continue_final_message": None, "chat_template_kwargs": None}
        response = post(http, CHAT, chat_body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2


def test_neutral_tool_choice_is_taken(server):
    with server.client() as http:
        response = post(http, CHAT, {"messages": HI, "max_tokens": 1, "tool_choice": "none", "tools": []})
    assert response.status_code == 200, response.text


def start_streaming(http, path: str, body: dict):
    """A streamed request: its response, open until the caller leaves (which aborts the request)."""
    return http.stream("POST", path, content=encoded({**body, "stream": True}),
                       headers={"Content-Type": "application/json"})


def first_chunk(lines) -> str:
    """The first data line; `lines` stays open (a closed line iterator closes the connection)."""
    for line in lines:
        if line.startswith("data: "):
            return line
    raise AssertionError("the stream ended without data")


@pytest.mark.parametrize("body", [{"prompt": [5, 6, 7], "max_tokens": MAX_MODEL_LEN - 3},
                                  {"prompt": [5, 6, 7]}, {"prompt": "a story"}],
                         ids=["prompt and max_tokens fill the context", "no max_tokens", "text, no max_tokens"])
def test_a_request_that_fits_the_context_is_taken(server, body):
    """Up to the last position of the context; without max_tokens the answer may run to its end."""
    with server.client() as http:
        with start_streaming(http, COMPLETIONS, {**body, "ignore_eos": True}) as response:
            assert response.status_code == 200, response.read()
            lines = response.iter_lines()
            assert first_chunk(lines)
    wait_until_idle(server)


def test_a_lone_surrogate_user_is_refused_and_snapshots_keep_working(server):
    with server.client() as http:
        refused = post(http, COMPLETIONS, {"prompt": "hi", "user": "\ud800", "max_tokens": 1})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "user"
        user = "løp 🚀"  # text outside ASCII and the BMP is fine
        with start_streaming(http, COMPLETIONS, {"prompt": "hi", "user": user, "max_tokens": 4000,
                                                 "ignore_eos": True}) as response:
            assert response.status_code == 200
            request_id = int(response.headers["x-zipage-request-id"])
            lines = response.iter_lines()
            first_chunk(lines)
            snapshot = http.get("/zipage/snapshot", params={"fresh": 1})
            assert snapshot.status_code == 200, snapshot.text
            assert any(r["id"] == request_id and r["session"] == user for r in snapshot.json()["requests"])
    wait_until_idle(server)


def prompt_ids(http, body: dict) -> list[int]:
    response = post(http, CHAT, {"max_tokens": 1, "return_token_ids": True, **body})
    assert response.status_code == 200, response.text
    return response.json()["prompt_token_ids"]


def test_chat_template_options_shape_the_prompt(server, reader):
    turns = HI + [{"role": "assistant", "content": "The answer is"}]
    with server.client() as http:
        default = prompt_ids(http, {"messages": turns})
        plain = prompt_ids(http, {"messages": turns, "add_generation_prompt": False})
        continued = prompt_ids(http, {"messages": turns, "continue_final_message": True})
        explicit = prompt_ids(http, {"messages": turns, "continue_final_message": True,
                                     "add_generation_prompt": False})
        with_kwargs = prompt_ids(http, {"messages": turns, "chat_template_kwargs": {"enable_thinking": False}})
    assert default == reader.chat(turns)
    assert plain == reader.chat(turns, add_generation_prompt=False) and plain != default
    assert continued == explicit == reader.chat(turns, add_generation_prompt=False, continue_final_message=True)
    assert reader.tokenizer.decode(continued).endswith("assistant\nThe answer is")  # inside the final message
    assert with_kwargs == default  # this template has no use for the variable, and takes it


def test_template_variables_reach_the_template():
    source = resolve_model(MODEL)  # a tokenizer of its own, given a template that reads a variable
    source.tokenizer.chat_template = CHATML_TEMPLATE + "{% if enable_thinking is false %}<think></think>{% endif %}"
    own = PromptReader(source)
    thinking = own.chat_text(HI)
    assert own.chat_text(HI, template_kwargs={"enable_thinking": False}) == thinking + "<think></think>"
    assert own.read(Chat(HI, template_kwargs={"enable_thinking": False})) == own.encode(thinking + "<think></think>")
    assert own.read(HI) == own.encode(thinking)  # a plain list of messages reads as before


def test_a_client_that_leaves_while_sending_its_body_is_no_crash(server):
    """The body is read after the route starts: a client gone by then is no error in the log (the
    check below), and the server keeps serving."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as raw_socket:
        raw_socket.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer " + API_KEY.encode()
                           + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    with server.client() as http:
        for _ in range(3):
            assert post(http, COMPLETIONS, {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_no_request_made_the_server_crash(server):
    """Every refusal above was an answer, not an exception: the log holds no traceback."""
    assert "Traceback" not in server.log.read_text()
