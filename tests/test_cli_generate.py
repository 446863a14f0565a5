"""`zipage generate` tells on stderr why an answer ended where the reader might not expect it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "zipage.cli.main", "generate", "--model", "random:llama-tiny", "--device", "cpu",
       "--raw", "--temperature", "0"]


def test_an_answer_cut_by_max_tokens_says_so():
    cut = subprocess.run(CLI + ["--max-tokens", "5", "hello"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert cut.returncode == 0, cut.stderr
    assert "stopped at --max-tokens (5 tokens)" in cut.stderr
    whole = subprocess.run(CLI + ["--max-tokens", "5", "--stats", "hello"], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)
    assert "finish: length" in whole.stderr  # the same answer, with its stats
