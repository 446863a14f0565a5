"""Progress where stderr is no terminal: plain lines, at least every interval and when a task ends."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from zipage.cli.progress_lines import ProgressLines

ROOT = Path(__file__).resolve().parents[1]


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_say_done_elapsed_and_time_left():
    clock, out = FakeClock(), io.StringIO()
    lines = ProgressLines(out, unit="tokens", clock=clock)
    lines.add("zipage", 300)
    lines.tick()
    assert out.getvalue() == ""  # nothing under way yet: nothing to say
    lines.update("zipage", 100)
    clock.now += 20
    lines.tick()
    assert out.getvalue().splitlines()[-1] == "zipage: 100/300 tokens, 0:00:20 elapsed, about 0:00:40 left"
    clock.now += 40
    lines.advance("zipage", 200)  # completes: a line at once, and none from later ticks
    assert out.getvalue().splitlines()[-1] == "zipage: 300/300 tokens, 0:01:00 elapsed, done"
    count = len(out.getvalue().splitlines())
    lines.tick()
    assert len(out.getvalue().splitlines()) == count


def test_eval_progress_prints_lines_without_a_terminal(capsys):
    from zipage.cli.eval.common import Progress

    with Progress(True) as progress:  # pytest's captured stderr is no terminal
        advance = progress.task("needle: full KV", 10)
        advance(4)
        progress.lines.tick()
        advance(6)
    err = capsys.readouterr().err
    assert "needle: full KV: 4/10 tokens" in err and "needle: full KV: 10/10 tokens" in err and "done" in err


def test_bench_into_a_file_prints_plain_progress():
    result = subprocess.run([sys.executable, "-m", "zipage.cli.main", "bench", "--model", "random:llama-tiny",
                             "--device", "cpu", "--num-requests", "4", "--input-len", "16", "--output-len", "16",
                             "--repeats", "1"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "zipage: 64/64 tokens" in result.stderr and "fullkv: 64/64 tokens" in result.stderr
    assert "━" not in result.stderr  # no bars drawn into a file
