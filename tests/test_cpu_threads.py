"""The engine's intra-op threads on the CPU (engine/execution/cpu_threads.py): what it was told wins
(cpu_threads, then OMP_NUM_THREADS, then the caller's torch.set_num_threads); else one thread per
idle CPU. Every choice is applied to torch and reported with the device."""

from __future__ import annotations

import os

import pytest
import torch

from zipage.engine import EngineConfig
from zipage.engine.core.engine_core import EngineCore
from zipage.engine.execution import cpu_threads
from zipage.engine.execution.cpu_threads import ThreadChoice, default_threads


@pytest.fixture(autouse=True)
def _fresh_process_state(monkeypatch):
    """Each test starts as a fresh process would: torch's default count, no earlier engine's choice."""
    previous = torch.get_num_threads()
    for variable in cpu_threads.THREAD_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(cpu_threads, "_chosen", None)
    torch.set_num_threads(default_threads())
    yield
    torch.set_num_threads(previous)


def engine(**knobs) -> EngineCore:
    return EngineCore(EngineConfig(model="random:llama-tiny", device="cpu", compression=False, block_size=16,
                                   num_kv_blocks=16, **knobs))


def no_sampling(*args):
    raise AssertionError("the CPUs were sampled although the count was given")


def test_an_explicit_count_is_applied_and_reported(monkeypatch):
    monkeypatch.setattr(cpu_threads, "idle_cpus", no_sampling)
    for count, label in ((1, "cpu · 1 thread"), (3, "cpu · 3 threads")):
        core = engine(cpu_threads=count)
        assert torch.get_num_threads() == count
        assert core.cpu_threads == ThreadChoice(count, "cpu_threads")
        assert core.snapshot().device == label


def test_omp_num_threads_wins_over_the_automatic_choice(monkeypatch):
    monkeypatch.setattr(cpu_threads, "idle_cpus", no_sampling)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)  # what torch made of the variable at start-up
    core = engine()
    assert core.cpu_threads == ThreadChoice(3, "OMP_NUM_THREADS") and torch.get_num_threads() == 3
    assert engine(cpu_threads=1).cpu_threads.count == 1  # the engine's own knob wins over the variable


def test_a_count_the_caller_set_is_kept(monkeypatch):
    monkeypatch.setattr(cpu_threads, "idle_cpus", no_sampling)
    torch.set_num_threads(default_threads() + 1)
    assert engine().cpu_threads == ThreadChoice(default_threads() + 1, "torch.set_num_threads")


def test_the_automatic_choice_is_one_thread_per_idle_cpu_and_holds_for_the_process(monkeypatch):
    core = engine()
    available = len(os.sched_getaffinity(0))
    assert core.cpu_threads.why == "idle CPUs" and 1 <= core.cpu_threads.count <= available
    assert torch.get_num_threads() == core.cpu_threads.count
    monkeypatch.setattr(cpu_threads, "idle_cpus", no_sampling)
    assert engine().cpu_threads == core.cpu_threads  # a later engine keeps it, unmeasured


@pytest.mark.parametrize("idle,expected", [(0, 1), (1, 1), (10_000, None)])
def test_busy_cpus_get_no_threads_and_idle_ones_at_most_torchs_default(monkeypatch, idle, expected):
    monkeypatch.setattr(cpu_threads, "idle_cpus", lambda: idle)
    assert cpu_threads.choose_threads() == ThreadChoice(expected or default_threads(), "idle CPUs")
    assert cpu_threads.choose_threads(ranks=default_threads() * 2).count == 1  # ranks share the CPUs


def test_idle_cpus_are_counted_from_the_cpus_this_process_may_use():
    idle = cpu_threads.idle_cpus(0.05)
    assert idle is None or 0 <= idle <= len(os.sched_getaffinity(0))
