"""Does the engine's thread count (engine/execution/cpu_threads.py) pick the faster one? Per round:
the CPUs other jobs leave idle (what the engine would run), then one request's decode steps
alternating 1 and torch's default count step by step, so both see the same load; medians.

    python benchmarks/cpu_threads.py --rounds 10
    python benchmarks/cpu_threads.py --rounds 5 --busy 1   # with one spinning process beside it
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from zipage.engine.config import DEFAULT_MODEL


def spin() -> None:
    while True:
        pass


def decode_steps(llm, counts: tuple[int, ...], steps: int) -> dict[int, float]:
    """Median milliseconds of a decode step at each thread count, taking turns step by step."""
    from zipage.engine.config import SamplingParams

    engine = llm.engine
    engine.add_request(list(range(100, 140)), SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # the prefill
    times = {n: [] for n in counts}
    step = 0
    while engine.has_work():
        n = counts[step % len(counts)]
        torch.set_num_threads(n)
        start = time.perf_counter()
        engine.step()
        times[n].append(time.perf_counter() - start)
        step += 1
    return {n: 1000 * statistics.median(t) for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--weight-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=24, help="decode steps per round, shared by the counts")
    parser.add_argument("--busy", type=int, default=0, help="spinning processes to run beside it")
    args = parser.parse_args()
    from zipage.engine import LLM
    from zipage.engine.execution.cpu_threads import default_threads, idle_cpus

    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    try:
        llm = LLM(args.model, device="cpu", weight_dtype=args.weight_dtype, num_kv_blocks=64, compression=False,
                  cpu_threads=1)
        counts = (1, default_threads())
        right = 0
        for r in range(args.rounds):
            choice = max(1, min(idle_cpus(), counts[-1]))
            ms = decode_steps(llm, counts, args.steps)
            fastest = min(ms, key=ms.get)
            right += choice == fastest
            print(f"round {r}: the engine would run {choice}; decode step " + ", ".join(f"{n} threads {t:.1f} ms" for n, t in ms.items())
                  + f"; faster: {fastest}", flush=True)
        print(f"the engine's count was the faster one in {right} of {args.rounds} rounds")
    finally:
        for p in spinners:
            p.terminate()


if __name__ == "__main__":
    main()
