"""No hang, no silent wrong answer, no leftover request: the engine's life cycle under hostile use.

Deadlines below only turn a hang into a failure; no test depends on how fast anything runs."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from conftest import BASE_KNOBS, assert_pool_empty, greedy, random_prompts, tiny_llm
from zipage.engine import EngineConfig, SamplingParams
from zipage.engine.api.thread import EngineClosed, EngineThread

HANG = 120  # seconds after which a wait counts as a hang


def make_service(path: str, **kw) -> EngineThread:
    knobs = dict(BASE_KNOBS, block_size=16, num_kv_blocks=64)
    knobs.update(kw)
    return EngineThread(path, **knobs)


def drain(handle) -> list[str]:
    """Read a handle to its end in a helper thread, failing (not hanging) if it never ends."""
    deltas: list[str] = []
    t = threading.Thread(target=lambda: deltas.extend(handle), daemon=True)
    t.start()
    t.join(HANG)
    assert not t.is_alive(), f"request {handle.id} never ended"
    return deltas


# -- EngineThread: close, failure, exit ----------------------------------------------------------

def test_submit_racing_close_never_blocks(tiny_path):
    svc = make_service(tiny_path)
    outcomes: list[str] = []
    started = threading.Event()

    def submit_forever():
        while True:
            try:
                handle = svc.submit(random_prompts(1, [8], seed=len(outcomes))[0], greedy(4, ignore_eos=True))
            except EngineClosed:
                outcomes.append("closed")
                return
            started.set()
            drain(handle)
            outcomes.append(handle.finish_reason)

    threads = [threading.Thread(target=submit_forever, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    assert started.wait(HANG)
    svc.close()
    for t in threads:
        t.join(HANG)
        assert not t.is_alive(), "a submit() racing close() never returned"
    assert outcomes.count("closed") == 3
    assert set(outcomes) <= {"closed", "length", "abort"}
    assert svc.snapshot().pool.used == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # it fails loudly
def test_a_failed_engine_thread_ends_requests_with_the_error_and_refuses_more(tiny_path):
    svc = make_service(tiny_path)
    try:
        svc.pause()
        handle = svc.submit(random_prompts(1, [8], seed=1)[0], greedy(50, ignore_eos=True))

        def broken_step():
            raise RuntimeError("injected step failure")

        svc.engine.step = broken_step
        svc.resume()
        drain(handle)
        out = handle.result(timeout=HANG)
        assert out.finish_reason == "error" and "injected step failure" in out.error
        svc._thread.join(HANG)
        with pytest.raises(EngineClosed, match="injected step failure"):
            svc.submit("more", greedy(2))
        assert svc.snapshot().pool.used == 0
    finally:
        svc.close()


def bounded_call(fn):
    """fn() in a helper thread: its result, or the exception it raised; fails (not hangs) if it never returns."""
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG)
    assert not t.is_alive(), "the call never returned"
    return result


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # it fails loudly
@pytest.mark.parametrize("call", ["step_once", "submit"])
def test_the_message_a_failing_engine_was_handling_is_answered(tiny_path, call):
    """The engine fails while handling a caller's message: that caller gets the cause, not a wait."""
    svc = make_service(tiny_path)
    try:
        svc.pause()
        if call == "step_once":
            svc.submit(random_prompts(1, [8], seed=1)[0], greedy(5, ignore_eos=True))

            def broken_step():
                raise RuntimeError("injected step failure")

            svc.engine.step = broken_step
            got = bounded_call(lambda: svc.step_once(timeout=HANG))
        else:
            def broken_enqueue(*args, **kwargs):
                raise RuntimeError("injected step failure")

            svc.engine.enqueue = broken_enqueue
            got = bounded_call(lambda: svc.submit("hello", greedy(2)))
        assert isinstance(got.get("error"), EngineClosed), got
        assert "injected step failure" in str(got["error"])
    finally:
        svc.close()


def test_a_raising_on_output_hook_ends_only_its_own_request(tiny_path):
    svc = make_service(tiny_path)
    try:
        svc.pause()  # all three are queued before the first token
        calls = []

        def broken_hook(out):
            calls.append(out)
            raise RuntimeError("hook bug")

        before = svc.submit(random_prompts(1, [8], seed=1)[0], greedy(12, ignore_eos=True))
        broken = svc.submit(random_prompts(1, [8], seed=2)[0], greedy(12, ignore_eos=True), on_output=broken_hook)
        after = svc.submit(random_prompts(1, [8], seed=3)[0], greedy(12, ignore_eos=True))
        svc.resume()
        for handle in (before, broken, after):
            drain(handle)
        assert broken.result(0).finish_reason == "error" and "hook bug" in broken.result(0).error
        assert len(calls) == 1  # a broken hook is not called again
        assert before.result(0).finish_reason == after.result(0).finish_reason == "length"
        assert svc.alive
        assert svc.snapshot(fresh=True).pool.used == 0  # the broken request's blocks were freed
        assert len(drain(svc.submit("more", greedy(3, ignore_eos=True)))) > 0
    finally:
        svc.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # it fails loudly
def test_abort_after_close_or_failure_is_a_no_op(tiny_path):
    closed = make_service(tiny_path)
    handle = closed.submit("hello", greedy(3))
    closed.close()
    closed.abort(handle)
    closed.abort(handle.id)

    failed = make_service(tiny_path)
    try:
        failed.pause()
        handle = failed.submit("hello", greedy(3))

        def broken_step():
            raise RuntimeError("injected step failure")

        failed.engine.step = broken_step
        failed.resume()
        assert handle.result(timeout=HANG).finish_reason == "error"
        failed._thread.join(HANG)
        assert not failed.alive
        failed.abort(handle)  # clean-up code aborts freely; the request has ended already
    finally:
        failed.close()


def test_interpreter_exit_with_a_busy_engine_thread_is_clean(tiny_path):
    script = textwrap.dedent(f"""
        from zipage import EngineThread, SamplingParams
        svc = EngineThread({tiny_path!r}, device="cpu", block_size=16, num_kv_blocks=64, window=4,
                           max_cache_blocks_per_seq=2)
        handles = [svc.submit([5 + i] * 20, SamplingParams(temperature=0, max_tokens=5000, ignore_eos=True))
                   for i in range(4)]
        for _ in zip(range(3), handles[0]):
            pass  # the engine is busy decoding and compressing; exit without close()
        print("leaving")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG * 3)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "leaving" in proc.stdout
    for bad in ("terminate called", "cannot schedule new futures", "Traceback"):
        assert bad not in proc.stderr, proc.stderr[-2000:]


def test_finished_handle_iterates_again_at_once_and_subscribers_are_bounded(tiny_path):
    svc = make_service(tiny_path)
    try:
        events = svc.subscribe(maxsize=2)  # a request logs admitted, prefilled and finished
        handle = svc.submit(random_prompts(1, [8], seed=2)[0], greedy(6, ignore_eos=True))
        first = drain(handle)
        assert drain(handle) == [] and first
        svc.snapshot(fresh=True)  # every event of the request is published by now
        assert events.qsize() == 2 and events.dropped >= 1
        assert [e.kind for e in (events.get_nowait(), events.get_nowait())][-1] == "finished"  # newest kept
    finally:
        svc.close()


def test_threads_submitting_streaming_and_aborting_then_close(tiny_path):
    """Stress: every handle ends, the pool is empty, no thread is left behind."""
    svc = make_service(tiny_path, compression=True, window=4, max_cache_blocks_per_seq=2, num_kv_blocks=24)
    handles, errors = [], []
    lock = threading.Lock()

    def client(k: int):
        for i in range(6):
            try:
                h = svc.submit(random_prompts(1, [4 + (k * 7 + i) % 40], seed=k * 10 + i)[0],
                               greedy(20 + 13 * i, ignore_eos=True))
            except EngineClosed:
                return
            with lock:
                handles.append(h)
            if (k + i) % 3 == 0:
                svc.abort(h)
            drain(h)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    threads[0].join(HANG)  # at least one client finished its round
    svc.close()
    for t in threads:
        t.join(HANG)
        assert not t.is_alive()
    assert not errors
    for h in handles:
        assert h.done and h.finish_reason in ("length", "abort")
    assert not svc._thread.is_alive()
    snap = svc.snapshot()
    assert snap.requests == () and snap.pool.used == 0
    assert not [t for t in threading.enumerate() if t.name.startswith(("zipage-engine", "zipage-compress"))
                and t.is_alive() and t is not threading.current_thread()]


# -- LLM.generate: nothing left behind ---------------------------------------------------------

@pytest.fixture
def llm(tiny_path):
    engine = tiny_llm(tiny_path, num_kv_blocks=32)
    yield engine
    engine.close()


def test_interrupted_generate_aborts_its_requests(llm):
    real_step, calls = llm.engine.step, []

    def step_then_interrupt():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    llm.engine.step = step_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts(4, [10], seed=3), greedy(200, ignore_eos=True))
    llm.engine.step = real_step
    assert not llm.engine.requests
    assert_pool_empty(llm.engine)
    assert len(llm.generate(random_prompts(1, [6], seed=4), greedy(5, ignore_eos=True))[0].token_ids) == 5


def mutated(**changes) -> SamplingParams:
    """Valid parameters changed after construction: generate() must check them again."""
    params = greedy(3)
    for key, value in changes.items():
        setattr(params, key, value)
    return params


@pytest.mark.parametrize("call,match", [
    (lambda llm: llm.generate(["a", "b"], [greedy(3), "not params"]), "params\\[1\\]"),
    (lambda llm: llm.generate(["a", "b"], [greedy(3), mutated(top_p=2.0)]), "top_p"),
    (lambda llm: llm.generate(["a", "b", "c"], greedy(3), sessions=["x"]), "sessions"),
    (lambda llm: llm.generate(None), "prompts must be"),
    (lambda llm: llm.generate({"prompt": "x"}), "prompts must be"),
    (lambda llm: llm.chat(None), "messages"),
    (lambda llm: llm.generate(torch.zeros(2, 2, 2, dtype=torch.long)), "1-D"),
])
def test_generate_checks_everything_before_queuing_anything(llm, call, match):
    with pytest.raises(ValueError, match=match):
        call(llm)
    assert not llm.engine.requests and not llm.engine.has_work()
    assert_pool_empty(llm.engine)


def test_tensor_prompts_match_list_prompts(llm):
    ids = random_prompts(1, [9], seed=5)[0]
    want = llm.generate(ids, greedy(6, ignore_eos=True))[0].token_ids
    assert llm.generate(torch.tensor(ids), greedy(6, ignore_eos=True))[0].token_ids == want


def test_generate_after_close_says_closed_and_releases_memory(tiny_path):
    llm = tiny_llm(tiny_path, num_kv_blocks=32)
    llm.close()
    assert llm.engine.runner.kv_cache.numel() == 0 and llm.engine.runner.model is None
    with pytest.raises(RuntimeError, match="engine is closed"):
        llm.generate(["hello"], greedy(3))
    assert not llm.engine.requests
    llm.close()  # twice is fine


def test_unseeded_sampling_is_reproducible_with_async_compression(tiny_path):
    params = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True)
    prompts = random_prompts(3, [10, 30, 20], seed=6)
    runs = []
    for _ in range(2):
        llm = tiny_llm(tiny_path, compression=True, window=4, block_size=16, max_cache_blocks_per_seq=2,
                       async_compress=True, num_kv_blocks=64, seed=9)
        try:
            runs.append([o.token_ids for o in llm.generate(prompts, params)])
            assert llm.engine.totals["compressions"] > 0
        finally:
            llm.close()
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0]}) == 3


# -- clear errors ----------------------------------------------------------------------------

@pytest.mark.parametrize("make,field", [
    (lambda: SamplingParams(stop=5), "stop"),
    (lambda: SamplingParams(stop_token_ids="x"), "stop_token_ids"),
    (lambda: SamplingParams(seed=2 ** 64), "seed"),
    (lambda: SamplingParams(seed=-1), "seed"),
    (lambda: SamplingParams(repetition_penalty=1e-300), "repetition_penalty"),
    (lambda: SamplingParams(temperature=math.inf), "temperature"),
    (lambda: EngineConfig(kv_cache_gb=math.inf), "kv_cache_gb"),
    (lambda: EngineConfig(kv_cache_gb="2"), "kv_cache_gb"),
])
def test_bad_values_name_their_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_tiny_top_p_keeps_the_most_likely_token(llm):
    ids = random_prompts(1, [7], seed=8)[0]
    want = llm.generate(ids, greedy(5, ignore_eos=True))[0].token_ids
    out = llm.generate(ids, SamplingParams(temperature=1.0, top_p=1e-300, max_tokens=5, ignore_eos=True))[0]
    assert out.token_ids == want


def test_step_once_that_outlasts_its_timeout_raises_timeout_error(tiny_path):
    svc = make_service(tiny_path)
    try:
        svc.pause()
        svc.submit(random_prompts(1, [8], seed=1)[0], greedy(3, ignore_eos=True))
        gate, real_step = threading.Event(), svc.engine.step

        def held_step():  # the step cannot end before the caller gave up
            gate.wait(HANG)
            return real_step()

        svc.engine.step = held_step
        with pytest.raises(TimeoutError, match="step"):
            svc.step_once(timeout=0.05)
        gate.set()
        assert svc.step_once(timeout=HANG) is not None  # the engine goes on serving
    finally:
        gate.set()
        svc.close()
