"""Compression geometry: every length the compression rules derive from the block size and budgets.

One frozen object, built once the block size is known, answers "when is this request compressed
next, and which of its positions form the observation window?" for the scheduler, the model runner,
the block manager's prefix cache and the compressor alike, so that no two of them can disagree.

Each request has its own budget n (`Sequence.kv_budget`, else the engine's). Under the fixed policy
(docs/design-notes.md, "Compression") a request is compressed whenever its KV length reaches its next
compression point: a prompt longer than the budget right after its prefill, at its own length; every
other compression at the trigger length (n + 1) * b, when its last block is full. The point depends
only on the prompt length, the budget and whether the request was compressed before, so it is the same
whether the prompt was prefilled whole, in chunks, or again after a preemption.

Under the elastic policy (docs/design-notes.md, "Budgets") no length triggers a compression: the
scheduler compresses requests when the pool is short, so every request holding a query slot keeps the
queries of its newest w entries in a ring, ready for whenever that is.
"""

from __future__ import annotations

from dataclasses import dataclass

from zipage.engine.config import EngineConfig


@dataclass(frozen=True)
class CompressionGeometry:
    block_size: int  # b
    budget_blocks: int  # the engine's n, for requests that name none
    window: int  # w: the newest positions whose queries score the cache
    num_sink_tokens: int  # oldest entries a compression always keeps
    config: EngineConfig
    elastic: bool = False

    @classmethod
    def from_config(cls, config: EngineConfig, block_size: int) -> "CompressionGeometry":
        if config.window >= block_size:
            raise ValueError(f"window={config.window}: must be smaller than block_size ({block_size})")
        geometry = cls(block_size, config.max_cache_blocks_per_seq, config.window, config.num_sink_tokens, config,
                       config.budget_policy == "elastic")
        geometry.check_budget(config.max_cache_blocks_per_seq, "max_cache_blocks_per_seq")
        return geometry

    def check_budget(self, blocks: int, name: str = "kv_budget") -> None:
        """ValueError unless a budget of `blocks` holds the sinks and the newest entries kept."""
        tokens = blocks * self.block_size
        if self.num_sink_tokens + self.recent_kept(blocks) > tokens:
            raise ValueError(f"{name}={blocks}: sinks plus the newest entries kept "
                             f"({self.num_sink_tokens + self.recent_kept(blocks)}) must fit in the budget of "
                             f"{tokens} tokens (num_sink_tokens={self.num_sink_tokens}, "
                             f"recent_share={self.config.recent_share})")

    # -- one request's budget ------------------------------------------------------------
    def budget_of(self, seq) -> int:
        """n: the blocks of kept entries after each of this request's compressions."""
        return seq.kv_budget or self.budget_blocks

    def budget_tokens_of(self, seq) -> int:
        """n * b: the entries a request keeps after each compression."""
        return self.budget_of(seq) * self.block_size

    def max_blocks_of(self, seq) -> int:
        """n + 1: the budget plus one block to decode into (a fixed budget's bound)."""
        return self.budget_of(seq) + 1

    def trigger_len_of(self, seq) -> int:
        """(n + 1) * b: the KV length at which a decoding request under a fixed budget is compressed."""
        return self.max_blocks_of(seq) * self.block_size

    def recent_kept(self, blocks: int) -> int:
        """Newest entries every compression to a budget of `blocks` keeps (at least the window)."""
        return self.config.recent_kept(blocks * self.block_size)

    # The engine's default budget, for callers that ask about it alone.
    @property
    def budget_tokens(self) -> int:
        return self.budget_blocks * self.block_size

    @property
    def max_blocks(self) -> int:
        return self.budget_blocks + 1

    @property
    def trigger_len(self) -> int:
        return self.max_blocks * self.block_size

    # -- when a request is compressed ---------------------------------------------------
    def compresses_prompt(self, seq) -> bool:
        """Whether the next compression of `seq` is the one right after its prompt's prefill (its
        prompt is over the budget), rather than one while decoding. Never under elastic budgets."""
        return self._prompt_over(seq, self.budget_tokens_of(seq))

    def next_point(self, seq) -> int:
        """The KV length at which `seq` is compressed next under a fixed budget: its prompt's length
        when compresses_prompt, else trigger_len_of. The budget is worked out once (the scheduler and
        the batch packing ask this of every decoding request on every step)."""
        budget = self.budget_tokens_of(seq)
        return seq.num_prompt_tokens if self._prompt_over(seq, budget) else budget + self.block_size

    def _prompt_over(self, seq, budget_tokens: int) -> bool:
        return not self.elastic and not seq.is_compressed and seq.num_prompt_tokens > budget_tokens

    def window_start(self, seq) -> int:
        """First KV index whose query belongs to the next compression's window (fixed budgets)."""
        return self.next_point(seq) - self.window

    def needs_compression(self, seq) -> bool:
        """Whether `seq` has reached its compression point (fixed budgets; elastic ones have none)."""
        return not self.elastic and seq.kv_len >= self.next_point(seq)

    def prefill_end(self, seq) -> int:
        """How many of a newly admitted request's tokens its prefill computes: all of them, except that
        under a fixed budget a prefill never runs past the next compression point (a recomputed request
        compresses where it first did, then decodes the tokens it already had)."""
        return seq.num_tokens if self.elastic else min(seq.num_tokens, self.next_point(seq))

    def max_cached_tokens(self, seq) -> int:
        """Prompt tokens the prefix cache may serve: never the window's, whose queries only a forward
        computes. Elastic budgets have no window known in advance: a request served its whole prompt
        becomes compressible once it has decoded w tokens."""
        return seq.num_tokens if self.elastic else self.window_start(seq)

    # -- query slots (hybrid scheduling) ------------------------------------------------
    def needs_slot_at_admission(self, seq) -> bool:
        """Under elastic budgets every running request holds a slot, so any of them can be compressed
        when the pool runs short (one that could not would have to be preempted). Under a fixed budget,
        only a prefill that computes window positions (a prompt longer than the budget, or a recompute
        that reaches the trigger's window) must, to write their queries."""
        return self.elastic or self.prefill_end(seq) > self.window_start(seq)

    def waits_for_slot(self, seq) -> bool:
        """A fixed-budget request whose next query belongs to the window waits for a slot to decode."""
        return not self.elastic and seq.query_slot is None and seq.kv_len >= self.window_start(seq)

    def window_rows(self, seq, kv_start: int, count: int) -> list[int]:
        """Query-cache row of each of the KV entries kv_start .. kv_start + count - 1 a forward computes,
        or -1 where its query is not kept. Fixed budgets keep the queries of the next window only;
        elastic ones keep every slot holder's newest w in a ring (only the last w of a forward, so no
        two rows of one forward write the same place)."""
        slot = seq.query_slot
        if slot is None:
            return [-1] * count
        w = self.window
        if self.elastic:
            first = max(kv_start, kv_start + count - w)
            return [-1] * (first - kv_start) + [self.ring_row(slot, j) for j in range(first, kv_start + count)]
        end = self.next_point(seq)
        return [self.ring_row(slot, j) if end - w <= j < end else -1 for j in range(kv_start, kv_start + count)]

    def ring_row(self, slot: int, kv_index: int) -> int:
        """The query-cache row of KV entry `kv_index` in query slot `slot`: each slot is a ring of w rows."""
        return slot * self.window + kv_index % self.window

    def scoring_rows(self, slot: int, kv_len: int) -> list[int]:
        """The rows a compression at KV length kv_len reads: the queries of its newest w entries."""
        return [self.ring_row(slot, j) for j in range(kv_len - self.window, kv_len)]

    def window_row(self, seq, kv_index: int) -> int:
        """Query-cache row of KV entry `kv_index` computed alone (as a decode step computes it)."""
        return self.window_rows(seq, kv_index, 1)[0]

    def can_compress_now(self, seq) -> bool:
        """Elastic budgets: whether `seq` holds more than its floor and the queries of its newest w
        entries (it held a query slot while computing them)."""
        return (seq.query_slot is not None and seq.kv_len > self.budget_tokens_of(seq)
                and seq.kv_len - seq.window_from >= self.window)


def check_request_budget(blocks: int, geometry: CompressionGeometry | None, pool_blocks: int,
                         label: str = "", noun: str = "kv_budget") -> None:
    """ValueError unless a request's own budget of `blocks` can run on an engine with this geometry (None:
    compression off) and pool: its n + 1 blocks fit the pool, and it holds the entries always kept.
    `label` starts the message (default "kv_budget=N"); `noun` names the budget in it."""
    label = label or f"kv_budget={blocks}"
    if geometry is None:
        raise ValueError(f"{label}: this engine keeps every request's full KV (compression is off)")
    if blocks + 1 > pool_blocks:
        raise ValueError(f"{label}: a request may hold {noun} + 1 blocks, and the KV pool has {pool_blocks}")
    geometry.check_budget(blocks)
