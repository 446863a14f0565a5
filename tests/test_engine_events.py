"""Snapshots and events survive a trip through plain dicts and JSON (what /zipage/snapshot sends)."""

from __future__ import annotations

import json

from zipage.engine import LLM, SamplingParams
from zipage.engine.events import (EngineSnapshot, event_from_dict, event_to_dict, snapshot_from_dict,
                                  snapshot_to_dict)


def test_a_busy_engines_snapshot_round_trips_through_json():
    llm = LLM("random:llama-tiny", device="cpu", block_size=16, window=8, max_cache_blocks_per_seq=2,
              num_kv_blocks=24, async_compress=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
        for i, n in enumerate((20, 5, 40)):
            llm.engine.add_request([3 + i] * n, params, session=f"s{i}")
        snapshot = None
        while llm.engine.has_work():
            llm.engine.step()
            snap = llm.snapshot()
            if snap.totals["compressions"] >= 2 and snap.requests:
                snapshot = snap
                break
    finally:
        llm.close()
    assert snapshot is not None, "the engine finished before it compressed twice"
    assert {"admitted", "prefilled", "compressed"} <= {e.kind for e in snapshot.events}
    assert any(r.block_roles and "target" in r.block_roles for r in snapshot.requests)

    data = json.loads(json.dumps(snapshot_to_dict(snapshot)))
    back = snapshot_from_dict(data)
    assert isinstance(back, EngineSnapshot)
    assert back == snapshot
    assert isinstance(back.requests[0].block_table, tuple) and isinstance(back.pool.cached_blocks, tuple)
    for event in snapshot.events:
        assert event_from_dict(json.loads(json.dumps(event_to_dict(event)))) == event
