"""OpenAI log-probabilities through a real `zipage serve`: chat's `logprobs`/`top_logprobs` and
completions' `logprobs`/`echo`, whole and streamed, in OpenAI's shapes and with the offline engine's
values; `max_tokens: 0` with echo scores a prompt; bad values are 400s that name the field."""

from __future__ import annotations

import openai
import pytest

from serve_helpers import MODEL, offline_engine, openai_client, start_server, stop_server
from zipage.engine import SamplingParams

TOL = 1e-4  # the server's engine batches differently from the offline one: float32 rounding only


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("serve-logprobs") / "server.log")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    """The server's engine offline: same model, knobs and seed, hence the same weights."""
    llm = offline_engine()
    yield llm
    llm.close()


def piece(offline, token_id: int) -> str:
    return offline.tokenizer.decode([token_id], skip_special_tokens=False)


PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # "Hello, world" in byte tokens


def test_chat_logprobs_whole_and_streamed(client, offline):
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = whole.choices[0]
    expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))
    assert choice.model_extra["token_ids"] == expected.token_ids
    content = choice.logprobs.content
    assert len(content) == 6
    for item, entry in zip(content, expected.logprobs):
        assert item.token == piece(offline, entry.token_id) and item.bytes == list(item.token.encode())
        assert item.logprob == pytest.approx(entry.logprob, abs=TOL)
        assert [t.token for t in item.top_logprobs] == [piece(offline, t) for t in entry.top]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(list(entry.top.values()), abs=TOL)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert [i.model_dump() for i in streamed] == [i.model_dump() for i in content]
    # Without logprobs, none are sent.
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_with_and_without_echo(client, offline):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    expected = offline.generate([PROMPT], params)[0]
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                       extra_body={"ignore_eos": True})
    check_completion(offline, answer.choices[0].logprobs, expected.token_ids, expected.logprobs)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                       echo=True, extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "Hello, world" + answer.choices[0].text
    check_completion(offline, echoed.choices[0].logprobs, PROMPT + expected.token_ids,
                     expected.prompt_logprobs + expected.logprobs)
    assert echoed.choices[0].logprobs.token_logprobs[0] is None and echoed.choices[0].logprobs.top_logprobs[0] is None
    # Streamed: the same lists in parts, the echoed prompt in the first chunk, offsets counting on.
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                            echo=True, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text.startswith("Hello, world")
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for p in parts for v in getattr(p, key)] == getattr(echoed.choices[0].logprobs, key)


def check_completion(offline, logprobs, ids: list[int], entries: list) -> None:
    """A completions choice's logprobs against the engine's entries for these ids."""
    texts = [piece(offline, t) for t in ids]
    assert logprobs.tokens == texts
    assert logprobs.text_offset == [sum(map(len, texts[:i])) for i in range(len(texts))]
    for value, top, entry, text in zip(logprobs.token_logprobs, logprobs.top_logprobs, entries, texts):
        if entry is None:
            assert value is None and top is None
            continue
        assert value == pytest.approx(entry.logprob, abs=TOL)
        expected = {piece(offline, t): lp for t, lp in entry.top.items()}
        expected.setdefault(text, entry.logprob)  # OpenAI's dict holds the token itself too
        assert top.keys() == expected.keys()
        assert list(top.values()) == pytest.approx(list(expected.values()), abs=TOL)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("logprobs", [None, 3])
def test_max_tokens_zero_with_echo_scores_the_prompt(client, offline, stream, logprobs):
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=logprobs)
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        choices = [c.choices[0] for c in chunks if c.choices]
        assert len(choices) == 1
        choice, usage = choices[0], chunks[-1].usage
    else:
        reply = client.completions.create(**kwargs)
        choice, usage = reply.choices[0], reply.usage
    assert (choice.text, choice.finish_reason) == ("Hello, world", "length")
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), 0)
    if logprobs is None:
        assert choice.logprobs is None
    else:
        check_completion(offline, choice.logprobs, PROMPT, expected.prompt_logprobs)


def test_a_list_of_token_prompts_scores_each_as_lm_evaluation_does(server, offline):
    """lm-evaluation-harness' local-completions log-likelihood request: token ids, echo, logprobs=1,
    max_tokens=1; it sums token_logprobs[context:-1]."""
    body = {"model": MODEL, "prompt": [PROMPT], "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True,
            "seed": 1234}
    with server.client() as http:
        reply = http.post("/v1/completions", json=body).json()
    logprobs = reply["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(PROMPT) + 1
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert sum(logprobs["token_logprobs"][4:-1]) == pytest.approx(
        sum(e.logprob for e in expected.prompt_logprobs[4:]), abs=1e-3)


def test_each_of_several_prompts_gets_its_own_logprobs(client, offline):
    prompts = [PROMPT, PROMPT[:5]]
    expected = offline.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0, logprobs=1,
                                                        prompt_logprobs=1))
    kwargs = dict(model=MODEL, prompt=prompts, max_tokens=2, temperature=0, logprobs=1, echo=True,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    for choice, out in zip(whole.choices, expected):
        ids = out.prompt_token_ids + out.token_ids
        check_completion(offline, choice.logprobs, ids, out.prompt_logprobs + out.logprobs)
        parts = [c.choices[0].logprobs for c in chunks if c.choices[0].index == choice.index and c.choices[0].logprobs]
        assert [t for p in parts for t in p.tokens] == choice.logprobs.tokens
        assert [o for p in parts for o in p.text_offset] == choice.logprobs.text_offset


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_with_token_ids_each_token_carries_the_engines_logprobs_by_id(client, offline, chat):
    """return_token_ids adds `logprobs_by_id` beside the ids: the engine's TokenLogprobs as they are, whole
    and streamed alike; without return_token_ids, or without logprobs, none."""
    from zipage.engine.logprobs import TokenLogprobs

    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    messages = [{"role": "user", "content": "Name a colour."}]
    expected = offline.chat(messages, params) if chat else offline.generate([PROMPT], params)[0]
    create = client.chat.completions.create if chat else client.completions.create
    asked = dict(messages=messages, logprobs=True, top_logprobs=2) if chat else dict(prompt=PROMPT, logprobs=2)
    kwargs = dict(model=MODEL, max_tokens=5, temperature=0, **asked)
    ids = {"ignore_eos": True, "return_token_ids": True}
    whole = create(**kwargs, extra_body=ids).choices[0].model_extra["logprobs_by_id"]
    entries = [TokenLogprobs.from_dict(d) for d in whole]
    assert [(e.token_id, e.rank, list(e.top)) for e in entries] == [(x.token_id, x.rank, list(x.top))
                                                                     for x in expected.logprobs]
    assert [e.logprob for e in entries] == pytest.approx([x.logprob for x in expected.logprobs], abs=TOL)
    chunks = list(create(**kwargs, stream=True, extra_body=ids))
    assert [d for c in chunks if c.choices for d in c.choices[0].model_extra.get("logprobs_by_id") or []] == whole
    plain = create(**kwargs, extra_body={"ignore_eos": True}).choices[0]
    assert "logprobs_by_id" not in plain.model_extra
    unasked = dict(messages=messages) if chat else dict(prompt=PROMPT)
    assert "logprobs_by_id" not in create(model=MODEL, max_tokens=2, **unasked, extra_body=ids).choices[0].model_extra


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BAD = [
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
    ("/v1/chat/completions", {**CHAT, "logprobs": False, "top_logprobs": 0}, "top_logprobs", "needs logprobs=true"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs=21"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs", "top_logprobs=-1"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 2}, "logprobs", "logprobs=2: must be true or false"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo", "not supported"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens", "max_tokens=0"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "logprobs=21"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs", "logprobs=True"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1.5}, "logprobs", "logprobs=1.5"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo", "echo='yes'"),
    ("/v1/completions", {"prompt": "hi", "top_logprobs": 2}, "top_logprobs", "not supported"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "only on /v1/completions with echo=true"),
]


@pytest.mark.parametrize("path, body, param, words", BAD, ids=[f"{p[4:]}-{w}" for p, _, _, w in BAD])
def test_bad_logprob_fields_get_400_naming_them(server, path, body, param, words):
    with server.client() as http:
        response = http.post(path, json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_the_openai_client_sees_a_bad_value_as_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], logprobs=True, top_logprobs=30)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1, logprobs=0).choices[0].logprobs
