"""Owns the model and its KV cache: sizes the pool, builds batch tensors, runs forward, samples."""

from __future__ import annotations

import itertools

import os
from dataclasses import dataclass, field

import torch

from zipage import kernels
from zipage.engine.config import EngineConfig
from zipage.engine.cpu_products import HalfWeight
from zipage.engine.loading.loader import ModelSource
from zipage.engine.kv.geometry import CompressionGeometry
from zipage.engine.execution.cuda_graphs import DecodeGraphs
from zipage.engine.execution.models import CausalLM, ForwardBatch, head_dim_of
from zipage.engine.execution.models.decoder import map_name  # HF name -> parameter, part
from zipage.engine.execution.models.parallel import TensorParallel
from zipage.engine.execution.models.quantized import install_quantized, report_weights
from zipage.engine.execution.grammar_masks import fill_bitmasks
from zipage.engine.execution.sampler import Sampler, upload
from zipage.engine.execution.token_logprobs import PROMPT_ROWS_AT_ONCE, PromptScoring, reduce_rows, to_host, unpack_rows
from zipage.engine.scheduling.scheduler import ScheduledBatch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CODE_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}  # kv_cache_dtype -> the codes' dtype
CPU_KV_SHARE_OF_RAM = 0.2  # never take more than this share of available RAM for KV on CPU
CPU_KV_CAP_BYTES = 2 << 30
MAX_GRAPH_BATCH = 512  # larger decode batches run eagerly
GPU_HEADROOM_BYTES = 1 << 30  # CUDA graphs, the compression stream's buffers, allocator slack


@dataclass
class LaunchedStep:
    """A forward whose sampled ids may still be on their way to the host (`ModelRunner.collect`)."""

    batch: ScheduledBatch
    sampling: list[int]  # batch index of each sampled row
    ids: torch.Tensor | None = None  # [rows] sampled ids, on the device
    host_ids: torch.Tensor | None = None  # their host copy (pinned, written asynchronously on CUDA)
    ready: "torch.cuda.Event | None" = None  # recorded after the step's copies
    logits: torch.Tensor | None = None  # kept only for a logits observer (evaluation)
    started: float = 0.0  # time.monotonic() at launch
    # Log-probabilities, where asked (token_logprobs.py): the sampling rows whose requests asked, the host
    # copy of their reduced rows (ready with the ids), and the prompt positions scored.
    logprob_rows: list[int] = field(default_factory=list)
    logprobs: torch.Tensor | None = None
    prompt: PromptScoring | None = None
    token_logprobs: list | None = None  # after `collect`: each sequence's TokenLogprobs, or None


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available on this machine")
    return torch.device(device)


def resolve_dtype(dtype: str | None, device: torch.device, weight_dtype: str = "auto") -> torch.dtype:
    dtype = dtype or (None if weight_dtype == "auto" else weight_dtype)  # dequantized weights set the dtype
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def keeps_quantized(config: EngineConfig, device: torch.device, source: ModelSource, tp: TensorParallel) -> bool:
    """Whether a GGUF's quantized weights stay quantized: weight_dtype "auto" on one CPU rank
    (docs/design-notes.md, "Quantized CPU weights"); the GPU dequantizes them."""
    return config.weight_dtype == "auto" and device.type == "cpu" and not tp.enabled and source.is_gguf


def _load_weights(model: CausalLM, source: ModelSource, quantized: bool = False) -> None:
    """The source's weights into the model, then with `quantized` a GGUF's quantized forms (cached);
    a weight that is missing, misshapen or corrupt names the model file or folder it came from."""
    try:
        model.load_weights(source.load_weights())
        if quantized:
            model.weight_report = install_quantized(model, source, map_name)
    except ValueError as e:
        raise ValueError(f"model {source.path!r}: {e}") from None


class ModelRunner:
    """One rank's model shard and KV cache. Under tensor parallelism rank 0 (the engine's runner)
    sends every forward's packed metadata to the other ranks (`workers`), which run the same
    forward on their heads; sampling happens on rank 0 only."""

    def __init__(self, config: EngineConfig, source: ModelSource, block_size: int, max_model_len: int,
                 tp: TensorParallel = TensorParallel(), geometry: CompressionGeometry | None = None):
        self.config = config
        self.tp = tp
        self.workers = None  # rank 0 under tensor parallelism: the TensorParallelWorkers handle
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, config.weight_dtype)
        # K and V as stored: the model's dtype, or 8-bit codes (fp8 or int8) with a float32 scale per
        # entry and KV head (docs/design-notes.md, "KV in 8 bits").
        self.kv_dtype = KV_CODE_DTYPES.get(config.kv_cache_dtype, self.dtype)
        self.kv_quantized = self.kv_dtype in KV_CODE_DTYPES.values()
        self.block_size = block_size
        self.max_model_len = max_model_len
        hf = source.hf_config
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = tp.share(hf.num_key_value_heads, "KV heads")  # this rank's heads
        self.num_heads = tp.share(hf.num_attention_heads, "attention heads")
        self.head_dim = head_dim_of(hf)

        if self.device.type == "cuda":
            kernels.use_triton()
        torch.manual_seed(config.seed)
        # Build straight on the device in the serving dtype: no full-precision copy in host memory.
        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = CausalLM(hf, tp)
        finally:
            torch.set_default_dtype(previous_dtype)
        if source.is_random:
            model.init_random(config.seed)
        else:
            _load_weights(model, source, keeps_quantized(config, self.device, source, tp))
            report_weights(model.weight_report)
        self.model = model.eval()
        self.model.rope.set_length(max_model_len)
        self.weight_bytes = sum(p.numel() * p.element_size()
                                for p in itertools.chain(self.model.parameters(), self.model.buffers()))
        self.weight_bytes += sum(m.nbytes for m in self.model.modules() if isinstance(m, HalfWeight))
        # On the CPU the matrix products are most of a step: oneDNN's packed weights speed them up.
        self.packed_weights = self.device.type == "cpu" and self.model.pack_for_cpu()
        self.sampler = Sampler(config.seed)
        self.logits_observer = None  # callable(seq, logits_row) for evaluation; None in serving

        self.compression = config.compression
        self.window = config.window
        self.geometry = geometry  # compression lengths: pool sizing, and where window queries go
        # Every rank holds the same blocks and slots: the fewest any of them has room for.
        self.num_blocks, self.num_query_slots = tp.min_over_ranks(list(self._size_pool()))
        self._allocate_pool()
        self._bind_cache(self.kv_cache, self.kv_scales)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.graphs: DecodeGraphs | None = None
        # Graph capture needs kernels that never sync with the host: the Triton ones.
        # Under tensor parallelism decode runs eagerly: graphs would have to capture the collectives.
        if (self.device.type == "cuda" and not config.enforce_eager and not tp.enabled
                and "paged_decode_attention" in kernels.TRITON_IMPLS):
            self.graphs = DecodeGraphs(self.model, self.device, min(config.max_num_seqs, MAX_GRAPH_BATCH),
                                       self.max_blocks_per_seq, self.query_cache if self.compression else None)
        if self.device.type == "cuda" and not tp.enabled:  # ranks would have to join its collectives
            self._warm_up_eager_shapes()

    @torch.inference_mode()
    def _warm_up_eager_shapes(self) -> None:
        """Run each kind of eager forward once before serving: prefills of a few, some and many
        tokens (each its own attention tiling) and a mixed step, with and without the window-query
        store, and each kind of sampling draw, so no kernel is compiled on first use while requests
        stream (docs/design-notes.md, "Scheduling"). Nothing is written: every slot is -1, and attention reads block 0 only."""
        shapes = [(0, 8), (0, 64), (0, 128), (2, 64)]
        stores = (False, True) if self.compression and self.query_cache.numel() else (False,)
        for (decoders, chunk), store_queries in itertools.product(shapes, stores):
            tokens = decoders + chunk
            lens = [1] * decoders + [chunk]
            width = -(-chunk // self.block_size)
            fwd = ForwardBatch(
                is_prefill=True, num_decode=decoders,
                slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=self.device),
                block_tables=torch.zeros((len(lens), width), dtype=torch.int32, device=self.device),
                context_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
                cu_seqlens_q=torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32,
                                          device=self.device))
            if store_queries:  # the window-query store, writing nowhere
                fwd.query_slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=self.device)
                fwd.query_cache = list(self.query_cache.unbind(0))
            ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
            hidden = self.model(ids, torch.zeros(tokens, dtype=torch.int64, device=self.device), fwd)
            logits = self.model.logits(hidden[-1:])
        self.sampler.warm_up(logits.float())
        torch.cuda.synchronize(self.device)

    # -- memory ------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers: K and V (and their scales when 8-bit), plus under
        compression its score cache and each entry's position and ranking score (docs/design-notes.md,
        "What a request still holds")."""
        per_entry = self.head_dim * self.kv_dtype.itemsize + (4 if self.kv_quantized else 0)  # + a float32 scale
        per_token = 2 * self.num_kv_heads * per_entry + (12 * self.num_kv_heads if self.compression else 0)
        return self.num_layers * self.block_size * per_token

    @property
    def rotates_qk(self) -> bool:
        """Whether q and k are rotated by a Hadamard matrix before an int8 cache stores k (a head size
        of a power of 2 only; docs/design-notes.md, "KV in 8 bits")."""
        return self.kv_dtype == torch.int8 and self.head_dim & (self.head_dim - 1) == 0

    @property
    def kv_dtype_name(self) -> str:
        """How K and V are stored, in short: fp8, int8, bf16, fp16 or fp32."""
        names = {torch.float8_e4m3fn: "fp8", torch.int8: "int8", torch.bfloat16: "bf16", torch.float16: "fp16"}
        return names.get(self.kv_dtype, "fp32")

    @property
    def query_slot_bytes(self) -> int:
        elem = torch.finfo(self.dtype).bits // 8
        return self.num_layers * self.window * self.num_heads * self.head_dim * elem

    @property
    def kv_bytes(self) -> int:
        """Bytes of everything the pool holds: KV blocks, score cache, positions and query slots."""
        return sum(t.numel() * t.element_size() for t in (self.kv_cache, self.kv_scales, self.query_cache,
                                                           self.score_cache, self.position_cache, self.choice_cache)
                   if t is not None)

    def _new_cache(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K/V blocks [layers, 2, blocks, block_size, kv_heads, head_dim] in the cache dtype, and their
        scales [layers, 2, blocks, block_size, kv_heads] when the cache is 8-bit (None otherwise), stored
        [.., kv_heads, block_size]: decode attention reads one head's scales of a block in one run."""
        shape = (self.num_layers, 2, blocks, self.block_size, self.num_kv_heads, self.head_dim)
        cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        if not self.kv_quantized:
            return cache, None
        scales = torch.ones((*shape[:3], self.num_kv_heads, self.block_size), dtype=torch.float32, device=self.device)
        return cache, scales.transpose(-1, -2)

    def _bind_cache(self, cache: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Point every attention layer at its K/V blocks (and scales)."""
        for i, attn in enumerate(self.model.attention_layers):
            attn.k_cache, attn.v_cache = cache[i, 0], cache[i, 1]
            attn.cache_scales = {"k_scales": scales[i, 0], "v_scales": scales[i, 1]} if scales is not None else {}
            attn.qk_rotation = {"hadamard_qk": True} if self.rotates_qk else {}

    def layer_cache(self, layer: int) -> dict:
        """One layer's K/V blocks and scales, as the kernels take them (k_cache, v_cache, k_scales, v_scales)."""
        return {"k_cache": self.kv_cache[layer, 0], "v_cache": self.kv_cache[layer, 1],
                "k_scales": self.kv_scales[layer, 0] if self.kv_scales is not None else None,
                "v_scales": self.kv_scales[layer, 1] if self.kv_scales is not None else None}

    def _allocate_pool(self) -> None:
        """The KV blocks, and the compression state: queries of the observation window, each kept
        entry's last score, and each entry's token position and the score that ranked it when it was
        kept (docs/design-notes.md, "What a request still holds"). A pool the device cannot hold (a
        num_kv_blocks or kv_cache_gb set too large) is a ValueError that says so, not an allocator error."""
        blocks, slots = self.num_blocks, self.num_query_slots
        self.kv_scales = None
        try:
            self.kv_cache, self.kv_scales = self._new_cache(blocks)
            self.query_cache = torch.zeros((self.num_layers, slots * self.window, self.num_heads, self.head_dim),
                                           dtype=self.dtype, device=self.device)
            entries = (self.num_layers, blocks * self.block_size if self.compression else 0, self.num_kv_heads)
            self.score_cache = torch.zeros(entries, dtype=torch.float32, device=self.device)
            self.position_cache = torch.zeros(entries, dtype=torch.int32, device=self.device)
            self.choice_cache = torch.zeros(entries, dtype=torch.float32, device=self.device)
        except RuntimeError as e:  # torch.OutOfMemoryError on CUDA, a RuntimeError from the CPU allocator
            self.kv_cache = self.kv_scales = self.query_cache = self.score_cache = None
            self.position_cache = self.choice_cache = None
            gib = (blocks * self.block_bytes + slots * self.query_slot_bytes) / (1 << 30)
            raise ValueError(f"the KV pool ({blocks} blocks, {gib:.3g} GiB) does not fit in {self.device.type} "
                             f"memory ({type(e).__name__} from the allocator); lower num_kv_blocks or "
                             "kv_cache_gb") from None

    def release(self) -> None:
        """Drop the KV pool, the weights and the CUDA graphs, so their device memory returns now and
        not whenever the engine object is garbage-collected (a second engine sizes its pool then)."""
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self.kv_cache = self.query_cache = self.score_cache = self.position_cache = self.choice_cache = empty
        self.kv_scales = None
        self.graphs = None
        self.model = None
        self.weight_bytes = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _size_pool(self) -> tuple[int, int]:
        """(blocks, query slots). Slots and blocks share one budget:
        M * (N_max * block_bytes + query_slot_bytes) <= KV memory."""
        cfg = self.config
        n_max = self.geometry.max_blocks if self.geometry is not None else 1  # blocks of one compressed request
        if cfg.num_kv_blocks is not None:
            blocks = cfg.num_kv_blocks
            slots = cfg.num_query_slots or max(1, blocks // n_max)
            return blocks, (min(slots, cfg.max_num_seqs) if self.compression else 0)
        if cfg.kv_cache_gb is not None:
            budget = int(cfg.kv_cache_gb * (1 << 30))
        elif self.device.type == "cuda":
            peak = self._profile_activation_peak()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cfg.memory_utilization) - (total - free) - peak - GPU_HEADROOM_BYTES
        else:
            budget = min(int(available_ram_bytes() * CPU_KV_SHARE_OF_RAM), CPU_KV_CAP_BYTES)
        slots = 0
        if self.compression:
            slots = cfg.num_query_slots or budget // (n_max * self.block_bytes + self.query_slot_bytes)
            slots = max(1, min(slots, cfg.max_num_seqs))
            budget -= slots * self.query_slot_bytes
        # No point holding more than every request at full length could use.
        needed = cfg.max_num_seqs * -(-self.max_model_len // self.block_size)
        blocks = min(budget // self.block_bytes, needed)
        if blocks < 1:
            raise ValueError(f"no memory left for the KV cache (budget {budget} bytes, one block needs "
                             f"{self.block_bytes}); lower the model size or raise memory_utilization/kv_cache_gb")
        return int(blocks), int(slots)

    @torch.inference_mode()
    def _profile_activation_peak(self) -> int:
        """Run the largest prefill once on a throw-away cache and measure the activation peak."""
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        blocks = -(-tokens // self.block_size)
        scratch, scratch_scales = self._new_cache(blocks)
        self._bind_cache(scratch, scratch_scales)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        ids = torch.randint(0, self.model.config.vocab_size, (tokens,), device=self.device)
        fwd = ForwardBatch(is_prefill=True, slot_mapping=torch.arange(tokens, device=self.device),
                           block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device)[None],
                           context_lens=torch.tensor([tokens], dtype=torch.int32, device=self.device),
                           cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=self.device))
        hidden = self.model(ids, torch.arange(tokens, device=self.device), fwd)
        rows = min(self.config.max_num_seqs, tokens)
        self.model.logits(hidden[:rows])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del scratch, scratch_scales, hidden
        torch.cuda.empty_cache()
        return int(peak)

    # -- one step -------------------------------------------------------------------

    def pack(self, batch: ScheduledBatch) -> tuple[torch.Tensor, dict, list[int]]:
        """All the batch metadata as one int64 host tensor plus a small header (what every rank
        needs to rebuild the forward), and the batch index of each sampling row."""
        input_ids, positions, slots, context_lens, cu, sample_rows, sampling = [], [], [], [], [0], [], []
        query_rows, any_query = [], False
        bs = self.block_size
        # Plain list appends: at batch 256 this loop is on every decode step's critical path.
        for i, seq in enumerate(batch.seqs):
            n = batch.num_new_tokens[i]
            start, kv, table = seq.num_computed_tokens, seq.kv_len, seq.block_table
            if n == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[kv // bs] * bs + kv % bs)
            else:
                input_ids += seq.token_ids[start:start + n]
                positions += range(start, start + n)
                slots += [table[j // bs] * bs + j % bs for j in range(kv, kv + n)]
            if self.compression:
                rows = self.geometry.window_rows(seq, kv, n)
                any_query = any_query or max(rows) >= 0
                query_rows += rows
            context_lens.append(kv + n)
            cu.append(cu[-1] + n)
            if batch.samples(i):
                sampling.append(i)
                sample_rows.append(cu[-1] - 1)
        width = max(len(s.block_table) for s in batch.seqs)
        tables = []
        for seq in batch.seqs:
            tables += seq.block_table
            if len(seq.block_table) < width:
                tables += [-1] * (width - len(seq.block_table))
        if not any_query:
            query_rows = []
        parts = [input_ids, positions, slots, context_lens, cu if batch.is_prefill else [], query_rows, tables]
        # Every part starts 16-byte aligned: Triton compiles a kernel once per pointer alignment, so
        # parts at shifting offsets would compile new variants mid-serve (docs/design-notes.md,
        # "Scheduling"). Staged in pinned memory on CUDA, so the upload is one asynchronous copy.
        flat = []
        for part in parts:
            flat += part
            if len(part) % 2:
                flat.append(0)
        packed = torch.tensor(flat, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        header = dict(is_prefill=batch.is_prefill, num_decode=batch.num_decode, sizes=[len(p) for p in parts], width=width,
                      num_seqs=len(batch.seqs), any_query=any_query, sample_rows=sample_rows)
        return packed, header, sampling

    def unpack(self, packed: torch.Tensor, header: dict, int32: bool = True,
               inputs_from: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        """The forward's tensors on the device. int32=False leaves tables and lengths int64 views
        of the upload (the decode graphs convert them while copying them in). `inputs_from`
        (rows, ids) puts ids still on the device into those rows of the input (an overlapped step)."""
        packed = packed.to(self.device, non_blocking=True)
        sizes = header["sizes"]
        ids_t, pos_t, slots_t, ctx_t, cu_t, rows_t, tables_t = (
            chunk[:n] for chunk, n in zip(packed.split([n + n % 2 for n in sizes]), sizes))
        if inputs_from is not None:
            rows, source = inputs_from
            ids_t.index_copy_(0, rows, source)
        tables_t = tables_t.view(header["num_seqs"], header["width"])
        fwd = ForwardBatch(
            is_prefill=header["is_prefill"],
            slot_mapping=slots_t,
            block_tables=tables_t.to(torch.int32) if int32 else tables_t,
            context_lens=ctx_t.to(torch.int32) if int32 else ctx_t,
            cu_seqlens_q=cu_t.to(torch.int32) if header["is_prefill"] else None,
            num_decode=header["num_decode"] if header["is_prefill"] else 0,
        )
        if header["any_query"]:
            fwd.query_slot_mapping = rows_t
            fwd.query_cache = list(self.query_cache.unbind(0))
        return ids_t, pos_t, fwd

    @torch.inference_mode()
    def forward_packed(self, packed: torch.Tensor, header: dict,
                       inputs_from: tuple[torch.Tensor, torch.Tensor] | None = None,
                       prompt: PromptScoring | None = None) -> torch.Tensor | None:
        """Forward a packed batch; the logits of its sampling rows, or None when none samples.
        Every rank runs this in step: the collectives inside pair up. The prompt rows the header
        names (only prefill chunks have any) go to `prompt` on rank 0."""
        rows = header["sample_rows"]
        if (not header["is_prefill"] and self.graphs is not None
                and self.graphs.fits(header["num_seqs"], header["width"])):
            input_ids, positions, fwd = self.unpack(packed, header, int32=False, inputs_from=inputs_from)
            self._record_positions(fwd.slot_mapping, positions)
            logits = self.graphs.run(input_ids, positions, fwd)
            if len(rows) < logits.shape[0]:
                logits = logits[upload(rows, self.device)]
            return logits if rows else None
        input_ids, positions, fwd = self.unpack(packed, header, inputs_from=inputs_from)
        self._record_positions(fwd.slot_mapping, positions)
        hidden = self.model(input_ids, positions, fwd)
        if header.get("prompt_rows"):
            self._score_prompt(hidden, header["prompt_rows"], prompt)
        if not rows:
            return None
        if len(rows) < hidden.shape[0]:
            hidden = hidden[upload(rows, self.device)]
        return self.model.logits(hidden)

    def _score_prompt(self, hidden: torch.Tensor, rows: list[int], prompt: PromptScoring | None) -> None:
        """The logits of the prompt rows, a slice at a time, each reduced at once; the other ranks only
        join the logits' gather (prompt is None there)."""
        for start in range(0, len(rows), PROMPT_ROWS_AT_ONCE):
            logits = self.model.logits(hidden[upload(rows[start:start + PROMPT_ROWS_AT_ONCE], self.device)])
            if prompt is not None:
                prompt.reduce(logits, start)

    def _record_positions(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Each KV entry this forward writes takes its token position, in every layer and head, where
        compaction later moves it with its entry (docs/design-notes.md, "What a request still holds").
        Queued on the device with the forward: no copy to the host, no sync."""
        table = self.position_cache
        if table is None or table.numel() == 0 or slots.numel() == 0:
            return
        layers, _, heads = table.shape
        table.index_copy_(1, slots, positions.to(torch.int32)[None, :, None].expand(layers, -1, heads))

    @torch.inference_mode()
    def read_kept(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, ranking scores) of these cache slots on this rank's heads, each [layers,
        len(slots), kv_heads], on the host: the only copy of them from the device, made on demand."""
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)
        return self.position_cache[:, index].cpu(), self.choice_cache[:, index].cpu()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: LaunchedStep | None = None,
               before_sampling=None) -> LaunchedStep:
        """Queue the forward and sampling of one batch; the ids stay on the device until `collect`.
        With `previous`, the input of every request that sampled there is its id from that step,
        read on the device: the host never waited for it. `before_sampling()` reads that step's tokens
        when a grammar needs them, once the forward is queued."""
        packed, header, sampling = self.pack(batch)
        prompt = PromptScoring.plan(batch)
        if prompt is not None:
            header["prompt_rows"] = prompt.rows
        inputs_from = self._inputs_from(batch, previous) if previous is not None else None
        if self.workers is not None:
            self.workers.send("forward", packed, header)
        logits = self.forward_packed(packed, header, inputs_from, prompt)
        step = LaunchedStep(batch, sampling, prompt=prompt)
        if logits is not None:
            requests = [(batch.seqs[i].params, batch.seqs[i].token_ids, batch.seqs[i].generator) for i in sampling]
            prompt_lens = [batch.seqs[i].num_prompt_tokens for i in sampling]
            masks = self._grammar_masks(batch, sampling, before_sampling)
            step.ids = self.sampler.sample_on_device(logits, requests, prompt_lens, masks)
            step.logprob_rows = [row for row, i in enumerate(sampling) if batch.seqs[i].params.logprobs is not None]
            if step.logprob_rows:
                step.logprobs = to_host(self._token_logprobs(step, logits))
            if self.logits_observer is not None:
                step.logits = logits
            step.host_ids = to_host(step.ids)
        if prompt is not None:
            prompt.copy_to_host()
        if self.device.type == "cuda" and (step.ids is not None or prompt is not None):
            step.ready = torch.cuda.Event()  # after every copy of the step
            step.ready.record()
        return step

    def _grammar_masks(self, batch: ScheduledBatch, sampling: list[int], before_sampling=None
                       ) -> tuple[list[int], torch.Tensor] | None:
        """(rows, host bitmasks) of the sampled rows whose requests a grammar constrains, None when none
        is. Written while the device runs the forward just queued, after `before_sampling()` has read
        the tokens of the step before (each grammar must have seen every token)."""
        if before_sampling is not None and any(batch.seqs[i].grammar is not None for i in sampling):
            before_sampling()
        # A request that ended with the step before samples a token nobody reads: it needs no mask.
        rows = [row for row, i in enumerate(sampling)
                if batch.seqs[i].grammar is not None and not batch.seqs[i].is_finished]
        if not rows:
            return None
        grammars = [batch.seqs[sampling[row]].grammar for row in rows]
        for row, grammar in zip(rows, grammars):
            seq = batch.seqs[sampling[row]]
            if grammar.consumed != seq.num_output_tokens:
                raise RuntimeError(f"request {seq.id}: its grammar saw {grammar.consumed} of "
                                   f"{seq.num_output_tokens} output tokens")
        return rows, fill_bitmasks(grammars, self.model.config.vocab_size, pin=self.device.type == "cuda")

    def _token_logprobs(self, step: LaunchedStep, logits: torch.Tensor) -> torch.Tensor:
        """The reduced rows (token_logprobs.py) of the sampled tokens whose requests asked, from the raw
        logits sampling started from; a teacher-forced token is scored in place of the sampled one."""
        seqs = [step.batch.seqs[step.sampling[row]] for row in step.logprob_rows]
        index = upload(step.logprob_rows, self.device)
        targets = step.ids.index_select(0, index)
        forced = [(n, seq.forced_tokens[seq.num_output_tokens]) for n, seq in enumerate(seqs)
                  if seq.forced_tokens is not None and seq.num_output_tokens < len(seq.forced_tokens)]
        if forced:
            targets = targets.index_copy(0, upload([n for n, _ in forced], self.device),
                                         upload([token for _, token in forced], self.device))
        return reduce_rows(logits.index_select(0, index), targets, max(seq.params.logprobs for seq in seqs))

    def _inputs_from(self, batch: ScheduledBatch, previous: LaunchedStep) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of this batch, their ids): the ids `previous` sampled for the same requests."""
        row_of = {id(previous.batch.seqs[i]): row for row, i in enumerate(previous.sampling)}
        pairs = [(i, row_of[id(seq)]) for i, seq in enumerate(batch.seqs) if id(seq) in row_of]
        if not pairs or previous.ids is None:
            return None
        index = upload([i for i, _ in pairs] + [row for _, row in pairs], self.device)
        rows, source_rows = index.split(len(pairs))
        return rows, previous.ids.index_select(0, source_rows)

    def collect(self, step: LaunchedStep) -> list[int | None]:
        """The sampled token of each sequence of a launched batch (None where it did not sample);
        waits for that step's copy only. Prompt logprobs it scored go to their sequences, and the
        logprobs of its tokens to `step.token_logprobs`."""
        out: list[int | None] = [None] * len(step.batch.seqs)
        if step.ready is not None:
            step.ready.synchronize()
        if step.prompt is not None:
            step.prompt.record()
        if step.ids is None:
            return out
        tokens = step.host_ids.tolist()
        for row, (i, token) in enumerate(zip(step.sampling, tokens)):
            seq = step.batch.seqs[i]
            if self.logits_observer is not None and step.logits is not None:
                self.logits_observer(seq, step.logits[row])
            if seq.forced_tokens is not None and seq.num_output_tokens < len(seq.forced_tokens):
                token = seq.forced_tokens[seq.num_output_tokens]
            out[i] = token
        step.logits = None
        if step.logprobs is not None:
            indexes = [step.sampling[row] for row in step.logprob_rows]
            entries = unpack_rows(step.logprobs, [out[i] for i in indexes],
                                  [step.batch.seqs[i].params.logprobs for i in indexes])
            step.token_logprobs = [None] * len(out)
            for i, entry in zip(indexes, entries):
                step.token_logprobs[i] = entry
        return out

    def run(self, batch: ScheduledBatch) -> list[int | None]:
        """Forward one scheduled batch; returns the sampled token of each sequence that samples."""
        return self.collect(self.launch(batch))
