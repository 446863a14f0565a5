"""Compression geometry: every length the compression rules derive from the block size and budget.

One frozen object, built once the block size is known, answers "when is this request compressed
next, and which of its positions form the observation window?" for the scheduler, the model runner,
the block manager's prefix cache and the compressor alike, so that no two of them can disagree.

The rule (DESIGN section 3): a request is compressed whenever its KV length reaches its next
compression point. A prompt longer than the budget is compressed once right after its prefill, at its
own length; every other compression happens at the trigger length N_max * b, when the last block is
full. The point depends only on the prompt length and whether the request was compressed before, so
it is the same whether the prompt was prefilled whole, in chunks, or again after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

from zipage.engine.config import EngineConfig


@dataclass(frozen=True)
class CompressionGeometry:
    block_size: int  # b
    budget_blocks: int  # n
    window: int  # w: the newest positions whose queries score the cache
    recent_kept: int  # newest entries a compression always keeps (>= w)
    num_sink_tokens: int  # oldest entries a compression always keeps

    @classmethod
    def from_config(cls, config: EngineConfig, block_size: int) -> "CompressionGeometry":
        if config.window >= block_size:
            raise ValueError(f"window={config.window}: must be smaller than block_size ({block_size})")
        geometry = cls(block_size, config.max_cache_blocks_per_seq, config.window,
                       config.recent_kept(config.max_cache_blocks_per_seq * block_size), config.num_sink_tokens)
        if geometry.num_sink_tokens + geometry.recent_kept > geometry.budget_tokens:
            raise ValueError(f"num_sink_tokens={config.num_sink_tokens}, recent_share={config.recent_share}: "
                             f"sinks plus the newest entries kept ({geometry.num_sink_tokens + geometry.recent_kept})"
                             f" must fit in the budget of {geometry.budget_tokens} tokens")
        return geometry

    @property
    def budget_tokens(self) -> int:
        """n * b: the entries a request keeps after each compression."""
        return self.budget_blocks * self.block_size

    @property
    def max_blocks(self) -> int:
        """N_max = n + 1: the budget plus one block to decode into."""
        return self.budget_blocks + 1

    @property
    def trigger_len(self) -> int:
        """N_max * b: the KV length at which a decoding request must be compressed."""
        return self.max_blocks * self.block_size

    def compresses_prompt(self, seq) -> bool:
        """Whether the next compression of `seq` is the one right after its prompt's prefill (its
        prompt is over the budget), rather than one while decoding."""
        return not seq.is_compressed and seq.num_prompt_tokens > self.budget_tokens

    def next_point(self, seq) -> int:
        """The KV length at which `seq` is compressed next."""
        return seq.num_prompt_tokens if self.compresses_prompt(seq) else self.trigger_len

    def window_start(self, seq) -> int:
        """First KV index whose query belongs to the next compression's window."""
        return self.next_point(seq) - self.window

    def needs_compression(self, seq) -> bool:
        return seq.kv_len >= self.next_point(seq)

    def prefill_end(self, seq) -> int:
        """How many of a newly admitted request's tokens its prefill computes: all of them, except that
        a prefill never runs past the next compression point (a recomputed request compresses where
        it first did, then decodes the tokens it already had)."""
        return min(seq.num_tokens, self.next_point(seq))

    def max_cached_tokens(self, seq) -> int:
        """Prompt tokens the prefix cache may serve: never the window's, whose queries only a forward
        computes."""
        return self.window_start(seq)

    def window_row(self, seq, kv_index: int) -> int:
        """Query-cache row that keeps the query of KV entry `kv_index`, or -1 when it is not in the
        next window (or the request holds no query slot)."""
        if seq.query_slot is None:
            return -1
        end = self.next_point(seq)
        if not end - self.window <= kv_index < end:
            return -1
        return seq.query_slot * self.window + kv_index % self.window
