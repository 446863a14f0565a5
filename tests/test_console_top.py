"""`zipage top`: the load generator, the prompts file, and teaching mode stepping the real engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from console_helpers import help_text, wait_for
from zipage.engine.config import SamplingParams
from zipage.engine.api.thread import EngineThread
from zipage.cli.console.top import LoadGenerator, TopApp, explain_step, prompt_source, read_prompts
from zipage.cli.console.widgets import PoolMap, drain

KNOBS = dict(device="cpu", block_size=16, window=8, max_cache_blocks_per_seq=2, num_kv_blocks=48)


@pytest.fixture
def engine():
    service = EngineThread("random:llama-tiny", **KNOBS)
    yield service
    service.close()


def load_for(engine, concurrency=3, input_len=8, output_len=200):
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    return LoadGenerator(engine, prompt_source(engine, None, input_len, seed=0), params, concurrency)


def test_teaching_mode_runs_exactly_one_step_per_key_press(engine):
    async def run():
        app = TopApp(engine, load_for(engine), teach=True)
        async with app.run_test(size=(150, 45)) as pilot:
            await pilot.pause(0.5)
            assert engine.paused
            # The load thread submits on its own schedule: wait for its three requests, not for a time.
            await wait_for(pilot, lambda: app.load.submitted == 3, what="the load to be queued")
            idle_step = engine.snapshot(fresh=True).step
            await pilot.pause(0.5)
            assert engine.snapshot(fresh=True).step == idle_step, "paused: no step without a key press"
            assert len(engine.snapshot().requests) == 3  # the load is queued, waiting

            notes = []
            for _ in range(5):  # 8 prompt tokens + 4 output tokens: no compression yet
                before = engine.snapshot(fresh=True).step
                await pilot.press("space")
                await app.workers.wait_for_complete()
                await pilot.pause()
                assert engine.snapshot(fresh=True).step == before + 1
                notes.append(str(app.query_one("#explain").render()))
            assert "prefill step" in notes[0] and "was admitted" in notes[0]
            assert "decode step: 3 running request(s)" in notes[1]
            assert "decoded one token" in notes[1] and "slot" in notes[1]

            # Keep stepping until the selected request gets compressed, and see it explained.
            for _ in range(80):
                await pilot.press("n")
                await app.workers.wait_for_complete()
                await pilot.pause()
                if "was compressed this step" in str(app.query_one("#explain").render()):
                    break
            note = " ".join(str(app.query_one("#explain").render()).split())
            compressed = app.selected
            # 48 entries (3 blocks of 16) against a budget of 32: the 8-token prompt stays, then the newest three
            # quarters of the other 24, and scores choose the rest
            assert (f"#{compressed} was compressed this step: every layer and KV head evicted 16 of its 48 cached "
                    "entries and kept 32: its first 8 (the prompt), the 18 newest, plus the 6 older ones that "
                    "scored highest") in note
            assert "block table went from 3 to 3 blocks (the same count" in note

            # Another request selected: its own account shows at once, without a step.
            step = engine.snapshot(fresh=True).step
            await pilot.press("down")
            await pilot.pause()
            other = app.selected
            note = " ".join(str(app.query_one("#explain").render()).split())
            assert other != compressed and f"#{other} " in note and f"#{compressed} was compressed" not in note
            assert engine.snapshot(fresh=True).step == step
            await pilot.press("up")
            await pilot.pause()
            await pilot.press("space")  # a step later, the first request's compression is still explained
            await app.workers.wait_for_complete()
            await pilot.pause()
            note = " ".join(str(app.query_one("#explain").render()).split())
            assert f"#{compressed}'s latest compression (its first): every layer and KV head evicted 16" in note

            await pilot.press("t")  # run freely again
            assert not engine.paused
            running_from = engine.snapshot(fresh=True).step
            await wait_for(pilot, lambda: engine.snapshot(fresh=True).step > running_from,
                           what="a step without a key press")

    asyncio.run(run())


def test_live_monitor_draws_requests_and_the_pool(engine):
    async def run():
        app = TopApp(engine, load_for(engine, concurrency=4, input_len=20, output_len=1500))
        async with app.run_test(size=(150, 45)) as pilot:
            # The table refreshes on a timer: wait for it to show every request (a busy CPU is slow).
            await wait_for(pilot, lambda: app.load.submitted == 4 and app.query_one("#requests").row_count == 4,
                           what="four requests in the table")
            pool = app.query_one(PoolMap)
            assert pool.snapshot.pool.total == 48
            owned = sum(len(r.block_table) for r in pool.snapshot.requests)
            grid = str(pool.render()).split("◆ shared prefix")[0]  # the map, without its legend
            assert sum(grid.count(g) for g in "■▣▶◆") == owned > 0
            assert grid.count("·") == 48 - owned - grid.count("▪")

    asyncio.run(run())


def test_pool_map_gives_every_live_request_its_own_look():
    """More live requests than the theme has colours: the colours come round with another style."""
    service = EngineThread("random:llama-tiny", device="cpu", block_size=16, window=8, num_kv_blocks=64)
    try:
        service.pause()
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        for i in range(16):
            service.submit(list(range(1 + i, 11 + i)), params)
        snapshot = service.step_once()
        assert len(snapshot.requests) == 16

        async def run():
            app = TopApp(service)
            async with app.run_test(size=(150, 45)) as pilot:
                await pilot.pause()
                pool = app.query_one(PoolMap)
                pool.show(snapshot)
                looks = {r.id: pool.owner_style(r.id) for r in snapshot.requests}
                assert len(set(looks.values())) == 16
                first = sorted(looks)[0]
                assert pool.looks[first] == 0  # a request keeps its look while it lives
                later = service.step_once()
                pool.show(later)
                assert pool.owner_style(first) == looks[first]

        asyncio.run(run())
    finally:
        service.resume()
        service.close()


def test_side_panes_hide_in_small_terminals_and_on_f2(engine):
    async def run():
        app = TopApp(engine)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            assert not app.query_one("#right").display
            assert app.query_one("#requests").size.width > 70  # the main pane takes the whole width
            await pilot.press("f2")
            await pilot.pause()
            assert app.query_one("#right").display
            await pilot.press("f2")
            await pilot.pause()
            assert not app.query_one("#right").display
        app = TopApp(engine)
        async with app.run_test(size=(160, 48)) as pilot:
            await pilot.pause()
            assert app.query_one("#right").display
            await pilot.press("f2")
            await pilot.pause()
            assert not app.query_one("#right").display

    asyncio.run(run())


def test_prompts_file_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        read_prompts(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n\n{"prompt": \n')
    with pytest.raises(ValueError, match="line 3: not valid JSON"):
        read_prompts(str(bad))
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match='line 1: expected an object with a non-empty string "prompt"'):
        read_prompts(str(bad))
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"prompt": p, "id": i}) for i, p in enumerate(["a", "b"])) + "\n")
    assert read_prompts(str(good)) == ["a", "b"]


def test_explanations_follow_the_engine_through_new_blocks_preemption_and_finish():
    """No UI: step a full-KV engine with a tiny pool by hand until it preempts, explaining each step."""
    service = EngineThread("random:llama-tiny", device="cpu", block_size=16, compression=False, num_kv_blocks=8)
    events = service.subscribe()
    try:
        service.pause()
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        handles = [service.submit(list(range(1 + i, 31 + i)), params) for i in range(3)]
        seen = {}
        for _ in range(400):
            before = service.snapshot(fresh=True)
            drain(events)
            after = service.step_once()
            fresh = drain(events)
            for event in fresh:
                note = "\n".join(explain_step(before, after, fresh, event.request))
                seen.setdefault(event.kind, note)
            for r in after.requests:
                note = "\n".join(explain_step(before, after, fresh, r.id))
                if "got new block" in note:
                    seen.setdefault("new block", note)
            if all(h.done for h in handles):
                break
        assert "was preempted: the pool ran out of free blocks" in seen["preempted"]
        assert "got new block" in seen["new block"]
        assert "finished (length, 60 tokens); its blocks went back to the pool" in seen["finished"]
        assert "was admitted: its 30-token prompt got 2 block(s)" in seen["admitted"]
    finally:
        service.resume()
        service.close()


def test_help_lists_every_key_including_the_request_selection(engine):
    async def run():
        app = TopApp(engine)
        async with app.run_test(size=(120, 40)) as pilot:
            keys = {line.split("  ")[0].strip() for line in (await help_text(app, pilot)).splitlines()}
            assert {"↑ or ↓", "t", "space or n", "w", "f2", "^t", "f1 or ?"} <= keys, keys

    asyncio.run(run())
