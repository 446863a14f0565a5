"""Waiting and running queues, continuous batching, chunked prefill and preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """One engine step: either prefill chunks or one decode token for each sequence."""

    is_prefill: bool
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes this step
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its newest token this step and so samples a next one."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] >= seq.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # -- queues --------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def live(self) -> list[Sequence]:
        return list(self.running) + list(self.waiting)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and release its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.blocks.free(seq)

    # -- one step -------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        seqs, counts, admitted = [], [], []
        # Sequences part-way through a chunked prefill go first.
        for seq in self.running:
            if budget == 0:
                break
            if seq.status is Status.RUNNING and seq.in_prefill:
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                seqs.append(seq)
                counts.append(n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.can_allocate(seq):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            seqs.append(seq)
            counts.append(n)
            admitted.append(seq)
            budget -= n
        if not seqs:
            return None
        return ScheduledBatch(True, seqs, counts, admitted=admitted)

    def _schedule_decode(self) -> ScheduledBatch | None:
        seqs, preempted = [], []
        queue = [s for s in self.running if s.status is Status.RUNNING and not s.in_prefill]
        while queue:
            seq = queue.pop(0)
            while not self.blocks.append_block(seq):
                victim = self._pick_victim(exclude=seq)
                if victim is None:
                    victim = seq if self._preemptible(seq) else None
                if victim is None:
                    break  # nothing may be preempted: this one waits for a block to free up
                self._preempt(victim)
                preempted.append(victim)
                if victim in queue:
                    queue.remove(victim)
                if victim in seqs:
                    seqs.remove(victim)
                if victim is seq:
                    break
            else:
                seqs.append(seq)
        if not seqs and not preempted:
            return None
        return ScheduledBatch(False, seqs, [1] * len(seqs), preempted=preempted)

    def _preemptible(self, seq: Sequence) -> bool:
        # A compressed request holds a bounded, already-paid footprint: it waits, never recomputes.
        return seq.status is Status.RUNNING and not seq.is_compressed

    def _pick_victim(self, exclude: Sequence) -> Sequence | None:
        for seq in reversed(self.running):
            if seq is not exclude and self._preemptible(seq):
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
