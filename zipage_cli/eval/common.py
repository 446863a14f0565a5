"""What every `zipage eval` task shares: the configurations, budgets, --set knobs, sample splits,
the engine loop, the full-KV reference cache, progress bars, partial JSON results and the table.

A task module supplies samples and a scoring rule; `evaluate` runs full KV once, then every
configuration at every budget, and writes the results as each cell finishes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from zipage.engine.config import EngineConfig, SamplingParams
from zipage.cli.eval.trace import Tracer, TraceTo, write_group

if TYPE_CHECKING:  # torch and the engine load when a task runs, not when the command line starts
    from zipage.engine.core.engine_core import EngineCore

# The rows every task compares at equal budgets. Each row names every scoring knob it relies on, so
# a change of the engine defaults moves only the "default" row.
PAPER_SCORING = dict(eviction="score", use_global_score=True, use_redundancy=True, enable_pooling=True,
                     pooling_kernel=5, recent_share=0.0, prompt_share=0.0, num_sink_tokens=0)
CONFIGURATIONS = {
    "default": {},  # the engine's defaults, whatever they are
    "pure scoring": PAPER_SCORING,  # every scoring component, the whole budget chosen by score
    "window score": {**PAPER_SCORING, "use_global_score": False, "use_redundancy": False, "enable_pooling": False},
    "+ global score": {**PAPER_SCORING, "use_redundancy": False, "enable_pooling": False},
    "+ redundancy": {**PAPER_SCORING, "enable_pooling": False},
    "sinks + recent": dict(eviction="recent", num_sink_tokens=4),
    "random": dict(eviction="random"),
}
SUITE = ["default", "pure scoring", "window score", "sinks + recent", "random"]
FULL_KV = "full KV"
SPLITS = ("selection", "report")


# -- options ---------------------------------------------------------------------------------
def parse_configurations(text: str | None, default: list[str] = SUITE) -> list[str]:
    """"default;random" -> ["default", "random"]; None -> the suite's rows."""
    if not text:
        return list(default)
    names = [name.strip() for name in text.split(";") if name.strip()]
    for name in names:
        if name not in CONFIGURATIONS:
            raise ValueError(f"unknown configuration {name!r}; known: {'; '.join(CONFIGURATIONS)}")
    if not names:
        raise ValueError("--configurations: name at least one configuration")
    return names


@dataclass(frozen=True)
class Budget:
    """A KV budget: a fixed number of blocks, or a share of each sample's context."""

    blocks: int | None = None
    share: float | None = None

    @property
    def label(self) -> str:
        return f"{self.share * 100:g}%" if self.share is not None else f"{self.blocks} blocks"

    def blocks_for(self, context_tokens: int, block_size: int) -> int:
        if self.blocks is not None:
            return self.blocks
        return max(1, round(self.share * context_tokens / block_size))


def parse_budgets(text: str) -> list[Budget]:
    """"25%,50%,75%" (shares of the context) or "4,8,16" (blocks), or a mix."""
    budgets = []
    for item in text.split(","):
        item = item.strip()
        try:
            if item.endswith("%"):
                share = float(item[:-1]) / 100
                if not 0 < share <= 4:
                    raise ValueError
                budgets.append(Budget(share=share))
            else:
                blocks = int(item)
                if blocks < 1:
                    raise ValueError
                budgets.append(Budget(blocks=blocks))
        except ValueError:
            raise ValueError(f"--budgets: {item!r} is neither a block count >= 1 nor a share like 50%") from None
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"--budgets {text!r}: a budget is listed twice")
    return budgets


# An evaluation setting beside the engine knobs: size each group's KV pool as this share of what its
# samples hold in full (--set pool_share=0.5), so elastic budgets are measured in a pool that is short.
POOL_SHARE = "pool_share"


def parse_settings(items: list[str]) -> dict:
    """["recent_share=0.5", "enable_pooling=false"] -> {"recent_share": 0.5, "enable_pooling": False}."""
    settings = {}
    known = {f.name for f in dataclasses.fields(EngineConfig)} | {POOL_SHARE}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KNOB=VALUE")
        if key not in known:
            raise ValueError(f"--set {item!r}: unknown engine knob {key!r}")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    share = settings.get(POOL_SHARE)
    if share is not None and not (isinstance(share, (int, float)) and not isinstance(share, bool) and 0 < share <= 4):
        raise ValueError(f"--set {POOL_SHARE}={share!r}: must be a number in (0, 4]")
    EngineConfig(**{k: v for k, v in settings.items() if k != POOL_SHARE})  # a bad value fails with the config's message
    return settings


def pool_blocks(requests: list[Request], block_size: int, share: float) -> int:
    """A KV pool of `share` times the blocks every request of a group holds at its full length: 1 holds
    them all in full KV, 0.5 half of that (elastic budgets then compress when it runs short)."""
    return max(1, int(share * sum(-(-r.context_tokens // block_size) for r in requests)))


def check_count(name: str, value: int, low: int = 1, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"--{name.replace('_', '-')} {value!r}: must be an integer {bound}")


def check_trace_folder(folder: str | None) -> None:
    """Make --trace's folder now, so a run never ends unable to draw what it measured."""
    if folder is None:
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--trace {folder}: cannot make the folder ({e.strerror})") from None
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--trace {folder}: not writable")


def split_indices(count: int, split: str, seed: int = 0) -> list[int]:
    """A seeded, disjoint halving of `count` fixed items: the selection half tunes, the report half reports."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: must be one of {', '.join(SPLITS)}")
    order = list(range(count))
    random.Random(seed).shuffle(order)
    half = order[:count // 2] if split == "selection" else order[count // 2:]
    return sorted(half)


def sample_rng(task: str, split: str, index: int) -> random.Random:
    """The generator of one generated sample: the two splits draw from disjoint seeds."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: must be one of {', '.join(SPLITS)}")
    return random.Random(f"{task}/{split}/{index}")


# -- the engine loop --------------------------------------------------------------------------
@dataclass
class Request:
    """One engine request of a task: a prompt, an optional forced start of the output (teacher
    forcing, so every configuration sees the same text), then `free_tokens` greedy tokens."""

    prompt: list[int]
    forced: list[int] = dataclasses.field(default_factory=list)
    free_tokens: int = 0

    @property
    def context_tokens(self) -> int:
        return len(self.prompt) + len(self.forced) + self.free_tokens


def make_engine(source, block_size: int, budget_blocks: int | None, window: int, overrides: dict,
                device: str) -> EngineCore:
    """Full KV when budget_blocks is None; otherwise compressed with synchronous compression, so the
    results are deterministic."""
    if budget_blocks is None:
        config = EngineConfig(model=source.name, compression=False, block_size=block_size, device=device)
    else:
        config = EngineConfig(**{**dict(model=source.name, compression=True, block_size=block_size,
                                        max_cache_blocks_per_seq=budget_blocks, window=window, device=device),
                                 **overrides, "async_compress": False})
    from zipage.engine.core.engine_core import EngineCore

    return EngineCore(config, source=source)


def drive(engine: EngineCore, requests: list[Request], observer=None, on_step=None,
          on_compressed=None) -> list[list[int]]:
    """Run the requests to completion, greedy after their forced tokens; observer(i, seq, logits) sees
    every sampled step of request i, on_step(n) the tokens each step made, and on_compressed(i, seq) each
    compression of request i, right after the step that landed it (while the request still runs).
    Returns each request's output tokens."""
    index: dict[int, int] = {}
    seqs = []
    for i, req in enumerate(requests):
        n = len(req.forced) + req.free_tokens
        seq = engine.add_request(req.prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                                 forced_tokens=req.forced)
        index[seq.id] = i
        seqs.append(seq)
    seen = [0] * len(seqs)  # compressions already reported
    if observer is not None:
        engine.observe_logits(lambda seq, logits: observer(index[seq.id], seq, logits))
    outputs: list[list[int]] = [[] for _ in requests]
    try:
        while engine.has_work():
            made = engine.totals["generated_tokens"]
            for out in engine.step():
                if out.finished:
                    outputs[index[out.id]] = list(out.token_ids)
            if on_compressed is not None:
                for i, seq in enumerate(seqs):
                    if seq.times_compressed > seen[i] and not seq.is_finished:
                        on_compressed(i, seq)
                    seen[i] = seq.times_compressed
            if on_step is not None:
                on_step(engine.totals["generated_tokens"] - made)
    finally:
        engine.observe_logits(None)
    return outputs


def tokens_of(requests: list[Request]) -> int:
    """Tokens a batch of requests makes, forced ones included: the progress bars' unit of work (steps
    would only be estimated: chunked prefill and compressions add some)."""
    return sum(len(r.forced) + r.free_tokens for r in requests)


# -- the full-KV reference cache ---------------------------------------------------------------
# The engine defaults full KV runs its numbers with: part of the cache key, so a reference computed
# on other weights (float32 before quantized CPU weights were the default) never serves a later run.
REFERENCE_NUMBERS = ("weight_dtype", "dtype", "kv_cache_dtype")


def cache_dir() -> Path:
    return Path(os.environ.get("ZIPAGE_EVAL_CACHE", Path.home() / ".cache" / "zipage" / "eval"))


def reference_key(task: Task, source, block_size: int, device: str) -> dict:
    """What full KV's results depend on: the model file, the engine's numbers (a quantized file's CPU
    forms among them), the samples."""
    from zipage.engine.execution.models.quantized import cpu_forms_stamp

    return {"model": model_identity(source), "block_size": block_size, "device": device,
            "numbers": {k: getattr(EngineConfig, k) for k in REFERENCE_NUMBERS}, "cpu_forms": cpu_forms_stamp(),
            "samples": [[(r.prompt, r.forced, r.free_tokens) for r in g] for g in task.groups], **task.reference_key}


def cached_reference(task: str, key: dict, build):
    """Full KV's results for these exact samples and options, computed once and reused by every
    later run (keyed by a hash of the task, model file and options). ZIPAGE_EVAL_CACHE=off disables it."""
    if os.environ.get("ZIPAGE_EVAL_CACHE") == "off":
        return build()
    digest = hashlib.sha256(json.dumps({"task": task, **key}, sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = cache_dir() / f"{task}-{digest}.pt"
    if path.exists():
        import torch

        return torch.load(path, weights_only=True)  # plain tensors, lists and numbers: nothing is unpickled
    value = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    import torch

    torch.save(value, tmp)
    tmp.replace(path)
    return value


def model_identity(source) -> str:
    """The model's name plus its file's size and modification time, so a changed file misses the cache."""
    path = Path(str(getattr(source, "path", "") or source.name))
    if path.exists():
        stat = path.stat()
        return f"{source.name}:{stat.st_size}:{int(stat.st_mtime)}"
    return str(source.name)


# -- progress --------------------------------------------------------------------------------
class Progress:
    """Rich progress bars on stderr with the time left, plain lines where stderr is no terminal, or
    nothing (enabled=False, for tests)."""

    def __init__(self, enabled: bool = True):
        from zipage.cli.progress_lines import ProgressLines, is_terminal

        self.bars = None
        self.lines = ProgressLines() if enabled and not is_terminal() else None
        if enabled and self.lines is None:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self.bars = RichProgress(TextColumn("{task.description:32}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                                     console=Console(stderr=True), transient=False)

    def __enter__(self):
        if self.bars is not None:
            self.bars.start()
        if self.lines is not None:
            self.lines.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bars is not None:
            self.bars.stop()
        if self.lines is not None:
            self.lines.__exit__(*exc)

    def task(self, description: str, total: int):
        """A bar; returns the function that advances it by n units."""
        if self.lines is not None:
            self.lines.add(description, total)
            return lambda n: self.lines.advance(description, n)
        if self.bars is None:
            return lambda n: None
        task_id = self.bars.add_task(description, total=total)
        return lambda n: self.bars.advance(task_id, n)

    def log(self, line: str) -> None:
        if self.lines is not None:
            print(line, file=sys.stderr, flush=True)
        elif self.bars is not None:
            self.bars.console.print(line)


# -- the run --------------------------------------------------------------------------------
@dataclass
class Task:
    """What a task gives `evaluate`. Samples are grouped: a group shares a context length, so one
    engine per budget serves the whole group."""

    name: str
    groups: list[list[Request]]  # samples, grouped
    score: object  # score(outputs_by_group, observed_by_group, reference) -> dict of metrics with "score"
    # observer(group_index, reference or None) -> (observer(i, seq, logits), what it collects)
    observer: object = None
    teacher_forced: bool = False  # compressed runs are fed full KV's outputs
    full_kv_metrics: object = None  # full_kv_metrics(reference) -> the full-KV row's metrics
    reference_key: dict = dataclasses.field(default_factory=dict)
    metric: str = "accuracy"  # what "score" is, for the table
    spans: object = None  # spans(group, i) -> [(label, text)]: what --trace marks in a sample's prompt


def run_cell(task: Task, source, budget: Budget | None, block_size: int, window: int, overrides: dict,
             device: str, advance, reference: dict | None = None, trace: TraceTo | None = None) -> dict:
    """One configuration at one budget over every group, or full KV (budget None, no reference yet):
    outputs, what the observer collected, compressions and seconds. With `trace`, each sample's kept
    maps after its compressions are drawn into trace.folder."""
    start = time.monotonic()
    outputs, observed, compressions = [], [], 0
    first = 0  # the number of the group's first sample, for the pictures' names
    for g, requests in enumerate(task.groups):
        if reference is not None and task.teacher_forced:
            requests = [Request(r.prompt, forced=out) for r, out in zip(requests, reference["outputs"][g])]
        context = max(r.context_tokens for r in requests)
        blocks = None if budget is None else budget.blocks_for(context, block_size)
        knobs = {k: v for k, v in overrides.items() if k != POOL_SHARE}
        if POOL_SHARE in overrides and blocks is not None:  # full KV keeps its own pool: its cache is shared
            knobs["num_kv_blocks"] = max(pool_blocks(requests, block_size, overrides[POOL_SHARE]), blocks + 1)
        engine = make_engine(source, block_size, blocks, window, knobs, device)
        observer, collected = task.observer(g, reference) if task.observer else (None, None)
        tracer = Tracer(engine) if trace is not None else None
        outputs.append(drive(engine, requests, observer, advance, tracer.compressed if tracer else None))
        observed.append(collected)
        if tracer is not None:
            write_group(trace, tracer, requests, outputs[-1], source.tokenizer, task.spans, g, first)
        first += len(requests)
        compressions += engine.totals["compressions"]
        engine.close()
    return {"outputs": outputs, "observed": observed, "compressions": compressions,
            "seconds": round(time.monotonic() - start, 1)}


def evaluate(task: Task, source, model: str, configurations: list[str], budgets: list[Budget],
             block_size: int, window: int, settings: dict, device: str, json_path: str | None,
             progress: Progress, params: dict, trace: str | None = None) -> dict:
    """Full KV (cached), then every configuration at every budget. The JSON file is rewritten as each
    cell finishes, so an interrupted run keeps what it measured. With `trace` (a folder), every sample
    of every compressed cell gets a picture of what its cache held after each compression."""
    tokens = sum(tokens_of(g) for g in task.groups)
    results = {"task": task.name, "model": model, "metric": task.metric, "block_size": block_size,
               "window": window, "settings": settings, "budgets": [b.label for b in budgets],
               "params": params, "rows": []}
    contexts = sorted({max(r.context_tokens for r in g) for g in task.groups})
    results["context_tokens"] = contexts
    results["budget_blocks"] = {b.label: sorted({b.blocks_for(c, block_size) for c in contexts}) for b in budgets}

    def build_reference():
        cell = run_cell(task, source, None, block_size, window, {}, device,
                        progress.task(f"{task.name}: full KV", tokens))
        return {"outputs": cell["outputs"], "observed": cell["observed"], "seconds": cell["seconds"]}

    reference = cached_reference(task.name, reference_key(task, source, block_size, device), build_reference)
    full = (task.full_kv_metrics(reference) if task.full_kv_metrics
            else task.score(reference["outputs"], reference["observed"], reference))
    results["rows"].append({"configuration": FULL_KV, "overrides": {"compression": False},
                            "by_budget": {b.label: full for b in budgets}, "seconds": reference["seconds"]})
    write_json(json_path, results)
    for name in configurations:
        overrides = {**CONFIGURATIONS[name], **settings}
        row = {"configuration": name, "overrides": overrides, "by_budget": {}}
        results["rows"].append(row)
        for budget in budgets:
            target = TraceTo(trace, task.name, name, budget.label) if trace else None
            cell = run_cell(task, source, budget, block_size, window, overrides, device,
                            progress.task(f"{task.name}: {name} @ {budget.label}", tokens), reference, target)
            metrics = task.score(cell["outputs"], cell["observed"], reference)
            row["by_budget"][budget.label] = {**metrics, "compressions": cell["compressions"],
                                              "seconds": cell["seconds"]}
            progress.log(f"{task.name:8s} {name:16s} {budget.label:>9s}: {task.metric} {metrics['score']:.3f} "
                         f"({cell['compressions']} compressions, {cell['seconds']:.0f} s)")
            write_json(json_path, results)
    return results


def write_json(path: str | None, results: dict) -> None:
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2)
    os.replace(tmp, path)


def percent(value: float) -> str:
    return f"{value * 100:.1f}%"


def markdown_table(results: dict, cell=None) -> str:
    """Configurations down, budgets across; `cell(metrics)` formats one entry (default: the score)."""
    cell = cell or (lambda m: percent(m["score"]))
    labels = results["budgets"]
    blocks = results.get("budget_blocks", {})

    def head(label):
        sizes = blocks.get(label)
        return label if not sizes or label.endswith("blocks") else f"{label} ({'/'.join(map(str, sizes))} blocks)"

    lines = ["| configuration | " + " | ".join(head(b) for b in labels) + " |", "|---|" + "---|" * len(labels)]
    for row in results["rows"]:
        cells = [cell(row["by_budget"][b]) if b in row["by_budget"] else "" for b in labels]
        lines.append(f"| {row['configuration']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def leaderboard(all_results: list[dict]) -> str:
    """One table over several tasks' results: configurations down, task x budget across. Fidelity
    cells show agreement / KL, the others accuracy. Runs of the same task (same samples) merge."""
    merged: dict[str, dict] = {}
    for r in all_results:
        if r["task"] not in merged:
            merged[r["task"]] = {**r, "rows": [{**row} for row in r["rows"]]}
            continue
        rows = {row["configuration"]: row for row in merged[r["task"]]["rows"]}
        for row in r["rows"]:
            if row["configuration"] in rows:  # fill budgets an earlier run did not reach
                known = rows[row["configuration"]]
                known["by_budget"] = {**row["by_budget"], **known["by_budget"]}
            else:
                merged[r["task"]]["rows"].append(row)
    all_results = list(merged.values())
    columns = [(r, b) for r in all_results for b in r["budgets"]]
    names = []
    for r in all_results:
        names += [row["configuration"] for row in r["rows"] if row["configuration"] not in names]
    lines = ["| configuration | " + " | ".join(f"{r['task']} {b}" for r, b in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for name in names:
        cells = []
        for r, b in columns:
            row = next((row for row in r["rows"] if row["configuration"] == name), None)
            m = row["by_budget"].get(b) if row else None
            cells.append("" if m is None else
                         f"{percent(m['score'])} / {m['mean_kl']:.4f}" if "mean_kl" in m else percent(m["score"]))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def run_task(model: str, make_task, params: dict, budgets, block_size: int, window: int, device: str,
             configurations, settings, json_path, progress, trace: str | None = None) -> dict:
    """What every task's `run` shares: the default budgets and rows, the model, the task's samples
    (`make_task(tokenizer)`), then `evaluate` with progress bars."""
    from zipage.engine.loading.loader import resolve_model

    budgets = budgets or parse_budgets("25%,50%,75%")
    configurations = parse_configurations(None) if configurations is None else configurations
    source = resolve_model(model)
    task = make_task(source.tokenizer)
    with progress or Progress(False) as bars:
        return evaluate(task, source, model, configurations, budgets, block_size, window, settings or {},
                        device, json_path, bars, params, trace)
