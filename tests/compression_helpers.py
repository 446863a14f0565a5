"""Helpers for the compression engine tests: a tiny random model with varied greedy output, engines
with a small budget, a step loop that checks the invariants after every step, and K/V readers."""

from __future__ import annotations

from pathlib import Path

import torch

from zipage.engine import EngineConfig, SamplingParams
from zipage.engine.core.engine_core import EngineCore
from zipage.engine.core.outputs import RequestOutput
from zipage.testing import save_random_model

# Block size 16, window 4, budget 2 blocks: a request is compressed every 16 tokens once it holds
# 3 blocks (48 entries), so compressions start within a few dozen generated tokens.
SMALL_BUDGET = dict(device="cpu", compression=True, block_size=16, window=4, max_cache_blocks_per_seq=2)


def build_random_model(folder: Path, family: str = "qwen3-tiny", seed: int = 0, init: float = 0.5) -> str:
    """An HF folder with large random weights (so greedy output varies from token to token)."""
    save_random_model(folder, family, seed, init=init, vary_norms=False)
    return str(folder)


def make_engine(path: str, **knobs) -> EngineCore:
    cfg = dict(SMALL_BUDGET, num_kv_blocks=128)
    cfg.update(knobs)
    return EngineCore(EngineConfig(model=path, **cfg))


def greedy(max_tokens: int, ignore_eos: bool = True, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, **kw)


def random_prompts(n: int, lengths, seed: int, vocab: int = 256) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(n)]


def check_bound(engine: EngineCore) -> None:
    """Through the public snapshot: under fixed budgets a compressed request never holds more than
    N_max = n + 1 blocks, n its own budget."""
    snap = engine.snapshot(max_events=0)
    for info in snap.requests:
        n_max = info.kv_budget + 1 if info.kv_budget is not None else None
        if info.times_compressed > 0 and engine.config.budget_policy == "fixed":
            assert len(info.block_table) <= n_max, (
                f"request {info.id} compressed {info.times_compressed}x holds {len(info.block_table)} blocks")
    used = sum(1 for r in snap.requests if r.query_slot is not None)
    assert snap.pool.query_slots_used == used, (snap.pool.query_slots_used, used)
    assert snap.pool.query_slots_used <= snap.pool.query_slots_total


def check_step(engine: EngineCore) -> None:
    engine.check_invariants()
    check_bound(engine)


def run(engine: EngineCore, on_step=None, max_steps: int = 5000) -> dict[int, RequestOutput]:
    """Step until no work is left, checking the invariants after every step; final outputs by id."""
    done: dict[int, RequestOutput] = {}
    steps = 0
    while engine.has_work():
        steps += 1
        assert steps <= max_steps, f"no progress after {max_steps} steps: {engine.scheduler.live()}"
        for out in engine.step():
            if out.finished:
                assert out.id not in done, f"request {out.id} finished twice"
                done[out.id] = out
        check_step(engine)
        if on_step is not None:
            on_step(engine)
    return done


def generate(path: str, prompts, max_tokens, **knobs) -> tuple[list[list[int]], dict]:
    """Greedy tokens of each prompt (all submitted at once) on a fresh engine, and the engine's
    totals; checks the invariants after every step and a clean end."""
    engine = make_engine(path, **knobs)
    try:
        if isinstance(max_tokens, int):
            max_tokens = [max_tokens] * len(prompts)
        seqs = [engine.add_request(p, greedy(m)) for p, m in zip(prompts, max_tokens)]
        done = run(engine)
        assert_drained(engine)
        return [done[s.id].token_ids for s in seqs], dict(engine.totals)
    finally:
        engine.close()


def assert_drained(engine: EngineCore) -> None:
    engine.check_invariants()
    snap = engine.snapshot()
    assert snap.requests == ()
    assert snap.pool.free == snap.pool.total, f"{snap.pool.total - snap.pool.free} blocks still held"
    assert snap.pool.used == 0
    assert snap.pool.query_slots_used == 0
    assert not engine.jobs


def slots_of(table: list[int], indices, block_size: int) -> torch.Tensor:
    return torch.tensor([table[j // block_size] * block_size + j % block_size for j in indices], dtype=torch.int64)


def read_kv(engine: EngineCore, slots: torch.Tensor) -> torch.Tensor:
    """K and V of the given cache slots, every layer: [layers, 2, len(slots), kv_heads, head_dim] (a copy)."""
    cache = engine.runner.kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    flat = cache.flatten(2, 3)
    return flat[:, :, slots].clone()


def read_blocks(engine: EngineCore, block_ids: list[int]) -> torch.Tensor:
    return engine.runner.kv_cache[:, :, block_ids].clone()
