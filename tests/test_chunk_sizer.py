"""Prefill chunks sized by time on the CPU (engine/scheduling/chunk_sizer.py): the estimate follows
the measured steps, and the scheduler keeps every step's chunk within what the target allows. Step
times here come from a fixed cost model, never from the clock."""

from __future__ import annotations

import pytest

from compression_helpers import assert_drained, build_random_model, greedy, make_engine, random_prompts, run
from zipage.engine import EngineConfig
from zipage.engine.scheduling.chunk_sizer import MIN_CHUNK, ChunkSizer


def test_the_estimate_follows_the_steps_and_sets_the_chunk():
    sizer = ChunkSizer(target_s=0.25)
    assert sizer.limit(decoders=3) is None  # nothing measured yet
    sizer.observe(tokens=500, seconds=0.5)  # 1 ms a token
    assert sizer.limit(decoders=0) == 250 and sizer.limit(decoders=10) == 240
    sizer.observe(tokens=100, seconds=0.3)  # 3 ms a token: a longer context costs more
    assert sizer.seconds_per_token == pytest.approx(0.002)
    assert sizer.limit(decoders=0) == 125
    sizer.observe(tokens=10, seconds=100.0)  # a machine that has slowed to a crawl
    assert sizer.limit(decoders=50) == MIN_CHUNK  # the prompt still advances
    sizer.observe(tokens=0, seconds=1.0)  # nothing computed: nothing learned
    sizer.observe(tokens=5, seconds=0.0)
    assert sizer.limit(decoders=0) == MIN_CHUNK


def test_without_a_target_time_never_limits():
    sizer = ChunkSizer(target_s=None)
    sizer.observe(tokens=100, seconds=10.0)
    assert sizer.limit(decoders=0) is None


@pytest.mark.parametrize("bad", [0, -5, 0.5, 100_000, True, "250"])
def test_bad_targets_are_refused(bad):
    with pytest.raises(ValueError, match="cpu_step_target_ms"):
        EngineConfig(device="cpu", cpu_step_target_ms=bad)


class CostModel(ChunkSizer):
    """Steps cost 2 ms a token, whatever the clock says."""

    def observe(self, tokens: int, seconds: float) -> None:
        super().observe(tokens, tokens * 0.002)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_random_model(tmp_path_factory.mktemp("zipage-chunks"), "qwen3-tiny", seed=8)


def test_the_scheduler_keeps_chunks_within_the_target_and_output_unchanged(model_path):
    prompts = random_prompts(3, [20, 25, 400], seed=4)
    outputs = {}
    for timed in (False, True):
        engine = make_engine(model_path, num_kv_blocks=96, cpu_step_target_ms=100 if timed else None)
        if timed:
            assert engine.scheduler.chunks.target_s == pytest.approx(0.1)
            engine.scheduler.chunks = CostModel(0.1)
        batches, launch = [], engine.runner.launch
        engine.runner.launch = lambda batch, *rest: batches.append(batch) or launch(batch, *rest)
        try:
            seqs = [engine.add_request(p, greedy(60)) for p in prompts[:2]]
            for _ in range(3):
                engine.step()
            seqs.append(engine.add_request(prompts[2], greedy(20)))
            done = run(engine)
            assert_drained(engine)
        finally:
            engine.close()
        outputs[timed] = [done[s.id].token_ids for s in seqs]
        chunks = [sum(b.num_new_tokens[b.num_decode:]) for b in batches[3:] if b.is_prefill]
        if timed:  # 100 ms at 2 ms a token: 50 tokens a step, the decoders' included
            assert chunks and max(chunks) <= 50 and len(chunks) >= 400 // 50
        else:
            assert chunks == [400]  # the whole prompt in one step
    assert outputs[True] == outputs[False]
