"""Waiting and running queues, continuous batching, chunked prefill in mixed steps, and preemption by
recompute (docs/design-notes.md, "Scheduling")."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from zipage.engine.kv.block_manager import BlockManager
from zipage.engine.scheduling.chunk_sizer import ChunkSizer
from zipage.engine.config import EngineConfig
from zipage.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """One engine step: one decode token for each of the first `num_decode` sequences, then prefill
    chunks for the rest. A step with both is a mixed step."""

    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes this step
    num_decode: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    compress: list = field(default_factory=list)  # CompressionJobs planned this step, to start
    exhausted: list[Sequence] = field(default_factory=list)  # outgrew the whole pool: must end

    @property
    def is_prefill(self) -> bool:
        """Whether any prefill chunk runs (a mixed step included): the forward's prefill path."""
        return self.num_decode < len(self.seqs)

    @property
    def is_mixed(self) -> bool:
        return 0 < self.num_decode < len(self.seqs)

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its newest token this step and so samples a next one."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] >= seq.num_tokens


@dataclass
class DecodePlan:
    """One decode scheduling pass: the requests still to consider, and what the pass decided."""

    queue: list[Sequence]
    seqs: list[Sequence] = field(default_factory=list)  # decode one token this step
    preempted: list[Sequence] = field(default_factory=list)
    compress: list = field(default_factory=list)  # CompressionJobs planned
    exhausted: list[Sequence] = field(default_factory=list)  # outgrew the whole pool

    def drop(self, victim: Sequence) -> None:
        """`victim` was preempted: it neither decodes nor waits its turn in this pass."""
        self.preempted.append(victim)
        for group in (self.queue, self.seqs):
            if victim in group:
                group.remove(victim)

    def batch(self, chunks: "PrefillPlan | None" = None) -> ScheduledBatch | None:
        """The step: these decoders first, then the prefill chunks (if any)."""
        chunks = chunks or PrefillPlan()
        if not (self.seqs or self.preempted or self.compress or self.exhausted or chunks.seqs):
            return None
        return ScheduledBatch(self.seqs + chunks.seqs, [1] * len(self.seqs) + chunks.counts, len(self.seqs),
                              preempted=self.preempted, admitted=chunks.admitted, compress=self.compress,
                              exhausted=self.exhausted)


@dataclass
class PrefillPlan:
    """The prefill chunks of one step: requests part-way through their prompt, then admissions."""

    seqs: list[Sequence] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # prompt tokens each computes this step
    admitted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, budget: int) -> int:
        """Give `seq` its next chunk within `budget` tokens; the budget left."""
        n = min(seq.prefill_end - seq.num_computed_tokens, budget)
        self.seqs.append(seq)
        self.counts.append(n)
        return budget - n


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 num_query_slots: int = 0, compressor=None, step_target_s: float | None = None):
        self.config = config
        self.chunks = ChunkSizer(step_target_s)
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.compressor = compressor  # None: full-KV baseline
        self.num_query_slots = num_query_slots
        self.free_slots: list[int] = list(range(num_query_slots))
        self.geometry = compressor.geometry if compressor is not None else None

    # -- queues --------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def live(self) -> list[Sequence]:
        return list(self.running) + list(self.waiting)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and release its blocks and slot (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table or seq.pending_blocks:
            self.blocks.free(seq)
        self._release_slot(seq)

    # -- query slots (hybrid scheduling) ---------------------------------------------
    @property
    def slots_used(self) -> int:
        return self.num_query_slots - len(self.free_slots)

    def _take_slot(self, seq: Sequence) -> bool:
        if seq.query_slot is not None:
            return True
        if not self.free_slots:
            return False
        seq.query_slot = self.free_slots.pop(0)
        seq.window_from = seq.kv_len  # its queries are kept from its next entry on
        return True

    def _release_slot(self, seq: Sequence) -> None:
        if seq.query_slot is not None:
            self.free_slots.append(seq.query_slot)
            self.free_slots.sort()
            seq.query_slot = None

    def _needs_slot_at_admission(self, seq: Sequence) -> bool:
        if self.compressor is None:
            return False
        if not self.config.hybrid_scheduling:
            return True  # without hybrid scheduling every running request holds a slot
        return self.geometry.needs_slot_at_admission(seq)

    def _admissible(self, seq: Sequence) -> bool:
        """Whether the head of the waiting queue can be admitted now: a running place, blocks for
        its prompt, and a query slot if its prefill needs one."""
        return self._has_place(seq) and self.blocks.can_allocate(seq)

    def _has_place(self, seq: Sequence) -> bool:
        """A running place and, if its prefill needs one, a query slot: all admission needs but blocks."""
        return (len(self.running) < self.config.max_num_seqs
                and (not self._needs_slot_at_admission(seq) or seq.query_slot is not None or bool(self.free_slots)))

    def _admit(self, seq: Sequence) -> None:
        self.waiting.popleft()
        self.blocks.allocate(seq)
        seq.window_from = seq.kv_len  # a slot taken before allocation records from the first computed entry
        seq.start(prefill_end=self.geometry.prefill_end(seq) if self.geometry is not None else seq.num_tokens)
        self.running.append(seq)

    # -- one step -------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        if self.compressor is not None:
            for seq in self.running:  # the first M running requests hold the slots
                if seq.status is not Status.WAITING and not self._take_slot(seq):
                    break
        if not self.config.mixed_steps:  # the older split: a step is all prefill or all decode
            chunks = self._plan_prefill(self._prefill_budget(0), preempted=[])
            return DecodePlan([]).batch(chunks) if chunks.seqs else self._plan_decode_step().batch()
        # Decoders first, each with its token; prefill chunks fill what is left of the step's budget,
        # so a long prompt never stops the streams (docs/design-notes.md, "Scheduling").
        plan = self._plan_decode_step()
        return plan.batch(self._plan_prefill(self._prefill_budget(len(plan.seqs)), preempted=plan.preempted))

    def _prefill_budget(self, decoders: int) -> int:
        """Prompt tokens this step may prefill: what the decoders leave of the step's budget, and on the
        CPU no more than the measured step time allows."""
        budget = max(0, self.config.max_num_batched_tokens - decoders)
        timed = self.chunks.limit(decoders)
        return budget if timed is None else min(budget, timed)

    def overlap_ready(self) -> bool:
        """Whether the next `schedule()` can be planned before the host reads the tokens in flight:
        decode for the running requests, plus compressions, and nothing else. So none can be admitted,
        no prefill is part-way, none reaches a window without a query slot, the pool has a block for
        each request that decodes, and every compression due has its blocks already (one that needs
        fresh blocks might preempt, and a preempted request must see all its tokens). Compressions for a
        short pool under elastic budgets qualify too: they are only planned where they need no fresh
        block, and the appends were counted before them."""
        if self.waiting and self._admissible(self.waiting[0]):
            return False
        needed, decoding = 0, 0
        for seq in self.running:
            if seq.status is Status.COMPRESSING:
                continue  # it skips decode until its compression lands, as in any step
            if seq.status is not Status.RUNNING or seq.in_prefill:
                return False
            if self.geometry is not None and self.geometry.needs_compression(seq):
                if self.compressor.fresh_blocks_needed(seq) > 0:
                    return False
                continue  # planned from lengths alone; past the per-step cap it waits a step
            if self.geometry is not None and self.geometry.waits_for_slot(seq):
                return False
            needed += self.blocks.needs_new_block(seq)
            decoding += 1
        return decoding > 0 and needed <= self.blocks.num_free

    def _plan_prefill(self, budget: int, preempted: list[Sequence]) -> PrefillPlan:
        """Chunks for up to `budget` prompt tokens: requests part-way through a chunked prefill first,
        then admissions from the head of the waiting queue. A request preempted in this step waits
        for the next one (its blocks were just taken for others)."""
        chunks = PrefillPlan()
        for seq in self.running:
            if budget == 0:
                break
            if seq.status is Status.RUNNING and seq.in_prefill:
                budget = chunks.add(seq, budget)
        while (self.waiting and budget > 0 and self.waiting[0] not in preempted
               and self._admissible(self.waiting[0])):
            seq = self.waiting[0]
            if self._needs_slot_at_admission(seq):
                self._take_slot(seq)
            self._admit(seq)
            budget = chunks.add(seq, budget)
            chunks.admitted.append(seq)
        return chunks

    # -- elastic budgets: compress for the pool, not for the budget ---------------------------
    @property
    def _elastic(self) -> bool:
        return self.geometry is not None and self.geometry.elastic

    def _decoders(self) -> list[Sequence]:
        return [s for s in self.running if s.status is Status.RUNNING and not s.in_prefill]

    def _needs_block_soon(self, seq: Sequence) -> bool:
        """Whether a decoding request needs a new block within the next block_size / 8 steps: elastic
        budgets compress that far ahead, so the compaction lands before the block is due and the step
        that needs it still finds one free (and can be planned while the previous step runs). Steps it
        will not take (it stops at max_tokens or max_model_len first) need nothing."""
        left = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        lookahead = min(max(1, self.blocks.block_size // 8), max(1, left))
        return seq.kv_len + lookahead > len(seq.block_table) * self.blocks.block_size

    def _blocks_short(self, decoders: list[Sequence]) -> int:
        """How many blocks the pool lacks for the decode appends due soon and the admission of the head
        of the waiting queue, counting those that compressions in flight will return."""
        demand = sum(1 for s in decoders if self._needs_block_soon(s))
        if self.waiting and self._has_place(self.waiting[0]):
            demand += self.blocks.blocks_to_allocate(self.waiting[0])
        incoming = sum(s.releasing for s in self.running if s.status is Status.COMPRESSING)
        return demand - self.blocks.num_free - incoming

    def _compress_for_pool(self, plan: "DecodePlan") -> None:
        """When the pool is short, compress the requests furthest above their floor, largest first, down
        to it (docs/design-notes.md, "Budgets"). Only those that need no fresh block: under pressure
        nothing is preempted to make room for a compression."""
        short = self._blocks_short(plan.queue)
        if short <= 0:
            return
        excess = lambda s: s.kv_len - self.geometry.budget_tokens_of(s)  # noqa: E731
        for seq in sorted((s for s in plan.queue if self.geometry.can_compress_now(s)), key=excess, reverse=True):
            if short <= 0 or len(plan.compress) >= self.config.max_compressions_per_step:
                return
            if self.compressor.fresh_blocks_needed(seq) > 0:
                continue
            gain = self.compressor.blocks_freed(seq) + self._needs_block_soon(seq)
            if gain == 0:
                continue
            plan.queue.remove(seq)
            plan.compress.append(self.compressor.plan(seq, reason="pool"))
            short -= gain

    def _plan_decode_step(self) -> DecodePlan:
        plan = DecodePlan(self._decoders())
        if self._elastic:
            self._compress_for_pool(plan)
        while plan.queue:
            seq = plan.queue.pop(0)
            if self.geometry is not None and self.geometry.needs_compression(seq):
                self._plan_compression(seq, plan)
            elif self.geometry is not None and self.geometry.waits_for_slot(seq):
                continue  # its next query belongs to the window: it waits for a slot
            else:
                self._plan_decode(seq, plan)
        return plan

    def _plan_compression(self, seq: Sequence, plan: "DecodePlan") -> None:
        """Compress `seq` this step if the cap allows and the fresh blocks it needs (to replace shared
        prefix blocks) can be freed, preempting uncompressed requests if necessary."""
        if len(plan.compress) >= self.config.max_compressions_per_step:
            return
        while self.blocks.num_free < self.compressor.fresh_blocks_needed(seq):
            victim = self._pick_victim(exclude=seq)
            if victim is None:
                return
            self._preempt(victim, plan)
        # Planning takes its fresh blocks now, so no later append this step can take them; from now on
        # the request is under compression and never preempted. Beyond the blocks it needs, it may take
        # free ones no request in this step will need, leaving its cached prompt blocks to the cache.
        appends = sum(1 for s in plan.queue if self.blocks.needs_new_block(s))
        spare = self.blocks.num_free - self.compressor.fresh_blocks_needed(seq) - appends
        plan.compress.append(self.compressor.plan(seq, spare=max(0, spare)))

    def _plan_decode(self, seq: Sequence, plan: "DecodePlan") -> None:
        """Give `seq` room for its next token, preempting from the back of the queue when the pool is
        empty; it decodes this step unless it had to wait or was preempted itself."""
        while not self.blocks.append_block(seq):
            if self._elastic and any(s.releasing for s in self.running if s.status is Status.COMPRESSING):
                return  # a compression in flight returns blocks when it lands: wait for them, preempt no one
            victim = self._pick_victim(exclude=seq)
            if victim is None and self.blocks.blocks_for(seq.kv_len + 1) > self.blocks.num_blocks:
                plan.exhausted.append(seq)  # not even the whole pool would hold it: recompute can't help
                return
            if victim is None:
                victim = seq if self._preemptible(seq) else None
            if victim is None:
                return  # nothing may be preempted: this one waits for a block to free up
            self._preempt(victim, plan)
            if victim is seq:
                return
        plan.seqs.append(seq)

    def _preemptible(self, seq: Sequence) -> bool:
        # A compressed request holds a bounded, already-paid footprint: it waits, never recomputes.
        return seq.status is Status.RUNNING and not seq.is_compressed

    def _pick_victim(self, exclude: Sequence) -> Sequence | None:
        for seq in reversed(self.running):
            if seq is not exclude and self._preemptible(seq):
                return seq
        return None

    def _preempt(self, seq: Sequence, plan: "DecodePlan") -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        self._release_slot(seq)
        seq.preempt()
        self.waiting.appendleft(seq)
        plan.drop(seq)
