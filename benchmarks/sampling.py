"""Time `Sampler.sample_on_device`: rows of random logits (rounded to bf16, as a bf16 head gives them)
drawn with each sampling setting, host and device together (calls back to back, one sync at the end).

    python benchmarks/sampling.py --device cuda --rows 1,8,64,256
    python benchmarks/sampling.py --against /tmp/sampler_before.py   # a former sampler.py, interleaved

With --against, the former sampler runs in alternation with the current one (medians of --rounds
rounds, which goes first alternating), and each setting first checks that both draw the same ids for the same seeds on
unrounded logits (where no two logits tie). Prints one JSON line per (rows, setting).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import torch

from zipage import kernels
from zipage.engine.config import SamplingParams
from zipage.engine.execution import sampler as current

SETTINGS = {
    "T0.7": dict(temperature=0.7),
    "T0.6-p0.95": dict(temperature=0.6, top_p=0.95),
    "T0.6-k20": dict(temperature=0.6, top_k=20),
    "T0.6-k20-p0.95": dict(temperature=0.6, top_k=20, top_p=0.95),  # Qwen3's recommended setting
    "T1.0-k50-p0.9-m0.05": dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05),
}


def load_sampler(path: str):
    spec = importlib.util.spec_from_file_location("sampler_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_call_ms(module, logits: torch.Tensor, requests, calls: int) -> float:
    sampler = module.Sampler(0)
    sampler.sample_on_device(logits, requests)
    if logits.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        sampler.sample_on_device(logits, requests)
    if logits.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def same_ids(a, b, logits: torch.Tensor, kw: dict) -> float:
    """The share of rows where both samplers draw the same id for the same per-row seed."""
    def requests():
        return [(SamplingParams(**kw, seed=i), [], torch.Generator().manual_seed(i)) for i in range(len(logits))]
    x, y = a.Sampler(0).sample_on_device(logits, requests()), b.Sampler(0).sample_on_device(logits, requests())
    return (x == y).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen3's vocabulary by default")
    parser.add_argument("--rows", default="1,8,64,256")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--against", default=None, help="a former sampler.py to time in alternation")
    args = parser.parse_args()
    if args.device == "cuda":
        kernels.use_triton()  # as the engine does at start
    against = load_sampler(args.against) if args.against else None
    gen = torch.Generator().manual_seed(0)
    for rows in [int(r) for r in args.rows.split(",")]:
        raw = torch.randn(rows, args.vocab, generator=gen) * 3
        logits = raw.bfloat16().float().to(args.device)
        for name in args.settings.split(","):
            kw = SETTINGS[name]
            requests = [(SamplingParams(**kw), [], None)] * rows
            now, before = [], []
            for round_ in range(args.rounds):  # which goes first alternates from round to round
                if against and round_ % 2:
                    before.append(per_call_ms(against, logits, requests, args.calls))
                now.append(per_call_ms(current, logits, requests, args.calls))
                if against and not round_ % 2:
                    before.append(per_call_ms(against, logits, requests, args.calls))
            row = {"rows": rows, "setting": name, "ms": round(statistics.median(now), 4)}
            if against:
                row["ms_against"] = round(statistics.median(before), 4)
                row["same_ids_against"] = same_ids(current, against, raw.to(args.device), kw)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
