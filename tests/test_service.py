"""EngineThread: submit from several threads, stream deltas, snapshot, subscribe, abort, close."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from conftest import BASE_KNOBS, greedy, random_prompts
from zipage.engine import SamplingParams
from zipage.engine.api.thread import EngineThread

TIMEOUT = 60


def make_service(path: str, **kw) -> EngineThread:
    knobs = dict(BASE_KNOBS, block_size=16, num_kv_blocks=64)
    knobs.update(kw)
    return EngineThread(path, **knobs)


@pytest.fixture(scope="module")
def service(tiny_path):
    svc = make_service(tiny_path)
    yield svc
    svc.close()


def stream(handle, timeout: float = TIMEOUT, on_delta=None) -> list[str]:
    """Iterate a handle's deltas in a helper thread, so a stuck stream fails instead of hanging."""
    deltas: list[str] = []

    def run():
        for d in handle:
            deltas.append(d)
            if on_delta:
                on_delta(d)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"stream of request {handle.id} did not end within {timeout} s"
    return deltas


def wait_for_events(q: queue.Queue, want: set[tuple[str, int]], timeout: float = 10) -> list:
    seen, got = set(), []
    deadline = time.monotonic() + timeout
    while not want <= seen:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"events missing: {want - seen}; got {[(e.kind, e.request) for e in got]}"
        try:
            event = q.get(timeout=remaining)
        except queue.Empty:
            continue
        got.append(event)
        seen.add((event.kind, event.request))
    return got


def test_two_sessions_stream_concurrently(service, tiny):
    prompts = ["Hello from session one!", random_prompts(1, [37], seed=3)[0]]
    params = greedy(60, ignore_eos=True)
    results: dict[str, tuple] = {}
    barrier = threading.Barrier(2)

    def client(name, prompt):
        barrier.wait()
        handle = service.submit(prompt, params, session=name)
        deltas = stream(handle)
        results[name] = (handle, deltas)

    threads = [threading.Thread(target=client, args=(f"s{i}", p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert set(results) == {"s0", "s1"}
    want = tiny.generate(prompts, params)
    for i, name in enumerate(("s0", "s1")):
        handle, deltas = results[name]
        out = handle.result(timeout=1)
        assert handle.done and handle.session == name and out.session == name
        assert out.finish_reason == "length" and handle.finish_reason == "length"
        assert out.token_ids == want[i].token_ids
        assert "".join(deltas) == out.text
        assert out.text == want[i].text
        assert len(deltas) > 1  # really streamed, not one final blob
    assert service.snapshot(fresh=True).pool.free == service.snapshot().pool.total


def test_snapshot_and_subscribe_follow_requests(service):
    events = service.subscribe()
    try:
        service.pause()
        assert service.paused
        a = service.submit([1, 2, 3, 4, 5], greedy(8, ignore_eos=True), session="alpha")
        b = service.submit("twenty-one tokens long", greedy(8, ignore_eos=True), session="beta")
        snap = service.snapshot(fresh=True)
        by_id = {r.id: r for r in snap.requests}
        assert set(by_id) == {a.id, b.id}
        assert by_id[a.id].session == "alpha" and by_id[b.id].session == "beta"
        assert by_id[a.id].status == "waiting" and by_id[a.id].prompt_tokens == 5
        assert by_id[b.id].prompt_tokens == len("twenty-one tokens long")
        snap = service.step_once()  # prefill both
        by_id = {r.id: r for r in snap.requests}
        assert by_id[a.id].status == "running" and len(by_id[a.id].block_table) == 1
        assert by_id[b.id].output_tokens == 1 and by_id[b.id].block_roles == ("private", "private")
        assert snap.pool.used == 3
        assert not a.done
        service.resume()
        assert a.result(TIMEOUT).finish_reason == "length"
        assert b.result(TIMEOUT).finish_reason == "length"
        wait_for_events(events, {("admitted", a.id), ("admitted", b.id), ("finished", a.id), ("finished", b.id)})
        snap = service.snapshot(fresh=True)
        assert snap.requests == () and snap.pool.free == snap.pool.total
        assert {e.kind for e in snap.events if e.request == a.id} >= {"admitted", "prefilled", "finished"}
    finally:
        service.resume()
        service.unsubscribe(events)


def test_abort_mid_stream_ends_iteration_and_frees_blocks(service):
    events = service.subscribe()
    try:
        handle = service.submit("Tell me a very long story.", greedy(1500, ignore_eos=True))
        aborted = []

        def on_delta(_):
            if not aborted:
                aborted.append(True)
                service.abort(handle)

        deltas = stream(handle, on_delta=on_delta)
        out = handle.result(timeout=1)
        assert aborted and out.finish_reason == "abort"
        assert 0 < len(out.token_ids) < 1500
        assert "".join(deltas) == out.text
        wait_for_events(events, {("aborted", handle.id)})
        snap = service.snapshot(fresh=True)
        assert snap.requests == () and snap.pool.free == snap.pool.total
        # Aborting again (or an unknown id) is harmless, and the engine still serves.
        service.abort(handle)
        service.abort(10 ** 9)
        again = service.submit([7, 8, 9], greedy(5, ignore_eos=True))
        assert len(again.result(TIMEOUT).token_ids) == 5
    finally:
        service.unsubscribe(events)


def test_abort_while_paused_frees_at_once(service):
    service.pause()
    try:
        handle = service.submit(random_prompts(1, [40], seed=8)[0], greedy(50, ignore_eos=True))
        service.step_once()
        assert service.snapshot(fresh=True).pool.used == 3
        service.abort(handle)
        snap = service.snapshot(fresh=True)  # the abort is handled before the snapshot
        assert snap.requests == () and snap.pool.used == 0
        assert handle.result(timeout=5).finish_reason == "abort"
        stream(handle, timeout=5)  # the iteration terminates
    finally:
        service.resume()


def test_submit_bad_input_raises_in_caller_and_service_keeps_running(service, tiny):
    for bad in ("", [], [1, 10 ** 6], b"\xff", [{"role": "user"}]):
        with pytest.raises(ValueError):
            service.submit(bad, greedy(4))
    with pytest.raises(ValueError, match="top_p"):
        service.submit("ok", SamplingParams(top_p=2.0))
    with pytest.raises(ValueError, match="max_model_len"):
        service.submit([5] * service.engine.max_model_len, greedy(4))
    with pytest.raises(ValueError, match="KV pool"):
        service.submit([5] * 1100, greedy(4))  # 64 blocks of 16 hold 1024 tokens
    assert service.failure is None
    prompt = random_prompts(1, [12], seed=13)[0]
    out = service.submit(prompt, greedy(10, ignore_eos=True)).result(TIMEOUT)
    assert out.token_ids == tiny.generate([prompt], greedy(10, ignore_eos=True))[0].token_ids
    assert service.snapshot(fresh=True).pool.used == 0


def test_chat_messages(service, tiny):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    params = greedy(20, ignore_eos=True)
    handle = service.submit(messages, params, session="chat")
    deltas = stream(handle)
    out = handle.result(timeout=1)
    want = tiny.chat(messages, params)
    assert out.prompt_token_ids == want.prompt_token_ids
    assert out.prompt_token_ids[0] == tiny.tokenizer.convert_tokens_to_ids("<|im_start|>")  # ChatML applied
    assert handle.prompt_tokens == len(want.prompt_token_ids)
    assert out.token_ids == want.token_ids and out.text == want.text == "".join(deltas)


def test_stop_string_is_never_streamed(service, tiny):
    """A 3-character stop string spans three byte tokens: no part of it may be streamed."""
    prompt = "Hello from session one!"
    full = tiny.generate([prompt], greedy(60, ignore_eos=True))[0]
    text = full.text
    starts = [i for i in range(len(text) // 3, len(text) - 2)
              if all(c.isascii() and c.isprintable() for c in text[i:i + 3])]
    assert starts, f"no 3 printable characters in a row in {text!r}"
    stop = text[starts[0]:starts[0] + 3]
    cut = text.index(stop)
    handle = service.submit(prompt, greedy(60, ignore_eos=True, stop=[stop]))
    deltas = stream(handle)
    out = handle.result(timeout=1)
    assert out.finish_reason == "stop"
    assert out.text == text[:cut] == "".join(deltas)


def test_close_ends_cleanly(tiny_path):
    svc = make_service(tiny_path)
    handle = svc.submit("a long one", greedy(1800, ignore_eos=True))
    events = svc.subscribe()
    svc.close()
    assert not svc._thread.is_alive()
    out = handle.result(timeout=5)
    assert out.finish_reason == "abort"
    stream(handle, timeout=5)
    assert svc.failure is None
    assert svc.snapshot().requests == () and svc.snapshot().pool.used == 0
    with pytest.raises(RuntimeError):
        svc.submit("more", greedy(2))
    svc.close()  # twice is fine


def test_real_model_streaming(smol):
    """Real BPE text with multi-byte characters: the streamed deltas add up to the final text."""
    params = greedy(40, ignore_eos=True)
    messages = [{"role": "user", "content": "Write the word 'café' and a smiley emoji, then say hello in Japanese."}]
    want = smol.chat(messages, params)
    with EngineThread("smollm2-135m", num_kv_blocks=64, **BASE_KNOBS) as svc:
        handle = svc.submit(messages, params)
        deltas = stream(handle)
        out = handle.result(timeout=1)
    assert out.token_ids == want.token_ids
    assert "".join(deltas) == out.text == want.text
    assert any(ord(c) > 127 for c in out.text), out.text
