"""What the benchmark scripts share: the parser with their common flags (--model, --json, and those
of the requests they serve: a fixed batch or a seeded random workload), the random workload itself,
the description of the hardware a result was measured on, writing a result to --json, capturing
a function's launches in a CUDA graph, the GPU time a function spends per kernel, and
--decode-launch, which changes decode attention's launch of a cache kind for one run.

The scripts run as `python benchmarks/NAME.py`, which puts this folder first on sys.path, so they
import this module by its plain name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random

import torch


def parser(doc: str, model: str) -> argparse.ArgumentParser:
    """A script's parser: the first line of its docstring `doc` as the description, and --model."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", default=model)
    return p


def parse_args(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Add --json, after the script's own flags, and parse argv."""
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


DECODE_LAUNCH_CACHES = {"model": "model", "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def add_decode_launch_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-launch", action="append", default=[], metavar="CACHE:FIELD=VALUE,...",
                   help="change decode attention's launch of one cache kind (model, fp8 or int8) for this run, "
                        "e.g. fp8:tma=on,table_ahead=16,stages=3 (fields of triton_attention.DecodeLaunch; "
                        "on/off for switches, none for no register cap); repeatable")


def _launch_value(name: str, text: str, current):
    if isinstance(current, bool):
        if text not in ("on", "off"):
            raise ValueError(f"{name} is a switch: on or off, not {text!r}")
        return text == "on"
    if name == "max_registers" and text == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} takes a whole number, not {text!r}") from None


def set_decode_launches(specs: list[str]) -> dict:
    """Apply --decode-launch specs to triton_attention.DECODE_LAUNCH for this process; returns every
    cache kind's launch as it now is, for the run's JSON. A bad spec exits with what was wrong."""
    from zipage.kernels import triton_attention

    for spec in specs:
        cache, sep, settings = spec.partition(":")
        try:
            if cache not in DECODE_LAUNCH_CACHES or not sep or not settings:
                raise ValueError(f"expected CACHE:FIELD=VALUE,... with CACHE one of {', '.join(DECODE_LAUNCH_CACHES)}")
            launch = triton_attention.DECODE_LAUNCH[DECODE_LAUNCH_CACHES[cache]]
            fields = {f.name for f in dataclasses.fields(launch)}
            changes = {}
            for setting in settings.split(","):
                name, sep, text = setting.partition("=")
                if name not in fields or not sep:
                    raise ValueError(f"{setting!r}: expected FIELD=VALUE with FIELD one of {', '.join(sorted(fields))}")
                changes[name] = _launch_value(name, text, getattr(launch, name))
            triton_attention.DECODE_LAUNCH[DECODE_LAUNCH_CACHES[cache]] = dataclasses.replace(launch, **changes)
        except ValueError as e:
            raise SystemExit(f"--decode-launch {spec}: {e}") from None
    return {cache: dataclasses.asdict(triton_attention.decode_launch(key))
            for cache, key in DECODE_LAUNCH_CACHES.items()}


def add_fixed_output_flags(p: argparse.ArgumentParser, *, num_requests: int, output_len: int) -> None:
    """--num-requests requests, each generating exactly --output-len tokens (EOS ignored)."""
    p.add_argument("--num-requests", type=int, default=num_requests)
    p.add_argument("--output-len", type=int, default=output_len)


def add_workload_flags(p: argparse.ArgumentParser, *, num_requests: int, min_output: int, max_output: int,
                       seed: int) -> None:
    """The flags of `workload`, with the defaults the script wants."""
    p.add_argument("--num-requests", type=int, default=num_requests)
    p.add_argument("--min-input", type=int, default=128)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--min-output", type=int, default=min_output)
    p.add_argument("--max-output", type=int, default=max_output)
    p.add_argument("--seed", type=int, default=seed)


def make_workload(num: int, min_in: int, max_in: int, min_out: int, max_out: int, vocab: int, seed: int):
    """`num` prompts of random token ids below `vocab` and their output lengths, the same for a seed."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(min_in, max_in))])
        outputs.append(rng.randint(min_out, max_out))
    return prompts, outputs


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """The workload the flags of `add_workload_flags` ask for, for args.model."""
    from zipage.engine.loading.loader import resolve_model

    vocab = resolve_model(args.model).hf_config.vocab_size
    # Capped so that a seed draws the same prompts for every model with a vocabulary this large.
    return make_workload(args.num_requests, args.min_input, args.max_input, args.min_output, args.max_output,
                         min(vocab, 32000), args.seed)


def device_description(device: str) -> dict:
    """The GPU (or "cpu") and torch a result on `device` was measured with."""
    return {"gpu": torch.cuda.get_device_name() if device != "cpu" else "cpu", "torch": torch.__version__}


def cpu_description() -> dict:
    """The torch, its intra-op threads and the processor a CPU result was measured with."""
    return {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine()}


def write_json(path: str | None, results: dict) -> None:
    """Write the results to `path` (--json) if one was given. Scripts call it after each mode, so a run
    that fails or is stopped part-way keeps what it measured."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def graph_of(fn):
    """fn's launches captured in a CUDA graph, after a warm call outside it: (graph, fn's output
    inside it, which each replay rewrites)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def kernel_breakdown(fn, top: int = 12, calls: int = 1) -> list[dict]:
    """GPU time per kernel name over `calls` calls of fn (torch.profiler; kernels a CUDA graph
    launches count too), per call, largest first. Work fn leaves in flight on other streams
    is counted once it has run."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            row = totals.setdefault(e.name[:90], [0, 0.0])
            row[0] += 1
            row[1] += e.device_time_total
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"kernel": k, "count": round(c / calls, 2), "us": round(us / calls, 1)} for k, (c, us) in rows]
