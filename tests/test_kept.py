"""Which token positions a request's KV cache still holds, and why (docs/design-notes.md, "What a
request still holds"): the position table moves with the entries through every compaction (the
PyTorch reference, the Triton kernels under the interpreter, and CUDA graphs on a GPU), the reasons
follow the compression rules, and the query answers through every door: EngineCore, EngineThread, the
server and an attached RemoteEngine, with a clear error for a request that is not live.

The position check never trusts the table: every key a request's cache was written with is recorded
by position from the host's own bookkeeping (block table, KV length) as it is appended, and the key the
cache holds now for each (layer, head, entry) must be the one recorded at the position the map names.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the Triton kernels run on CPU tensors through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import json  # noqa: E402
import threading  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402

from compression_helpers import greedy, make_engine, read_kv, slots_of  # noqa: E402
from zipage import kernels  # noqa: E402
from zipage.engine import EngineThread  # noqa: E402
from zipage.engine.core.outputs import UnknownRequest  # noqa: E402
from zipage.engine.kv.kept import KeptMap  # noqa: E402
from zipage.kernels import reference as ref  # noqa: E402
from zipage.testing import save_random_model  # noqa: E402
from serve_helpers import API_KEY, DEADLINE_S, MODEL, start_server, stop_server, wait_for, wait_until_idle  # noqa: E402

BS, W, BUDGET = 16, 4, 2  # a request keeps 32 entries per head, and is compressed at 48
KEEP, TRIGGER = BUDGET * BS, (BUDGET + 1) * BS
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="runs the Triton kernels on the CPU")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def engine_on(**knobs):
    """A CPU engine with a budget of 2 blocks of 16. Compressions land in the step that starts them
    (no worker thread), so what a test sees never depends on timing."""
    return make_engine(MODEL, **{"window": W, "max_cache_blocks_per_seq": BUDGET, "async_compress": False, **knobs})


class KeyRecord:
    """Every key a request's cache was written with, by token position (what the cache held right after
    each step wrote it), found through the block table and KV length alone. In an 8-bit cache (fp8 or
    int8) a key is its codes and its K and V scales: compaction moves all three and never re-quantizes."""

    def __init__(self, engine, seq):
        self.engine, self.seq = engine, seq
        self.keys: dict[int, tuple[torch.Tensor, ...]] = {}  # position -> ([layers, kv_heads, head_dim], ...)
        self.seen = 0

    def _read(self, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[layers, len(slots), kv_heads, head_dim] keys, and when 8-bit [layers, 2, len(slots), kv_heads] scales."""
        keys = read_kv(self.engine, slots)[:, 0].cpu()
        scales = self.engine.runner.kv_scales
        return (keys,) if scales is None else (keys, scales.flatten(2, 3)[:, :, slots].cpu())

    def after_step(self) -> None:
        seq = self.seq
        new = seq.num_computed_tokens - self.seen
        if new <= 0 or seq.is_finished:
            return
        written = self._read(slots_of(seq.block_table, range(seq.kv_len - new, seq.kv_len), BS))
        for i, position in enumerate(range(self.seen, seq.num_computed_tokens)):
            self.keys[position] = (written[0][:, i],) + tuple(t[:, :, i] for t in written[1:])
        self.seen = seq.num_computed_tokens

    def check(self, kept: KeptMap) -> None:
        """The key the cache holds at each entry is the one written at the position the map names."""
        seq = self.seq
        held = self._read(slots_of(seq.block_table, range(seq.kv_len), BS))
        for layer, heads in enumerate(kept.positions):
            for head, positions in enumerate(heads):
                assert len(positions) == seq.kv_len
                expected = torch.stack([self.keys[p][0][layer, head] for p in positions])
                assert torch.equal(held[0][layer, :, head], expected), (layer, head)
                if len(held) > 1:  # 8-bit: each entry's K and V scales came with it
                    scales = torch.stack([self.keys[p][1][layer, :, head] for p in positions], dim=1)
                    assert torch.equal(held[1][layer, :, :, head], scales), (layer, head)


def step_until(engine, condition, records=(), max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if condition():
            return
        assert engine.has_work(), "the engine ran out of work first"
        engine.step()
        for record in records:
            record.after_step()
    raise AssertionError(f"not reached in {max_steps} steps")


def prompt(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=gen).tolist()


def check_shape(kept: KeptMap, engine, seq) -> None:
    """One list per layer and KV head, each holding every entry the request has, in valid order."""
    cfg = engine.source.hf_config
    assert kept.request_id == seq.id and kept.num_positions == seq.num_computed_tokens
    assert (kept.num_layers, kept.num_kv_heads) == (cfg.num_hidden_layers, cfg.num_key_value_heads)
    for layer in range(kept.num_layers):
        for head in range(kept.num_kv_heads):
            positions, reasons = kept.positions[layer][head], kept.reasons[layer][head]
            scores = kept.scores[layer][head]
            assert len(positions) == seq.kv_len
            assert positions == sorted(set(positions)) and 0 <= positions[0] and positions[-1] < kept.num_positions
            assert all((s is not None) == (r == "score") for r, s in zip(reasons, scores))
            assert all(isinstance(s, float) and s == s for s in scores if s is not None)


# -- the compaction kernels move positions with their entries --------------------------------------
def compaction_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    heads, dim, blocks = 2, 16, 9
    k = torch.randn(blocks, BS, heads, dim, generator=gen)
    v = torch.randn(blocks, BS, heads, dim, generator=gen)
    scores = torch.randn(blocks * BS, heads, generator=gen)
    positions = torch.randint(0, 10_000, (blocks * BS, heads), generator=gen, dtype=torch.int32)
    choices = torch.randn(blocks * BS, heads, generator=gen)
    table = torch.tensor([3, 0, 7, 1, 6])
    kv_len, keep = 75, 48
    token_slots = (table[:, None] * BS + torch.arange(BS)[None, :]).flatten()[:kv_len]
    src = token_slots[ref.keep_indices(torch.randn(heads, kv_len, generator=gen), keep)]
    dst = torch.tensor([b * BS + o for b in (0, 3, 7) for o in range(BS)])  # sources of the first kept entries
    kept_scores, kept_choices = torch.randn(heads, keep, generator=gen), torch.randn(heads, keep, generator=gen)
    return (k, v, scores, positions, choices), src, dst, kept_scores, kept_choices


def test_reference_compaction_moves_positions_and_writes_choices():
    (k, v, scores, positions, choices), src, dst, kept_scores, kept_choices = compaction_inputs(1)
    before = positions.clone()
    ref.compact_kv(k, v, scores, src, dst, kept_scores, positions, choices, kept_choices)
    heads = torch.arange(2)[None, :]
    assert torch.equal(positions[dst], before[src.t(), heads])  # gathered before anything was written
    assert torch.equal(choices[dst], kept_choices.t())
    untouched = torch.ones(len(positions), dtype=torch.bool)
    untouched[dst] = False
    assert torch.equal(positions[untouched], before[untouched])


@needs_interpreter
@pytest.mark.parametrize("tables", ["all", "positions", "none"])
def test_triton_compaction_moves_positions_as_the_reference_does(tables):
    from zipage.kernels import triton_cache, triton_ops

    triton_ops.patch_interpreter_for_numpy2()
    caches, src, dst, kept_scores, kept_choices = compaction_inputs(2)
    expected, got = [t.clone() for t in caches], [t.clone() for t in caches]
    for fn, (k, v, scores, positions, choices) in ((ref.compact_kv, expected), (triton_cache.compact_kv, got)):
        extra = {"all": (positions, choices, kept_choices), "positions": (positions, None, None),
                 "none": (None, None, None)}[tables]
        fn(k, v, scores, src, dst, kept_scores, *extra)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


# -- the engine --------------------------------------------------------------------------------------
def test_before_any_compression_every_position_is_held():
    engine = engine_on(num_sink_tokens=2)
    try:
        seq = engine.add_request(prompt(12), greedy(40))
        step_until(engine, lambda: seq.num_output_tokens >= 10)
        kept = engine.kept(seq.id)
        check_shape(kept, engine, seq)
        assert kept.compressions == 0 and seq.kv_len == kept.num_positions
        held = list(range(kept.num_positions))
        why = ["sink"] * 2 + ["prompt"] * 10 + ["recent"] * (kept.num_positions - 12)
        for layer in range(kept.num_layers):
            for head in range(kept.num_kv_heads):
                assert kept.positions[layer][head] == held and kept.reasons[layer][head] == why
        assert kept.holders() == [kept.num_layers * kept.num_kv_heads] * kept.num_positions
    finally:
        engine.close()


def full_kv_keys(engine_knobs: dict, seq, upto: int) -> torch.Tensor:
    """Keys [layers, upto, kv_heads, head_dim] of the same tokens on a full-KV engine (the outputs forced)."""
    engine = make_engine(MODEL, compression=False, **engine_knobs)
    try:
        forced = seq.token_ids[seq.num_prompt_tokens:upto]
        full = engine.add_request(seq.token_ids[:seq.num_prompt_tokens], greedy(len(forced) + 5),
                                  forced_tokens=forced)
        step_until(engine, lambda: full.num_computed_tokens >= upto)
        return read_kv(engine, slots_of(full.block_table, range(upto), BS))[:, 0]
    finally:
        engine.close()


@pytest.mark.parametrize("case", [
    dict(prompt=20, sinks=2, tokens=70),  # prompt beyond its share: the scores choose among it
    dict(prompt=12, sinks=0, tokens=60),  # prompt within its share (16): kept whole
    dict(prompt=40, sinks=1, tokens=30),  # prompt over the budget: compressed right after its prefill
])
def test_after_compression_each_head_holds_its_budget_and_the_right_keys(case):
    knobs = dict(num_sink_tokens=case["sinks"])
    engine = engine_on(**knobs)
    try:
        seq = engine.add_request(prompt(case["prompt"], seed=case["prompt"]), greedy(case["tokens"] + 20))
        record = KeyRecord(engine, seq)
        step_until(engine, lambda: seq.num_output_tokens >= case["tokens"], [record])
        kept = engine.kept(seq.id)
        check_shape(kept, engine, seq)
        record.check(kept)
        assert kept.compressions == seq.times_compressed >= 1
        lead, newest = seq.protected
        since = seq.kv_len - KEEP  # entries decoded after the last compression
        assert 0 <= since < BS and lead >= case["sinks"] and newest >= W
        sinks, size = case["sinks"], case["prompt"]
        shared = min(size, TRIGGER)  # written before the first compression (prompt or trigger)
        for layer in range(kept.num_layers):
            for head in range(kept.num_kv_heads):
                positions, reasons = kept.positions[layer][head], kept.reasons[layer][head]
                # In cache order: what the last compression kept outright at the front (sinks, a prompt
                # within its share), what the scores chose, its newest entries, and those written since.
                assert positions[:sinks] == list(range(sinks)) and reasons[:sinks] == ["sink"] * sinks
                assert reasons[sinks:lead] == ["prompt"] * (lead - sinks)
                assert reasons[lead:KEEP - newest] == ["score"] * (KEEP - lead - newest)
                assert reasons[KEEP - newest:] == ["recent"] * (newest + since)
                assert positions[KEEP:] == list(range(kept.num_positions - since, kept.num_positions))
                if size <= KEEP // 2:  # within its share: the prompt is held whole
                    assert lead == size and positions[:size] == list(range(size))
        assert KEEP - lead - newest > 0  # the scores chose some
        assert kept.holders().count(0) > 0  # something was evicted
        # Against a full-KV run of the same tokens: its keys at the held positions. Layer 0's keys depend
        # on the token and its position alone; deeper layers' only until the first compression.
        full = full_kv_keys(dict(knobs, window=W, max_cache_blocks_per_seq=BUDGET), seq, kept.num_positions)
        cache = read_kv(engine, slots_of(seq.block_table, range(seq.kv_len), BS))[:, 0]
        for layer in range(kept.num_layers):
            for head in range(kept.num_kv_heads):
                for j, p in enumerate(kept.positions[layer][head]):
                    if layer == 0 or p < shared:
                        torch.testing.assert_close(cache[layer, j, head], full[layer, p, head], rtol=1e-5, atol=1e-5)
    finally:
        engine.close()


def test_positions_follow_the_entries_through_many_compressions_and_baselines():
    for knobs in (dict(num_sink_tokens=1), dict(eviction="recent", num_sink_tokens=2), dict(eviction="random"),
                  dict(kv_cache_dtype="fp8"), dict(kv_cache_dtype="int8")):
        engine = engine_on(**knobs)
        try:
            if "kv_cache_dtype" in knobs:  # the keys compared are codes (torch.equal on the raw dtype)
                assert engine.runner.kv_dtype_name == knobs["kv_cache_dtype"] and engine.runner.kv_quantized
            seqs = [engine.add_request(prompt(n, seed=n), greedy(150)) for n in (9, 30)]
            records = [KeyRecord(engine, s) for s in seqs]
            step_until(engine, lambda: all(s.times_compressed >= 4 for s in seqs), records)
            for seq, record in zip(seqs, records):
                kept = engine.kept(seq.id)
                check_shape(kept, engine, seq)
                record.check(kept)
                reasons = {r for layer in kept.reasons for head in layer for r in head}
                if knobs.get("eviction") == "recent":  # nothing is ranked by a score
                    assert "score" not in reasons
                    assert all(head[knobs["num_sink_tokens"]:] == list(range(kept.num_positions - len(head)
                                                                             + knobs["num_sink_tokens"],
                                                                             kept.num_positions))
                               for layer in kept.positions for head in layer)
                else:
                    assert "score" in reasons
        finally:
            engine.close()


def test_requests_sharing_a_cached_prefix_both_report_its_positions():
    engine = engine_on(num_kv_blocks=64)
    try:
        head = prompt(2 * BS, seed=7)  # two full blocks the cache can serve (they end before the window)
        first = engine.add_request(head + prompt(4, seed=8), greedy(3))
        step_until(engine, lambda: first.is_finished)
        a = engine.add_request(head + prompt(5, seed=9), greedy(80))
        b = engine.add_request(head + prompt(6, seed=10), greedy(80))
        records = [KeyRecord(engine, s) for s in (a, b)]
        # Both prompts (37 and 38 tokens) are over the budget: compressed in the step after their prefill.
        step_until(engine, lambda: a.num_computed_tokens == a.num_prompt_tokens and
                   b.num_computed_tokens == b.num_prompt_tokens, records)
        assert a.num_cached_prefix_tokens == b.num_cached_prefix_tokens == 2 * BS
        shared = a.block_table[:2]
        assert b.block_table[:2] == shared and all(engine.blocks.blocks[i].ref_count == 2 for i in shared)
        # The shared blocks hold the prefix's positions, the same for both sharers, in every layer and head.
        table = engine.runner.position_cache[:, slots_of(shared, range(2 * BS), BS)].cpu()
        assert torch.equal(table, torch.arange(2 * BS, dtype=torch.int32)[None, :, None].expand_as(table))
        for seq, record in zip((a, b), records):
            kept = engine.kept(seq.id)
            check_shape(kept, engine, seq)
            record.check(kept)
            assert kept.positions[0][0] == list(range(seq.num_computed_tokens))
        step_until(engine, lambda: a.times_compressed >= 2 and b.times_compressed >= 2, records)
        for seq, record in zip((a, b), records):
            kept = engine.kept(seq.id)
            check_shape(kept, engine, seq)
            record.check(kept)
    finally:
        engine.close()


def test_a_compaction_under_way_is_waited_for_and_described():
    """Asked while its compression may still run on the worker thread (it lands at the next step): the
    map is what the compaction leaves."""
    engine = engine_on(async_compress=True)
    try:
        seq = engine.add_request(prompt(10), greedy(80))
        record = KeyRecord(engine, seq)
        step_until(engine, lambda: seq.id in engine.jobs, [record])
        kept = engine.kept(seq.id)
        assert kept.compressions == 1 and all(len(h) == KEEP for layer in kept.positions for h in layer)
        step_until(engine, lambda: seq.id not in engine.jobs, [record])
        again = engine.kept(seq.id)
        assert again.compressions == 1
        assert [[h[:KEEP] for h in layer] for layer in again.positions] == kept.positions
        assert [[h[:KEEP] for h in layer] for layer in again.reasons] == kept.reasons
        record.check(again)
    finally:
        engine.close()


def test_unknown_and_finished_requests_are_a_clear_error():
    engine = engine_on()
    try:
        seq = engine.add_request(prompt(5), greedy(4))
        waiting = engine.kept(seq.id)  # queued, not yet admitted: nothing held yet
        assert waiting.num_positions == 0 and waiting.positions == [[[], []], [[], []]]
        step_until(engine, lambda: seq.is_finished)
        for request_id in (seq.id, 10**9):
            with pytest.raises(UnknownRequest, match=f"request {request_id} is unknown or has finished"):
                engine.kept(request_id)
        assert issubclass(UnknownRequest, KeyError)
    finally:
        engine.close()


def test_a_full_kv_engine_holds_every_position():
    engine = make_engine(MODEL, compression=False)
    try:
        seq = engine.add_request(prompt(7), greedy(30))
        step_until(engine, lambda: seq.num_output_tokens >= 20)
        kept = engine.kept(seq.id)
        check_shape(kept, engine, seq)
        assert kept.holders() == [4] * kept.num_positions
        assert kept.reasons[1][1] == ["prompt"] * 7 + ["recent"] * (kept.num_positions - 7)
    finally:
        engine.close()


@needs_interpreter
def test_triton_compression_kernels_move_positions_in_the_engine(monkeypatch):
    """The compression pass with its Triton kernels (as on CUDA), run by the interpreter on the CPU."""
    from zipage.kernels import triton_cache, triton_ops, triton_scores

    triton_ops.patch_interpreter_for_numpy2()
    monkeypatch.setattr(kernels, "compact_kv", triton_cache.compact_kv)
    for name in ("window_attention_score", "pool_scores", "global_score_merge", "keep_indices"):
        monkeypatch.setattr(kernels, name, getattr(triton_scores, name))
    engine = engine_on(num_sink_tokens=1)
    try:
        seq = engine.add_request(prompt(20, seed=3), greedy(100))
        record = KeyRecord(engine, seq)
        step_until(engine, lambda: seq.times_compressed >= 2, [record])
        kept = engine.kept(seq.id)
        check_shape(kept, engine, seq)
        record.check(kept)
        assert any(r == "score" for layer in kept.reasons for head in layer for r in head)
    finally:
        engine.close()


def test_two_tensor_parallel_ranks_report_what_one_does():
    """Each rank holds its own KV heads; rank 0 gathers theirs, in head order."""
    maps = {}
    for size in (1, 2):
        engine = engine_on(tensor_parallel_size=size)
        try:
            seq = engine.add_request(prompt(20, seed=4), greedy(80))
            step_until(engine, lambda: seq.times_compressed >= 2)
            maps[size] = engine.kept(seq.id)
        finally:
            engine.close()
    one, two = maps[1], maps[2]
    assert two.positions == one.positions and two.reasons == one.reasons
    for a, b in zip(one.scores, two.scores):
        for x, y in zip(a, b):
            assert [s is None for s in x] == [s is None for s in y]
            torch.testing.assert_close([s for s in x if s is not None], [s for s in y if s is not None])


# -- the doors ---------------------------------------------------------------------------------------
def test_engine_thread_answers_between_steps():
    with EngineThread(MODEL, device="cpu", block_size=BS, window=W, max_cache_blocks_per_seq=BUDGET,
                      num_kv_blocks=64) as door:
        enough = threading.Event()
        counted = []

        def count(out):  # on the engine thread: hold the loop once the request has been compressed
            counted.append(out)
            if len(counted) == TRIGGER + 10:
                door.pause()  # the loop still answers messages; it only stops stepping
                enough.set()

        handle = door.submit(prompt(8), greedy(5000), on_output=count)
        assert enough.wait(DEADLINE_S)
        by_handle, by_id = door.kept(handle), door.kept(handle.id)
        assert by_handle == by_id  # the loop is held: nothing changed in between
        assert by_handle.request_id == handle.id and by_handle.compressions >= 1
        assert len({len(h) for layer in by_handle.positions for h in layer}) == 1  # the same count everywhere
        assert by_handle.num_positions == handle.prompt_tokens + len(counted) - 1  # the last token has no KV yet
        door.abort(handle)
        assert handle.result(DEADLINE_S).finish_reason == "abort"
        for asked in (handle, 10**9):
            with pytest.raises(UnknownRequest):
                door.kept(asked)
        assert door.alive


LONG_CONTEXT = 1_000_000  # a request that runs for minutes, so it is surely running when asked about


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The serving tests' server, on the tiny Llama with room for a very long answer."""
    folder = tmp_path_factory.mktemp("kept-model")
    save_random_model(folder, "llama-tiny")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": LONG_CONTEXT}))
    server = start_server(tmp_path_factory.mktemp("kept") / "server.log",
                          ["--model", str(folder), "--max-model-len", str(LONG_CONTEXT)])
    yield server
    stop_server(server)


def test_the_server_answers_by_the_snapshots_id_behind_the_key(server):
    from zipage.cli.serve.remote import RemoteEngine

    with server.client() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt(8), "ignore_eos": True, "stream": True,  # to the end of the context
                "return_token_ids": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            request_id = int(response.headers["x-zipage-request-id"])
            tokens, lines = 0, response.iter_lines()  # held: dropping it would close the stream
            for line in lines:  # until the request was compressed (budget 32 of 16)
                if line.startswith("data: {"):
                    tokens += sum(len(c.get("token_ids") or []) for c in json.loads(line[6:])["choices"])
                if tokens >= 3 * TRIGGER:
                    break
            assert request_id in [r["id"] for r in server.snapshot()["requests"]]  # the snapshot's id
            path = f"/zipage/requests/{request_id}/kept"
            answer = http.get(path)
            assert answer.status_code == 200
            kept = KeptMap.from_dict(answer.json())
            assert kept.request_id == request_id and kept.compressions >= 1
            assert {len(h) for layer in kept.positions for h in layer} == {len(kept.positions[0][0])}
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                refused = httpx.get(server.url + path, headers=headers, timeout=30)
                assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            attached = RemoteEngine(server.url, API_KEY)
            try:
                assert attached.kept(request_id).request_id == request_id
                with pytest.raises(UnknownRequest, match="unknown or has finished"):
                    attached.kept(10**9)
            finally:
                attached.close()
        wait_until_idle(server)  # leaving the stream aborted it
        for gone in (request_id, 10**9):
            answer = http.get(f"/zipage/requests/{gone}/kept")
            assert answer.status_code == 404
            error = answer.json()["error"]
            assert error["code"] == "request_not_found" and str(gone) in error["message"]
        assert http.get("/zipage/requests/abc/kept").status_code == 404
    assert wait_for(lambda: httpx.get(server.url + "/health", timeout=30).status_code == 200)


# -- CUDA: the compression pass captured in a graph ----------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_graph_compressions_move_positions(monkeypatch, overlap):
    from zipage.engine.kv.compressor import CompressionGraph

    replays = []
    original = CompressionGraph.replay
    monkeypatch.setattr(CompressionGraph, "replay", lambda self, *a: (replays.append(1), original(self, *a)))
    engine = make_engine(MODEL, device="cuda", window=W, max_cache_blocks_per_seq=BUDGET, num_sink_tokens=1,
                         overlap_steps=overlap)
    try:
        seqs = [engine.add_request(prompt(n, seed=n), greedy(200)) for n in (9, 20)]
        records = [KeyRecord(engine, s) for s in seqs]
        step_until(engine, lambda: all(s.times_compressed >= 4 and s.id not in engine.jobs for s in seqs), records)
        assert replays, "no compression ran as a captured graph"
        for seq, record in zip(seqs, records):
            kept = engine.kept(seq.id)
            check_shape(kept, engine, seq)
            record.check(kept)
            assert any(r == "score" for layer in kept.reasons for head in layer for r in head)
    finally:
        engine.close()
