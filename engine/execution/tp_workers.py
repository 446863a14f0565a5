"""Tensor-parallel ranks 1..N-1: one process each, following rank 0 step by step.

Rank 0 is the engine's own process: it schedules, samples and plans compressions. Before each
forward it sends the packed batch metadata to the other ranks, which run the same forward on
their shard (the collectives inside pair up); before each compression it sends the job, which
every rank runs on its own heads, in the order it was sent. Commands travel over a gloo group
(`broadcast_object_list`); activations over NCCL on GPUs, gloo on CPUs.

The processes are daemons started with `spawn`: they end with the engine (`close`), when rank 0's
process exits (Ctrl-C included: they ignore it themselves and follow rank 0), and never outlive it.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import signal
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zipage.engine.config import EngineConfig
from zipage.engine.execution.models.parallel import TensorParallel

STARTUP_TIMEOUT = timedelta(minutes=10)  # model loads on every rank happen inside the first collectives
STOP_TIMEOUT_S = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_device(config: EngineConfig, rank: int) -> str:
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return f"cuda:{rank}" if device.startswith("cuda") else "cpu"


def _join_group(rank: int, size: int, port: int, device: str):
    """Join the process group; returns the group for commands (gloo, even next to NCCL)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=STARTUP_TIMEOUT)
    return dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD


class TensorParallelWorkers:
    """Rank 0's handle on the other ranks: starts them, sends them commands, stops them."""

    def __init__(self, config: EngineConfig, model_spec: str, block_size: int, max_model_len: int):
        self.size = config.tensor_parallel_size
        port = _free_port()
        context = mp.get_context("spawn")
        ready = context.Queue()
        self.processes = []
        for rank in range(1, self.size):
            worker_config = config.replace(device=_rank_device(config, rank))
            process = context.Process(target=_worker_main, name=f"zipage-tp-rank{rank}", daemon=True,
                                      args=(rank, self.size, port, worker_config, model_spec, block_size,
                                            max_model_len, torch.get_num_threads(), ready))
            process.start()
            self.processes.append(process)
        self._wait_until_started(ready)
        self.device = _rank_device(config, 0)
        self.control = _join_group(0, self.size, port, self.device)
        self.tp = TensorParallel(0, self.size, dist.group.WORLD)
        self.closed = False

    def _wait_until_started(self, ready) -> None:
        """Wait for every worker to come up, so a worker that dies while starting is an error here
        rather than a hang inside the first collective."""
        started = 0
        while started < len(self.processes):
            try:
                ready.get(timeout=0.5)
                started += 1
            except queue.Empty:
                dead = [p for p in self.processes if not p.is_alive()]
                if dead:
                    for p in self.processes:
                        p.terminate()
                    raise RuntimeError(
                        f"tensor-parallel worker {dead[0].name} failed to start (exit code {dead[0].exitcode}). "
                        "A script that uses tensor_parallel_size > 1 must create the engine under "
                        "`if __name__ == \"__main__\":`, since every worker re-imports it")

    def send(self, *command) -> None:
        """Send one command to every other rank (they run it in the order sent)."""
        dead = [p.name for p in self.processes if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker {', '.join(dead)} has stopped; restart the engine")
        dist.broadcast_object_list([command], src=0, group=self.control)

    def gather_kept(self, slots: list[int], mine: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, ranking scores) of these slots over every rank's KV heads, in head order: rank 0's
        own `mine` and each other rank's answer to a "kept" command (ModelRunner.read_kept)."""
        self.send("kept", slots)
        parts = [None] * self.size
        dist.gather_object(mine, parts, dst=0, group=self.control)
        return torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.processes):
                dist.broadcast_object_list([("exit",)], src=0, group=self.control)
        finally:
            for p in self.processes:
                p.join(STOP_TIMEOUT_S)
                if p.is_alive():
                    p.terminate()
                    p.join()
            dist.destroy_process_group()


def _worker_main(rank: int, size: int, port: int, config: EngineConfig, model_spec: str, block_size: int,
                 max_model_len: int, threads: int, ready) -> None:
    from zipage.engine.kv.compressor import Compressor
    from zipage.engine.kv.geometry import CompressionGeometry
    from zipage.engine.loading.loader import resolve_model
    from zipage.engine.execution.model_runner import ModelRunner

    # Ctrl-C reaches the whole process group. A worker that left on it could quit between two
    # collectives of one forward and leave rank 0 blocked in the next one for good; so workers
    # ignore it and follow rank 0, which stops them (or whose exit terminates them).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # SIGUSR1 prints where a worker waits
    torch.set_num_threads(max(1, threads))
    ready.put(rank)
    control = _join_group(rank, size, port, config.device)
    try:
        tp = TensorParallel(rank, size, dist.group.WORLD)
        geometry = CompressionGeometry.from_config(config, block_size) if config.compression else None
        runner = ModelRunner(config, resolve_model(model_spec), block_size, max_model_len, tp, geometry)
        compressor = Compressor(config, runner, None, block_size, geometry) if config.compression else None
        if compressor is not None and runner.device.type == "cuda" and not config.enforce_eager:
            compressor.capture_graphs()
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            op, *args = box[0]
            if op == "forward":
                runner.forward_packed(*args)
            elif op == "compress":
                compressor.run_work(**args[0])  # in command order: done before any later forward
            elif op == "kept":  # this rank's heads of a request's positions, for rank 0 (gather_kept)
                dist.gather_object(runner.read_kept(*args), None, dst=0, group=control)
            elif op == "exit":
                break
            else:
                raise RuntimeError(f"unknown tensor-parallel command {op!r}")
    finally:
        dist.destroy_process_group()
