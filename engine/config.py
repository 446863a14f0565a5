"""Every engine knob in one validated dataclass, plus the per-request SamplingParams."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields


EVICTION_POLICIES = ("score", "random", "recent")
BUDGET_POLICIES = ("fixed", "elastic")
WEIGHT_DTYPES = ("auto", "float32", "bfloat16")  # docs/design-notes.md, "Quantized CPU weights"
KV_CACHE_DTYPES = ("auto", "fp8", "int8")  # docs/design-notes.md, "KV in 8 bits"
DEFAULT_MODEL = "smollm2-135m"  # the built-in model a newcomer runs (engine/loading/model_registry.py)
GREEDY_BELOW_TEMPERATURE = 1e-5
MIN_PENALTY = 1e-6  # repetition penalties outside [1e-6, 1e6] only overflow the logits
MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (vLLM's default limit)
MAX_COUNT_PENALTY = 2.0  # frequency and presence penalties lie in [-2, 2], as OpenAI's API defines them


def _as_list(name: str, value, kind: type) -> list:
    """A stop list given as one item, a list or tuple, or None; anything else names the field."""
    if value is None:
        return []
    if isinstance(value, kind) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    _fail(name, value, f"must be a {kind.__name__}, a list of them, or None")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fail(name: str, value, why: str) -> None:
    raise ValueError(f"{name}={value!r}: {why}")


@dataclass
class EngineConfig:
    """Engine configuration. Every keyword of `LLM(...)` and `EngineThread(...)` is a field here."""

    model: str = DEFAULT_MODEL
    device: str | None = None  # "cpu" | "cuda" | None (auto)
    dtype: str | None = None  # "float32" | "bfloat16" | "float16" | None (bf16 on GPU, fp32 on CPU)
    # "auto": a quantized GGUF runs as stored on the CPU where a kernel maps its type (docs/design-notes.md,
    # "Quantized CPU weights"); "float32" / "bfloat16": every weight dequantized to that dtype.
    weight_dtype: str = "auto"
    # "auto": K and V in the model's dtype; "fp8" (float8_e4m3fn) or "int8" codes with a scale per
    # entry and KV head, half the bytes of bf16 (docs/design-notes.md, "KV in 8 bits").
    kv_cache_dtype: str = "auto"
    cpu_threads: int | None = None  # CPU: intra-op threads of the engine; None: chosen for the machine

    # Compressed PagedAttention
    compression: bool = True  # False: the full-KV baseline on the same engine
    block_size: int | None = None  # None: 256 on GPU, 32 on CPU
    max_cache_blocks_per_seq: int = 8  # budget n of a request that names none (SamplingParams.kv_budget)
    # "fixed": a request is compressed whenever it reaches its budget and never holds more than n + 1
    # blocks. "elastic": the budget is a floor; requests keep their full KV while the pool has room, and
    # the largest above their floor are compressed down to it when the pool is short.
    budget_policy: str = "fixed"
    window: int = 16  # observation window w (< block_size)
    use_global_score: bool = True
    global_decay: float = 0.8
    use_redundancy: bool = True
    redundancy_lambda: float = 0.2
    redundancy_temperature: float = 0.4
    lightning_redundancy: bool = True
    enable_pooling: bool = True
    pooling_kernel: int = 15  # wide enough to keep a retrieved fact whole (docs/quality.md)
    num_sink_tokens: int = 0
    # Score eviction: a prompt that fits in prompt_share of the budget is never evicted; while decoding,
    # recent_share of the rest of the budget is kept for the newest entries; scores choose the others.
    recent_share: float = 0.75
    prompt_share: float = 0.5
    eviction: str = "score"  # "score" (Zipage); baselines: "random", "recent" (sinks + most recent)
    async_compress: bool = True
    max_compressions_per_step: int = 8  # cap on compression work started per engine step
    hybrid_scheduling: bool = True
    num_query_slots: int | None = None  # None: sized together with the block pool

    # Paged cache and scheduling
    prefix_caching: bool = True
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: min(32768, the model's context length)
    max_num_batched_tokens: int = 4096  # tokens per step: decoders' first, prefill chunks fill the rest
    mixed_steps: bool = True  # prefill chunks ride in decode steps; False: a step is prefill or decode
    cpu_step_target_ms: float | None = None  # CPU: prefill chunks sized so a step lasts about this long
    memory_utilization: float = 0.9  # fraction of device memory for weights + KV (GPU)
    kv_cache_gb: float | None = None  # explicit KV pool size; on CPU default is a safe share of RAM
    num_kv_blocks: int | None = None  # explicit block count (tests, teaching demos); overrides sizing
    enforce_eager: bool = False
    overlap_steps: bool | None = None  # plan decode step N+1 while step N runs; None: on CUDA
    tensor_parallel_size: int = 1  # processes (one per GPU) sharing the model's heads and MLP columns
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        for key in kwargs:
            if key not in known:
                raise ValueError(f"unknown engine config field {key!r}; known fields: {', '.join(sorted(known))}")
        if model is not None:
            kwargs["model"] = model
        return cls(**kwargs)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            _fail("model", self.model, "must be a non-empty model name, path or hub id")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            _fail("device", self.device, 'must be "cpu", "cuda" or None')
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            _fail("dtype", self.dtype, 'must be "float32", "bfloat16", "float16" or None')
        if self.weight_dtype not in WEIGHT_DTYPES:
            _fail("weight_dtype", self.weight_dtype, f"must be one of {', '.join(WEIGHT_DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            _fail("kv_cache_dtype", self.kv_cache_dtype, f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.cpu_threads is not None:
            self._positive_int("cpu_threads")
        if self.weight_dtype != "auto" and self.dtype not in (None, self.weight_dtype):
            _fail("weight_dtype", self.weight_dtype, f"disagrees with dtype={self.dtype!r}: dequantized weights "
                                                     "run in the model's dtype, so set one of the two")
        for name in ("compression", "use_global_score", "use_redundancy", "lightning_redundancy",
                     "enable_pooling", "async_compress", "hybrid_scheduling", "prefix_caching",
                     "enforce_eager", "mixed_steps"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be True or False")
        if self.overlap_steps not in (None, True, False):
            _fail("overlap_steps", self.overlap_steps, "must be True, False or None (on for CUDA)")
        if self.overlap_steps and self.tensor_parallel_size > 1:
            _fail("overlap_steps", self.overlap_steps, "needs tensor_parallel_size=1")
        if self.cpu_step_target_ms is not None and (
                isinstance(self.cpu_step_target_ms, bool) or not isinstance(self.cpu_step_target_ms, (int, float))
                or not 1 <= self.cpu_step_target_ms <= 60_000):
            _fail("cpu_step_target_ms", self.cpu_step_target_ms, "must be None or a number of milliseconds in [1, 60000]")
        self._positive_int("max_cache_blocks_per_seq")
        self._positive_int("window")
        self._positive_int("max_num_seqs")
        self._positive_int("max_num_batched_tokens")
        self._positive_int("pooling_kernel")
        self._positive_int("max_compressions_per_step")
        self._positive_int("tensor_parallel_size")
        if self.block_size is not None:
            self._positive_int("block_size")
            if self.block_size & (self.block_size - 1):
                _fail("block_size", self.block_size, "must be a power of two")
            if self.compression and self.window >= self.block_size:
                _fail("window", self.window, f"must be smaller than block_size ({self.block_size})")
        if self.pooling_kernel % 2 == 0:
            _fail("pooling_kernel", self.pooling_kernel, "must be odd so pooling stays centred")
        if self.budget_policy not in BUDGET_POLICIES:
            _fail("budget_policy", self.budget_policy, f"must be one of {', '.join(BUDGET_POLICIES)}")
        if self.eviction not in EVICTION_POLICIES:
            _fail("eviction", self.eviction, f"must be one of {', '.join(EVICTION_POLICIES)}")
        sinks = self.num_sink_tokens
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            _fail("num_sink_tokens", self.num_sink_tokens, "must be an integer >= 0")
        self._number_in("recent_share", 0.0, 1.0, "must be a number in [0, 1)", top_open=True)
        self._number_in("prompt_share", 0.0, 1.0, "must be a number in [0, 1)", top_open=True)
        if self.max_model_len is not None:
            self._positive_int("max_model_len")
        if self.num_query_slots is not None:
            self._positive_int("num_query_slots")
        if self.num_kv_blocks is not None:
            self._positive_int("num_kv_blocks")
        self._number_in("memory_utilization", 0.0, 1.0, "must be a number in (0, 1]", bottom_open=True)
        if self.kv_cache_gb is not None and not (_is_number(self.kv_cache_gb) and 0 < self.kv_cache_gb < 1 << 20):
            _fail("kv_cache_gb", self.kv_cache_gb, "must be a number of GiB, > 0 and finite")
        self._number_in("global_decay", 0.0, 1.0, "must be a number in [0, 1]")
        self._number_in("redundancy_lambda", 0.0, 1.0, "must be a number in [0, 1]")
        self._number_in("redundancy_temperature", 0.0, math.inf, "must be a finite number > 0", bottom_open=True)
        # The seed goes to torch.manual_seed, which takes exactly this range.
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -2 ** 63 <= self.seed < 2 ** 64:
            _fail("seed", self.seed, "must be an integer in [-2**63, 2**64)")

    def _number_in(self, name: str, low: float, high: float, why: str, bottom_open: bool = False,
                   top_open: bool = False) -> None:
        """A finite real number (not a bool or a string, which float() would coerce or fail on
        without naming the field) between low and high, each end open or closed."""
        value = getattr(self, name)
        if not _is_number(value) or value < low or value > high or (bottom_open and value == low) \
                or (top_open and value == high):
            _fail(name, value, why)

    def _positive_int(self, name: str) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _fail(name, value, "must be an integer >= 1")

    def recent_kept(self, budget_tokens: int) -> int:
        """How many newest entries a compression always keeps: the window, or under score eviction
        the recent share of the budget if that is more. Scores choose the rest."""
        share = int(self.recent_share * budget_tokens) if self.eviction == "score" else 0
        return max(self.window, share)

    def prompt_kept(self, num_prompt_tokens: int, budget_tokens: int) -> int:
        """How many leading entries (the prompt) every compression of a request keeps: the whole prompt
        when it fits in the prompt share of the budget (score eviction), else none. A longer prompt is
        compressed right after its prefill, scored by its own last queries (usually the question)."""
        fits = num_prompt_tokens <= int(self.prompt_share * budget_tokens)
        return num_prompt_tokens if self.eviction == "score" and fits else 0


@dataclass
class SamplingParams:
    """How one request samples and when it stops."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's penalties, over the output's tokens only (docs/design-notes.md, "Penalties"):
    # logits[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int = 512
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_strings_in_output: bool = False  # keep the matched stop string in the text
    kv_budget: int | None = None  # KV budget in blocks (the floor under elastic budgets); None: the engine's
    # Log-probabilities under the model's raw distribution, log_softmax of the logits before penalties,
    # temperature and filters (docs/design-notes.md, "Log-probabilities"): each output token's and its
    # `logprobs` most likely alternatives; each prompt token's after the first, with `prompt_logprobs`
    # alternatives. None: not computed. 0: the token's own only.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured output (docs/design-notes.md, "Structured output"): the output is JSON matching this
    # schema (a dict, or its JSON text), or any JSON object for True; a grammar masks every token that
    # would leave it, and the request stops where the JSON ends.
    json_schema: dict | str | bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def number(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                _fail(name, value, "must be a finite number")
            return float(value)

        if number("temperature") < 0:
            _fail("temperature", self.temperature, "must be >= 0")
        if not 0.0 < number("top_p") <= 1.0:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            _fail("top_k", self.top_k, "must be an integer >= -1 (0 or -1 disables it)")
        if not 0.0 <= number("min_p") <= 1.0:
            _fail("min_p", self.min_p, "must be in [0, 1]")
        if not MIN_PENALTY <= number("repetition_penalty") <= 1 / MIN_PENALTY:
            _fail("repetition_penalty", self.repetition_penalty, f"must be in [{MIN_PENALTY:g}, {1 / MIN_PENALTY:g}]")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -MAX_COUNT_PENALTY <= number(name) <= MAX_COUNT_PENALTY:
                _fail(name, getattr(self, name), f"must be in [{-MAX_COUNT_PENALTY:g}, {MAX_COUNT_PENALTY:g}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                _fail(name, value, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        # 0 generates nothing: the request only scores its prompt (docs/design-notes.md, "Log-probabilities").
        lowest = 0 if self.prompt_logprobs is not None else 1
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < lowest:
            _fail("max_tokens", self.max_tokens, "must be an integer >= 1, or 0 with prompt_logprobs (to score the "
                                                 "prompt only)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2 ** 64):
            _fail("seed", self.seed, "must be None or an integer in [0, 2**64)")
        if self.kv_budget is not None and (isinstance(self.kv_budget, bool) or not isinstance(self.kv_budget, int)
                                           or self.kv_budget < 1):
            _fail("kv_budget", self.kv_budget, "must be None or an integer number of blocks >= 1")
        self.stop = _as_list("stop", self.stop, str)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids, int)
        for name in ("ignore_eos", "skip_special_tokens", "stop_strings_in_output"):
            # A string such as "false" would count as true and silently change the output.
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be True or False")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _fail("stop", self.stop, "must be non-empty strings")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                _fail("stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        if self.json_schema is not None:
            if self.json_schema is not True and not isinstance(self.json_schema, (dict, str)):
                _fail("json_schema", self.json_schema, "must be None, True (any JSON object), a JSON schema "
                                                       "object or its JSON text")
            if self.ignore_eos:
                _fail("ignore_eos", self.ignore_eos, "cannot be combined with json_schema: the output ends "
                                                     "where its JSON does")

    @property
    def penalised(self) -> bool:
        """Whether sampling reads the request's tokens (a repetition, frequency or presence penalty)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def greedy(self) -> bool:
        # Below this, dividing the logits by the temperature only overflows: it is argmax.
        return self.temperature < GREEDY_BELOW_TEMPERATURE
