"""Serving benchmark: many concurrent streaming clients against `zipage serve`, and the offline engine
on the same requests.

    python benchmarks/serve_bench.py --model random:llama-tiny --device cpu --num-requests 32 \\
        --input-len 64 --output-len 128
    python benchmarks/serve_bench.py --model random:qwen3-0.6b --device cuda --num-requests 256 \\
        --input-len 256 --output-len 2048 --mode zipage --mode fullkv --json serve.json

For each mode (zipage: compression on; fullkv: the same engine with compression off):
  1. offline: a child process builds `LLM(...)`, warms up on two requests, then times
     `generate()` on all the prompts at once (greedy, EOS ignored, fixed output length);
  2. server: `zipage serve` starts on 127.0.0.1 with the same knobs; after a warm-up on two
     requests, every prompt is sent at once as a streaming /v1/completions request from its own
     client (asyncio + httpx), with the prompt as token ids. The clients are spread over
     --client-procs processes (one per 4 CPUs, at most 4): one Python process parsing every
     stream would measure itself rather than the server.
Each phase runs --repeats times; the run with the median throughput is reported (with its
latencies), and every run's tokens/s goes into --json.
Output tokens/s = generated tokens / wall time from the first request sent to the last token
received. Time to first token (TTFT) and inter-token latency (ITL) are measured by the clients:
TTFT from sending to the first token, ITL between consecutive tokens of one stream (a chunk of n
tokens counts as n gaps of 1/n of the time since the chunk before). The CPU busy shares (Linux)
are CPU seconds over the load's wall time, for the server's HTTP process, its engine process and
the busiest client process: one near 1.0 was the limit. The prompts
are the random-token prompts of `zipage bench` (same seed), so `zipage bench` runs the same load.
Neither this process nor the server shares a device with the other's measurement: each phase
runs in its own process, one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from zipage.cli.bench import random_prompts
from zipage.cli.eval.common import parse_settings
from zipage.engine.loading.loader import resolve_model

START_DEADLINE_S = 900.0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN when there are no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# -- offline ---------------------------------------------------------------------------------------
def offline_run(model: str, knobs: dict, prompts: list[list[int]], output_len: int, repeats: int) -> dict:
    """In a child process: the offline engine's throughput on the prompts, after a warm-up; the median run."""
    from zipage.engine import LLM, SamplingParams

    llm = LLM(model, **knobs)
    runs = []
    try:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        for _ in range(repeats):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outputs)
            runs.append({"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds})
        device = llm.snapshot().device
    finally:
        llm.close()
    return dict(median_run(runs), device=device, runs_tokens_per_s=[r["tokens_per_s"] for r in runs])


def median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]


def offline(model: str, knobs: dict, prompts: list[list[int]], output_len: int, repeats: int) -> dict:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(offline_run, model, knobs, prompts, output_len, repeats).result()


# -- server ----------------------------------------------------------------------------------------
def cli_flags(knobs: dict) -> list[str]:
    flags = []
    for key, value in knobs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, knobs: dict, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "zipage.cli.main", "serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning", *cli_flags(knobs)]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_DEADLINE_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"zipage serve exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"zipage serve did not start within {START_DEADLINE_S:.0f} s:\n{log.read_text()}")
        time.sleep(0.5)


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def one_stream(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> dict:
    """One client: send, then timestamp every token as it arrives (time.monotonic: one clock for every
    process on the machine)."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    sent = time.monotonic()
    arrivals: list[tuple[float, int]] = []  # (time, tokens in the chunk)
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                n = len(chunk["choices"][0].get("token_ids") or []) if chunk["choices"] else 0
                if n:
                    arrivals.append((time.monotonic(), n))
    gaps = []
    for (before, _), (after, n) in zip(arrivals, arrivals[1:]):
        gaps += [(after - before) / n] * n
    return {"sent": sent, "ttft": arrivals[0][0] - sent, "end": arrivals[-1][0], "itl": gaps,
            "tokens": sum(n for _, n in arrivals), "chunks": len(arrivals)}


async def streams(url: str, prompts: list[list[int]], output_len: int) -> list[dict]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60, read=None), limits=limits) as client:
        return await asyncio.gather(*(one_stream(client, p, output_len) for p in prompts))


def client_process(url: str, prompts: list[list[int]], output_len: int, barrier, results) -> None:
    """A share of the clients in a process of their own; they start when every share is ready."""
    barrier.wait()
    cpu = time.process_time()
    done = asyncio.run(streams(url, prompts, output_len))
    results.put((done, time.process_time() - cpu))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    pids = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return pids


def load(url: str, prompts: list[list[int]], output_len: int, client_procs: int = 1, server_pid: int | None = None
         ) -> dict:
    """Every prompt at once, each from its own streaming client; the clients are spread over
    `client_procs` processes, so that parsing the streams never limits what is measured."""
    watched = [server_pid, *child_pids(server_pid)] if server_pid else []
    before = {pid: cpu_seconds(pid) for pid in watched}
    if client_procs == 1:
        cpu = time.process_time()
        done = asyncio.run(streams(url, prompts, output_len))
        client_cpu = [time.process_time() - cpu]
    else:
        context = multiprocessing.get_context("spawn")
        barrier, results = context.Barrier(client_procs + 1), context.Queue()
        workers = [context.Process(target=client_process, args=(url, prompts[i::client_procs], output_len,
                                                                barrier, results)) for i in range(client_procs)]
        for w in workers:
            w.start()
        barrier.wait()
        parts = [results.get() for _ in workers]
        for w in workers:
            w.join()
        done = [s for part, _ in parts for s in part]
        client_cpu = [cpu for _, cpu in parts]
    after = {pid: cpu_seconds(pid) for pid in watched}
    start, end = min(s["sent"] for s in done), max(s["end"] for s in done)
    tokens = sum(s["tokens"] for s in done)
    ttft = [s["ttft"] for s in done]
    itl = [g for s in done for g in s["itl"]]
    seconds = end - start
    # Busy share of the wall time: near 1.0, that process was the limit.
    busy = {"clients_max": max(client_cpu) / seconds}
    if server_pid:
        busy["http"] = (after[server_pid] - before[server_pid]) / seconds
        busy["engine"] = sum(after[p] - before[p] for p in watched[1:]) / seconds
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "ttft_p50_ms": 1000 * percentile(ttft, 50), "ttft_p99_ms": 1000 * percentile(ttft, 99),
            "itl_p50_ms": 1000 * percentile(itl, 50), "itl_p99_ms": 1000 * percentile(itl, 99),
            "tokens_per_chunk": tokens / sum(s["chunks"] for s in done), "client_procs": client_procs,
            "cpu_busy": busy}


def served(model: str, knobs: dict, prompts: list[list[int]], output_len: int, repeats: int, log: Path,
           client_procs: int) -> dict:
    """The median of `repeats` loads on one server, after a warm-up load of two short requests."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_server(model, knobs, port, log)
    try:
        asyncio.run(streams(url, [p[:8] for p in prompts[:2]], 8))
        runs = [load(url, prompts, output_len, client_procs, process.pid) for _ in range(repeats)]
    finally:
        stop_server(process)
    return dict(median_run(runs), runs_tokens_per_s=[r["tokens_per_s"] for r in runs])


def default_client_procs() -> int:
    """A process of clients per 4 CPUs, at most 4: the server and the engine keep cores of their own."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama-tiny")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--mode", action="append", choices=("zipage", "fullkv"),
                        help="zipage (compression on) and/or fullkv (off); default: both")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per phase; the median run is reported")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KNOB=VALUE",
                        help="an engine knob for both the offline engine and the server (repeatable)")
    parser.add_argument("--client-procs", type=int, default=default_client_procs(),
                        help="processes the clients are spread over (default: one per 4 CPUs, at most 4)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    knobs = parse_settings(args.settings)
    if args.device:
        knobs["device"] = args.device
    seed = knobs.get("seed", 0)
    prompts = random_prompts(resolve_model(args.model).hf_config.vocab_size, args.num_requests, args.input_len, seed)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.mode or ["zipage", "fullkv"]:
            mode_knobs = dict(knobs, compression=mode == "zipage")
            print(f"{mode}: offline engine...", file=sys.stderr, flush=True)
            base = offline(args.model, mode_knobs, prompts, args.output_len, args.repeats)
            print(f"{mode}: zipage serve with {args.num_requests} streaming clients...", file=sys.stderr, flush=True)
            online = served(args.model, mode_knobs, prompts, args.output_len, args.repeats,
                            Path(tmp) / f"{mode}.log", args.client_procs)
            results.append({"mode": mode, "offline": base, "server": online,
                            "server_vs_offline": online["tokens_per_s"] / base["tokens_per_s"]})

    print(f"\n{args.model} · {args.num_requests} requests · {args.input_len} in / {args.output_len} out · "
          f"{results[0]['offline']['device']} · {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n")
    print("| mode | offline tok/s | server tok/s | server / offline | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) "
          "| tokens per chunk | CPU busy: HTTP / engine / busiest client process |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        s = r["server"]
        busy = s["cpu_busy"]
        print(f"| {r['mode']} | {r['offline']['tokens_per_s']:.1f} | {s['tokens_per_s']:.1f} | "
              f"{r['server_vs_offline']:.2f} | {s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | "
              f"{s['itl_p50_ms']:.1f} / {s['itl_p99_ms']:.1f} | {s['tokens_per_chunk']:.2f} | "
              f"{busy.get('http', 0):.2f} / {busy.get('engine', 0):.2f} / {busy['clients_max']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "num_requests": args.num_requests,
                                               "input_len": args.input_len, "output_len": args.output_len,
                                               "knobs": knobs, "results": results}, indent=2))


if __name__ == "__main__":
    main()
