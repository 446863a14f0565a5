"""Progress as plain lines, for long commands whose stderr is not a terminal (a file, a pipe, CI):
live bars draw nothing there, so a run of many minutes would look hung. A line per task at least
every `every_s` seconds, and one when a task completes: done/total, elapsed, time left."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, TextIO

EVERY_S = 10.0


@dataclass
class _Task:
    label: str
    total: int
    done: int = 0
    started: float | None = None
    finished: bool = False


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLines:
    """Tasks with totals; `update` records, `tick` prints what changed. Used as a context manager it
    ticks from a background thread every `every_s` seconds; tests call `tick` themselves."""

    def __init__(self, stream: TextIO | None = None, unit: str = "tokens", every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = stream or sys.stderr
        self.unit, self.every_s, self.clock = unit, every_s, clock
        self.tasks: dict[str, _Task] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, label: str, total: int) -> None:
        with self.lock:
            self.tasks.setdefault(label, _Task(label, total))

    def update(self, label: str, done: int, total: int | None = None) -> None:
        """The task's units done so far; a line at once when it completes."""
        with self.lock:
            task = self.tasks.setdefault(label, _Task(label, total or 0))
            if total is not None:
                task.total = total
            if task.started is None:
                task.started = self.clock()
            task.done = done
            completes = not task.finished and task.total and done >= task.total
            if completes:
                task.finished = True
        if completes:
            self._print(task)

    def advance(self, label: str, n: int) -> None:
        with self.lock:
            done = self.tasks[label].done + n
        self.update(label, done)

    def tick(self) -> None:
        """One line for every task under way."""
        with self.lock:
            running = [t for t in self.tasks.values() if t.started is not None and not t.finished]
        for task in running:
            self._print(task)

    def line(self, task: _Task) -> str:
        elapsed = self.clock() - (task.started if task.started is not None else self.clock())
        text = f"{task.label}: {task.done}/{task.total} {self.unit}, {_clock(elapsed)} elapsed"
        if task.finished:
            return text + ", done"
        if task.done and task.total:
            text += f", about {_clock(elapsed * (task.total - task.done) / task.done)} left"
        return text

    def _print(self, task: _Task) -> None:
        print(self.line(task), file=self.stream, flush=True)

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, name="progress-lines", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.tick()


def is_terminal(stream: TextIO | None = None) -> bool:
    stream = stream or sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())
