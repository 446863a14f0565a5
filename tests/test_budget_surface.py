"""A request's own KV budget and the budget policy, where users meet them: the server's `kv_budget` field
(and its 400s), `zipage generate --kv-budget`, `--budget-policy` on every engine command, the chat's
`/budget` (local, plain and attached), and top's budget column, event lines and teaching notes.
Everything runs on the tiny random model; waits are deadlines on conditions, never timings."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json

import openai
import pytest
from typer.testing import CliRunner

from console_helpers import KNOBS, help_text, type_line, wait_for as pilot_wait_for
from serve_helpers import API_KEY, MODEL, pool_idle, scrape, start_server, stop_server, wait_for, wait_until_idle
from zipage.cli.console.chat import ChatApp
from zipage.cli.main import app as cli
from zipage.cli.console.plain_chat import Conversation, run_plain
from zipage.cli.serve.remote import RemoteEngine
from zipage.cli.console.top import TopApp, explain_step, row_cells
from zipage.cli.console.widgets import EventLog, describe_event, drain
from zipage.engine.config import SamplingParams
from zipage.engine.api.thread import EngineThread

LONG = 5000  # output tokens of a request that is stopped by hand
TINY = ["--model", MODEL, "--device", "cpu", "--block-size", "16", "--window", "8", "--num-kv-blocks", "64"]
BUDGET_WORDS = "must be None or an integer number of blocks >= 1"


# -- the server -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Fixed budgets, the engine's 2 blocks of 16, a pool of 64 (serve_helpers.KNOBS)."""
    server = start_server(tmp_path_factory.mktemp("budget-serve") / "server.log")
    yield server
    stop_server(server)


def compressions_of(snapshot: dict, request_id: int) -> list[dict]:
    return [e["details"] for e in snapshot["events"] if e["request"] == request_id and e["kind"] == "compressed"]


def test_server_holds_a_streamed_request_to_its_kv_budget(server):
    body = {"model": MODEL, "prompt": "a budget of one block", "max_tokens": LONG, "ignore_eos": True,
            "stream": True, "kv_budget": 1}
    with server.client() as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            request_id = int(response.headers["x-zipage-request-id"])
            lines = response.iter_lines()  # kept: dropping the iterator would close the stream
            next(lines)

            def compressed_twice():
                mine = [r for r in server.snapshot()["requests"] if r["id"] == request_id]
                assert mine, "the request ended before it was compressed twice"
                return mine[0] if mine[0]["times_compressed"] >= 2 else None

            row = wait_for(compressed_twice, what="two compressions")
            snapshot = server.snapshot()
    assert row["kv_budget"] == 1 and row["compressed_for"] == "budget"
    assert len(row["block_table"]) <= 2  # budget + 1, not the engine's 2 + 1
    compressions = compressions_of(snapshot, request_id)
    assert len(compressions) >= 2
    assert all(c["budget_blocks"] == 1 and c["reason"] == "budget" and c["tokens_after"] == 16 for c in compressions)
    wait_until_idle(server)


def test_openai_client_sends_kv_budget_in_extra_body(server):
    messages = [{"role": "user", "content": "Tell me about budgets, at length."}]
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        budgets = {}
        for kv_budget in (1, None):  # None: the engine's 2 blocks, so the comparison is not vacuous
            extra = {"ignore_eos": True, **({"kv_budget": kv_budget} if kv_budget else {})}
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                                   extra_body=extra)
            request_id = int(reply.id.rsplit("-", 1)[1])
            budgets[kv_budget] = {c["budget_blocks"] for c in compressions_of(server.snapshot(), request_id)}
        assert budgets == {1: {1}, None: {2}}
        with pytest.raises(openai.BadRequestError, match="kv_budget=0"):
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body={"kv_budget": 0})


BAD_BUDGETS = [(0, BUDGET_WORDS), (-1, BUDGET_WORDS), (2.5, BUDGET_WORDS), ("4", BUDGET_WORDS),
               (True, BUDGET_WORDS), (64, "the KV pool has 64"), (10 ** 9, "the KV pool has 64")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("value, words", BAD_BUDGETS, ids=[repr(v) for v, _ in BAD_BUDGETS])
def test_bad_kv_budget_gets_400_and_leaves_nothing_behind(server, path, value, words):
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    with server.client() as http:
        response = http.post(path, json={"model": MODEL, **prompt, "max_tokens": 4, "kv_budget": value})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "kv_budget", None)
        assert f"kv_budget={value!r}" in error["message"] and words in error["message"]
        assert pool_idle(server.snapshot())  # the refused request never entered the engine
        ok = http.post(path, json={"model": MODEL, **prompt, "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_a_full_kv_server_refuses_any_kv_budget(tmp_path):
    server = start_server(tmp_path / "server.log", ["--no-compression"])
    try:
        with server.client() as http:
            refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                         "kv_budget": 2})
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert error["param"] == "kv_budget" and "compression is off" in error["message"]
            assert pool_idle(server.snapshot())
            for extra in ({}, {"kv_budget": None}):  # no budget, or null, is the engine's: full KV
                ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra})
                assert ok.status_code == 200, ok.text
    finally:
        stop_server(server)


def test_elastic_server_compresses_to_each_floor_when_the_pool_is_short(tmp_path):
    """Four endless streams outgrow a 64-block pool: the engine compresses them down to their floors
    (1 block for two of them, the engine's 2 for the others) instead of preempting."""
    server = start_server(tmp_path / "server.log", ["--budget-policy", "elastic"])
    try:
        floors = {}
        with server.client() as http, contextlib.ExitStack() as streams:
            assert http.get("/zipage/config").json()["budget_policy"] == "elastic"
            for i, kv_budget in enumerate((1, None, 1, None)):
                body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": LONG, "ignore_eos": True,
                        "stream": True, **({"kv_budget": kv_budget} if kv_budget else {})}
                response = streams.enter_context(http.stream("POST", "/v1/completions", json=body))
                assert response.status_code == 200
                floors[int(response.headers["x-zipage-request-id"])] = kv_budget or 2

            def squeezed_by_the_pool():
                snapshot = server.snapshot()
                rows = [r for r in snapshot["requests"] if r["id"] in floors]
                assert len(rows) == 4, "a stream ended before the pool ran short"
                # compressed_for is set when a compression is planned, the totals and events when it lands
                planned = {r["id"] for r in rows if r["compressed_for"] == "pool"}
                landed = {i for i in floors if any(c["reason"] == "pool" for c in compressions_of(snapshot, i))}
                return snapshot if planned == landed == set(floors) else None

            snapshot = wait_for(squeezed_by_the_pool, what="a pool compression of every stream")
        assert {r["id"]: r["kv_budget"] for r in snapshot["requests"] if r["id"] in floors} == floors
        assert snapshot["totals"]["preemptions"] == 0 and snapshot["totals"]["pool_compressions"] >= 4
        metrics = scrape(server)
        assert metrics[("zipage_pool_compressions_total", ())] >= 4 and metrics[("zipage_preemptions_total", ())] == 0
        for request_id, floor in floors.items():
            compressions = compressions_of(snapshot, request_id)
            assert compressions and all(c["reason"] == "pool" and c["budget_blocks"] == floor for c in compressions)
        wait_until_idle(server)
    finally:
        stop_server(server)


def test_attached_chat_sends_its_budget_to_the_server(server):
    remote = RemoteEngine(server.url, API_KEY)
    try:
        conv = Conversation("attached", temperature=0.0)
        assert conv.apply("/budget", "1", remote) == "KV budget 1 block"
        with pytest.raises(ValueError, match="KV pool has 64"):
            conv.apply("/budget", "64", remote)  # checked against the server's pool before any message
        assert conv.kv_budget == 1
        params = dataclasses.replace(conv.params(), max_tokens=LONG, ignore_eos=True)
        handle = remote.submit(conv.messages_for("hello"), params, session=conv.name)

        def compressed():
            mine = [r for r in server.snapshot()["requests"] if r["id"] == handle.id]
            assert mine, "the request ended before it was compressed"
            return mine[0] if mine[0]["times_compressed"] else None

        row = wait_for(compressed, what="a compression of the attached chat's request")
        assert row["kv_budget"] == 1 and row["session"] == "attached"
        remote.abort(handle)
        assert handle.result(timeout=60).finish_reason == "abort"
    finally:
        remote.close()
    wait_until_idle(server)


# -- the command line ---------------------------------------------------------------------------

def one_line_error(result, message: str) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())  # rich wraps long lines at the console's width
    assert text.startswith("error: ") and message in text and "Traceback" not in text, result.output
    assert text.count("error:") == 1


@pytest.mark.parametrize("value", ["0", "-3", "2.5", "four"])
def test_generate_refuses_a_bad_kv_budget_before_loading_the_model(value):
    result = CliRunner().invoke(cli, ["generate", "hi", "--kv-budget", value, "--model", "random:nope"])
    one_line_error(result, f"--kv-budget {value}: must be a whole number of blocks >= 1")


def test_generate_refuses_a_budget_the_engine_cannot_hold():
    runner = CliRunner()
    one_line_error(runner.invoke(cli, ["generate", "hi", "--raw", "--kv-budget", "64", *TINY]),
                   "kv_budget=64: a request may hold kv_budget + 1 blocks, and the KV pool has 64")
    one_line_error(runner.invoke(cli, ["generate", "hi", "--raw", "--kv-budget", "2", "--no-compression", *TINY]),
                   "kv_budget=2: this engine keeps every request's full KV (compression is off)")
    one_line_error(runner.invoke(cli, ["generate", "hi", "--budget-policy", "sometimes", *TINY]),
                   "budget_policy='sometimes': must be one of fixed, elastic")


def test_generate_runs_with_a_kv_budget_under_either_policy():
    for policy in ("fixed", "elastic"):
        result = CliRunner().invoke(cli, ["generate", "hello", "--raw", "--temperature", "0", "--max-tokens", "40",
                                          "--kv-budget", "1", "--budget-policy", policy, "--stats", *TINY])
        assert result.exit_code == 0, result.output
        assert "40 tokens in" in result.output


def test_every_engine_command_takes_the_budget_policy():
    for command in ("chat", "top", "generate", "bench", "serve"):
        result = CliRunner().invoke(cli, [command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0
        assert "--budget-policy" in result.output, command
    assert "--kv-budget" in CliRunner().invoke(cli, ["generate", "--help"], env={"COLUMNS": "200"}).output


def test_bench_runs_elastic_budgets(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(cli, ["bench", "--mode", "zipage", "--num-requests", "2", "--input-len", "12",
                                      "--output-len", "40", "--repeats", "1", "--budget-policy", "elastic",
                                      "--json", str(out), *TINY])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["results"][0]["output_tokens"] == 2 * 40


# -- chat ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    service = EngineThread("random:llama-tiny", **KNOBS)  # budget 2 blocks of 16, a pool of 64
    yield service
    service.close()


def test_chat_budget_command_sets_shows_and_resets_the_sessions_budget(engine):
    async def run():
        app = ChatApp(engine, temperature=0.0, max_tokens=60)
        async with app.run_test(size=(120, 36)) as pilot:
            session = app.current

            def last_note() -> str:
                return list(app._notifications)[-1].message

            await type_line(pilot, "/budget")
            assert last_note() == "chat-1: KV budget: the engine's, 2 blocks"
            await type_line(pilot, "/budget 1")
            assert session.conv.kv_budget == 1 and last_note() == "chat-1: KV budget 1 block"
            assert "KV budget 1" in str(app.settings.render())
            for bad, words in (("0", "give a whole number of blocks >= 1"), ("2.5", "give a whole number"),
                               ("lots", "give a whole number"), ("64", "the KV pool has 64")):
                await type_line(pilot, f"/budget {bad}")
                assert words in last_note() and list(app._notifications)[-1].severity == "error"
                assert session.conv.kv_budget == 1  # refused: the budget stays
            events = engine.subscribe()
            try:
                await type_line(pilot, "Tell me a long story about blocks.")
                await pilot_wait_for(pilot, lambda: not session.busy and len(session.conv.history) == 2,
                                     what="the answer")
                compressions = [e for e in drain(events) if e.kind == "compressed"]
            finally:
                engine.unsubscribe(events)
            assert compressions and {e.budget_blocks for e in compressions} == {1}
            await type_line(pilot, "/budget default")
            assert session.conv.kv_budget is None and last_note() == "chat-1: KV budget: the engine's, 2 blocks"
            assert "/budget N" in await help_text(app, pilot)

    asyncio.run(run())


def test_plain_chat_budget_command(engine):
    lines = "/budget 1\n/temp 0\n/max 40\nA story about blocks, please.\n/budget\n/budget 0\n/budget 99\n" \
            "/budget off\n/budget\n"
    out, err = io.StringIO(), io.StringIO()
    events = engine.subscribe()
    try:
        conv = Conversation("plain")
        run_plain(engine, conv, stdin=io.StringIO(lines), out=out, err=err)
        compressions = [e for e in drain(events) if e.kind == "compressed"]
    finally:
        engine.unsubscribe(events)
    assert err.getvalue().splitlines() == [
        "KV budget 1 block", "temperature 0", "max tokens 40", "KV budget 1 block",
        "error: /budget 0: give a whole number of blocks >= 1, or default",
        "error: /budget 99: a request may hold budget + 1 blocks, and the KV pool has 64",
        "KV budget: the engine's, 2 blocks", "KV budget: the engine's, 2 blocks"]
    assert out.getvalue().count("\n") == 1 and len(conv.history) == 2
    assert compressions and {e.budget_blocks for e in compressions} == {1}


# -- top -----------------------------------------------------------------------------------------

def step_until(service, events, found, max_steps: int = 3000):
    """Step a paused engine until `found(events of the step)` gives something; (before, after,
    events, what it gave)."""
    for _ in range(max_steps):
        before = service.snapshot(fresh=True)
        drain(events)
        after = service.step_once()
        fresh = drain(events)
        hit = found(fresh)
        if hit:
            return before, after, fresh, hit
    raise AssertionError(f"nothing found in {max_steps} steps")


def test_top_shows_why_each_request_was_compressed_under_elastic_budgets():
    """Six requests outgrow a 24-block pool under elastic budgets: a pool compression shows in the
    requests table, the event log and the teaching notes, at 80×24 too."""
    service = EngineThread("random:llama-tiny", device="cpu", block_size=16, window=8, max_cache_blocks_per_seq=2,
                           num_kv_blocks=24, budget_policy="elastic")
    events = service.subscribe()
    try:
        service.pause()
        floors = {}
        for i in range(6):
            kv_budget = 1 if i % 2 else None
            handle = service.submit(list(range(1 + i, 9 + i)), SamplingParams(temperature=0.0, max_tokens=200,
                                                                                ignore_eos=True, kv_budget=kv_budget))
            floors[handle.id] = kv_budget or 2
        before, after, fresh, pool = step_until(
            service, events, lambda es: next((e for e in es if e.kind == "compressed" and e.reason == "pool"), None))
        rid, floor = pool.request, floors[pool.request]
        assert pool.budget_blocks == floor
        info = next(r for r in after.requests if r.id == rid)
        assert info.compressed_for == "pool" and info.kv_budget == floor
        assert row_cells(info)[6] == f"{floor}/{len(info.block_table)} pool"
        assert describe_event(pool).startswith(f"compressed {pool.blocks_before}→{pool.blocks_after} blocks, "
                                               f"pool short, down to its floor of {floor}: ")
        note = " ".join(" ".join(explain_step(before, after, fresh, rid)).split())
        assert (f"Why: the pool was short of free blocks, so #{rid} was compressed from {pool.blocks_before} blocks "
                f"down to its floor of {floor} block{'s' if floor != 1 else ''} instead of anyone being preempted."
                ) in note

        async def run():
            app = TopApp(service)  # the engine stays paused until the app ends
            async with app.run_test(size=(80, 24)) as pilot:
                await pilot.pause()
                assert "budget/held" in [str(c.label) for c in app.table.columns.values()]
                assert app.table.get_row(str(rid))[6] == row_cells(info)[6]
                await pilot.press("f2")  # the side panes, hidden at 80 columns
                log = app.query_one(EventLog)
                log.add([pool])
                await pilot.pause()
                assert log.line(pool).startswith(f"#{rid} compressed {pool.blocks_before}→{pool.blocks_after} blocks, "
                                                 "pool short")
                assert "pool short" in " ".join(str(log.render()).split())

        asyncio.run(run())
    finally:
        service.resume()
        service.unsubscribe(events)
        service.close()


def test_top_says_when_a_request_reached_its_own_budget():
    service = EngineThread("random:llama-tiny", device="cpu", block_size=16, window=8, max_cache_blocks_per_seq=2,
                           num_kv_blocks=32)
    events = service.subscribe()
    try:
        service.pause()
        handle = service.submit(list(range(1, 9)), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True,
                                                                  kv_budget=1))
        before, after, fresh, compressed = step_until(
            service, events, lambda es: next((e for e in es if e.kind == "compressed"), None))
        assert compressed.request == handle.id and compressed.reason == "budget" and compressed.budget_blocks == 1
        info = next(r for r in after.requests if r.id == handle.id)
        assert row_cells(info)[6] == f"1/{len(info.block_table)} budget"
        assert describe_event(compressed).startswith(
            f"compressed {compressed.blocks_before}→{compressed.blocks_after} blocks, at its budget of 1: ")
        note = " ".join(" ".join(explain_step(before, after, fresh, handle.id)).split())
        assert "Why: it reached its KV budget of 1 block, so it was compressed back to it." in note
    finally:
        service.resume()
        service.unsubscribe(events)
        service.close()
