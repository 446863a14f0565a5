"""CPU cost of the server's HTTP process per streamed token, with the model taken out of the picture.

    python benchmarks/serve_http_cost.py --num-requests 64 --output-len 512

`zipage serve`'s HTTP process (tokenizing, detokenizing, server-sent events, sockets) runs against
a stand-in engine process that gives every running request one random token id each --step-ms,
as a fast GPU would. Streaming clients (serve_bench.py's) read every answer. The figure is the HTTP
process's CPU seconds over the tokens it streamed: when it nears --step-ms / requests, the server
cannot keep up with the engine. Compare server builds (say, with and without httptools, uvicorn's
C parser) by running this in each.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench  # noqa: E402

VOCAB = 151936  # Qwen3's: most random ids decode to real text


class StandInEngine:
    """What EngineLoop needs of an EngineCore: requests that gain one random token a step."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.requests: dict[int, SimpleNamespace] = {}
        self.ids = itertools.count()
        self.events: deque = deque(maxlen=10)
        self.event_count = 0
        self.max_model_len = 32768
        self.rng = random.Random(0)
        self.last = time.monotonic()

    def add_request(self, ids, params, session=None, stream=False):
        seq = SimpleNamespace(id=next(self.ids), num_prompt_tokens=len(ids), token_ids=list(ids), params=params)
        self.requests[seq.id] = seq
        return seq

    def abort(self, request_id):
        seq = self.requests.pop(request_id, None)
        return None if seq is None else self._output(seq, "abort")

    def has_work(self) -> bool:
        return bool(self.requests)

    def step(self):
        time.sleep(max(0.0, self.last + self.step_s - time.monotonic()))
        self.last = time.monotonic()
        ended = []
        for seq in list(self.requests.values()):
            seq.token_ids.append(self.rng.randrange(VOCAB))
            if len(seq.token_ids) - seq.num_prompt_tokens >= seq.params.max_tokens:
                del self.requests[seq.id]
                ended.append(self._output(seq, "length"))
        return ended

    def snapshot(self):
        return None

    def close(self) -> None:
        pass

    @staticmethod
    def _output(seq, reason: str):
        from zipage.engine.core.outputs import RequestOutput

        n = seq.num_prompt_tokens
        return RequestOutput(seq.id, None, seq.token_ids[:n], seq.token_ids[n:], "", "", True, reason,
                             num_output_tokens=len(seq.token_ids) - n)


def run_stand_in(inbox, outbox, config, step_s: float) -> None:
    """The engine child's entry point, with the stand-in in place of EngineCore."""
    from zipage.engine.api import process

    engine = StandInEngine(step_s)
    process.write_frame(outbox.fileno(), ("ready", {"max_model_len": engine.max_model_len, "snapshot": None}))
    process.EngineLoop(inbox, outbox.fileno(), engine).run()


def serve_stand_in(port: int, step_s: float, model: str) -> None:
    """The server process: `zipage serve`'s app and HTTP stack in front of the stand-in engine."""
    import functools

    from zipage.cli.serve.lifecycle import serve
    from zipage.engine.api import process
    from zipage.engine.config import EngineConfig

    process.run_engine_process = functools.partial(_child, step_s=step_s)
    engine = process.EngineProcess(EngineConfig(model=model, device="cpu"))
    try:
        serve(engine, "127.0.0.1", port, None, "warning")
    finally:
        engine.close()


def _child(inbox, outbox, config, step_s: float) -> None:
    run_stand_in(inbox, outbox, config, step_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--step-ms", type=float, default=3.1, help="the stand-in engine's step time")
    parser.add_argument("--model", default="random:qwen3-0.6b", help="whose tokenizer the server uses")
    parser.add_argument("--client-procs", type=int, default=1)
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the server process
    args = parser.parse_args()
    if args.serve is not None:
        serve_stand_in(args.serve, args.step_ms / 1e3, args.model)
        return
    port = serve_bench.free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--step-ms", str(args.step_ms),
                               "--model", args.model])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the stand-in server did not start")
            time.sleep(0.2)
        prompts = [[i + 1] * 64 for i in range(args.num_requests)]
        asyncio.run(serve_bench.streams(url, prompts[:2], 8))  # warm-up
        result = serve_bench.load(url, prompts, args.output_len, args.client_procs, server.pid)
        http_cpu = result["cpu_busy"]["http"] * result["seconds"]
        per_token = 1e6 * http_cpu / result["output_tokens"]
        print(f"{result['output_tokens']} tokens in {result['seconds']:.2f} s, "
              f"{result['tokens_per_chunk']:.2f} tokens per chunk; "
              f"HTTP process: {per_token:.1f} us of CPU per token (busy {result['cpu_busy']['http']:.2f})")
    finally:
        serve_bench.stop_server(server)


if __name__ == "__main__":
    main()
