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


class Sequence:
    """A request inside the engine.

    Token positions and KV entries are counted separately: `num_tokens` grows with every
    token, while `kv_len` (entries held in the cache) drops when compression evicts tokens.
    Positions fed to the model are always true token positions.
    """

    def __init__(self, token_ids: list[int], params: SamplingParams, *, session: str | None = None,
                 request_id: int | None = None):
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

        # Compression state
        self.times_compressed = 0
        self.query_slot: int | None = None
        self.pending_blocks: list[int] = []  # fresh blocks reserved by a compression in flight
        self.num_scored = 0  # leading KV entries that carry a score out of the last compression
        self.compress_after_prefill = False  # a prefill left more than the budget: compress first
        self.num_preemptions = 0

        self.forced_tokens: list[int] | None = None  # teacher forcing (evaluation): the output's first tokens, fed whatever is sampled
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

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
        """True while more than the newest token still needs its KV computed (prompt or recompute)."""
        return self.num_tokens - self.num_computed_tokens > 1

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def __repr__(self) -> str:
        return (f"Sequence(id={self.id}, status={self.status.value}, tokens={self.num_tokens}, "
                f"kv_len={self.kv_len}, blocks={self.block_table})")
