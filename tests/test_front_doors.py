"""One front-door protocol (engine/api/protocol.py): every door has its shape, checked on the
signatures, and a local engine and an attached server behave the same through it."""

from __future__ import annotations

import inspect
import re

import pytest

from zipage.cli.serve.engine_client import EngineClient
from zipage.cli.serve.remote import RemoteEngine
from zipage.engine import LLM, EngineThread, SamplingParams
from zipage.engine.api.process import EngineLoop
from zipage.engine.api.protocol import (AsyncFrontDoor, Close, Door, FrontDoor, MessageHandler, StepOnce,
                                        TakeSnapshot)
from zipage.engine.events import Admitted, EngineSnapshot, Finished
from serve_helpers import API_KEY, DEADLINE_S, MODEL, start_server, stop_server, wait_until_idle

DOORS = [(EngineThread, FrontDoor), (RemoteEngine, FrontDoor), (EngineClient, AsyncFrontDoor), (LLM, Door)]


def protocol_members(protocol) -> dict[str, object]:
    members = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object,) or not getattr(klass, "_is_protocol", False):
            continue
        members.update({k: v for k, v in vars(klass).items() if callable(v) or isinstance(v, property)})
        members.update({k: None for k in getattr(klass, "__annotations__", {})})
    return {k: v for k, v in members.items() if not k.startswith("_")}


@pytest.mark.parametrize("door, protocol", DOORS, ids=lambda x: x.__name__)
def test_every_door_has_the_protocols_shape(door, protocol):
    for name, member in protocol_members(protocol).items():
        if member is None:  # an attribute, set on the instance: find where the class assigns it
            assigned = rf"\bself\.{name}\b[^=\n]*=(?!=)"
            assert re.search(assigned, inspect.getsource(door)), f"{door.__name__} never sets {name}"
            continue
        assert hasattr(door, name), f"{door.__name__} lacks {name}"
        mine = getattr(door, name)
        if isinstance(member, property):
            assert isinstance(mine, property), f"{door.__name__}.{name} should be a property"
            continue
        wanted = inspect.signature(member).parameters
        got = inspect.signature(mine).parameters
        extra = list(got)[len(wanted):]  # a door may take more, as optional keywords only
        assert list(got)[:len(wanted)] == list(wanted), f"{door.__name__}.{name}{inspect.signature(mine)}"
        assert all(got[p].kind == inspect.Parameter.KEYWORD_ONLY and got[p].default is not inspect.Parameter.empty
                   for p in extra), f"{door.__name__}.{name}: {extra} must be optional keywords"
        for p in wanted:
            assert (got[p].kind, got[p].default) == (wanted[p].kind, wanted[p].default), \
                f"{door.__name__}.{name}: parameter {p} differs from the protocol"
        assert inspect.iscoroutinefunction(mine) == inspect.iscoroutinefunction(member), \
            f"{door.__name__}.{name}: async where the protocol is not, or the other way"


def test_doors_refuse_messages_they_do_not_take():
    class Snapshots(MessageHandler):
        def __init__(self):
            self.taken = []

        def on_snapshot(self, message, reply):
            self.taken.append(message.key)

    door = Snapshots()
    door.handle(TakeSnapshot(3))
    assert door.taken == [3]
    with pytest.raises(ValueError, match="does not take StepOnce"):
        door.handle(StepOnce())
    with pytest.raises(ValueError, match="does not take str"):
        door.handle("snapshot")
    # The engine process has no teaching mode; the thread is closed by close(), not by a message.
    assert not hasattr(EngineLoop, "on_step") and not hasattr(EngineThread, "on_close")
    assert hasattr(EngineLoop, "on_close")
    with pytest.raises(ValueError, match="does not take Close"):
        MessageHandler.handle(EngineThread.__new__(EngineThread), Close())


# -- behaviour: a local engine and an attached server, through the same calls ---------------------
KNOBS = dict(device="cpu", block_size=16, window=8, max_cache_blocks_per_seq=2, num_kv_blocks=64)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("doors") / "server.log")
    yield server
    stop_server(server)


@pytest.fixture(params=["local", "attached"])
def door(request, server):
    engine = EngineThread(MODEL, **KNOBS) if request.param == "local" else RemoteEngine(server.url, API_KEY)
    yield engine
    engine.close()
    if request.param == "attached":
        wait_until_idle(server)


def run_through(door: FrontDoor, prompt, params: SamplingParams):
    """Submit, stream to the end, and return (streamed text, final output, the request's events)."""
    events = door.subscribe()
    try:
        handle = door.submit(prompt, params, session="doors")
        streamed = "".join(handle)
        out = handle.result(DEADLINE_S)
        seen = []
        while not any(isinstance(e, Finished) and e.request == out.id for e in seen):
            seen.append(events.get(timeout=DEADLINE_S))
        return streamed, out, [e for e in seen if e.request == out.id]
    finally:
        door.unsubscribe(events)


def test_a_local_and_an_attached_door_give_the_same_answer_and_events(server):
    """Greedy, compressed (the budget is 2 blocks of 16): the same ids and text through either door."""
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    results = {}
    for kind in ("local", "attached"):
        door = EngineThread(MODEL, **KNOBS) if kind == "local" else RemoteEngine(server.url, API_KEY)
        try:
            assert isinstance(door, FrontDoor)
            assert isinstance(door.snapshot(fresh=True), EngineSnapshot)
            results[kind] = run_through(door, [5, 6, 7, 8, 9], params)
        finally:
            door.close()
    wait_until_idle(server)
    (text_l, out_l, events_l), (text_a, out_a, events_a) = results["local"], results["attached"]
    assert out_l.token_ids == out_a.token_ids and len(out_l.token_ids) == 70
    assert text_l == out_l.text and text_a == out_a.text == out_l.text
    assert out_l.finish_reason == out_a.finish_reason == "length"
    for events in (events_l, events_a):
        assert isinstance(events[0], Admitted) and isinstance(events[-1], Finished)
    assert [type(e).__name__ for e in events_l] == [type(e).__name__ for e in events_a]  # compressions too


def test_abort_by_handle_or_by_id_and_bad_input_behave_alike(door):
    endless = SamplingParams(temperature=0.0, max_tokens=8000, ignore_eos=True)
    for how in ("handle", "id"):
        handle = door.submit([5, 6, 7], endless)
        next(iter(handle))  # it runs
        door.abort(handle if how == "handle" else handle.id)
        out = handle.result(DEADLINE_S)
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 8000
    door.abort(10**9)  # unknown: ignored
    with pytest.raises(ValueError, match="temperature"):
        door.submit("hi", SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError):
        door.submit("", SamplingParams(max_tokens=2))
    done = door.submit([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)).result(DEADLINE_S)
    assert done.finish_reason == "length" and len(done.token_ids) == 3
    assert door.alive
