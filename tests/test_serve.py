"""`zipage serve` as a real server process, driven by the official openai client and plain HTTP."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from zipage.engine import SamplingParams
from zipage.engine.events import snapshot_from_dict
from serve_helpers import (API_KEY, MODEL, offline_engine, openai_client, scrape, start_server, stop_server,
                           wait_for, wait_until_idle)

LONG = 5000  # output tokens of a request meant to be cut short (compression keeps its KV bounded)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("serve") / "server.log")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    """The same engine offline: same model, knobs and seed, hence the same weights and greedy tokens."""
    llm = offline_engine()
    yield llm
    llm.close()


def prompt_ids(i: int, n: int = 8) -> list[int]:
    return [(37 * i + 11 * k) % 500 + 3 for k in range(n)]


def test_completions_match_the_offline_engine(client, offline):
    """Greedy tokens through the server equal the offline engine's; usage counts are exact."""
    prompt = prompt_ids(1)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    choice = reply.choices[0]
    assert choice.model_extra["token_ids"] == expected.token_ids
    assert choice.text == expected.text
    assert choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (8, 20, 28)
    assert reply.object == "text_completion" and reply.model == MODEL


def test_chat_streaming_equals_not_streaming(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 16 or whole.choices[0].finish_reason == "stop"

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert reasons == [whole.choices[0].finish_reason]
    # The same usage, but for the prompt tokens the prefix cache served the second asking.
    same = dict(exclude={"prompt_tokens_details"})
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(**same) == whole.usage.model_dump(**same)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_developer_role_is_a_system_message_and_plain_text_format_is_accepted(client):
    """OpenAI's "developer" role reads as "system" (chat templates know only the latter), and
    response_format {"type": "text"} asks for nothing beyond plain text."""
    def reply(role, **extra):
        messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True}, **extra)

    system, developer = reply("system"), reply("developer", response_format={"type": "text"})
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens
    assert developer.choices[0].message.content == system.choices[0].message.content


def test_stop_string_ends_the_answer_before_it(client):
    base = client.completions.create(model=MODEL, prompt=prompt_ids(2), max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(base[i:i + 2] for i in range(4, len(base) - 2) if base[i:i + 2].strip())
    cut = client.completions.create(model=MODEL, prompt=prompt_ids(2), max_tokens=30, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == base[:base.index(stop)]


def test_concurrent_streaming_clients_get_their_own_greedy_answers(server, client):
    """Eight clients at once: each stream equals that prompt's answer when sent alone."""
    alone = [client.completions.create(model=MODEL, prompt=prompt_ids(i), max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text for i in range(8)]

    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt_ids(i), max_tokens=24, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(8)))

    results = asyncio.run(all_at_once())
    assert [text for text, _ in results] == alone
    assert [usage for _, usage in results] == [24] * 8


def test_many_concurrent_streams_give_the_offline_engines_greedy_answers(server, offline):
    """Twenty-four streams at once, tokens and text detokenized by the server, against one offline batch."""
    prompts = [prompt_ids(100 + i, n=4 + i % 5) for i in range(24)]
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))

    async def one(http: httpx.AsyncClient, prompt: list[int]) -> tuple[list[int], str]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        ids, text = [], ""
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    ids += choice.get("token_ids", [])
                    text += choice["text"]
        return ids, text

    async def all_at_once():
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=120) as http:
            return await asyncio.gather(*(one(http, p) for p in prompts))

    results = asyncio.run(all_at_once())
    assert [ids for ids, _ in results] == [out.token_ids for out in expected]
    assert [text for _, text in results] == [out.text for out in expected]


def test_streamed_stop_string_ends_the_answer_before_it(client):
    """Stop strings are matched in the engine: the streamed text is cut as the whole answer is."""
    base = client.completions.create(model=MODEL, prompt=prompt_ids(3), max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(base[i:i + 2] for i in range(6, len(base) - 2) if base[i:i + 2].strip())
    chunks = list(client.completions.create(model=MODEL, prompt=prompt_ids(3), max_tokens=30, temperature=0,
                                            stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == base[:base.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_client_that_disconnects_mid_stream_frees_its_blocks(server):
    with server.client() as http:
        with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Tell me a long story",
                                                          "max_tokens": LONG, "ignore_eos": True,
                                                          "stream": True}) as response:
            assert response.status_code == 200
            request_id = int(response.headers["x-zipage-request-id"])
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(6))]
            assert sum(line.startswith("data: ") for line in received) >= 3
            assert any(r["id"] == request_id for r in server.snapshot()["requests"])
        # leaving the block closes the connection mid-stream

    snap = wait_until_idle(server)
    assert snap["pool"]["free"] == snap["pool"]["total"]
    aborted = [e for e in snap["events"] if e["request"] == request_id and e["kind"] == "aborted"]
    assert aborted and aborted[0]["details"]["output_tokens"] < LONG


def test_client_that_disconnects_while_waiting_for_a_whole_answer_aborts_it(server):
    """Not streaming: the request is aborted as soon as its client goes, not when it would end."""

    async def leave_early() -> int:
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=60) as http:
            before = {r["id"] for r in server.snapshot()["requests"]}
            task = asyncio.ensure_future(http.post("/v1/completions", json={
                "model": MODEL, "prompt": "Tell me another long story", "max_tokens": LONG, "ignore_eos": True}))
            deadline = asyncio.get_running_loop().time() + 120
            while True:  # until the request is generating
                running = [r for r in (await http.get("/zipage/snapshot?fresh=1")).json()["requests"]
                           if r["id"] not in before and r["output_tokens"] > 0]
                if running:
                    break
                assert asyncio.get_running_loop().time() < deadline, "the request never started"
                await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return running[0]["id"]

    request_id = asyncio.run(leave_early())
    snap = wait_until_idle(server)
    assert any(e["request"] == request_id and e["kind"] == "aborted" for e in snap["events"])


def test_a_list_of_prompts_gets_one_choice_each_in_prompt_order(client, offline):
    """Token-id prompts of different lengths: each choice is the offline engine's answer to its prompt, its
    index the prompt's place; usage adds up over the prompts."""
    prompts = [prompt_ids(20 + i, n=5 + 3 * i) for i in range(3)]
    reply = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in reply.choices] == [e.token_ids for e in expected]
    assert [c.model_extra["prompt_token_ids"] for c in reply.choices] == prompts
    assert [c.text for c in reply.choices] == [e.text for e in expected]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (sum(map(len, prompts)), 36)


def test_a_list_of_text_prompts_answers_each_as_alone(client):
    texts = ["The sky is", "Once upon a time", "def main():"]
    alone = [client.completions.create(model=MODEL, prompt=text, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True}) for text in texts]
    together = client.completions.create(model=MODEL, prompt=texts, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert together.usage.completion_tokens == 30


def test_streamed_prompts_carry_their_index_and_end_with_one_usage_chunk(server, offline):
    prompts = [prompt_ids(40 + i, n=4 + i) for i in range(4)]
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    with server.client() as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            ids = response.headers["x-zipage-request-id"].split(",")
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert len(set(ids)) == 4
    *answers, last = chunks
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": sum(map(len, prompts)),
                                                       "completion_tokens": 64,
                                                       "total_tokens": sum(map(len, prompts)) + 64,
                                                       "prompt_tokens_details": {"cached_tokens": 0},
                                                       "kv_compressions": 0}
    texts, tokens, reasons = [""] * 4, [[] for _ in range(4)], [[] for _ in range(4)]
    for chunk in answers:
        assert "usage" not in chunk and chunk["id"] == last["id"]
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        tokens[choice["index"]] += choice.get("token_ids", [])
        if choice["finish_reason"]:
            reasons[choice["index"]].append(choice["finish_reason"])
    assert tokens == [out.token_ids for out in expected]
    assert texts == [out.text for out in expected]
    assert reasons == [["length"]] * 4


def test_a_client_that_leaves_a_list_of_prompts_aborts_every_one(server):
    body = {"model": MODEL, "prompt": ["A first story", "A second story", "A third story"], "max_tokens": LONG,
            "ignore_eos": True, "stream": True}
    with server.client() as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            ids = [int(i) for i in response.headers["x-zipage-request-id"].split(",")]
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(12))]
            assert sum(line.startswith("data: ") for line in received) >= 6
            assert set(ids) <= {r["id"] for r in server.snapshot()["requests"]}
        # leaving the block closes the connection mid-stream

    snap = wait_until_idle(server)
    assert snap["pool"]["free"] == snap["pool"]["total"]
    for request_id in ids:
        aborted = [e for e in snap["events"] if e["request"] == request_id and e["kind"] == "aborted"]
        assert aborted and aborted[0]["details"]["output_tokens"] < LONG


def test_a_refused_prompt_refuses_its_whole_list_and_leaves_nothing_behind(server):
    """A prompt too long for the context is found before any prompt is sent; one the engine refuses
    (longer than the pool) after the others were taken, which are then aborted."""
    def post(prompts):
        before = server.snapshot()
        with server.client() as http:
            response = http.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": LONG,
                                                          "ignore_eos": True})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["message"].startswith("prompt[2]: ")
        after = wait_until_idle(server)
        assert after["pool"]["free"] == after["pool"]["total"]
        seen = {(e["request"], e["kind"]) for e in before["events"]}
        return before, after, [e for e in after["events"] if (e["request"], e["kind"]) not in seen]

    before, after, new = post([[5, 6, 7], [8, 9], [7] * 9000])
    assert after["totals"]["prompt_tokens"] == before["totals"]["prompt_tokens"] and not new  # none was sent
    before, after, new = post([[5, 6, 7], [8, 9], [7] * 2000])
    aborted = [e for e in new if e["kind"] == "aborted"]
    assert len(aborted) == 2 and all(e["details"]["output_tokens"] < LONG for e in aborted)


@pytest.mark.parametrize("frequency, presence", [(0.0, 0.0), (1.0, 0.0), (0.3, 1.5), (-0.5, 0.5)])
def test_penalties_give_the_offline_engines_greedy_answers(client, offline, frequency, presence):
    prompt = prompt_ids(5)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                      frequency_penalty=frequency, presence_penalty=presence,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=frequency,
                            presence_penalty=presence)
    expected = offline.generate([prompt], params)[0]
    assert reply.choices[0].model_extra["token_ids"] == expected.token_ids
    plain = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert (expected.token_ids == plain.token_ids) == (frequency == presence == 0)


BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', None, "not valid JSON"),
    ("/v1/completions", b'["a list"]', None, "JSON object"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature", "temperature=-1"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p", "top_p=1.5"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, "top_k", "top_k=-2"),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, "min_p", "min_p=2"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "repetition_penalty=0"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens=0"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, "seed", "seed='x'"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop", "stop=5"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n", "only n=1"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", "presence_penalty=2.5"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty", "frequency_penalty=-3"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": "1"},
     "frequency_penalty", "frequency_penalty='1'"),
    ("/v1/completions", {"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos", "ignore_eos='yes'"),
    ("/v1/completions", {"prompt": []}, "prompt", "non-empty list"),
    ("/v1/completions", {"prompt": ["one", [5, 6]]}, "prompt", "(all of one kind)"),
    ("/v1/completions", {"prompt": ["p"] * 257}, "prompt", "at most 256"),
    ("/v1/completions", {"prompt": ["hi", ""]}, None, "prompt[1]: prompt is empty"),
    ("/v1/completions", {"prompt": [[5, 6], [1, 2, 512]]}, None, "prompt[1]: prompt token ids out of range"),
    ("/v1/completions", {"prompt": ["one", "two"], "kv_budget": 1000}, "kv_budget", "prompt[0]: kv_budget=1000"),
    ("/v1/completions", {"prompt": ""}, None, "prompt is empty"),
    ("/v1/completions", {"prompt": [7] * 9000}, None, "max_model_len is 8192"),
    ("/v1/completions", {"prompt": [1, 2, 512]}, None, "out of range"),
    ("/v1/completions", {"prompt": [7] * 2000}, None, "the KV pool holds only 1024"),  # refused by the engine
    ("/v1/completions", {"prompt": [[5, 6], [7] * 9000]}, None, "prompt[1]: prompt has 9000 tokens; max_model_len"),
    ("/v1/completions", {"prompt": [[5, 6], [7] * 2000]}, None, "prompt[1]: prompt has 2000 tokens but the KV pool"),
    ("/v1/chat/completions", {"messages": []}, "messages", "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, "messages", "content"),
    ("/v1/chat/completions", {"messages": [{"role": "usr", "content": "hi"}]}, "messages", "role='usr'"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "42", "tool_call_id": 7}]}, "messages",
     "tool_call_id must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "xml"}}, "response_format", "must be {type: text}"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],  # the preset's template: no tools
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "does not take tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream",
     "stream='yes'"),
]


@pytest.mark.parametrize("path, body, param, words", BAD_REQUESTS, ids=[w for *_, w in BAD_REQUESTS])
def test_bad_request_gets_400_in_openai_shape(server, path, body, param, words):
    with server.client() as http:
        if isinstance(body, bytes):
            response = http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            response = http.post(path, json={"model": MODEL, **body} if "model" not in body else body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert words in error["message"]
        assert error["param"] == param
        too_long = "max_model_len" in words or "KV pool" in words
        assert (error["code"] == "context_length_exceeded") == too_long  # OpenAI's code, which clients test
        # ...and the server keeps serving
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_openai_client_sees_bad_values_as_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="top_p=0"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], top_p=0)
    for field, value in (("presence_penalty", -2.5), ("frequency_penalty", 2.01)):
        with pytest.raises(openai.BadRequestError, match=f"{field}=") as refused:
            client.completions.create(model=MODEL, prompt="hi", **{field: value})
        assert refused.value.param == field
    with pytest.raises(openai.NotFoundError, match="not served"):  # 404, code model_not_found
        client.completions.create(model="other", prompt="hi")
    assert [m.id for m in client.models.list()] == [MODEL]


def test_api_key_is_required_everywhere_but_health(server):
    for path in ("/v1/models", "/metrics", "/zipage/snapshot", "/zipage/config"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            response = httpx.get(server.url + path, headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_unknown_path_gets_openai_shaped_404(server):
    with server.client() as http:
        response = http.get("/v1/nothing")
    assert response.status_code == 404 and "Not Found" in response.json()["error"]["message"]


def test_metrics_count_what_the_requests_did(server, client):
    prompt = list(range(40, 64))  # 24 tokens: a full block the second request finds in the prefix cache
    before = scrape(server)
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = scrape(server)

    def grew(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert grew("zipage_time_to_first_token_seconds_count") == 2
    assert grew("zipage_inter_token_latency_seconds_count") == 2 * 5
    assert grew("zipage_e2e_request_latency_seconds_count") == 2
    assert grew("zipage_requests_total", (("finish_reason", "length"),)) == 2
    assert grew("zipage_generation_tokens_total") == 12
    assert grew("zipage_prompt_tokens_total") == 48
    hits = grew("zipage_prefix_cache_hit_tokens_total")  # the second prompt reuses whole blocks of the first
    assert hits > 0 and hits % 16 == 0
    assert after[("zipage_kv_blocks_total", ())] == 64
    assert after[("zipage_requests_running", ())] == after[("zipage_requests_waiting", ())] == 0
    assert after[("zipage_kv_blocks_used", ())] == 0 and after[("zipage_kv_cache_usage_ratio", ())] == 0
    for name in ("zipage_preemptions_total", "zipage_compressions_total"):
        assert (name, ()) in after
    ttft_sum = after[("zipage_time_to_first_token_seconds_sum", ())]
    assert ttft_sum > before.get(("zipage_time_to_first_token_seconds_sum", ()), 0.0)


def test_metrics_show_a_running_request_and_its_compressions(server):
    """While a long request streams, the gauges see it and the compressions counter follows it."""
    before = scrape(server)
    with server.client() as http:
        with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "A long one", "max_tokens": LONG,
                                                          "ignore_eos": True, "stream": True}) as response:
            request_id = int(response.headers["x-zipage-request-id"])
            lines = response.iter_lines()  # kept: dropping the iterator would close the stream
            next(lines)

            def compressed_three_times():
                mine = [r for r in server.snapshot()["requests"] if r["id"] == request_id]
                assert mine, "the request ended before it was compressed three times"
                return mine[0]["times_compressed"] >= 3

            wait_for(compressed_three_times, what="three compressions")  # a budget of 2 blocks of 16 tokens
            during = scrape(server)
    assert during[("zipage_requests_running", ())] + during[("zipage_requests_waiting", ())] == 1
    assert 1 <= during[("zipage_kv_blocks_used", ())] <= 3  # compressed: never more than budget + 1 blocks
    assert during[("zipage_compressions_total", ())] - before[("zipage_compressions_total", ())] >= 3
    wait_until_idle(server)


def test_snapshot_endpoint_round_trips_into_an_engine_snapshot(server):
    with server.client() as http:  # a request of its own, so a finished event is there whatever ran before
        done = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert done.status_code == 200
    wait_until_idle(server)
    data = server.snapshot()
    snap = snapshot_from_dict(data)
    assert snap.model == MODEL and snap.pool.total == 64 and snap.pool.block_size == 16
    assert snap.compression is True
    assert any(e.kind == "finished" for e in snap.events)
    with server.client() as http:
        config = http.get("/zipage/config").json()
    assert config["model"] == MODEL and config["num_kv_blocks"] == 64 and config["window"] == 8


def test_event_stream_carries_a_requests_life(server):
    """/zipage/events: admitted, prefilled and finished for a request made while listening."""
    seen: list[dict] = []
    connected = threading.Event()

    def listen():
        with server.client() as http:
            with http.stream("GET", "/zipage/events") as response:
                for line in response.iter_lines():
                    connected.set()
                    if line.startswith("data: "):
                        seen.append(json.loads(line[6:]))
                        if seen[-1]["kind"] == "finished":
                            return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    assert connected.wait(60)
    with server.client() as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "events", "max_tokens": 3})
    request_id = int(response.headers["x-zipage-request-id"])
    listener.join(120)
    kinds = [e["kind"] for e in seen if e["request"] == request_id]
    assert kinds[:2] == ["admitted", "prefilled"] and kinds[-1] == "finished"
