"""One request: its tokens, its place in the KV cache, its status and compression state."""

from __future__ import annotations

import enum
import itertools
import time

import torch

from zipage.engine.config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    COMPRESSING = "compressing"
    FINISHED = "finished"


_ids = itertools.count()
UNKNOWN_TOKEN = -1  # stands for a token sampled on the device whose id the host has not read yet


class Sequence:
    """A request inside the engine.

    Token positions and KV entries are counted separately: `num_tokens` grows with every
    token, while `kv_len` (entries held in the cache) drops when compression evicts tokens.
    Positions fed to the model are always true token positions.
    """

    def __init__(self, token_ids: list[int], params: SamplingParams, *, session: str | None = None,
                 request_id: int | None = None, stream_seed: int | None = None):
        self.id = next(_ids) if request_id is None else request_id
        self.session = session
        self.params = params
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None

        # Paged KV state
        self.block_table: list[int] = []
        self.kv_len = 0  # KV entries in the cache (== tokens processed until compressed)
        self.num_computed_tokens = 0  # tokens of token_ids whose KV has been computed
        self.num_cached_prefix_tokens = 0  # prompt tokens served by the prefix cache at admission
        self.num_hashed_blocks = 0  # leading blocks registered in the prefix cache
        self.prefill_end = 0  # tokens the current prefill computes (set at admission)

        # Compression state
        self.kv_budget: int | None = params.kv_budget  # blocks; None: the engine's (CompressionGeometry.budget_of)
        self.times_compressed = 0
        self.window_from = 0  # first KV index whose query its slot recorded (elastic budgets)
        self.releasing = 0  # blocks its compression in flight returns to the pool when it lands
        self.compressed_for: str | None = None  # why its last compression ran: "budget" or "pool"
        self.query_slot: int | None = None
        self.pending_blocks: list[int] = []  # fresh blocks reserved by a compression in flight
        self.num_scored = 0  # leading KV entries that carry a score out of the last compression
        self.protected = (0, 0)  # (leading, newest) of those entries that compression kept outright
        self.num_preemptions = 0

        self.forced_tokens: list[int] | None = None  # teacher forcing (evaluation): the output's first tokens, fed whatever is sampled
        self.grammar = None  # an OutputGrammar (loading/grammars.py) where the output must match a JSON schema
        # Log-probabilities, where asked (docs/design-notes.md, "Log-probabilities"): one per output token,
        # and one per prompt token (None for the first, which nothing predicts), filled in as the prefill
        # scores positions 0 .. prompt_scored - 1.
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = [None] * len(token_ids) if params.prompt_logprobs is not None else None
        self.prompt_scored = 0
        # Each sampling request draws from its own stream: its own seed, else one derived from the
        # engine's seed and its arrival index, so what it samples never depends on what else runs.
        self.generator: torch.Generator | None = None
        seed = params.seed if params.seed is not None else stream_seed
        if seed is not None and not params.greedy:
            self.generator = torch.Generator().manual_seed(seed)

    # -- token bookkeeping -------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_compressed(self) -> bool:
        return self.times_compressed > 0

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True until the prefill planned at admission (prompt, or recompute) has computed its KV.
        Decided by that plan, not by how many tokens remain, so a chunk boundary that leaves one
        prompt token never sends the request down the decode path early."""
        return self.num_computed_tokens < self.prefill_end

    # -- life cycle: every change of status and KV bookkeeping goes through one of these -------
    def take_blocks(self, table: list[int], cached_tokens: int, hashed_blocks: int) -> None:
        """Blocks for all its tokens, the first `cached_tokens` already computed (prefix cache)."""
        self.block_table = table
        self.num_computed_tokens = self.kv_len = cached_tokens
        self.num_cached_prefix_tokens = cached_tokens
        self.num_hashed_blocks = hashed_blocks

    def drop_blocks(self) -> None:
        """Every block released (finish, abort or preemption): nothing of its KV is left."""
        self.block_table = []
        self.pending_blocks = []
        self.kv_len = 0
        self.num_computed_tokens = 0
        self.num_hashed_blocks = 0
        self.window_from = 0
        self.releasing = 0

    def start(self, prefill_end: int) -> None:
        """Admitted: it runs, and its prefill computes tokens up to `prefill_end`."""
        self.prefill_end = prefill_end
        self.status = Status.RUNNING

    def computed(self, n: int) -> None:
        """A forward wrote the KV of its next n tokens."""
        self.num_computed_tokens += n
        self.kv_len += n

    def preempt(self) -> None:
        """Back to the waiting queue, to be recomputed (its blocks were dropped)."""
        self.status = Status.WAITING
        self.num_preemptions += 1

    def start_compression(self, reserved: list[int], releasing: int, reason: str) -> None:
        """A compression is planned: it holds `reserved` fresh blocks, returns `releasing` when it lands,
        and skips decode until then. `reason`: "budget" (it reached its budget) or "pool" (the pool
        was short, elastic budgets)."""
        self.pending_blocks = reserved
        self.releasing = releasing
        self.compressed_for = reason
        self.status = Status.COMPRESSING

    def land_compression(self, table: list[int], kept: int, protected: tuple[int, int] = (0, 0)) -> None:
        """The compaction is done: `kept` entries in `table`, each carrying a score; the first and last
        of them as `protected` counts were kept outright (CompressionJob.kept)."""
        self.block_table = table
        self.protected = protected
        self.pending_blocks = []
        self.releasing = 0
        self.kv_len = kept
        self.window_from = kept  # the ring holds no query of the compacted entries' new places
        self.num_scored = kept
        self.times_compressed += 1
        self.status = Status.RUNNING

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def record_prompt_logprobs(self, first: int, entries: list) -> None:
        """The logprobs of the prompt tokens after positions first .. first + len(entries) - 1."""
        self.prompt_logprobs[first + 1:first + 1 + len(entries)] = entries
        self.prompt_scored = max(self.prompt_scored, first + len(entries))

    # -- overlapped steps: the next step is planned before this step's token is read ----------
    def expect_token(self) -> None:
        """Its next token is being sampled on the device: hold its place, so the next step can be
        planned (lengths, blocks) before the id is known."""
        self.token_ids.append(UNKNOWN_TOKEN)

    @property
    def expects_token(self) -> bool:
        return bool(self.token_ids) and self.token_ids[-1] == UNKNOWN_TOKEN

    def fill_token(self, token_id: int) -> None:
        """The expected token arrived: it takes its place."""
        self.token_ids.pop()
        self.append_token(token_id)

    def forget_expected_token(self) -> None:
        if self.expects_token:
            self.token_ids.pop()

    def __repr__(self) -> str:
        return (f"Sequence(id={self.id}, status={self.status.value}, tokens={self.num_tokens}, "
                f"kv_len={self.kv_len}, blocks={self.block_table})")
