"""The KV block pool: allocation, reference counts and the xxhash prefix cache."""

from __future__ import annotations

from collections import deque

import numpy as np
import xxhash

from zipage.engine.sequence import Sequence

NO_HASH = -1


def block_hash(token_ids: list[int], prev_hash: int) -> int:
    """Hash of a full block, chained to its predecessor so equal blocks at different places differ."""
    h = xxhash.xxh64()
    if prev_hash != NO_HASH:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Owns every KV block. A block is free when its ref count is 0; a free block keeps its
    hash (and stays findable by the prefix cache) until it is handed out again."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))  # least recently freed first
        self.hash_to_block: dict[int, int] = {}
        # Optional cap on the prompt tokens one sequence may take from the cache (compression needs
        # the window's queries, which only a prefill computes).
        self.max_cached_tokens = None

    # -- pool accounting -----------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def cached_free_ids(self) -> list[int]:
        """Free blocks that still hold a reusable prefix."""
        return [i for i in self.free_ids if self.blocks[i].hash != NO_HASH]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation ------------------------------------------------------------
    def _take_free(self) -> int:
        block_id = self.free_ids.popleft()
        block = self.blocks[block_id]
        if block.hash != NO_HASH and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids, block.ref_count = NO_HASH, (), 1
        return block_id

    def allocate_one(self) -> int | None:
        """A fresh private block, or None when the pool is empty."""
        return self._take_free() if self.free_ids else None

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks. The block holding the
        last token never comes from the cache: its KV must be computed to sample from it."""
        if not self.prefix_caching:
            return []
        hits, prev = [], NO_HASH
        limit = seq.num_tokens - 1
        if self.max_cached_tokens is not None:
            limit = min(limit, self.max_cached_tokens(seq))
        if seq.prompt_logprobs is not None:  # only a forward scores a prompt (design-notes, "Log-probabilities")
            limit = min(limit, seq.prompt_scored)
        for i in range(max(limit, 0) // self.block_size):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            prev = block_hash(tokens, prev)
            block_id = self.hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            hits.append(block_id)
        return hits

    def blocks_to_allocate(self, seq: Sequence) -> int:
        """Free blocks admitting `seq` takes: new ones, and cached prefix blocks no one holds."""
        hits = self._prefix_hits(seq)
        reused_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_for(seq.num_tokens) - len(hits) + reused_free

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_to_allocate(seq) <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, f"sequence {seq.id} already holds blocks"
        hits = self._prefix_hits(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_ids.remove(block_id)
            block.ref_count += 1
        table = list(hits)
        for _ in range(self.blocks_for(seq.num_tokens) - len(hits)):
            table.append(self._take_free())
        seq.take_blocks(table, cached_tokens=len(hits) * self.block_size, hashed_blocks=len(hits))

    def needs_new_block(self, seq: Sequence) -> bool:
        """Whether the next KV entry of a decoding sequence falls past its last block."""
        return seq.kv_len >= len(seq.block_table) * self.block_size

    def append_block(self, seq: Sequence) -> bool:
        """Give a decoding sequence one more block if it needs one; False when the pool is empty."""
        if not self.needs_new_block(seq):
            return True
        block_id = self.allocate_one()
        if block_id is None:
            return False
        seq.block_table.append(block_id)
        return True

    def release_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} released twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_ids.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Later blocks are released first so that, when the
        pool runs short, a prompt's deepest blocks are reused before its shared head."""
        for block_id in reversed(seq.block_table + seq.pending_blocks):
            self.release_block(block_id)
        seq.drop_blocks()

    def private_blocks(self, seq: Sequence) -> list[int]:
        """The sequence's blocks no one else references: compression may overwrite these."""
        return [b for b in seq.block_table if self.blocks[b].ref_count == 1]

    def is_cached(self, block_id: int) -> bool:
        """Whether the prefix cache can serve this block to a later request."""
        block = self.blocks[block_id]
        return block.hash != NO_HASH and self.hash_to_block.get(block.hash) == block_id

    def forget_hash(self, block_id: int) -> None:
        """Take a block out of the prefix cache before its content is overwritten."""
        block = self.blocks[block_id]
        if block.hash != NO_HASH and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids = NO_HASH, ()

    # -- prefix cache ------------------------------------------------------------
    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register blocks whose KV is now complete, so later requests can share them.
        A compressed sequence's blocks no longer match token positions and are never shared."""
        if not self.prefix_caching or seq.is_compressed:
            return
        bs = self.block_size
        while (seq.num_hashed_blocks + 1) * bs <= seq.num_computed_tokens:
            i = seq.num_hashed_blocks
            block = self.blocks[seq.block_table[i]]
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            prev = self.blocks[seq.block_table[i - 1]].hash if i > 0 else NO_HASH
            if block.hash == NO_HASH:
                block.hash = block_hash(tokens, prev)
                block.token_ids = tuple(tokens)
                self.hash_to_block[block.hash] = block.id
            seq.num_hashed_blocks += 1

    def check_invariants(self, live: list[Sequence]) -> None:
        """Ref counts equal the references held by live sequences; free list holds exactly the rest."""
        refs = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table + seq.pending_blocks:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.id], (
                f"block {block.id}: ref_count {block.ref_count} but {refs[block.id]} holders")
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is on the free list twice"
        assert free == {b.id for b in self.blocks if b.ref_count == 0}, "free list out of sync"
