"""Compression points do not depend on how a request was served: greedy output with compression is
the same whether its prompt was prefilled whole or in chunks (a chunk boundary may leave a single
prompt token), alone or batched, and whether or not it was preempted and recomputed on the way."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from compression_helpers import build_random_model, generate, random_prompts
from zipage.engine.kv.geometry import CompressionGeometry

torch.set_num_threads(1)

# SMALL_BUDGET: block 16, window 4, budget 2 blocks (32 entries), trigger at 48 entries.
BUDGET, TRIGGER = 32, 48


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_random_model(tmp_path_factory.mktemp("zipage-points"), "qwen3-tiny", seed=3)


@pytest.fixture(scope="module")
def alone(model_path):
    """Greedy tokens of one prompt served alone: a roomy pool, the whole prompt in one chunk."""
    @functools.lru_cache(maxsize=None)
    def tokens(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        out, _ = generate(model_path, [list(prompt)], max_tokens, num_kv_blocks=256, max_num_batched_tokens=4096)
        return out[0]
    return tokens


@pytest.mark.parametrize("length,chunk", [(41, 40), (41, 1), (47, 23), (60, 59), (33, 32), (100, 7)])
def test_chunk_boundaries_do_not_move_the_compression(model_path, alone, length, chunk):
    """A prompt over the budget is compressed at its own length, after its last chunk, however the
    chunks fall (the first case leaves exactly one prompt token for a second chunk)."""
    prompt = random_prompts(1, [length], seed=length)[0]
    out, totals = generate(model_path, [prompt], 40, max_num_batched_tokens=chunk)
    assert totals["compressions"] >= 2
    assert out[0] == alone(tuple(prompt), 40)


def test_two_prompts_in_one_batch_leaving_one_token(model_path, alone):
    """The first prompt uses all but one token of the step's budget for the second: the second's
    last prompt token comes in the next step, still as prefill."""
    first, second = random_prompts(2, [30, 41], seed=7)
    out, totals = generate(model_path, [first, second], 40, max_num_batched_tokens=70)
    assert totals["compressions"] >= 2
    assert out == [alone(tuple(first), 40), alone(tuple(second), 40)]


@pytest.mark.parametrize("lengths", [[14, 14, 14, 14], [30, 30, 30]])
def test_recompute_after_preemption_compresses_where_the_first_run_did(model_path, alone, lengths):
    """A request preempted between the budget and the trigger is recomputed and then compressed at
    the trigger, as it would have been, not at its new length."""
    prompts = random_prompts(len(lengths), lengths, seed=11)
    out, totals = generate(model_path, prompts, 45, num_kv_blocks=7, max_num_batched_tokens=48)
    assert totals["preemptions"] > 0 and totals["compressions"] > 0
    assert out == [alone(tuple(p), 45) for p in prompts]


@settings(max_examples=25, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 80), min_size=1, max_size=5), chunk=st.integers(1, 96),
       pool=st.integers(6, 40), max_tokens=st.integers(1, 60), seed=st.integers(0, 10_000))
def test_greedy_output_does_not_depend_on_chunking_batching_or_preemption(model_path, alone, lengths, chunk, pool,
                                                                           max_tokens, seed):
    prompts = random_prompts(len(lengths), lengths, seed=seed)
    pool = max(pool, -(-max(lengths) // 16) + 1)  # every prompt must fit the pool on its own
    out, _ = generate(model_path, prompts, max_tokens, num_kv_blocks=pool, max_num_batched_tokens=chunk)
    assert out == [alone(tuple(p), max_tokens) for p in prompts]


def test_geometry_points():
    from zipage.engine.config import EngineConfig
    from zipage.engine.sequence import Sequence
    from zipage.engine.config import SamplingParams

    g = CompressionGeometry.from_config(EngineConfig(device="cpu", block_size=16, window=4,
                                                     max_cache_blocks_per_seq=2), 16)
    assert (g.budget_tokens, g.trigger_len, g.max_blocks) == (BUDGET, TRIGGER, 3)
    short, long = Sequence(list(range(20)), SamplingParams()), Sequence(list(range(41)), SamplingParams())
    assert g.next_point(short) == TRIGGER and g.next_point(long) == 41
    assert g.max_cached_tokens(long) == 37 and g.window_start(short) == 44
    long.token_ids.append(5)  # a recompute of the long prompt plus its first output
    assert g.prefill_end(long) == 41
    long.times_compressed = 1
    assert g.next_point(long) == TRIGGER
    long.query_slot = 2
    assert [g.window_row(long, j) for j in (43, 44, 47, 48)] == [-1, 2 * 4 + 0, 2 * 4 + 3, -1]
    # A request's own budget: 4 blocks (64 entries), so a 70-token prompt is compressed at 70, and
    # every later compression at (4 + 1) * 16; a 50-token prompt waits for the trigger.
    own, own_short = (Sequence(list(range(n)), SamplingParams(kv_budget=4)) for n in (70, 50))
    assert (g.compresses_prompt(own), g.next_point(own), g.next_point(own_short)) == (True, 70, 80)
    own.times_compressed = 1
    assert (g.compresses_prompt(own), g.next_point(own), g.trigger_len_of(own)) == (False, 80, 80)
    with pytest.raises(ValueError, match="window"):
        CompressionGeometry.from_config(EngineConfig(device="cpu", window=16), 16)
