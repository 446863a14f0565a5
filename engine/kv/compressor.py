"""The compression pipeline: scores -> keep set -> compaction (docs/design-notes.md, "Compression").

A compression is planned on the engine thread (which blocks become targets, which are released),
executed as pure tensor work (possibly on a worker thread, beside decoding), and applied back on
the engine thread (new block table, blocks released).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from zipage import kernels
from zipage.engine.kv.block_manager import BlockManager
from zipage.engine.config import EngineConfig
from zipage.engine.kv.geometry import CompressionGeometry
from zipage.engine.sequence import Sequence

NEAR_DUPLICATE = 0.5  # cosine similarity above which two keys count as near-duplicates
MAX_GRAPH_CLASSES = 8  # budgets with captured compression graphs; others compress eagerly


@dataclass
class CompressionJob:
    seq: Sequence
    kv_len: int  # entries scored
    source_table: list[int]
    targets: list[int]  # n blocks that receive the kept entries
    decode_block: int  # the fresh block the request decodes into next
    release: list[int]  # blocks the request drops once compaction lands
    first: bool  # the request's first compression (pooling applies)
    num_scored: int  # leading entries that carry a score from the previous compression
    started: float = field(default_factory=time.monotonic)
    duration: float = 0.0
    future: object = None
    error: BaseException | None = None
    ready: object = None  # CUDA event: the request's last KV writes are done
    prompt_tokens: int = 0  # the request's prompt length (a prompt within its share is kept whole)
    decoding: bool = True  # a compression while decoding, not the one right after a long prompt's prefill
    kept: tuple[int, int] = (0, 0)  # (leading, newest) entries the compression always keeps
    reason: str = "budget"  # "budget": it reached its budget; "pool": the pool was short (elastic)
    keep: int = 0  # entries kept per layer and head: the request's budget in tokens

    def work(self) -> dict:
        """The tensor work alone (`Compressor.run_work`), as every tensor-parallel rank runs it."""
        return dict(source_table=self.source_table, query_slot=self.seq.query_slot, kv_len=self.kv_len,
                    targets=self.targets, first=self.first, num_scored=self.num_scored,
                    prompt_tokens=self.prompt_tokens, decoding=self.decoding, keep=self.keep)


class Compressor:
    def __init__(self, config: EngineConfig, runner, blocks: BlockManager, block_size: int,
                 geometry: CompressionGeometry | None = None):
        self.config = config
        self.runner = runner
        self.blocks = blocks
        self.block_size = block_size
        self.geometry = geometry = geometry or CompressionGeometry.from_config(config, block_size)
        self.window = geometry.window
        self.generator = torch.Generator(device=runner.device).manual_seed(config.seed)  # random baseline
        # On CUDA, compression runs on its own stream so decoding never waits for it.
        self.stream = torch.cuda.Stream(runner.device) if runner.device.type == "cuda" else None
        # (entries kept, first compression?) -> graph: the engine's budget is captured at start, other
        # budgets after their first compression at the trigger length (a budget class of their own).
        self.graphs: dict[tuple[int, bool], CompressionGraph] = {}
        self.graphs_enabled = False

    # -- planning (engine thread) ---------------------------------------------------
    def fresh_blocks_needed(self, seq: Sequence) -> int:
        """Free blocks a compression of `seq` cannot do without: its targets and decode block must be
        private. Shared prefix blocks are never written."""
        return max(0, self.geometry.max_blocks_of(seq) - len(self.blocks.private_blocks(seq)))

    def blocks_freed(self, seq: Sequence) -> int:
        """Blocks the pool gains when a compression of `seq` lands: all it holds beyond its n + 1."""
        return max(0, len(seq.block_table) - self.geometry.max_blocks_of(seq))

    def plan(self, seq: Sequence, spare: int = 0, reason: str = "budget") -> CompressionJob:
        """Choose the N_max blocks the kept entries (and the next decode step) go to, and what the
        request releases once compaction lands. The caller has made `fresh_blocks_needed` blocks free,
        and may allow `spare` more.

        Targets are, in order of preference: the request's private blocks that hold nothing the prefix
        cache can serve; fresh blocks (up to the spare allowance); and only then its private blocks
        that the cache maps, which forget their hash. So a compressed request's prompt blocks go back
        to the free list still hashed, and later requests with the same prefix are served from them
        for as long as the pool has room."""
        n_max = self.geometry.max_blocks_of(seq)
        budget = self.geometry.budget_of(seq)
        keep = self.geometry.budget_tokens_of(seq)
        # A compression scores with the queries of its newest w entries: the output's, unless they are
        # the prompt's own (a long prompt right after its prefill).
        decoding = seq.is_compressed or seq.kv_len - self.window >= seq.num_prompt_tokens
        private = self.blocks.private_blocks(seq)
        unhashed = [b for b in private if not self.blocks.is_cached(b)]
        hashed = [b for b in private if self.blocks.is_cached(b)]
        chosen = unhashed[:n_max]
        wanted = min(n_max - len(chosen), self.fresh_blocks_needed(seq) + spare)
        fresh = []
        while len(fresh) < wanted:
            block_id = self.blocks.allocate_one()
            if block_id is None:
                if len(fresh) + len(chosen) + len(hashed) >= n_max:
                    break  # fewer spare blocks than hoped: overwrite cached ones instead
                for b in fresh:
                    self.blocks.release_block(b)
                raise RuntimeError("compression planned without enough free blocks")
            fresh.append(block_id)
        # Overwrite the request's newest cached blocks first: its prompt head is likelier to recur.
        overwritten = hashed[len(hashed) - (n_max - len(chosen) - len(fresh)):] if len(chosen) + len(fresh) < n_max else []
        for block_id in overwritten:
            self.blocks.forget_hash(block_id)  # its content is about to change
        chosen += overwritten
        new_table = chosen + fresh
        release = [b for b in seq.block_table if b not in chosen]
        seq.start_compression(fresh, releasing=len(release), reason=reason)
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # after every forward that wrote this request's KV was queued
        return CompressionJob(ready=ready,
            seq=seq, kv_len=seq.kv_len, source_table=list(seq.block_table),
            targets=new_table[:budget], decode_block=new_table[budget], release=release,
            first=seq.times_compressed == 0, num_scored=seq.num_scored, prompt_tokens=seq.num_prompt_tokens,
            decoding=decoding, kept=self.protected(seq.num_prompt_tokens, decoding, keep), reason=reason, keep=keep)

    # -- the tensor work (any thread) ---------------------------------------------------
    @torch.inference_mode()
    def execute(self, job: CompressionJob) -> None:
        start = time.monotonic()
        if self.stream is None:
            self.run_work(**job.work())
        else:
            with torch.cuda.stream(self.stream):
                if job.ready is not None:
                    self.stream.wait_event(job.ready)
                self.run_work(**job.work())
                self.stream.synchronize()  # the job lands only once its writes are done
        job.duration = time.monotonic() - start

    @torch.inference_mode()
    def run_work(self, source_table: list[int], query_slot: int, kv_len: int, targets: list[int], first: bool,
                 num_scored: int, prompt_tokens: int = 0, decoding: bool = True, keep: int | None = None) -> None:
        """Score and compact one request on this rank's heads (on whichever stream is current): its
        kv_len entries down to `keep` (its budget in tokens; the engine's when None)."""
        device, bs = self.runner.device, self.block_size
        keep = keep or self.geometry.budget_tokens
        table = torch.tensor(source_table, dtype=torch.int64, device=device)
        window_rows = torch.tensor(self.geometry.scoring_rows(query_slot, kv_len), dtype=torch.int64, device=device)
        dst = torch.tensor([b * bs + o for b in targets for o in range(bs)], dtype=torch.int64, device=device)
        lead, recent = self.protected(prompt_tokens, decoding, keep)
        kept = torch.tensor([lead, recent], dtype=torch.int64, device=device)
        # Graphs serve the usual compression: a decoding request whose last block just filled.
        at_trigger = kv_len == keep + bs and decoding and self.graphs_enabled
        graph = self.graphs.get((keep, first)) if at_trigger else None
        if graph is not None:
            graph.replay(table, window_rows, dst, kept)
            return
        self._score_and_compact(table, window_rows, dst, kv_len, first, num_scored, kept, keep)
        if at_trigger and len(self.graphs) < MAX_GRAPH_CLASSES * 2:
            # The eager run above compiled every kernel at this shape: capture it for next time.
            self.graphs[(keep, first)] = CompressionGraph(self, first, keep, (table, window_rows, dst, kept))

    def protected(self, prompt_tokens: int, decoding: bool, keep: int | None = None) -> tuple[int, int]:
        """(leading, newest) entries a compression to `keep` entries always keeps. Leading: the sinks,
        or the whole prompt when it fits in the prompt share. Newest: the recent share of the rest while
        decoding; only the window when a prompt is compressed after its prefill, since its window (the
        question) scores what it needs."""
        keep = keep or self.geometry.budget_tokens
        lead = max(self.config.num_sink_tokens, self.config.prompt_kept(prompt_tokens, keep))
        lead = min(lead, keep - self.window)  # the window always fits
        recent = self.config.recent_kept(keep - lead) if decoding else self.window
        return lead, max(min(recent, keep - lead), self.window)

    def _score_and_compact(self, table: torch.Tensor, window_rows: torch.Tensor, dst: torch.Tensor, kv_len: int,
                           first: bool, num_scored: int, kept: torch.Tensor, keep: int) -> None:
        """Every layer: score the request's kv_len entries, keep the best of each head, compact them
        into the target slots `dst`. Only device work, so it can be captured in a CUDA graph."""
        runner, cfg, bs = self.runner, self.config, self.block_size
        token_slots = table[:, None] * bs + torch.arange(bs, device=table.device)[None, :]
        token_slots = token_slots.flatten()[:kv_len]  # slot of each scored entry
        scale = runner.head_dim ** -0.5
        always = self._always_kept(kv_len, kept, table.device)  # the same entries in every layer
        scored = cfg.eviction == "score"
        # Every layer's window queries and previous scores in one gather each (layer-major tables; no
        # compaction writes what another layer reads).
        window_queries = runner.query_cache.index_select(1, window_rows) if scored else None
        previous_scores = (runner.score_cache.index_select(1, token_slots)
                           if scored and cfg.use_global_score else None)
        # Each entry's position moves with it, and each kept entry records the score that ranked it
        # (docs/design-notes.md, "What a request still holds").
        for layer in range(runner.num_layers):
            cache = runner.layer_cache(layer)  # K/V blocks and, when 8-bit, their scales
            k_cache, k_scales = cache["k_cache"], cache["k_scales"]
            tables = (runner.position_cache[layer], runner.choice_cache[layer])
            if not scored:
                self._compact_baseline(kv_len, cache, token_slots, dst, always, keep, tables)
                continue
            attention = kernels.window_attention_score(window_queries[layer], k_cache, table, kv_len, scale,
                                                       k_scales=k_scales)
            if cfg.enable_pooling and first:
                attention = kernels.pool_scores(attention, cfg.pooling_kernel)
            if cfg.use_global_score:
                attention = kernels.global_score_merge(attention, previous_scores[layer].t(), num_scored,
                                                       cfg.global_decay)
            final = attention
            if cfg.use_redundancy:
                # 8-bit keys are dequantized straight into the model's dtype: there the similarity
                # products run on tensor cores (float32 ones took 150x longer on the H200)
                keys = kernels.gather_kv(k_cache, table, kv_len, k_scales, runner.dtype).transpose(0, 1)
                redundancy = kernels.redundancy_score(keys, bs if cfg.lightning_redundancy else None,
                                                      NEAR_DUPLICATE, cfg.redundancy_temperature)
                final = cfg.redundancy_lambda * attention - (1 - cfg.redundancy_lambda) * redundancy
            chosen = kernels.keep_indices(final.masked_fill(always, float("inf")), keep)  # [kv_heads, keep], ascending
            kernels.compact_kv(k_cache, cache["v_cache"], runner.score_cache[layer], token_slots[chosen], dst,
                               attention.gather(1, chosen), *tables, final.gather(1, chosen),
                               k_scales=k_scales, v_scales=cache["v_scales"])

    @staticmethod
    def _always_kept(kv_len: int, kept: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Which of the kv_len entries a compression always keeps [kv_len]: kept = [leading, newest]
        counts (`protected`), read on the device so a captured graph serves every request. Made once
        a compression, not once a layer: a graph replay is mostly small launches."""
        position = torch.arange(kv_len, device=device)
        return (position < kept[0]) | (position >= kv_len - kept[1])

    def capture_graphs(self) -> None:
        """CUDA graphs of the usual compression (a decoding request at the trigger length), one for a
        request's first compression and one for later ones: hundreds of small kernels, one launch.
        The engine's budget is captured now, on scratch blocks of the still empty pool."""
        if self.stream is None or self.config.eviction != "score":
            return
        self.graphs_enabled = True
        for first in (True, False):
            self.graphs[(self.geometry.budget_tokens, first)] = CompressionGraph(self, first)

    def _compact_baseline(self, kv_len, cache, token_slots, dst, always, keep, tables) -> None:
        """The comparison policies at the same budget: random eviction, or sinks + most recent.
        `cache`: this layer's ModelRunner.layer_cache; `tables`: its (position, choice) tables;
        `always`: the entries kept whatever their score (`_always_kept`)."""
        k_cache = cache["k_cache"]
        kv_heads = k_cache.shape[2]
        if self.config.eviction == "random":
            final = torch.rand((kv_heads, kv_len), generator=self.generator, device=k_cache.device)
        else:
            final = torch.arange(kv_len, device=k_cache.device, dtype=torch.float32).expand(kv_heads, -1)
        chosen = kernels.keep_indices(final.masked_fill(always, float("inf")), keep)
        kernels.compact_kv(k_cache, cache["v_cache"], None, token_slots[chosen], dst, None, *tables,
                           final.gather(1, chosen), k_scales=cache["k_scales"], v_scales=cache["v_scales"])

    # -- landing (engine thread) ---------------------------------------------------------
    def apply(self, job: CompressionJob) -> None:
        seq = job.seq
        for block_id in job.release:
            self.blocks.release_block(block_id)
        seq.land_compression(job.targets + [job.decode_block], kept=job.keep, protected=job.kept)


class CompressionGraph:
    """One captured compression at the trigger length of one budget; replays read a new block table,
    window rows and target slots from static buffers."""

    def __init__(self, compressor: Compressor, first: bool, keep: int | None = None, inputs: tuple | None = None):
        """Without `inputs`, warms up and captures on scratch blocks 0..n (only while the pool is still
        empty). With the inputs of an eager run of the same shape that just compiled every kernel, it
        only captures (nothing runs during a capture, so live blocks are safe), on the compression
        stream while the engine thread goes on launching decode steps."""
        device = compressor.runner.device
        keep = keep or compressor.geometry.budget_tokens
        bs = compressor.block_size
        if inputs is None:
            self.table = torch.arange(keep // bs + 1, dtype=torch.int64, device=device)
            self.window_rows = torch.arange(compressor.window, dtype=torch.int64, device=device)
            self.dst = torch.arange(keep, dtype=torch.int64, device=device)
            self.kept = torch.tensor([0, compressor.window], dtype=torch.int64, device=device)
        else:
            self.table, self.window_rows, self.dst, self.kept = (t.clone() for t in inputs)
        args = (self.table, self.window_rows, self.dst, keep + bs, first, 0 if first else keep, self.kept, keep)
        stream = compressor.stream
        with torch.inference_mode():
            if inputs is None:
                with torch.cuda.stream(stream):
                    compressor._score_and_compact(*args)  # warm-up compiles every kernel
                stream.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
                compressor._score_and_compact(*args)
        stream.synchronize()

    def replay(self, table: torch.Tensor, window_rows: torch.Tensor, dst: torch.Tensor, kept: torch.Tensor) -> None:
        self.table.copy_(table)
        self.kept.copy_(kept)
        self.window_rows.copy_(window_rows)
        self.dst.copy_(dst)
        self.graph.replay()
