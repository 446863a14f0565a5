"""CUDA graphs of the decode forward and its logits, one per bucketed batch size.

Decode steps are many small kernels; replaying a captured graph removes their launch overhead.
The LM head runs inside the graph too (every decode row samples), into one float32 buffer.
Inputs live in static buffers that each replay reads; a batch runs in the smallest bucket that
holds it, with padding rows that write nothing (slot -1) and read one real block (no NaNs).
"""

from __future__ import annotations

import torch

from zipage.engine.execution.models import ForwardBatch


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model, device: torch.device, max_batch: int, table_width: int,
                 query_cache: torch.Tensor | None):
        self.model = model
        self.buckets = bucket_sizes(max_batch)
        self.table_width = table_width
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.full((n, table_width), -1, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_rows = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.logits = torch.empty((n, model.config.vocab_size), dtype=torch.float32, device=device)
        self.query_cache = list(query_cache.unbind(0)) if query_cache is not None and query_cache.numel() else []
        self._query_rows_set = False
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    def _batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            is_prefill=False, slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            query_slot_mapping=self.query_rows[:size] if self.query_cache else None,
            query_cache=self.query_cache)

    @torch.inference_mode()
    def _capture(self) -> None:
        self.block_tables[:, 0] = 0  # padding rows read block 0 and write nowhere
        pool = None
        for size in reversed(self.buckets):  # largest first, so smaller graphs reuse its pool
            batch = self._batch(size)
            self._forward(size, batch)  # warm-up (compiles kernels)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size, batch)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def _forward(self, size: int, batch: ForwardBatch) -> None:
        hidden = self.model(self.input_ids[:size], self.positions[:size], batch)
        self.model.logits(hidden, out=self.logits[:size])

    def fits(self, batch_size: int, table_width: int) -> bool:
        return batch_size <= self.buckets[-1] and table_width <= self.table_width

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, fwd: ForwardBatch) -> torch.Tensor:
        """Logits [batch, vocab] (float32) of the decode batch; int64 tables and lengths are
        converted by the copies into the static int32 buffers."""
        n = input_ids.shape[0]
        size = next(b for b in self.buckets if b >= n)
        width = fwd.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(fwd.slot_mapping)
        self.context_lens[:n].copy_(fwd.context_lens)
        self.block_tables[:n, :width].copy_(fwd.block_tables)
        if width < self.table_width:
            self.block_tables[:n, width:].fill_(-1)
        if n < size:  # padding rows write nowhere and read one entry of block 0
            self.slot_mapping[n:size].fill_(-1)
            self.context_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].fill_(0)
        if fwd.query_slot_mapping is not None:
            self.query_rows[:n].copy_(fwd.query_slot_mapping)
            self.query_rows[n:size].fill_(-1)
            self._query_rows_set = True
        elif self._query_rows_set:  # only after a step that stored queries
            self.query_rows.fill_(-1)
            self._query_rows_set = False
        self.graphs[size].replay()
        return self.logits[:n]
