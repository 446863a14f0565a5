"""How many intra-op threads the engine runs on the CPU (docs/design-notes.md, "CPU threads").

A decode step is hundreds of small parallel operators, and each waits until all of its threads
have run. On a 2-core AMD EPYC two threads decoded 1.3x faster than one while the machine was idle,
but 1.9-2.5x slower while another job kept one core busy and 8-15x slower with both busy
(docs/benchmarks.md, "CPU threads"). So, unless told, the engine runs one thread per CPU that other
jobs leave idle, counted over SAMPLE_S at start-up. Told means, first to last: `cpu_threads`,
OMP_NUM_THREADS or MKL_NUM_THREADS, a torch.set_num_threads call by the caller (a count other than
torch's default). The choice holds for the process: a later engine keeps it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SAMPLE_S = 0.1  # how long other jobs' use of the CPUs is watched
FREE_SHARE = 0.75  # a CPU counts as free when others left it idle this share of the time
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class ThreadChoice:
    count: int
    why: str  # "cpu_threads", a variable's name, "torch.set_num_threads" or "idle CPUs"


_chosen: ThreadChoice | None = None  # what an engine of this process set last


def use_cpu_threads(cpu_threads: int | None = None, ranks: int = 1) -> ThreadChoice:
    """Choose the intra-op threads of an engine on the CPU (`ranks` processes of it share the CPUs)
    and set them for this process."""
    global _chosen
    _chosen = choose_threads(cpu_threads, ranks)
    torch.set_num_threads(_chosen.count)
    return _chosen


def choose_threads(cpu_threads: int | None = None, ranks: int = 1) -> ThreadChoice:
    """The count and why, in the module docstring's order; sets nothing."""
    if cpu_threads is not None:
        return ThreadChoice(cpu_threads, "cpu_threads")
    current = torch.get_num_threads()
    for variable in THREAD_VARIABLES:
        if os.environ.get(variable):
            return ThreadChoice(current, variable)
    if _chosen is not None and current == _chosen.count:
        return _chosen
    if current != default_threads():
        return ThreadChoice(current, "torch.set_num_threads")
    idle = idle_cpus()
    if idle is None:  # no /proc/stat to read: torch's default stands
        return ThreadChoice(current, "torch's default")
    return ThreadChoice(max(1, min(current, idle) // ranks), "idle CPUs")


def default_threads() -> int:
    """torch's intra-op threads when no variable sets them: one per physical core of the machine."""
    cores = set()
    for topology in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"):
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            continue
    return len(cores) or os.cpu_count() or 1


def idle_cpus(seconds: float = SAMPLE_S) -> int | None:
    """How many of the CPUs this process may run on other jobs left idle over `seconds` (each at least
    FREE_SHARE of the time); None where /proc/stat cannot be read."""
    if not hasattr(os, "sched_getaffinity"):  # not Linux
        return None
    names = {f"cpu{i}" for i in os.sched_getaffinity(0)}
    before = _cpu_ticks(names)
    time.sleep(seconds)
    after = _cpu_ticks(names)
    if before is None or after is None:
        return None
    idle, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return None
    return int(len(names) * idle / total + 1 - FREE_SHARE)


def _cpu_ticks(names: set[str]) -> tuple[int, int] | None:
    """(idle, all) clock ticks of these CPUs since boot."""
    idle = total = 0
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                name, *ticks = line.split()
                if name in names:
                    values = [int(t) for t in ticks]
                    idle += values[3] + values[4]  # idle and waiting for I/O
                    total += sum(values[:8])  # guest time is counted in user time already
    except (OSError, ValueError, IndexError):
        return None
    return (idle, total) if total else None


def device_label(device: torch.device, threads: int | None = None) -> str:
    """A device as the engine reports it, "cpu · 2 threads" (torch's count unless given) or "cuda:0"."""
    if device.type != "cpu":
        return str(device)
    count = threads or torch.get_num_threads()
    return f"cpu · {count} thread{'s' if count != 1 else ''}"
