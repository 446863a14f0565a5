"""The engine loop body: validate requests, schedule a step, run it, apply results, report.

`EngineCore` is single-threaded; `LLM` drives it directly and `EngineThread` drives it from a
background thread.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait, FIRST_COMPLETED

import torch

from zipage.engine.kv.block_manager import BlockManager
from zipage.engine.kv.compressor import CompressionJob, Compressor
from zipage.engine.config import EngineConfig, SamplingParams
from zipage.engine.loading.detokenizer import IncrementalDetokenizer
from zipage.engine.loading.grammars import Grammars
from zipage.engine.kv.geometry import CompressionGeometry, check_request_budget
from zipage.engine.kv.kept import KeptMap
from zipage.engine.kv.kept_reasons import kept_map
from zipage.engine.latency import LatencyMonitor
from zipage.engine.events import (ROLE_DECODE, ROLE_PRIVATE, ROLE_REUSED, ROLE_SHARED, ROLE_TARGET, Admitted, Aborted,
                                  Compressed, EngineSnapshot, Event, Failed, Finished, MemoryInfo, PoolInfo, Preempted,
                                  Prefilled, RequestInfo, ThroughputMeter)
from zipage.engine.loading.loader import ModelSource, resolve_model
from zipage.engine.loading.prompts import PromptReader
from zipage.engine.execution.cpu_threads import device_label, use_cpu_threads
from zipage.engine.execution.model_runner import LaunchedStep, ModelRunner, resolve_device
from zipage.engine.execution.models.parallel import TensorParallel, check_tensor_parallel
from zipage.engine.execution.tp_workers import TensorParallelWorkers
from zipage.engine.scheduling.scheduler import ScheduledBatch, Scheduler
from zipage.engine.sequence import Sequence
from zipage.engine.core.outputs import PromptTooLong, RequestOutput, UnknownRequest

DEFAULT_MAX_MODEL_LEN = 32768
EVENT_LOG_SIZE = 2000


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None):
        self.config = config
        self.source = source or resolve_model(config.model)
        self.tokenizer = self.source.tokenizer
        self.prompts = PromptReader(self.source)
        hf = self.source.hf_config
        device = resolve_device(config.device)
        self.block_size = config.block_size or (256 if device.type == "cuda" else 32)
        # Every compression length, derived once (and checked) for the scheduler, runner and cache.
        self.geometry = CompressionGeometry.from_config(config, self.block_size) if config.compression else None
        model_limit = int(getattr(hf, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN) or DEFAULT_MAX_MODEL_LEN)
        if config.max_model_len is not None and config.max_model_len > model_limit:
            raise ValueError(f"max_model_len={config.max_model_len}: the model supports at most {model_limit}")
        self.max_model_len = config.max_model_len or min(DEFAULT_MAX_MODEL_LEN, model_limit)
        # Chosen before the weights load (loading runs on them too) and before tensor-parallel ranks
        # start: each takes rank 0's count.
        self.cpu_threads = (use_cpu_threads(config.cpu_threads, config.tensor_parallel_size)
                            if device.type == "cpu" else None)

        self.tp_workers = None
        tp = TensorParallel()
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(hf, config.tensor_parallel_size, device)
            self.tp_workers = TensorParallelWorkers(config, self.source.path or self.source.name,
                                                    self.block_size, self.max_model_len)
            tp = self.tp_workers.tp
        try:
            self.runner = ModelRunner(config, self.source, self.block_size, self.max_model_len, tp, self.geometry)
        except BaseException:
            if self.tp_workers is not None:
                self.tp_workers.close()
            raise
        self.runner.workers = self.tp_workers
        self.blocks = BlockManager(self.runner.num_blocks, self.block_size, config.prefix_caching)
        if self.geometry is not None:
            self.blocks.max_cached_tokens = self.geometry.max_cached_tokens
        self.compressor = (Compressor(config, self.runner, self.blocks, self.block_size, self.geometry)
                           if config.compression else None)
        if self.compressor is not None and not config.enforce_eager:
            self.compressor.capture_graphs()
        step_target_s = (config.cpu_step_target_ms / 1000 if config.cpu_step_target_ms and device.type == "cpu"
                         else None)
        self.scheduler = Scheduler(config, self.blocks, self.max_model_len, self.runner.num_query_slots,
                                   self.compressor, step_target_s)
        self.jobs: dict[int, CompressionJob] = {}  # compressions in flight, by request id
        # Overlapped decode: the next step is planned and queued while the device runs this one.
        self.overlap = (config.overlap_steps if config.overlap_steps is not None
                        else device.type == "cuda" and self.tp_workers is None)
        self.inflight: LaunchedStep | None = None  # a decode step whose tokens are not read yet
        self.overlapped_steps = 0  # steps queued behind another before its tokens were read
        self.worker = (ThreadPoolExecutor(1, thread_name_prefix="zipage-compress")
                       if config.compression and config.async_compress else None)
        self.eos_token_ids = _eos_ids(hf, self.tokenizer)
        self.vocab_size = hf.vocab_size
        self.grammars = Grammars(self.tokenizer, hf.vocab_size, sorted(self.eos_token_ids))

        self.closed = False
        self.requests: dict[int, Sequence] = {}
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        self.events: deque[Event] = deque(maxlen=EVENT_LOG_SIZE)
        self.meter = ThroughputMeter()
        self.latency = LatencyMonitor()
        self.step_count = 0
        self.num_added = 0  # requests ever added: each one's sampling stream is derived from its index
        self.event_count = 0  # events ever logged (the log itself is bounded)
        self.totals = {"prompt_tokens": 0, "generated_tokens": 0, "finished": 0, "preemptions": 0,
                       "prefix_hit_tokens": 0, "compressions": 0, "pool_compressions": 0}

    # -- requests ------------------------------------------------------------------
    def encode_prompt(self, prompt) -> list[int]:
        """Token ids for a prompt given as text, UTF-8 bytes, or token ids; ValueError when unusable."""
        return self.prompts.encode(prompt)

    def check_prompt(self, ids: list[int]) -> list[int]:
        """PromptTooLong unless the prompt fits max_model_len and the KV pool with room for one token."""
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             "(the prompt must leave room for at least one generated token)")
        if self.blocks.blocks_for(len(ids) + 1) > self.blocks.num_blocks:
            raise PromptTooLong(f"prompt has {len(ids)} tokens but the KV pool holds only "
                             f"{self.blocks.num_blocks * self.block_size}")
        return ids

    def check_budget(self, kv_budget: int | None) -> None:
        """ValueError unless a request's own KV budget can run here: compression on, and its n + 1 blocks
        within the pool."""
        if kv_budget is not None:
            check_request_budget(kv_budget, self.geometry, self.blocks.num_blocks)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.prompts.chat(messages)

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("engine is closed")

    def check_params(self, params: SamplingParams | None) -> SamplingParams:
        """The request's SamplingParams (the defaults for None), checked for this engine: their values,
        and a kv_budget it can hold. ValueError otherwise."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        self.check_budget(params.kv_budget)
        if params.json_schema is not None:
            self.grammars.compile(params.json_schema)  # a schema the library refuses is the caller's error
        return params

    def add_request(self, prompt, params: SamplingParams | None = None, *, session: str | None = None,
                    stream: bool = False, forced_tokens: list[int] | None = None) -> Sequence:
        """Check a request (`check_params`, `check_prompt`) and queue it; ValueError queues nothing.
        `forced_tokens` (evaluation, teacher forcing): the output's first tokens, fed to the model in
        place of what it samples (the logits observer still sees what it would have sampled from)."""
        self.check_open()
        params = self.check_params(params)
        forced_tokens = self.encode_prompt(list(forced_tokens)) if forced_tokens else None  # ids in the vocabulary
        return self.enqueue(self.check_prompt(self.encode_prompt(prompt)), params, session=session, stream=stream,
                            forced_tokens=forced_tokens)

    def enqueue(self, ids: list[int], params: SamplingParams, *, session: str | None = None,
                stream: bool = False, forced_tokens: list[int] | None = None) -> Sequence:
        """Queue a request already checked (front doors check every request of a call before queueing
        any of them, so they validate once, here in the engine's terms)."""
        self.check_open()
        seq = Sequence(ids, params, session=session, stream_seed=_stream_seed(self.config.seed, self.num_added))
        seq.forced_tokens = forced_tokens
        if params.json_schema is not None:
            seq.grammar = self.grammars.compile(params.json_schema)
        self.num_added += 1
        self.requests[seq.id] = seq
        if stream or params.stop:
            self.detokenizers[seq.id] = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                                              params.stop)
        self.scheduler.add(seq)
        self.latency.arrived()
        self.totals["prompt_tokens"] += len(ids)
        return seq

    def observe_logits(self, observer) -> None:
        """Evaluation: `observer(seq, logits_row)` sees the float32 logits of every row a step samples
        from, before sampling (None stops it). Its steps run without overlap, so it sees each in turn."""
        self.runner.logits_observer = observer

    def abort(self, request_id: int) -> RequestOutput | None:
        """Stop a request now and free its blocks. Unknown or finished ids are ignored."""
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return None
        out = self._finish(seq, "abort")
        self._settle_inflight()
        return out

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None

    # -- one step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        self._settle_inflight()
        return outputs

    def _step(self) -> list[RequestOutput]:
        outputs = self._land_compressions(block=False)
        if self.inflight is not None:
            overlapped = self._overlapped_step()
            if overlapped is not None:
                return outputs + overlapped
            outputs += self._collect_inflight()
        batch = self.scheduler.schedule()
        if batch is None:
            if self.jobs:  # only compressions are in flight: wait for one rather than spin
                outputs += self._land_compressions(block=True)
            return outputs
        for seq in batch.admitted:
            self._log(Admitted(request=seq.id, time=time.time(), prompt_tokens=seq.num_prompt_tokens,
                               cached_tokens=seq.num_cached_prefix_tokens, blocks=len(seq.block_table)))
            self.totals["prefix_hit_tokens"] += seq.num_cached_prefix_tokens
            self.latency.admitted(seq.arrival_time, seq.num_prompt_tokens, seq.num_cached_prefix_tokens,
                                  first_time=seq.num_preemptions == 0)
        for seq in batch.preempted:
            self.totals["preemptions"] += 1
            self.latency.count("preemptions")
            self._log(Preempted(request=seq.id, time=time.time(), output_tokens=seq.num_output_tokens))
        for seq in batch.exhausted:  # longer than the whole pool: it can never run again
            outputs.append(self._finish(seq, "length", error="the KV pool cannot hold this request any longer"))
        for job in batch.compress:
            outputs += self._start_compression(job)
        if not batch.seqs:
            if self.jobs and not batch.compress and not batch.preempted:
                outputs += self._land_compressions(block=True)
            return outputs
        launched = self._launch(batch)
        if not isinstance(launched, LaunchedStep):
            return outputs + launched
        if self._may_overlap(batch):
            self._apply_computed(batch, 0.0)
            self.inflight = launched  # its tokens are read during the next step, after it is queued
            return outputs
        tokens, failed = self._collect(launched)
        self._apply_computed(batch, time.monotonic() - launched.started)
        return outputs + failed + self._apply_tokens(batch, tokens, launched.token_logprobs)

    # -- overlapped decode: step N+1 is queued on the device before step N's ids are read ----------
    def _may_overlap(self, batch: ScheduledBatch) -> bool:
        """Whether the next step may be planned before this batch's tokens are known: plain decode,
        and nothing needs the host to see a token before the next forward (penalties read the tokens,
        teacher forcing and logit observers replace or read each row). A grammar's mask follows each
        token too, but only sampling needs it: the step in flight is read after the next forward is
        queued and before that forward's rows are sampled (`_overlapped_step`)."""
        return (self.overlap and not batch.is_prefill and self.runner.logits_observer is None
                and all(not seq.params.penalised and seq.forced_tokens is None for seq in batch.seqs))

    def _overlapped_step(self) -> list[RequestOutput] | None:
        """Queue the next decode step behind the one in flight, then read and apply the one in flight.
        None (nothing changed) when the next step is more than plain decode of the running requests:
        then the step in flight is collected first and the step is planned as usual."""
        previous = self.inflight
        waiting_for = [previous.batch.seqs[i] for i in previous.sampling if not previous.batch.seqs[i].is_finished]
        for seq in waiting_for:
            seq.expect_token()
        if not self.scheduler.overlap_ready():
            for seq in waiting_for:
                seq.forget_expected_token()
            return None
        batch = self.scheduler.schedule()
        assert batch is not None and not (batch.is_prefill or batch.preempted or batch.exhausted), \
            "overlap_ready() promised decode and compressions only"
        # A compression reads KV up to the token in flight, which the device writes before it starts;
        # the sampled id itself is not needed.
        outputs = []
        for job in batch.compress:
            outputs += self._start_compression(job)
        if not batch.seqs:  # a short pool compresses every request that would decode (elastic budgets)
            return outputs + self._collect_inflight()
        # A grammar's mask needs the tokens in flight: the runner reads them, once this forward is
        # queued, before it samples (docs/design-notes.md, "Structured output").
        collected = []
        launched = self._launch(batch, previous, before_sampling=lambda: collected.extend(self._collect_inflight()))
        self.overlapped_steps += 1
        outputs += collected + (self._collect_inflight() if self.inflight is not None else [])
        if not isinstance(launched, LaunchedStep):
            return outputs + launched
        # Only now are the tokens whose KV this step writes all known: block hashes read them.
        self._apply_computed(batch, 0.0)
        if self._may_overlap(batch):
            self.inflight = launched
            return outputs
        tokens, failed = self._collect(launched)
        return outputs + failed + self._apply_tokens(batch, tokens, launched.token_logprobs)

    def finish_inflight(self) -> list[RequestOutput]:
        """Read the step in flight now, so nothing is left queued (a paused engine, or one stepped by
        hand, shows every token it computed): its outputs."""
        return self._collect_inflight() if self.inflight is not None else []

    def _settle_inflight(self) -> None:
        """A step in flight whose requests have all ended (the last token of each came in the step
        before, or they were aborted) is waited for and dropped, so an idle engine holds no step."""
        if self.inflight is not None and all(seq.is_finished for seq in self.inflight.batch.seqs):
            self._collect_inflight()  # reports nothing: every request in it has ended

    def _collect_inflight(self) -> list[RequestOutput]:
        launched, self.inflight = self.inflight, None
        tokens, failed = self._collect(launched)
        return failed + self._apply_tokens(launched.batch, tokens, launched.token_logprobs)

    def _launch(self, batch: ScheduledBatch, previous: LaunchedStep | None = None,
                before_sampling=None) -> LaunchedStep | list[RequestOutput]:
        """Queue the batch's forward; a failure ends the requests in it (not the engine)."""
        started = time.monotonic()
        try:
            launched = self.runner.launch(batch, previous, before_sampling)
        except Exception as e:
            return self._fail_batch(batch, e)
        launched.started = started
        self.step_count += 1
        self.latency.stepped()
        return launched

    def _collect(self, launched: LaunchedStep) -> tuple[list[int | None], list[RequestOutput]]:
        """The launched batch's tokens; a failure ends its requests (their outputs come second)."""
        try:
            return self.runner.collect(launched), []
        except Exception as e:
            return [None] * len(launched.batch.seqs), self._fail_batch(launched.batch, e)

    def _fail_batch(self, batch: ScheduledBatch, e: Exception) -> list[RequestOutput]:
        return [self._finish(seq, "error", error=f"{type(e).__name__}: {e}") for seq in batch.seqs
                if not seq.is_finished]

    def _apply_computed(self, batch: ScheduledBatch, seconds: float) -> None:
        """The batch's KV writes are queued: count them (and register the blocks they fill)."""
        prefilled = decoded = 0
        for i, seq in enumerate(batch.seqs):
            if seq.is_finished:
                continue
            n = batch.num_new_tokens[i]
            seq.computed(n)
            self.blocks.commit_full_blocks(seq)
            if i < batch.num_decode:
                decoded += n
                continue
            prefilled += n
            if not seq.in_prefill:
                self._log(Prefilled(request=seq.id, time=time.time(), tokens=seq.num_computed_tokens,
                                    seconds=round(seconds, 4)))
        self.meter.add(prefilled, decoded)
        if prefilled:
            self.scheduler.chunks.observe(prefilled + decoded, seconds)

    def _apply_tokens(self, batch: ScheduledBatch, tokens: list[int | None],
                      logprobs: list | None = None) -> list[RequestOutput]:
        """Append each sampled token (in place of its placeholder when the next step was planned
        already) and its logprobs where asked, check the stop conditions, report."""
        outputs = []
        for i, (seq, token) in enumerate(zip(batch.seqs, tokens)):
            if token is None or seq.is_finished:
                continue
            if seq.params.max_tokens == 0:  # it only scored its prompt: its prefill is all it asked for
                outputs.append(self._finish(seq, "length"))
                continue
            if seq.expects_token:
                seq.fill_token(token)
            else:
                seq.append_token(token)
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs[i])
            self.latency.token(seq.id, seq.arrival_time)
            self.totals["generated_tokens"] += 1
            refused = seq.grammar.accept(token) if seq.grammar is not None else None
            out = self._after_token(seq, token) if refused is None else self._finish(seq, "error", error=refused)
            if out is not None:
                outputs.append(out)
        return outputs

    # -- compression ------------------------------------------------------------------
    def _start_compression(self, job: CompressionJob) -> list[RequestOutput]:
        self.jobs[job.seq.id] = job
        if self.tp_workers is not None:  # every rank compacts its own heads, in the order sent
            self.tp_workers.send("compress", job.work())
        if self.worker is not None:
            job.future = self.worker.submit(self._execute, job)
            return []
        self._execute(job)
        return self._land(job)

    def _execute(self, job: CompressionJob) -> None:
        try:
            self.compressor.execute(job)
        except Exception as e:  # reported when the job lands, on the engine thread
            job.error = e

    def _land_compressions(self, block: bool) -> list[RequestOutput]:
        futures = [j.future for j in self.jobs.values() if j.future is not None]
        if block and futures:
            wait(futures, return_when=FIRST_COMPLETED)
        outputs = []
        for job in [j for j in self.jobs.values() if j.future is not None and j.future.done()]:
            outputs += self._land(job)
        return outputs

    def _land(self, job: CompressionJob) -> list[RequestOutput]:
        seq = job.seq
        del self.jobs[seq.id]
        if job.error is not None:
            return [self._finish(seq, "error", error=f"compression failed: {type(job.error).__name__}: {job.error}")]
        self.compressor.apply(job)
        self.totals["compressions"] += 1
        self.totals["pool_compressions"] += job.reason == "pool"
        self.latency.count("compressions")
        self._log(Compressed(request=seq.id, time=time.time(), blocks_before=len(job.source_table),
                             blocks_after=len(seq.block_table), tokens_before=job.kv_len, tokens_after=seq.kv_len,
                             evicted_per_layer=job.kv_len - seq.kv_len, prompt_kept=job.kept[0],
                             recent_kept=job.kept[1], times=seq.times_compressed, seconds=round(job.duration, 5),
                             reason=job.reason, budget_blocks=job.keep // self.block_size))
        return []

    def _after_token(self, seq: Sequence, token: int) -> RequestOutput | None:
        """Check the stop conditions; an output for finished or streaming requests, else None."""
        params = seq.params
        detok = self.detokenizers.get(seq.id)
        delta = detok.add([token]) if detok else ""
        reason = None
        if detok is not None and detok.stopped_at is not None:
            reason = "stop"
        elif token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif seq.grammar is not None and seq.grammar.done:  # the JSON is complete: only its end may follow
            reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            out = self._finish(seq, reason)
            out.delta = delta + out.delta
            return out
        if detok is None:
            return None
        out = self._output(seq, delta, finished=False)
        out.new_token_ids = [token]
        out.new_logprobs = seq.logprobs[-1:] if seq.logprobs is not None else None
        return out

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> RequestOutput:
        seq.forget_expected_token()  # a token still on the device is never reported
        # An abort, or a last token read after its compression started (overlapped steps): the worker
        # is writing its blocks, so they are freed once it is done, and the compaction is dropped.
        job = self.jobs.pop(seq.id, None)
        if job is not None and job.future is not None:
            wait([job.future])
        self.scheduler.remove(seq)
        seq.finish(reason, error)
        self.totals["finished"] += 1
        self.latency.finished(seq.id)
        if reason == "abort":
            self.latency.count("aborts")
        kind = {"abort": Aborted, "error": Failed}.get(reason, Finished)
        self._log(kind(request=seq.id, time=time.time(), reason=reason, output_tokens=seq.num_output_tokens,
                       error=error))
        detok = self.detokenizers.pop(seq.id, None)
        if detok is not None:
            delta = detok.finish(seq.params.stop_strings_in_output)
            text = detok.final_text
        else:
            delta = ""
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
        del self.requests[seq.id]
        return self._output(seq, delta, finished=True, text=text)

    def _output(self, seq: Sequence, delta: str, finished: bool, text: str | None = None) -> RequestOutput:
        if text is None:
            detok = self.detokenizers.get(seq.id)
            text = detok.text[:detok.emitted] if detok else ""
        metrics = {"arrival": seq.arrival_time, "first_token": seq.first_token_time,
                   "preemptions": seq.num_preemptions, "times_compressed": seq.times_compressed,
                   "cached_prompt_tokens": seq.num_cached_prefix_tokens}
        if finished:
            prompt_ids, output_ids = seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids
        else:
            prompt_ids, output_ids = [], []
        # Logprobs where asked: all of them when finished; the prompt's on the first output too.
        logprobs = list(seq.logprobs) if finished and seq.logprobs is not None else None
        first = finished or seq.num_output_tokens == 1
        prompt_logprobs = list(seq.prompt_logprobs) if first and seq.prompt_logprobs is not None else None
        return RequestOutput(seq.id, seq.session, prompt_ids, output_ids, text, delta, finished,
                             seq.finish_reason, seq.error, metrics, num_output_tokens=seq.num_output_tokens,
                             logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _log(self, event: Event) -> None:
        self.events.append(event)
        self.event_count += 1

    def events_since(self, seen: int) -> tuple[list[Event], int]:
        """The events logged after the first `seen` ones, and the count to pass next time. The log is
        a bounded deque: counting from the newest, entries it already dropped do not matter."""
        fresh = min(self.event_count - seen, len(self.events))
        new = [self.events[i] for i in range(len(self.events) - fresh, len(self.events))] if fresh > 0 else []
        return new, self.event_count

    # -- observation -------------------------------------------------------------------
    def block_roles(self, seq: Sequence) -> tuple[str, ...]:
        roles = []
        targets = self.geometry.budget_of(seq) if seq.is_compressed else 0
        reused = 0 if seq.is_compressed else seq.num_cached_prefix_tokens // self.block_size
        for i, block_id in enumerate(seq.block_table):
            if self.blocks.blocks[block_id].ref_count > 1:
                roles.append(ROLE_SHARED)
            elif i < reused:
                roles.append(ROLE_REUSED)
            elif i < targets:
                roles.append(ROLE_TARGET)
            elif seq.is_compressed and i == targets:
                roles.append(ROLE_DECODE)
            else:
                roles.append(ROLE_PRIVATE)
        return tuple(roles)

    def snapshot(self, max_events: int = 200) -> EngineSnapshot:
        now = time.monotonic()
        infos = []
        for seq in self.scheduler.live():
            elapsed = now - (seq.first_token_time or now)
            roles = self.block_roles(seq)
            infos.append(RequestInfo(
                id=seq.id, session=seq.session, status=seq.status.value, prompt_tokens=seq.num_prompt_tokens,
                output_tokens=seq.num_output_tokens, kv_len=seq.kv_len, block_table=tuple(seq.block_table),
                block_roles=roles, blocks_shared=roles.count(ROLE_SHARED),
                times_compressed=seq.times_compressed, query_slot=seq.query_slot,
                kv_budget=self.geometry.budget_of(seq) if self.geometry is not None else None,
                compressed_for=seq.compressed_for,
                tokens_per_s=seq.num_output_tokens / elapsed if elapsed > 0 else 0.0))
        cached_blocks = tuple(self.blocks.cached_free_ids())
        pool = PoolInfo(total=self.blocks.num_blocks, free=self.blocks.num_free, used=self.blocks.num_used,
                        cached=len(cached_blocks), cached_blocks=cached_blocks, block_size=self.block_size,
                        query_slots_total=self.scheduler.num_query_slots,
                        query_slots_used=self.scheduler.slots_used)
        return EngineSnapshot(
            time=time.time(), step=self.step_count, model=self.source.name, device=self.device_label,
            compression=self.config.compression, requests=tuple(infos), pool=pool, memory=self._memory(),
            throughput=self.meter.rates(now), events=tuple(list(self.events)[-max_events:]),
            waiting=len(self.scheduler.waiting), running=len(self.scheduler.running), totals=dict(self.totals),
            latency=self.latency.summary(self.has_work()))

    @property
    def device_label(self) -> str:
        """The device as reported: "cpu · 2 threads", "cuda:0"."""
        return device_label(self.runner.device, self.cpu_threads.count if self.cpu_threads else None)

    def kept(self, request_id: int) -> KeptMap:
        """Which token positions a live request's KV cache still holds, per layer and KV head, and why
        (docs/design-notes.md, "What a request still holds"). Asked between steps: the one place the
        positions are copied from the device. A compaction under way is waited for, and what it leaves
        is described. UnknownRequest for an id that is not live (never submitted, or finished)."""
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            raise UnknownRequest(f"request {request_id} is unknown or has finished")
        table, kv_len, compressions = seq.block_table, seq.kv_len, seq.times_compressed
        compacted, protected = seq.num_scored, seq.protected
        job = self.jobs.get(request_id)
        if job is not None:  # its blocks are being rewritten: describe them as the compaction leaves them
            if job.future is not None:
                wait([job.future])
            if job.error is not None:
                raise RuntimeError(f"request {request_id}: its compression failed: {job.error}")
            table, kv_len, compacted, protected = job.targets, job.keep, job.keep, job.kept
            compressions += 1
        hf = self.source.hf_config
        if self.compressor is None:  # nothing is ever evicted: entry j holds position j
            positions = torch.arange(kv_len, dtype=torch.int32)[None, :, None].expand(
                self.runner.num_layers, kv_len, hf.num_key_value_heads)
            choices = None
        else:
            bs = self.block_size
            slots = [table[j // bs] * bs + j % bs for j in range(kv_len)]
            positions, choices = self.runner.read_kept(slots)
            if self.tp_workers is not None:  # every rank holds its own KV heads
                positions, choices = self.tp_workers.gather_kept(slots, (positions, choices))
        return kept_map(request_id, seq.num_computed_tokens, compressions, positions, choices,
                        prompt_tokens=seq.num_prompt_tokens, sink_tokens=self.config.num_sink_tokens,
                        compacted=compacted, protected=protected, by_recency=self.config.eviction == "recent")

    def _memory(self) -> MemoryInfo:
        device = self.runner.device
        if device.type == "cuda":
            used = torch.cuda.memory_reserved(device)
            total = torch.cuda.get_device_properties(device).total_memory
        else:
            used, total = _process_rss(), _total_ram()
        return MemoryInfo(kv=self.runner.kv_bytes, weights=self.runner.weight_bytes, device_used=used,
                          device_total=total, kv_dtype=self.runner.kv_dtype_name)

    def check_invariants(self) -> None:
        """Exact pool accounting and the compression bound (used by tests after every step)."""
        live = self.scheduler.live()
        self.blocks.check_invariants(live)
        if self.compressor is not None:
            for seq in live:  # a fixed budget bounds a request at n + 1 blocks once compressed
                n_max = self.geometry.max_blocks_of(seq)
                if seq.is_compressed and not self.geometry.elastic:
                    assert len(seq.block_table) <= n_max, f"request {seq.id} holds {len(seq.block_table)} blocks"
            slots = [s.query_slot for s in live if s.query_slot is not None]
            assert len(slots) == len(set(slots)), "a query slot is held twice"
            assert len(slots) + len(self.scheduler.free_slots) == self.scheduler.num_query_slots

    def close(self) -> None:
        """Abort every request, stop the workers and release the pool and weights. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for request_id in list(self.requests):
            self.abort(request_id)
        self.inflight = None
        if self.worker is not None:
            self.worker.shutdown(wait=True)
        if self.tp_workers is not None:
            self.tp_workers.close()
        if self.compressor is not None:
            self.compressor.graphs.clear()  # they hold device memory
        self.runner.release()


def _stream_seed(engine_seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for the index-th request (SplitMix64's finaliser)."""
    x = (engine_seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1


def _eos_ids(hf_config, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return ids


def _process_rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            import os
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _total_ram() -> int:
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
