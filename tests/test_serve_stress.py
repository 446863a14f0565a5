"""A bounded stress run against one server on the loopback: many clients at once that stream to the
end, leave mid-stream, wait for whole answers, send refused bodies and abort in loops. Afterwards
every block is back in the pool, nothing crashed, and a greedy answer is the one the server gave
before the storm. Bounded in requests, not in time: it passes however busy the CPU is."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from serve_helpers import API_KEY, DEADLINE_S, MODEL, start_server, stop_server, wait_until_idle

CLIENTS = 16
ROUNDS = 4  # requests per client
LONG = 4000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("stress") / "server.log")
    yield server
    stop_server(server)


def greedy_body(prompt: list[int], max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


async def stream_to_end(http: httpx.AsyncClient, rng: random.Random) -> str:
    async with http.stream("POST", "/v1/completions", json=greedy_body([rng.randrange(1, 400)] * 5, 12, True)) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]", lines[-3:]
    return "streamed"


async def leave_mid_stream(http: httpx.AsyncClient, rng: random.Random) -> str:
    async with http.stream("POST", "/v1/completions", json=greedy_body([7, 8, 9], LONG, True)) as r:
        assert r.status_code == 200
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= rng.randrange(1, 6):
                break  # leaving the block closes the connection: the server aborts the request
    return "left"


async def whole_answer(http: httpx.AsyncClient, rng: random.Random) -> str:
    r = await http.post("/v1/completions", json=greedy_body([rng.randrange(1, 400), 3], 8))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    return "whole"


async def refused(http: httpx.AsyncClient, rng: random.Random) -> str:
    body = rng.choice([{"model": MODEL, "prompt": "x", "temperature": -3},
                       {"model": MODEL, "prompt": [], "max_tokens": 2},
                       {"model": MODEL, "prompt": "x", "stop": ["a"] * 500}])
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 400 and "error" in r.json()
    return "refused"


async def abort_while_waiting(http: httpx.AsyncClient, rng: random.Random) -> str:
    task = asyncio.ensure_future(http.post("/v1/completions", json=greedy_body([11, 12], LONG)))
    await asyncio.sleep(rng.uniform(0.0, 0.3))  # any moment: queued, prefilling or decoding
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return "cancelled"


ACTIONS = [stream_to_end, leave_mid_stream, whole_answer, refused, abort_while_waiting]


def test_a_storm_of_clients_leaves_the_server_serving_and_the_pool_whole(server):
    reference = {"prompt": [21, 22, 23, 24], "max_tokens": 16}
    with server.client() as http:
        before = http.post("/v1/completions", json=greedy_body(reference["prompt"], reference["max_tokens"])).json()

    async def client(i: int) -> list[str]:
        rng = random.Random(i)
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=DEADLINE_S) as http:
            return [await rng.choice(ACTIONS)(http, rng) for _ in range(ROUNDS)]

    async def storm():
        return await asyncio.gather(*(client(i) for i in range(CLIENTS)))

    done = [kind for kinds in asyncio.run(storm()) for kind in kinds]
    assert len(done) == CLIENTS * ROUNDS and len(set(done)) == len(ACTIONS)  # every kind happened
    snap = wait_until_idle(server)
    assert snap["pool"]["free"] == snap["pool"]["total"] and snap["pool"]["query_slots_used"] == 0
    with server.client() as http:
        assert http.get("/health").status_code == 200
        after = http.post("/v1/completions", json=greedy_body(reference["prompt"], reference["max_tokens"])).json()
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert "Traceback" not in server.log.read_text()
