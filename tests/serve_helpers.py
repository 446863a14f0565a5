"""A real `zipage serve` process on 127.0.0.1 for the serving tests: started once per test module,
always stopped in teardown. Also a condition wait with a generous deadline (never sleep-and-assume)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

MODEL = "random:llama-tiny"
API_KEY = "test-key"
# Small pool, small blocks: long requests get compressed and every block is easy to account for.
ENGINE_KNOBS = dict(device="cpu", block_size=16, window=8, max_cache_blocks_per_seq=2, num_kv_blocks=64)
KNOBS = [arg for name, value in ENGINE_KNOBS.items() for arg in (f"--{name.replace('_', '-')}", str(value))]
START_DEADLINE_S = 180.0
DEADLINE_S = 120.0


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60, **kwargs)

    def snapshot(self) -> dict:
        """A snapshot taken now (not the last one published), so that it shows what just happened."""
        with self.client() as client:
            response = client.get("/zipage/snapshot", params={"fresh": 1})
            response.raise_for_status()
            return response.json()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log: Path, extra: list[str] = (), port: int | None = None, model: str = MODEL) -> Server:
    """`port`: a given one, to start a server again where a stopped one was."""
    port = port or free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")  # a tiny model on a shared CPU: one thread is fastest
    command = [sys.executable, "-m", "zipage.cli.main", "serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--api-key", API_KEY, "--log-level", "warning", *KNOBS, *extra]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_for(lambda: _healthy(server), START_DEADLINE_S, "the server to answer /health")
    except BaseException:
        stop_server(server)
        raise
    return server


def _healthy(server: Server) -> bool:
    if server.process.poll() is not None:
        raise RuntimeError(f"zipage serve exited with {server.process.returncode}:\n{server.log.read_text()}")
    try:
        return httpx.get(server.url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(timeout=30)


def engine_pid(server: Server) -> int:
    """The server's engine process: its child started by multiprocessing's spawn (Linux /proc)."""
    pid = server.process.pid
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as cmd:
                    if b"spawn_main" in cmd.read():
                        found.append(int(child))
    assert len(found) == 1, f"expected one engine process under {pid}, found {found}"
    return found[0]


def process_ended(pid: int) -> bool:
    """Gone, or a zombie (ended, waiting for a parent that may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def wait_for(condition, deadline_s: float = DEADLINE_S, what: str = "the condition", poll_s: float = 0.1):
    """Poll until `condition()` is truthy and return its value; fail after the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


def pool_idle(snapshot: dict) -> bool:
    return not snapshot["requests"] and snapshot["pool"]["used"] == 0


def wait_until_idle(server: Server) -> dict:
    """The first snapshot with no request left and every block back in the pool."""

    def idle():
        snapshot = server.snapshot()
        return snapshot if pool_idle(snapshot) else None

    return wait_for(idle, what="every request to end and its blocks to be freed")


def scrape(server) -> dict:
    """{(name, labels): value} from /metrics, through the Prometheus parser."""
    from prometheus_client.parser import text_string_to_metric_families

    with server.client() as http:
        response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def offline_engine():
    """The server's engine offline: same model, knobs and seed, hence the same weights and greedy tokens."""
    from zipage.engine import LLM

    return LLM(MODEL, **ENGINE_KNOBS)


def openai_client(server: Server):
    """The openai client of a test server: the key, no retries, a generous timeout."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=DEADLINE_S)
